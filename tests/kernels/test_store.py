"""Quantise-and-store kernels vs pages.write_tokens: byte-identical pages."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED
from sglang_diffkv.kernels.store import (
    store_decode,
    store_decode_reference,
    store_tokens,
    store_tokens_reference,
)
from sglang_diffkv.layout import PageGeometry

CASES = [
    (64, (K8V4_GROUPED, K4V2_GROUPED)),
    (128, (K8V4, K4V2)),
    (256, (K8V4, K4V2)),
]


def random_tokens(layout, t, num_pages, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    flat = torch.randperm(num_pages * layout.tokens_per_page, generator=g)[:t]
    page_ids = (flat // layout.tokens_per_page).int()
    slots = (flat % layout.tokens_per_page).int()
    d = layout.head_dim
    key = torch.randn(t, d, generator=g) * 3
    key[0] = 0.75  # a constant row: the scale falls back to SCALE_EPS
    key[1, : d // 2] = 70000.0  # beyond fp16: saturates at 65504
    value = torch.randn(t, d, generator=g)
    score = torch.rand(t, generator=g)
    pos = torch.randint(0, 1 << 20, (t,), generator=g, dtype=torch.int32)
    dev = torch.device(device)
    return [x.to(dev) for x in (page_ids, slots)] + [
        key.to(dtype).to(dev), value.to(dtype).to(dev), score.to(dev), pos.to(dev)]


@pytest.mark.parametrize("head_dim,tiers", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_tokens_cpu(head_dim, tiers, dtype):
    geo = PageGeometry.build(head_dim, *tiers)
    for i, layout in enumerate(geo.tiers):
        args = random_tokens(layout, 37, 4, dtype, "cpu", seed=head_dim + i)
        pages = torch.randint(0, 256, (4, geo.page_bytes), dtype=torch.uint8)
        ref = pages.clone()
        store_tokens(pages, layout, *args)
        store_tokens_reference(ref, layout, *args)
        assert torch.equal(pages, ref)


def test_store_decode_cpu():
    geo = PageGeometry.build(128, K8V4_GROUPED, K4V2_GROUPED)
    for layout in geo.tiers:
        pid, slot, key, value, score, pos = random_tokens(layout, 6, 3, torch.bfloat16, "cpu",
                                                          seed=9)
        args = (pid.view(2, 3), slot.view(2, 3), key.view(2, 3, -1), value.view(2, 3, -1),
                score.view(2, 3), pos.view(2, 3))
        pages = torch.randint(0, 256, (3, geo.page_bytes), dtype=torch.uint8)
        ref = pages.clone()
        store_decode(pages, layout, *args)
        store_decode_reference(ref, layout, *args)
        assert torch.equal(pages, ref)


def test_store_rejects_bad_shapes():
    geo = PageGeometry.build(64, K8V4, K4V2)
    pages = torch.zeros(2, geo.page_bytes, dtype=torch.uint8)
    ids = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="key must be"):
        store_tokens(pages, geo.high, ids, ids, torch.zeros(3, 32), torch.zeros(3, 64),
                     torch.zeros(3), ids)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,tiers", CASES)
def test_store_tokens_gpu(head_dim, tiers):
    geo = PageGeometry.build(head_dim, *tiers)
    for i, layout in enumerate(geo.tiers):
        args = random_tokens(layout, 20000, 2000, torch.bfloat16, "cuda", seed=i)
        pages = torch.randint(0, 256, (2000, geo.page_bytes), dtype=torch.uint8, device="cuda")
        # reference on the CPU: torch's CUDA division by a Python scalar multiplies by the
        # reciprocal, so a GPU run of the reference may differ from it by an ulp
        ref = pages.cpu()
        store_tokens(pages, layout, *args)
        store_tokens_reference(ref, layout, *(a.cpu() for a in args))
        assert torch.equal(pages.cpu(), ref)
