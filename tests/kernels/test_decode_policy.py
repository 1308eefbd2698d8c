"""Decode policy step kernel vs CompressedKVCache.decode_layer_store, step by step."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.kernels.decode_policy import decode_policy_step, decode_policy_step_reference

CONFIG = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 6.0, "alpha_l": 1.5,
                                 "window": 4, "score_queries": 8})


def prefilled(lengths, hkv, d, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    cache = CompressedKVCache(CONFIG, head_dim=d, num_layers=2, num_kv_heads=hkv,
                              num_pages=400, max_reqs=4, max_context=160, device=device)
    cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, generator=g, dtype=torch.uint8))
    req = torch.tensor([2, 0, 3][: len(lengths)], device=device)
    lens = torch.tensor(lengths)
    cache.begin_prefill(req, lens).raise_if_failed()
    lmax = max(lengths)
    for layer in range(2):
        q = torch.randn(len(lengths), 2 * hkv, lmax, d, generator=g).to(device)
        k = torch.randn(len(lengths), hkv, lmax, d, generator=g).to(device)
        v = torch.randn(len(lengths), hkv, lmax, d, generator=g).to(device)
        cache.prefill_layer(layer, req, lens, q, k, v, d**-0.5)
    cache.end_prefill(req)
    return cache, req, lens


def copy_state(src: CompressedKVCache, device) -> CompressedKVCache:
    """A cache on ``device`` holding exactly ``src``'s state."""
    dst = CompressedKVCache(CONFIG, head_dim=src.geometry.head_dim, num_layers=2,
                            num_kv_heads=src.spec.num_kv_heads, num_pages=400, max_reqs=4,
                            max_context=160, device=device)
    dst.copy_state_from(src)
    return dst


def run_steps(device, dtype, steps, lengths=(40, 23, 61), hkv=2, d=64, scan_block=256):
    """Reference on the CPU (the canonical one), kernel on ``device``, same start state."""
    seen = set()
    a, req_a, lens = prefilled(list(lengths), hkv, d, "cpu", seed=11)
    b = copy_state(a, device)
    req = req_a.to(device)
    g = torch.Generator(device="cpu").manual_seed(12)
    alpha = a.alpha[req_a]
    for step in range(steps):
        a.begin_decode(req_a).raise_if_failed()
        b.begin_decode(req).raise_if_failed()
        assert torch.equal(a.manager.table, b.manager.table.cpu())
        positions = lens + step
        for layer in range(2):
            key = torch.randn(len(lengths), hkv, d, generator=g).to(dtype)
            value = torch.randn(len(lengths), hkv, d, generator=g).to(dtype)
            ref = decode_policy_step_reference(a.pages, a.geometry, a.manager.table,
                                               a.manager.counts, req_a, layer, positions,
                                               alpha, CONFIG.window, key, value)
            got = decode_policy_step(b.pages, b.geometry, b.manager.table, b.manager.counts,
                                     req, layer, positions.to(device), alpha.to(device),
                                     CONFIG.window, key.to(device), value.to(device),
                                     scan_block=scan_block)
            assert torch.equal(got.action.cpu(), ref.action.to(torch.int8))
            assert torch.equal(got.hmin.cpu(), ref.hmin) and torch.equal(got.lmin.cpu(), ref.lmin)
            assert torch.equal(a.manager.counts, b.manager.counts.cpu())
            assert torch.equal(a.pages, b.pages.cpu())
            seen.update(got.action.flatten().tolist())
    return seen


@pytest.mark.parametrize("scan_block", [256, 16])  # one block per row; several (ties across)
def test_decode_policy_cpu(scan_block):
    seen = run_steps("cpu", torch.bfloat16, steps=3, scan_block=scan_block)
    assert len(seen) >= 3, f"actions seen: {seen}"  # evict, demote-append, demote-replace


def test_scan_block_is_checked():
    with pytest.raises(ValueError, match="scan_block must be a power of two >= 16, got 24"):
        decode_policy_step(*[None] * 11, scan_block=24)


@pytest.mark.gpu
def test_decode_policy_gpu():
    seen = run_steps("cuda", torch.float16, steps=12, lengths=(90, 64, 40), hkv=8, d=128)
    assert len(seen) >= 3


@pytest.mark.parametrize("bench", [False, True])
def test_prepared_step_equals_per_call(bench):
    """``prepare_decode_step`` once per step, reused by every layer (as DiffKVOps does),
    gives the same decisions, pages and counters, bit for bit, as per-call conversion."""
    from sglang_diffkv.kernels.decode_policy import prepare_decode_step

    a, req, lens = prefilled([40, 23, 61], 2, 64, "cpu", seed=21)
    b = copy_state(a, "cpu")
    g = torch.Generator(device="cpu").manual_seed(22)
    # non-contiguous, non-float32 alpha and int32 positions: the conversions must happen
    alpha = torch.rand(2, 3, generator=g, dtype=torch.float64).t() * 4
    mix = (0.3, 0.5, 0.2)
    seeds = torch.randint(0, 2**31, (3,), generator=g, dtype=torch.int32)
    seen = set()
    for step in range(4):
        a.begin_decode(req).raise_if_failed()
        b.begin_decode(req).raise_if_failed()
        positions = (lens + step).to(torch.int32)
        bench_arg = (seeds, mix) if bench else None
        prep = prepare_decode_step(b.pages, req, positions, alpha, 2, bench=bench_arg)
        for layer in range(2):
            key = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16)
            value = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16)
            want = decode_policy_step(a.pages, a.geometry, a.manager.table, a.manager.counts,
                                      req, layer, positions, alpha, CONFIG.window, key, value,
                                      bench=bench_arg)
            got = decode_policy_step(b.pages, b.geometry, b.manager.table, b.manager.counts,
                                     req, layer, positions, alpha, CONFIG.window, key, value,
                                     bench=bench_arg, step=prep)
            assert got.action is prep.action  # the step's shared buffers
            for x, y in ((got.action, want.action), (got.hmin, want.hmin),
                         (got.lmin, want.lmin)):
                assert torch.equal(x, y)
            assert torch.equal(a.manager.counts, b.manager.counts)
            assert torch.equal(a.pages, b.pages)
            seen.update(got.action.flatten().tolist())
    assert len(seen) >= 2, f"actions seen: {seen}"
    with pytest.raises(ValueError, match="step inputs"):
        decode_policy_step(b.pages, b.geometry, b.manager.table, b.manager.counts, req, 0,
                           positions, alpha, CONFIG.window, key, value,
                           bench=None if bench else (seeds, mix), step=prep)


def test_position_minus_one_rows_change_nothing():
    """CUDA-graph padding rows carry position -1: on any row, even a live request's, the
    policy kernel stores nothing and advances no counter."""
    a, req, lens = prefilled([40, 23, 61], 2, 64, "cpu", seed=31)
    a.begin_decode(req).raise_if_failed()
    pages = a.pages.clone()
    g = torch.Generator(device="cpu").manual_seed(32)
    key = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16)
    value = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16)
    positions = torch.tensor([-1, int(lens[1]), -1])
    decode_policy_step(a.pages, a.geometry, a.manager.table, a.manager.counts, req, 0,
                       positions, a.alpha[req], CONFIG.window, key, value)
    b, ref_req, _ = prefilled([40, 23, 61], 2, 64, "cpu", seed=31)
    b.begin_decode(ref_req).raise_if_failed()
    decode_policy_step_reference(b.pages, b.geometry, b.manager.table, b.manager.counts,
                                 ref_req[1:2], 0, positions[1:2], b.alpha[ref_req[1:2]],
                                 CONFIG.window, key[1:2], value[1:2])
    # exactly what the reference does to the live row alone: the -1 rows were not touched
    assert torch.equal(a.pages, b.pages) and torch.equal(a.manager.counts, b.manager.counts)
    assert not torch.equal(a.pages, pages)
