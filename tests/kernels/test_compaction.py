"""CUDA decode-step compaction: compiles with nvcc (CPU CI), equals the torch manager (GPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.kernels.compaction import (
    build_library,
    compaction_backend,
    decode_compaction,
    decode_compaction_reference,
    nvcc_path,
)
from sglang_diffkv.memory import MemorySpec, PageManager


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed on this machine")
def test_cuda_source_compiles(tmp_path):
    lib = build_library(tmp_path)
    assert lib.stat().st_size > 0


def random_manager(batch, layers, heads, num_pages, seed, device="cuda", free_left=None):
    """Two identical decoding managers; some (row, tier) exactly full so they want a page."""
    spec = MemorySpec(num_pages=num_pages, max_reqs=batch + 3, num_layers=layers,
                      num_kv_heads=heads, high_tokens_per_page=32, low_tokens_per_page=60,
                      max_context=1024)
    g = torch.Generator(device="cpu").manual_seed(seed)
    req = torch.randperm(batch + 3, generator=g)[:batch]
    lengths = torch.randint(1, 400, (batch,), generator=g)
    shape = (batch, layers, heads)
    frac = torch.rand(shape, generator=g)
    n_hi = (lengths.view(-1, 1, 1) * frac * 0.6).long()
    n_lo = ((lengths.view(-1, 1, 1) - n_hi) * torch.rand(shape, generator=g)).long()
    full_hi = torch.rand(shape, generator=g) < 0.4
    full_lo = torch.rand(shape, generator=g) < 0.4
    tiers = torch.rand(batch, 2, generator=g) < 0.8
    managers = []
    for _ in range(2):
        m = PageManager(spec, device, validate=False)
        m.allocate_prefill(req, lengths).raise_if_failed()
        m.reclaim_prefill(req, n_hi, n_lo)
        c = m.counts[req.to(device)].long()
        hi = torch.where(full_hi.to(device), c[..., 2] * 32, c[..., 0])
        lo = torch.where(full_lo.to(device), c[..., 3] * 60, c[..., 1])
        m.set_counts(req, torch.stack([hi, lo], -1))
        if free_left is not None:  # pretend other requests hold the rest of the pool
            m.free_list.head.copy_(m.free_list.tail - free_left)
        managers.append(m)
    return managers, req.to(device), tiers.to(device)


def assert_same(a: PageManager, b: PageManager) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("free_left", [None, 50])  # plenty / too few pages (a no-op)
@pytest.mark.parametrize("cooperative", [None, False, True])  # default / one block / grid
def test_decode_compaction_gpu(free_left, cooperative):
    assert compaction_backend() == "cuda"
    (ref, ker), req, tiers = random_manager(37, 4, 8, 200_000, seed=3, free_left=free_left)
    for step in range(3):
        r = decode_compaction_reference(ref, req, tiers)
        k = decode_compaction(ker, req, tiers, cooperative=cooperative)
        for f in ("ok", "needed", "free", "rows_ok"):
            assert torch.equal(getattr(r, f).cpu(), getattr(k, f).cpu()), (step, f)
        assert_same(ref, ker)
        # next step: every tier that got a page fills it, so the rows want again
        c = ref.counts[req]
        full = torch.stack([c[..., 2] * 32, c[..., 3] * 60], -1)
        for m in (ref, ker):
            m.set_counts(req, full)
    assert bool(r.ok) == (free_left is None)
