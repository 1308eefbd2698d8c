"""The config's bounds are what the kernels take: at MAX_WINDOW, MAX_SCORE_QUERIES and
MAX_ALPHA the prefill scoring, prefill compression and decode policy kernels still equal
their references (here under the Triton interpreter; sm_90 shared memory for
MAX_SCORE_QUERIES is the comment at config.MAX_SCORE_QUERIES)."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import MAX_ALPHA, MAX_SCORE_QUERIES, MAX_WINDOW, DiffKVConfig
from sglang_diffkv.kernels.decode_policy import decode_policy_step, decode_policy_step_reference
from sglang_diffkv.kernels.prefill import (
    compress_prefill,
    compress_prefill_reference,
    prefill_scores,
    prefill_scores_reference,
)
from sglang_diffkv.kernels.testing import rel_err

D, HQ, HKV = 64, 4, 2
LONG = [MAX_SCORE_QUERIES + 9, 7]  # every query row of the scoring tile in use
SHORT = [40, 7]


def prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (len(lengths), max(lengths))
    q = torch.randn(*shape, HQ, D, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(*shape, HKV, D, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(*shape, HKV, D, generator=g).bfloat16().transpose(1, 2)
    return q, k, v


def test_prefill_scores_at_max_score_queries():
    q, k, _ = prompts(LONG, 1)
    lengths = torch.tensor(LONG)
    sig = prefill_scores(q, k, lengths, D**-0.5, MAX_SCORE_QUERIES)
    ref = prefill_scores_reference(q, k, lengths, D**-0.5, MAX_SCORE_QUERIES)
    assert rel_err(sig, ref) < 1e-4


@pytest.mark.parametrize("window, alpha", [
    (MAX_WINDOW, (MAX_ALPHA, MAX_ALPHA)),  # every token inside the window: all high
    (4, (MAX_ALPHA, 1.0)),  # thresholds clamp to 1: outside the window low or pruned
])
def test_compress_prefill_and_decode_policy_at_the_bounds(window, alpha):
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "window": window,
                                     "score_queries": MAX_SCORE_QUERIES})
    q, k, v = prompts(SHORT, 2)
    lengths = torch.tensor(SHORT)
    sig = prefill_scores_reference(q, k, lengths, D**-0.5, MAX_SCORE_QUERIES)
    caches, classes = [], []
    for fn in (compress_prefill, compress_prefill_reference):
        cache = CompressedKVCache(config, head_dim=D, num_layers=1, num_kv_heads=HKV,
                                  num_pages=200, max_reqs=3, max_context=400)
        # the same bytes in both pools (page storage starts uninitialised)
        g = torch.Generator().manual_seed(7)
        cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, generator=g,
                                        dtype=torch.uint8))
        req = torch.tensor([2, 0])
        a = [alpha[0]] * 2, [alpha[1]] * 2
        cache.begin_prefill(req, lengths, *a).raise_if_failed()
        al = cache.alpha[req]
        classes.append(fn(cache.pages, cache.geometry, cache.manager.table, req, 0, k, v, sig,
                          lengths, al[:, 0], al[:, 1], window, MAX_SCORE_QUERIES))
        cache.end_prefill(req)
        caches.append(cache)
    (kc, rc), (kcls, rcls) = caches, classes
    assert torch.equal(kcls.tier, rcls.tier) and torch.equal(kc.pages, rc.pages)
    all_high = int(kcls.n_high.sum()) == sum(SHORT) * HKV
    assert all_high == (window == MAX_WINDOW)
    g = torch.Generator().manual_seed(3)
    req = torch.tensor([2, 0])
    for step in range(2):  # (the second step reads what the first wrote)
        for cache in caches:
            cache.begin_decode(req).raise_if_failed()
        positions = lengths + step
        key = torch.randn(2, HKV, D, generator=g).bfloat16()
        value = torch.randn(2, HKV, D, generator=g).bfloat16()
        ref = decode_policy_step_reference(rc.pages, rc.geometry, rc.manager.table,
                                           rc.manager.counts, req, 0, positions,
                                           rc.alpha[req], window, key, value)
        got = decode_policy_step(kc.pages, kc.geometry, kc.manager.table, kc.manager.counts,
                                 req, 0, positions, kc.alpha[req], window, key, value)
        assert torch.equal(got.action, ref.action.to(torch.int8))
        assert torch.equal(kc.pages, rc.pages) and torch.equal(kc.counts, rc.counts)
