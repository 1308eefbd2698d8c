"""Extend attention kernel (a compressed prefix + causal fresh tokens) vs the torch oracle
(extend_attention.paged_extend_attention)."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED
from sglang_diffkv.kernels.extend_attention import (
    extend_attention,
    extend_attention_reference,
    scratch_elements,
    tile_shape,
)
from sglang_diffkv.kernels.testing import random_extend_case, rel_err
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.prompt_attention import PackedPrompts, attend_padded

# request b's row keeps (n_high, n_low) per KV head: no prefix, one token, partial pages,
# several pages of both tiers (what a prefix held beyond these counts was pruned)
PREFIX = [[(0, 0), (0, 0)], [(1, 0), (0, 1)], [(20, 7), (13, 40)], [(70, 90), (100, 3)]]


def check_case(geo, prefix, new_lens, group, dtype, device, seed, *, splits=None,
               block_m=16, block_k=16, tol=5e-3):
    """Kernel vs oracle on fresh random inputs; output, LSE and scratch poisoned with NaN
    first, so every value read must have been written. Rows of no request stay NaN, pages
    are never written."""
    case = random_extend_case(geo, prefix, new_lens, group, dtype=dtype, device=device,
                              seed=seed)
    c = case.cache
    d = geo.head_dim
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), device=device)
    scratch = None
    if splits is not None and splits > 1:
        bm, qt = tile_shape(group, case.max_new, block_m)
        tiles = len(new_lens) * -(-case.max_new // qt)
        scratch = tuple(torch.full((n,), float("nan"), device=device)
                        for n in scratch_elements(tiles, c.table.shape[2], splits, bm, d))
    pages = c.pages.clone()
    extend_attention(case.q, case.k, case.v, case.starts, case.lens, c.pages, geo, c.table,
                     c.counts, c.req_idx, 1, d**-0.5, out, lse, max_new=case.max_new,
                     block_m=block_m, block_k=block_k, splits=splits, scratch=scratch)
    ref = extend_attention_reference(case.q, case.k, case.v, case.starts, case.lens, c.pages,
                                     geo, c.table, c.counts, c.req_idx, 1, d**-0.5)
    n = int(case.lens.sum())
    assert rel_err(out[:n], ref.out[:n].float()) < tol
    assert rel_err(lse[:n], ref.lse[:n]) < 1e-5
    assert torch.isnan(out[n:]).all() and torch.isnan(lse[n:]).all()
    assert torch.equal(pages, c.pages)
    return case, out, lse


@pytest.mark.parametrize(
    "tiers,group,dtype,splits",
    [
        ((K8V4, K4V2), 4, torch.bfloat16, 1),  # 4 fresh tokens per tile, output written direct
        ((K8V4_GROUPED, K4V2_GROUPED), 1, torch.float16, 3),  # 16 per tile, split and merged
        ((K8V4, K4V2), 5, torch.float32, 2),  # a group that does not divide the tile
    ],
)
def test_extend_attention_cpu(tiers, group, dtype, splits):
    geo = PageGeometry.build(64, *tiers)
    # fresh tokens: one, a few, and more than one tile (QT = 16 // group)
    check_case(geo, PREFIX, [1, 5, 40, 17], group, dtype, "cpu", seed=group, splits=splits)


def test_extend_attention_default_tiles_cpu():
    # the default tile (64 rows, 64 fresh keys per step) and split choice
    geo = PageGeometry.build(64, K8V4_GROUPED, K4V2_GROUPED)
    check_case(geo, PREFIX[2:], [70, 3], 4, torch.bfloat16, "cpu", seed=9, block_m=64,
               block_k=64)


def test_extend_attention_without_prefix_equals_prefill_attention_cpu():
    geo = PageGeometry.build(64, K8V4, K4V2)
    lens = [1, 20, 37]
    case, out, lse = check_case(geo, [[(0, 0)] * 2] * 3, lens, 4, torch.float32, "cpu",
                                seed=2, splits=2)
    prompts = PackedPrompts.from_lengths(lens, "cpu")
    want, _ = attend_padded(case.q, case.k, case.v, prompts, 64**-0.5)
    torch.testing.assert_close(out[:prompts.num_tokens], want, rtol=1e-5, atol=1e-5)


def test_extend_attention_empty_batch_and_bad_inputs():
    geo = PageGeometry.build(64, K8V4, K4V2)
    case = random_extend_case(geo, PREFIX[:2], [3, 2], 2, dtype=torch.float16)
    c = case.cache
    args = (case.starts, case.lens, c.pages, geo, c.table, c.counts, c.req_idx, 0, 0.125)
    res = extend_attention(case.q, case.k, case.v, case.starts[:0], case.lens[:0], c.pages,
                           geo, c.table, c.counts, c.req_idx[:0], 0, 0.125)
    assert res.out.shape == case.q.shape and res.lse.shape == case.q.shape[:2]
    with pytest.raises(ValueError, match="one dtype"):
        extend_attention(case.q, case.k.float(), case.v, *args)
    with pytest.raises(ValueError, match="head_dim"):
        extend_attention(case.q[..., :32], case.k[..., :32], case.v[..., :32], *args)
    with pytest.raises(ValueError, match="like req_idx"):
        extend_attention(case.q, case.k, case.v, case.starts[:1], *args[1:])
    with pytest.raises(ValueError, match="scratch"):
        extend_attention(case.q, case.k, case.v, *args, splits=2,
                         scratch=(torch.empty(1), torch.empty(1)))


@pytest.mark.gpu
@pytest.mark.parametrize("tiers", [(K8V4, K4V2), (K8V4_GROUPED, K4V2_GROUPED)])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_extend_attention_gpu(tiers, splits):
    # serving shapes: D128, 8 KV heads, GQA 4, bf16; a chunk over a long mixed prefix next to
    # short extends (a radix hit with one new token, a short prompt with no prefix)
    geo = PageGeometry.build(128, *tiers)
    g = torch.Generator().manual_seed(len(tiers[0].name))
    prefix = [[(0, 0)] * 8, [(1, 0)] * 8]
    for total in (700, 3000):
        heads = []
        for _ in range(8):
            hi = int(total * (0.15 + 0.3 * torch.rand(1, generator=g)))
            lo = int(total * (0.3 + 0.4 * torch.rand(1, generator=g)))
            heads.append((hi, min(lo, total - hi)))
        prefix.append(heads)
    check_case(geo, prefix, [300, 1, 1000, 2048], 4, torch.bfloat16, "cuda", seed=7,
               splits=splits, block_m=64, block_k=64, tol=1e-2)


def test_tile_shape():
    # (BLOCK_M, QT): a power of two >= 16 rows; short extends take the smallest that fits
    assert tile_shape(4, 8192) == (64, 16)
    assert tile_shape(7, 8192) == (64, 9)  # 63 of 64 rows used
    assert tile_shape(4, 1) == (16, 4)
    assert tile_shape(1, 3) == (16, 16)
    assert tile_shape(32, 5) == (64, 2)
    assert tile_shape(32, 5, block_m=16) == (32, 1)  # a group wider than the tile: one token
    assert tile_shape(4, 8192, block_m=128) == (128, 32)


@pytest.mark.gpu
def test_short_extend_gpu():
    # radix hits with a token or three: the 16-row tile (tile_shape) and the default splits
    geo = PageGeometry.build(128, K8V4, K4V2)
    prefix = [[(900, 1500)] * 8, [(1, 0)] * 8, [(3000, 40)] * 8]
    check_case(geo, prefix, [1, 3, 1], 4, torch.bfloat16, "cuda", seed=8, block_m=64,
               block_k=64, tol=1e-2)
