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


def pack(xs, lengths):
    """[B, H, Lmax, D] padded prompts -> their tokens packed [T, H, D], as SGLang passes
    them (the padding is dropped: a kernel reading past a prompt reads the next one)."""
    return torch.cat([x.transpose(0, 1)[:n] for x, n in zip(xs, lengths, strict=True)])


@pytest.mark.parametrize("lse_from", ["kernel", "attention"])
def test_packed_prompts_score_like_padded_ones_cpu(lse_from):
    """Packed [T, H, D] prompts (as SGLang passes them) give the padded scores, with the
    LSE pass or a varlen attention's per-token LSE [T, Hq] (any strides)."""
    lens = [70, 5, 130]
    q, k, _ = prompts(lens, 4, 2, 64, torch.bfloat16, "cpu", seed=4)
    lengths = torch.tensor(lens)
    qp, kp = pack(q, lens), pack(k, lens)
    starts = torch.tensor([0, 70, 75])
    lse = None
    if lse_from == "attention":
        lse_rows = []
        for b, n in enumerate(lens):
            s = torch.einsum("hqd,hkd->hqk", q[b, :, :n].float(),
                             k[b, :, :n].float().repeat_interleave(2, 0)) * 0.125
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
            lse_rows.append(torch.logsumexp(s, -1))  # [Hq, n]
        lse = torch.cat(lse_rows, 1).t()  # [T, Hq] viewed from [Hq, T], as flash returns it
    out = torch.full((3, 2, 130), float("nan"))
    sig = prefill_scores(qp, kp, lengths, 0.125, 16, lse=lse, starts=starts, max_len=130,
                         out=out)
    assert sig is out
    ref = prefill_scores_reference(q, k, lengths, 0.125, 16)
    torch.testing.assert_close(sig, ref, rtol=1e-4, atol=1e-6)
    if lse is not None:  # a per-token LSE has no meaning for padded prompts
        with pytest.raises(ValueError, match="needs packed prompts"):
            prefill_scores(q, k, lengths, 0.125, 16, lse=lse)


def test_packed_prompts_compress_like_padded_ones_cpu():
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                     "window": 8, "score_queries": 16})
    lens = [200, 9, 131]
    lengths = torch.tensor(lens)
    q, k, v = prompts(lens, 4, 2, 64, torch.bfloat16, "cpu", seed=5)
    sig = prefill_scores(q, k, lengths, 0.125, 16)
    starts = torch.tensor([0, 200, 209])
    done = []
    for layout in ("padded", "packed"):
        cache, req = make_cache(config, lens, "cpu", seed=8)
        a = cache.alpha[req]
        if layout == "padded":
            cls = compress_prefill(cache.pages, cache.geometry, cache.manager.table, req, 1,
                                   k, v, sig, lengths, a[:, 0], a[:, 1], 8, 16)
            totals = torch.stack([cls.n_high, cls.n_low], -1)
        else:
            totals = torch.full((3, 2, 2), -7, dtype=torch.int32)
            compress_prefill(cache.pages, cache.geometry, cache.manager.table, req, 1,
                             pack(k, lens), pack(v, lens), sig, lengths, a[:, 0], a[:, 1], 8,
                             16, starts=starts, totals=totals)
        done.append((cache.pages.clone(), totals))
    assert torch.equal(done[0][0], done[1][0])
    assert torch.equal(done[0][1], done[1][1])
    with pytest.raises(ValueError, match="starts"):
        compress_prefill(cache.pages, cache.geometry, cache.manager.table, req, 1,
                         pack(k, lens), pack(v, lens), sig, lengths, a[:, 0], a[:, 1], 8, 16)
    with pytest.raises(ValueError, match="starts"):
        prefill_scores(pack(q, lens), pack(k, lens), lengths, 0.125, 16)


@pytest.mark.parametrize("nb", [1, 4, 11])
def test_block_scan_over_several_tiles_cpu(nb):
    """The scan walks the blocks BLOCK_NB at a time with a carry: with tiles of 4, 11
    blocks take three (compress_prefill's tile is 128 blocks: prompts over 8k tokens)."""
    from sglang_diffkv.kernels.prefill import _scan_kernel

    g = torch.Generator().manual_seed(nb)
    counts = torch.randint(0, 65, (2, 3, nb, 2), generator=g, dtype=torch.int32)
    first = torch.full_like(counts, -1)
    totals = torch.full((2, 3, 2), -1, dtype=torch.int32)
    _scan_kernel[(2, 3)](counts, first, totals, nb, BLOCK_NB=4, num_warps=1)
    inc = counts.cumsum(2, dtype=torch.int32)
    assert torch.equal(first, inc - counts)
    assert torch.equal(totals, inc[:, :, -1])


@pytest.mark.gpu
def test_packed_prompts_with_the_flash_lse_gpu():
    """The backend's prefill on the H100: packed prompts, the LSE from flash varlen, then
    compression; against the dense oracle and the padded kernels."""
    from sglang_diffkv.prompt_attention import PackedPrompts, attend_varlen

    lens = [1000, 17, 1, 2500, 300]
    q, k, v = prompts(lens, 32, 8, 128, torch.bfloat16, "cuda", seed=6)
    lengths = torch.tensor(lens)
    qp, kp, vp = pack(q, lens), pack(k, lens), pack(v, lens)
    p = PackedPrompts.from_lengths(lens, "cuda")
    _, lse = attend_varlen(qp, kp, vp, p, 128**-0.5)
    sig = prefill_scores(qp, kp, p.lengths, 128**-0.5, 64, lse=lse, starts=p.starts,
                         max_len=p.max_len)
    ref = prefill_scores_reference(q, k, lengths, 128**-0.5, 64)
    assert rel_err(sig, ref) < 1e-3
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 1.0, "alpha_l": 0.1})
    pages = []
    for layout in ("padded", "packed"):
        cache = CompressedKVCache(config, head_dim=128, num_layers=1, num_kv_heads=8,
                                  num_pages=3000, max_reqs=6, max_context=4096, device="cuda")
        torch.manual_seed(11)
        cache.pages.random_(0, 256)  # poisoned alike: only the stores may differ
        req = torch.tensor([4, 0, 5, 2, 1], device="cuda")
        cache.begin_prefill(req, lens).raise_if_failed()
        a = cache.alpha[req]
        if layout == "padded":
            compress_prefill(cache.pages, cache.geometry, cache.manager.table, req, 0, k, v,
                             sig, p.lengths, a[:, 0], a[:, 1], 64, 64)
        else:
            compress_prefill(cache.pages, cache.geometry, cache.manager.table, req, 0, kp, vp,
                             sig, p.lengths, a[:, 0], a[:, 1], 64, 64, starts=p.starts)
        pages.append(cache.pages)
    assert torch.equal(pages[0], pages[1])
