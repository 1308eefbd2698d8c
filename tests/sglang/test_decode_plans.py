"""DiffKVOps' decode-attention plan cache: power-of-two (batch, context) buckets, a byte
budget with least-recently-used eviction, and kernel output equal to the reference when a
bucketed plan runs a smaller batch."""

from __future__ import annotations

import logging
import os

import harness  # noqa: F401  (sglang importable on CPU)
import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.sglang.ops import DiffKVOps, plan_bucket

CONFIG = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 6.0, "alpha_l": 1.5,
                                 "window": 4, "score_queries": 8,
                                 "bench_mix": [0.3, 0.5, 0.2]})


def small_cache(max_reqs: int = 64, max_context: int = 4096) -> CompressedKVCache:
    return CompressedKVCache(CONFIG, head_dim=64, num_layers=2, num_kv_heads=2,
                             num_pages=400, max_reqs=max_reqs, max_context=max_context)


def test_plan_bucket_rounds_up_to_powers_of_two_within_the_cache_limits():
    assert plan_bucket(1, 10, 64, 4096) == (8, 256)  # floors
    assert plan_bucket(9, 257, 64, 4096) == (16, 512)
    assert plan_bucket(16, 512, 64, 4096) == (16, 512)  # exact powers stay
    # capped by max running requests and the cache's max_context...
    assert plan_bucket(40, 3000, 50, 4100) == (50, 4096)
    assert plan_bucket(40, 4097, 50, 4100) == (50, 4100)
    # ...but never below what the batch needs (a row holds up to its sequence length)
    assert plan_bucket(60, 5000, 50, 4100) == (60, 5000)


def test_plans_are_reused_within_a_bucket_and_bounded_in_bytes(caplog):
    ops = DiffKVOps(small_cache(), use_kernels=True)
    dev = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        p = ops.decode_plan(3, 100, 4, dev)
        assert (p.batch, p.max_context) == (8, 256)
        # every batch size up to 8 and every context up to 256 shares it
        for b, ctx in ((1, 1), (5, 256), (8, 17)):
            assert ops.decode_plan(b, ctx, 4, dev) is p
        assert ops.plans_built == 1
        built = [r for r in caplog.records if "decode attention: plan" in r.getMessage()]
        assert len(built) == 1 and "scratch" in built[0].getMessage()
    assert "batch <= 8, context <= 256, 4 q heads" in built[0].getMessage()

    q9 = ops.decode_plan(9, 100, 4, dev)  # next batch bucket
    c512 = ops.decode_plan(3, 300, 4, dev)  # next context bucket
    assert (q9.batch, q9.max_context, c512.batch, c512.max_context) == (16, 256, 8, 512)
    assert ops.plans_built == 3 and len(ops._plans) == 3
    # scratch grows with batch x context: that is why the cache is bounded in bytes
    assert q9.scratch_bytes() > p.scratch_bytes() and c512.scratch_bytes() > p.scratch_bytes()

    # A budget that fits the two most recent plans: using p refreshes it, so the next
    # build evicts the least recently used one (q9), not p.
    ops.plan_cache_bytes = p.scratch_bytes() + c512.scratch_bytes() + 1
    assert ops.decode_plan(2, 2, 4, dev) is p
    big = ops.decode_plan(3, 1000, 4, dev)  # (8, 1024): over budget with anything else
    assert list(ops._plans.values()) == [big]
    # the plan in use is kept even when it alone exceeds the budget
    ops.plan_cache_bytes = 1
    assert ops.decode_plan(3, 1000, 4, dev) is big and list(ops._plans.values()) == [big]
    assert ops.plans_built == 4
    small = ops.decode_plan(1, 1, 4, dev)
    assert small is not p and list(ops._plans.values()) == [small]  # p was evicted earlier
    assert ops.cached_plan_bytes() == small.scratch_bytes()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
def test_bucketed_plan_attends_a_smaller_batch_like_the_reference():
    """Kernel decode attention through the seam, 3 of 5 requests on an (8, 256) plan sized
    from the batch's longest sequence, equals the torch reference: output and scores."""
    g = torch.Generator().manual_seed(7)
    caches = [small_cache(max_reqs=8, max_context=512) for _ in range(2)]
    for c in caches:
        c.pages.fill_(0xA5)  # page storage starts uninitialised: make the copies identical
    ref_ops = DiffKVOps(caches[0], use_kernels=False)
    ker_ops = DiffKVOps(caches[1], use_kernels=True)
    req = torch.tensor([4, 0, 2, 5, 1])
    lengths = torch.tensor([37, 90, 61, 12, 150])
    q = torch.randn(5, 4, 150, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(5, 2, 150, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(5, 2, 150, 64, generator=g).to(torch.bfloat16)
    kd = torch.randn(5, 2, 64, generator=g)
    for c in caches:  # the same reference prefill and one decode store on both
        c.begin_prefill(req, lengths).raise_if_failed()
        for layer in range(2):
            c.prefill_layer(layer, req, lengths, q, k, v, 0.125)
        c.end_prefill(req)
        c.begin_decode(req).raise_if_failed()
        for layer in range(2):
            c.decode_layer_store(layer, req, lengths, kd, kd)
    assert torch.equal(caches[0].pages, caches[1].pages)
    sub = req[[0, 1, 2]]
    seq = (lengths[[0, 1, 2]] + 1).tolist()  # tokens after the step
    qd = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)
    for layer in range(2):
        want = ref_ops.decode_attend(layer, sub, qd, 0.125)
        got = ker_ops.decode_attend(layer, sub, qd, 0.125, max_seq_len=max(seq))
        err = float((got.double() - want.double()).norm() / want.double().norm())
        assert err < 2e-2  # bf16 queries, fp16 probabilities in the kernel
    (plan,) = ker_ops._plans.values()
    assert (plan.batch, plan.max_context) == (8, 256)
    # scores accumulated for the same tokens (only the score fields differ, by rounding)
    s0, s1 = caches[0].pages.view(torch.float32), caches[1].pages.view(torch.float32)
    torch.testing.assert_close(s1, s0, rtol=2e-3, atol=1e-6, equal_nan=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("bench", [True, False])
def test_per_step_inputs_equal_per_call_path(bench):
    """``begin_decode_step`` once per step, passed to every layer's decode_store /
    decode_attend (the backend's path), changes nothing: outputs, pages and counters are
    bit-identical to the per-call path on the same random state, over several steps."""
    cfg = CONFIG if bench else DiffKVConfig.from_dict(
        {"preset": "llama-3-8b", "alpha_h": 6.0, "alpha_l": 1.5, "window": 4,
         "score_queries": 8})
    g = torch.Generator().manual_seed(17)
    caches = [CompressedKVCache(cfg, head_dim=64, num_layers=2, num_kv_heads=2,
                                num_pages=400, max_reqs=8, max_context=512)
              for _ in range(2)]
    req = torch.tensor([4, 0, 2, 5])
    lengths = torch.tensor([37, 90, 61, 12])
    q = torch.randn(4, 4, 90, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(4, 2, 90, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(4, 2, 90, 64, generator=g).to(torch.bfloat16)
    for c in caches:
        c.pages.fill_(0xA5)
        c.begin_prefill(req, lengths).raise_if_failed()
        for layer in range(2):
            c.prefill_layer(layer, req, lengths, q, k, v, 0.125)
        c.end_prefill(req)
    per_call, per_step = (DiffKVOps(c, use_kernels=True) for c in caches)
    assert per_step.begin_decode_step(req, lengths) is not None
    assert DiffKVOps(caches[0], use_kernels=False).begin_decode_step(req, lengths) is None
    for step in range(3):
        positions = lengths + step
        max_seq = int(positions.max()) + 1
        for c in caches:
            c.begin_decode(req).raise_if_failed()
        st = per_step.begin_decode_step(req, positions, max_seq)
        for layer in range(2):
            kd = torch.randn(4, 2, 64, generator=g).to(torch.bfloat16)
            vd = torch.randn(4, 2, 64, generator=g).to(torch.bfloat16)
            qd = torch.randn(4, 4, 64, generator=g).to(torch.bfloat16)
            per_call.decode_store(layer, req, positions, kd, vd)
            per_step.decode_store(layer, req, positions, kd, vd, step=st)
            want = per_call.decode_attend(layer, req, qd, 0.125, max_seq_len=max_seq)
            got = per_step.decode_attend(layer, req, qd, 0.125, max_seq_len=max_seq, step=st)
            assert torch.equal(got, want)
            assert torch.equal(caches[0].pages, caches[1].pages)
            assert torch.equal(caches[0].manager.counts, caches[1].manager.counts)
        assert list(st.plans) == [4]  # one plan lookup per step and q head count
