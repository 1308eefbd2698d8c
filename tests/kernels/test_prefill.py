"""Prefill scoring (LSE + column sums) and compression (classify + count, then prefix +
compact + store) kernels against the dense oracle and CompressedKVCache's placement."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.kernels.prefill import (
    PrefillBuffers,
    _block_prefix,
    compress_prefill,
    compress_prefill_reference,
    prefill_blocks,
    prefill_scores,
    prefill_scores_reference,
)
from sglang_diffkv.kernels.testing import rel_err
from sglang_diffkv.policy import contributing_queries


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


@triton.jit
def _prefix_probe(counts, out, nblk, NB, TILE: tl.constexpr):
    """_block_prefix of every (head, block), as the store kernel calls it, into out [.., 4]."""
    head = tl.program_id(0)
    blk = tl.program_id(1)
    h_first, l_first, n_hi, n_lo = _block_prefix(counts + head * NB * 2, blk,
                                                 tl.load(nblk + head), TILE)
    base = out + (head * NB + blk) * 4
    tl.store(base, h_first)
    tl.store(base + 1, l_first)
    tl.store(base + 2, n_hi)
    tl.store(base + 3, n_lo)


@pytest.mark.parametrize("nb", [1, 4, 11])
def test_block_prefix_over_several_tiles_cpu(nb):
    """The store kernel's prefix walks the blocks TILE at a time with a carry: with tiles of
    4, 11 blocks take three (compress_prefill's tile is 128 blocks: prompts over 8k tokens).
    Only a head's first nblk blocks count (later ones hold no token)."""
    g = torch.Generator().manual_seed(nb)
    heads = 6
    counts = torch.randint(0, 65, (heads, nb, 2), generator=g, dtype=torch.int32)
    nblk = torch.randint(1, nb + 1, (heads,), generator=g, dtype=torch.int32)
    nblk[0] = nb
    out = torch.full((heads, nb, 4), -1, dtype=torch.int32)
    _prefix_probe[(heads, nb)](counts, out, nblk, nb, TILE=4)
    live = torch.arange(nb)[None, :, None] < nblk[:, None, None].long()
    inc = (counts * live).cumsum(1, dtype=torch.int32)
    assert torch.equal(out[..., :2], inc - counts * live)
    assert torch.equal(out[..., 2:], inc[:, -1:].expand(-1, nb, -1))


def poisoned_cache(config, lengths, max_context, seed, num_layers=2, num_kv_heads=2):
    """A cache whose pages are random bytes, with ``lengths``' prompts allocated."""
    cache = CompressedKVCache(config, head_dim=64, num_layers=num_layers,
                              num_kv_heads=num_kv_heads, num_pages=400, max_reqs=6,
                              max_context=max_context, device="cpu")
    g = torch.Generator(device="cpu").manual_seed(seed)
    cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, generator=g, dtype=torch.uint8))
    req = torch.tensor([3, 0, 5, 1, 4][: len(lengths)])
    cache.begin_prefill(req, lengths).raise_if_failed()
    return cache, req


def random_significance(lengths, hkv, score_queries, seed):
    """Significance sums whose means fall around the thresholds of alpha (2, 0.5) (every
    tier occurs), and random garbage past each prompt's end (the kernels must ignore it)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    lmax = max(lengths)
    count = contributing_queries(lens, lmax, score_queries).clamp_min(1).float()
    sig = torch.rand(len(lengths), hkv, lmax, generator=g) * 3 * count[:, None] / lens[
        :, None, None]
    past = torch.arange(lmax)[None, None, :] >= lens[:, None, None]
    return torch.where(past, torch.rand(sig.shape, generator=g) * 100, sig)


# odd NB (3, 5) and NB 1; blocks of the short prompts past their end
@pytest.mark.parametrize("lengths", [[150, 9, 64, 65, 1], [300, 130, 2], [64]])
def test_fused_store_matches_the_reference_cpu(lengths):
    """The store kernel's own prefix sum over the block counts (no scan launch) places
    every token where the reference does, and block 0 writes the totals; all outputs are
    poisoned first."""
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                     "window": 8, "score_queries": 16})
    b, hkv, d = len(lengths), 2, 64
    lmax = max(lengths)
    lens = torch.tensor(lengths)
    g = torch.Generator().manual_seed(len(lengths))
    k = torch.randn(b, hkv, lmax, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, hkv, lmax, d, generator=g).to(torch.bfloat16)
    sig = random_significance(lengths, hkv, 16, seed=lmax)
    alpha_h = 2.0 * (1 + torch.rand(b, generator=g) * 0.5)
    alpha_l = 0.5 * torch.rand(b, generator=g)
    got, want = [poisoned_cache(config, lengths, 320, seed=9) for _ in range(2)]
    nb = prefill_blocks(lmax)
    totals = torch.full((b, hkv, 2), -5, dtype=torch.int32)
    tier = torch.full((b, hkv, lmax), 7, dtype=torch.int8)
    counts = torch.full((b, hkv, nb, 2), -3, dtype=torch.int32)
    kc = compress_prefill(got[0].pages, got[0].geometry, got[0].manager.table, got[1], 1, k,
                          v, sig, lens, alpha_h, alpha_l, 8, 16, totals=totals, tier_out=tier,
                          block_counts=counts)
    rc = compress_prefill_reference(want[0].pages, want[0].geometry, want[0].manager.table,
                                    want[1], 1, k, v, sig, lens, alpha_h, alpha_l, 8, 16)
    assert kc.tier is tier and torch.equal(tier, rc.tier)
    assert torch.equal(totals, torch.stack([rc.n_high, rc.n_low], -1))
    assert torch.equal(kc.score, rc.score) and torch.equal(kc.pos, rc.pos)
    assert torch.equal(got[0].pages, want[0].pages)
    big = int(lens.argmax())
    assert {0, 1, 2} <= set(tier[big].flatten().tolist())  # every tier occurs
    assert int(rc.n_high[big].min()) > 0 and int(rc.n_low[big].min()) > 0


@pytest.mark.gpu
def test_fused_store_over_several_count_tiles_gpu():
    """Prompts of more than COUNT_TILE (128) blocks: the store programs' prefix walks two or
    three tiles of block counts; the reference runs on the CPU."""
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                     "window": 64, "score_queries": 64})
    lengths = [20000, 300, 8193]
    b, hkv, d, lmax = 3, 2, 128, 20000
    lens = torch.tensor(lengths)
    g = torch.Generator().manual_seed(13)
    k = torch.randn(b, hkv, lmax, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, hkv, lmax, d, generator=g).to(torch.bfloat16)
    sig = random_significance(lengths, hkv, 64, seed=14)
    alpha_h, alpha_l = torch.full((b,), 2.0), torch.full((b,), 0.5)
    caches = []
    for fn, dev in ((compress_prefill, "cuda"), (compress_prefill_reference, "cpu")):
        cache = CompressedKVCache(config, head_dim=d, num_layers=1, num_kv_heads=hkv,
                                  num_pages=2000, max_reqs=4, max_context=20480, device=dev)
        cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, generator=g.manual_seed(15),
                                        dtype=torch.uint8))
        req = torch.tensor([2, 0, 3], device=dev)
        cache.begin_prefill(req, lengths).raise_if_failed()
        cls = fn(cache.pages, cache.geometry, cache.manager.table, req, 0, k.to(dev),
                 v.to(dev), sig.to(dev), lens.to(dev), alpha_h.to(dev), alpha_l.to(dev), 64, 64)
        caches.append((cache, cls))
    (kc, kcls), (rc, rcls) = caches
    assert torch.equal(kcls.tier.cpu(), rcls.tier)
    assert torch.equal(kcls.n_high.cpu(), rcls.n_high)
    assert torch.equal(kcls.n_low.cpu(), rcls.n_low)
    assert torch.equal(kc.pages.cpu(), rc.pages)


def run_compress(cache, req, layer, k, v, sig, lens, starts=None, **kw):
    a = cache.alpha[req]
    return compress_prefill(cache.pages, cache.geometry, cache.manager.table, req, layer, k,
                            v, sig, lens, a[:, 0], a[:, 1], cache.config.window,
                            cache.config.score_queries, starts=starts, **kw)


def test_step_buffers_are_reused_across_layers_cpu():
    """Two layers through one step's PrefillBuffers (prefill_scores' out, tier and block
    counts, no score / pos) leave what fresh buffers leave, per layer: pages, tiers, totals.
    The second layer has fewer members per block, so stale counts would misplace tokens."""
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                     "window": 8, "score_queries": 16})
    lens = [150, 9, 131]
    lengths = torch.tensor(lens)
    starts = torch.tensor([0, 150, 159])
    fresh, reused = [poisoned_cache(config, lens, 256, seed=10) for _ in range(2)]
    bufs = PrefillBuffers.allocate(3, 2, 150, "cpu")
    bufs.significance.fill_(float("nan"))
    bufs.tier.fill_(9)
    bufs.block_counts.fill_(-4)
    for layer, alpha_scale in ((0, 1.0), (1, 4.0)):
        q, k, v = prompts(lens, 4, 2, 64, torch.bfloat16, "cpu", seed=20 + layer)
        qp, kp, vp = pack(q, lens), pack(k, lens), pack(v, lens)
        for c in (fresh, reused):
            c[0].alpha[c[1]] = torch.tensor([2.0, 0.5]) * alpha_scale
        sig = prefill_scores(qp, kp, lengths, 0.125, 16, starts=starts, max_len=150)
        want_totals = torch.full((3, 2, 2), -1, dtype=torch.int32)
        want = run_compress(*fresh, layer, kp, vp, sig, lengths, starts, totals=want_totals)
        got_sig = prefill_scores(qp, kp, lengths, 0.125, 16, starts=starts, max_len=150,
                                 out=bufs.significance)
        assert got_sig is bufs.significance
        got_totals = torch.full((3, 2, 2), -1, dtype=torch.int32)
        got = run_compress(*reused, layer, kp, vp, got_sig, lengths, starts, totals=got_totals,
                           tier_out=bufs.tier, block_counts=bufs.block_counts, scores=False)
        assert got.score is None and got.pos is None
        assert got.tier is bufs.tier and torch.equal(got.tier, want.tier)
        assert torch.equal(got_totals, want_totals), layer
        assert torch.equal(reused[0].pages, fresh[0].pages), layer
    assert int(want_totals[..., 1].sum()) > 0


def test_buffer_checks_name_the_bad_value_cpu():
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                     "window": 8, "score_queries": 16})
    lens = [70, 9]
    lengths = torch.tensor(lens)
    q, k, v = prompts(lens, 4, 2, 64, torch.bfloat16, "cpu", seed=12)
    cache = poisoned_cache(config, lens, 256, seed=11)
    sig = prefill_scores(q, k, lengths, 0.125, 16)
    bad = {
        "tier_out": {"tier_out": torch.empty(2, 2, 71, dtype=torch.int8)},
        "block_counts": {"block_counts": torch.empty(2, 2, 2, 2, dtype=torch.int64)},
        "totals": {"totals": torch.empty(2, 2, 2, dtype=torch.int32).transpose(0, 1)},
        "bench seed": {"bench": (torch.zeros(3, dtype=torch.int64), (0.3, 0.5, 0.2))},
        "bench mix": {"bench": (torch.zeros(2, dtype=torch.int64),
                                torch.tensor([0.3, 0.5, 0.2]))},
    }
    for name, kw in bad.items():
        with pytest.raises(ValueError, match=name):
            run_compress(*cache, 0, k, v, sig, lengths, **kw)
    with pytest.raises(ValueError, match="not contiguous"):
        run_compress(*cache, 0, k, v, sig, lengths, **bad["totals"])
    with pytest.raises(ValueError, match="significance"):  # the draw is written in place
        run_compress(*cache, 0, k, v, sig.double(), lengths,
                     bench=(torch.zeros(2, dtype=torch.int64), (0.3, 0.5, 0.2)))
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 \\[2, 2, 70\\]"):
        prefill_scores(q, k, lengths, 0.125, 16, out=torch.empty(2, 2, 64))


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
