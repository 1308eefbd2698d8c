"""Prefill scoring (LSE + column sums) and compression (count + compact + store) kernels
against the dense oracle and CompressedKVCache's placement."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.kernels.prefill import (
    compress_prefill,
    compress_prefill_reference,
    prefill_scores,
    prefill_scores_reference,
)
from sglang_diffkv.kernels.testing import rel_err


def prompts(lengths, hq, hkv, d, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lmax = max(lengths)
    q = torch.randn(len(lengths), lmax, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(len(lengths), lmax, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(len(lengths), lmax, hkv, d, generator=g).to(dtype).to(device)
    # token-major storage viewed head-major: the kernels take strides, not copies
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("given_lse", [False, True])
def test_prefill_scores_cpu(given_lse):
    lengths = torch.tensor([70, 5, 130])
    q, k, _ = prompts(lengths.tolist(), 4, 2, 64, torch.bfloat16, "cpu", seed=1)
    lse = None
    if given_lse:
        # the last min(Q, L) queries' LSE, as a prefill attention kernel would return it
        nq = 16
        lse = torch.full((3, 4, nq), float("nan"))
        for b, n in enumerate(lengths.tolist()):
            m = min(nq, n)
            s = torch.einsum("hqd,hkd->hqk", q[b, :, n - m:n].float(),
                             k[b, :, :n].float().repeat_interleave(2, 0)) * 0.125
            qpos = torch.arange(n - m, n)
            s = s.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], -torch.inf)
            lse[b, :, :m] = torch.logsumexp(s, -1)
    sig = prefill_scores(q, k, lengths, 0.125, 16, lse=lse)
    ref = prefill_scores_reference(q, k, lengths, 0.125, 16)
    assert rel_err(sig, ref) < 1e-5
    torch.testing.assert_close(sig, ref, rtol=1e-4, atol=1e-6)


def make_cache(config, lengths, device, seed):
    cache = CompressedKVCache(config, head_dim=64, num_layers=2, num_kv_heads=2,
                              num_pages=200, max_reqs=5, max_context=256, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, generator=g, dtype=torch.uint8))
    req = torch.tensor([3, 0, 4][: len(lengths)], device=device)
    cache.begin_prefill(req, lengths).raise_if_failed()
    return cache, req


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compress_prefill_cpu(dtype):
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                     "window": 8, "score_queries": 16})
    lengths = torch.tensor([200, 9, 131])
    q, k, v = prompts(lengths.tolist(), 4, 2, 64, dtype, "cpu", seed=2)
    sig = prefill_scores(q, k, lengths, 0.125, 16)
    out = []
    for use_kernel in (True, False):
        cache, req = make_cache(config, lengths, "cpu", seed=7)
        a = cache.alpha[req]
        fn = compress_prefill if use_kernel else compress_prefill_reference
        cls = fn(cache.pages, cache.geometry, cache.manager.table, req, 1, k, v, sig, lengths,
                 a[:, 0], a[:, 1], config.window, config.score_queries)
        out.append((cache, cls))
    (kc, kcls), (rc, rcls) = out
    assert torch.equal(kcls.tier, rcls.tier)
    assert torch.equal(kcls.n_high, rcls.n_high) and torch.equal(kcls.n_low, rcls.n_low)
    assert torch.equal(kcls.pos, rcls.pos) and torch.equal(kcls.score, rcls.score)
    assert torch.equal(kc.pages, rc.pages)
    assert 0 < int(kcls.n_low.sum()) and int((kcls.tier == 2).sum()) > 0  # all tiers occur
    # and the reference cache's own store_prefill agrees with the reference placement
    cache, req = make_cache(config, lengths, "cpu", seed=7)
    cache.store_prefill(1, req, k, v, cache.classify(req, lengths, sig))
    assert torch.equal(cache.pages, rc.pages)


@pytest.mark.gpu
def test_prefill_gpu():
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 1.0, "alpha_l": 0.1})
    lengths = torch.tensor([200, 64, 131])
    q, k, v = prompts(lengths.tolist(), 8, 2, 64, torch.bfloat16, "cuda", seed=3)
    sig = prefill_scores(q, k, lengths.cuda(), 0.125, 64)
    ref = prefill_scores_reference(q, k, lengths, 0.125, 64)
    assert rel_err(sig, ref) < 1e-4
    caches = []
    # the reference runs on the CPU (torch's CUDA scalar division is not IEEE-exact)
    for fn, dev in ((compress_prefill, "cuda"), (compress_prefill_reference, "cpu")):
        cache, req = make_cache(config, lengths.tolist(), dev, seed=7)
        a = cache.alpha[req]
        fn(cache.pages, cache.geometry, cache.manager.table, req, 0, k.to(dev), v.to(dev),
           sig.to(dev), lengths.to(dev), a[:, 0], a[:, 1], config.window, config.score_queries)
        caches.append(cache)
    assert torch.equal(caches[0].pages.cpu(), caches[1].pages)
