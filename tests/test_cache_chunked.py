"""Chunked prefill through the reference cache (no SGLang): ``CompressedKVCache.store_chunk``,
``store_last_chunk``, ``end_extend`` and ``extend_layer_attend`` against the whole prompt's
``prefill_layer``, on random K/V whose attention is sharp enough to use all three tiers.

The rule (docs/backend.md, "Stage 2"): earlier chunks are stored at K8V4 unscored; the last
chunk scores the whole prompt with its last score_queries queries (earlier chunks' queries
when it is shorter). Scores then differ from the whole prompt's only by the K8 error of the
stored keys; a token that stays high keeps its stored bytes (bit for bit what the whole
prompt stores), a token that goes low is re-quantised from them.
"""

from __future__ import annotations

import pytest
import torch
from extend_case import CFG, HKV, LAYERS, SCALE, D, G, qkv

from sglang_diffkv.attention import gather_cache
from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.extend_attention import paged_prefix_probs
from sglang_diffkv.pages import read_token_codes, token_locations, write_tokens
from sglang_diffkv.policy import Tier, contributing_queries, thresholds
from sglang_diffkv.quant import error_bound, fake_quantize, quantize


def new_cache(cfg: DiffKVConfig = CFG) -> CompressedKVCache:
    return CompressedKVCache(cfg, head_dim=D, num_layers=LAYERS, num_kv_heads=HKV,
                             num_pages=200, max_reqs=4, max_context=256)


def whole(q, k, v, slot: int = 1) -> tuple[CompressedKVCache, list]:
    c, n = new_cache(), q.shape[1]
    assert bool(c.begin_prefill([slot], [n]).ok)
    classes = []
    for layer in range(LAYERS):
        classes.append(c.prefill_layer(
            layer, [slot], torch.tensor([n]), q[layer].transpose(0, 1)[None],
            k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None], SCALE))
    c.end_prefill([slot])
    return c, classes


def chunked(q, k, v, chunks: list[int], slot: int = 2, cfg: DiffKVConfig = CFG
            ) -> tuple[CompressedKVCache, list, list[torch.Tensor]]:
    """The prompt in ``chunks``; returns the cache, the last chunk's classification per
    layer and each chunk's attention outputs [layers, n, Hq, D]."""
    c, n = new_cache(cfg), q.shape[1]
    assert sum(chunks) == n
    req = torch.tensor([slot])
    outs, at = [], 0
    calls = []
    orig = c.classify
    c.classify = lambda *a: calls.append(orig(*a)) or calls[-1]
    for i, m in enumerate(chunks):
        if i == 0:
            assert bool(c.begin_prefill(req, [m], reserve=[n]).ok)
        ext = ExtendRequests.build(req, [slot], [m], [at], [n])
        step = []
        for layer in range(LAYERS):
            rows = slice(at, at + m)
            if at:  # (a first chunk has nothing stored: the backend attends over it alone)
                res = c.extend_layer_attend(layer, req, q[layer, rows], k[layer, rows],
                                            v[layer, rows], torch.tensor([0]),
                                            torch.tensor([m]), SCALE)
                step.append(res.out)
            c.store_chunk(layer, ext, q[layer, rows], k[layer, rows], v[layer, rows])
            c.store_last_chunk(layer, ext, q[layer, rows], k[layer, rows], v[layer, rows],
                               SCALE)
        c.end_extend(ext)
        c.manager.check_invariants()
        outs.append(torch.stack(step) if step else None)
        at += m
    return c, calls, outs


def band(q, k, stored: int) -> torch.Tensor:
    """exp(2 eps) - 1 [Hkv]: how far (relatively) a token's significance may move when the
    keys 0..stored-1 are K8-quantised (eps: the scoring queries' largest logit change)."""
    n = q.shape[0]
    nq = min(CFG.score_queries, n)
    ek = error_bound(quantize(k[:stored], CFG.high.key_bits, CFG.high.key_groups).scale, D)
    qs = q[n - nq:].abs().view(nq, HKV, G, D)
    return torch.expm1(2 * SCALE * torch.einsum("qhgd,jhd->hqgj", qs, ek).amax((1, 2, 3)))


def codes_of(pages_like: torch.Tensor, c: CompressedKVCache, k, v) -> list[torch.Tensor]:
    """The K8V4 bytes ``write_tokens`` stores for k / v [T, D] (on a scratch page set)."""
    high = c.geometry.high
    scratch = torch.zeros_like(pages_like)
    t = k.shape[0]
    ids = torch.arange(t) // high.tokens_per_page
    slots = (torch.arange(t) % high.tokens_per_page).int()
    write_tokens(scratch, high, ids, slots, k, v, torch.zeros(t), torch.zeros(t).int())
    return read_token_codes(scratch, high, ids, slots)


@pytest.mark.parametrize("chunks", [[32, 32, 6], [40, 30], [10, 10, 10, 10, 3, 7, 1],
                                    [64, 6]],
                         ids=["short-last", "full-last", "many", "one-query-short"])
def test_chunked_prompt_matches_the_whole_prompt(chunks):
    n = sum(chunks)
    stored = n - chunks[-1]
    q, k, v = qkv(n, seed=len(chunks))
    cw, cls_w = whole(q, k, v)
    cc, cls_c, outs = chunked(q, k, v, chunks)
    assert len(cls_c) == LAYERS
    assert not cc._score_queries  # dropped at the last chunk
    flips = 0
    for layer in range(LAYERS):
        tw, tc = cls_w[layer].tier[0], cls_c[layer].tier[0]
        assert (torch.bincount(tw.flatten().long(), minlength=3) > 0).all()  # 3 tiers used
        # scores within the K8 band of the whole prompt's; decisions equal outside it
        bw, sc = band(q[layer], k[layer], stored)[:, None], cls_c[layer].score[0]
        sw = cls_w[layer].score[0]
        assert ((sc - sw).abs() <= sw * bw + 1e-5).all()
        mean = sw / contributing_queries(torch.tensor([n]), n, CFG.score_queries)[0]
        near = torch.zeros_like(tw, dtype=torch.bool)
        for alpha in (CFG.alpha_h, CFG.alpha_l):
            t = float(thresholds(torch.tensor(alpha), torch.tensor(n)))
            near |= (mean / (1 + bw) <= t) & (t <= mean * (1 + bw))
        assert bool((tw == tc)[~near].all())
        flips += int((tw != tc).sum())
        # stored rows follow the chunked decisions: high tokens with the K8V4 bytes of their
        # exact K/V (earlier chunks' copied bit for bit), low tokens within K4 + K8 steps
        cnt = cc.counts[2, layer]
        assert cnt[:, 0].tolist() == (tc == Tier.HIGH).sum(-1).tolist()
        assert cnt[:, 1].tolist() == (tc == Tier.LOW).sum(-1).tolist()
        g = gather_cache(cc.pages, cc.geometry, cc.manager.table, cc.counts,
                         torch.tensor([2]), layer)
        for h in range(HKV):
            hi = torch.nonzero(tc[h] == Tier.HIGH).squeeze(1)
            loc = token_locations(cc.manager.table[2, layer, h][None, None],
                                  cnt[h:h + 1, 0][None], cc.geometry.high.tokens_per_page,
                                  low=False, capacity=hi.numel())
            got = read_token_codes(cc.pages, cc.geometry.high, loc.page_ids.reshape(-1),
                                   loc.slots.reshape(-1))
            want = codes_of(cc.pages[:8], cc, k[layer, hi, h], v[layer, hi, h])
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (layer, h)
            lo = torch.nonzero(tc[h] == Tier.LOW).squeeze(1)
            kl = g.low.key[0, h, :lo.numel()]
            e = (error_bound(quantize(kl, CFG.low.key_bits, CFG.low.key_groups).scale, D)
                 + 2 * error_bound(quantize(kl, CFG.high.key_bits, CFG.high.key_groups).scale,
                                   D))
            assert ((kl - k[layer, lo, h]).abs() <= e).all(), (layer, h)
    assert flips <= 0.02 * LAYERS * HKV * n, flips  # the band holds few tokens
    if flips == 0:
        assert torch.equal(cw.counts[1], cc.counts[2])
    # chunks after the first attend over the stored K8V4 chunks: equal to whole-prompt
    # attention on those round trips
    at = chunks[0]
    for i, m in enumerate(chunks[1:], 1):
        for layer in range(LAYERS):
            kq, vq = k[layer].clone(), v[layer].clone()
            kq[:at] = fake_quantize(k[layer, :at], CFG.high.key_bits, CFG.high.key_groups)
            vq[:at] = fake_quantize(v[layer, :at], CFG.high.value_bits, CFG.high.value_groups)
            logits = torch.einsum("qhd,khd->hqk", q[layer, at:at + m],
                                  kq[:at + m].repeat_interleave(G, 1)) * SCALE
            causal = torch.arange(at + m)[None, :] <= torch.arange(at, at + m)[:, None]
            p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
            want = torch.einsum("hqk,khd->qhd", p, vq[:at + m].repeat_interleave(G, 1))
            torch.testing.assert_close(outs[i][layer], want, rtol=1e-5, atol=1e-5)
        at += m


def test_tokens_that_stay_high_keep_their_bytes():
    """Re-quantising a K8V4 token's dequantised values is not always the identity: a group
    whose values sit far from zero relative to their spread loses the fp32 exactness of
    zero + 255 * scale, and the fp16 scale rounds up a step. The last chunk therefore copies
    the stored bytes of tokens that stay high instead of re-quantising them."""
    n, chunks = 40, [32, 8]
    q, k, v = qkv(n, seed=3)
    k = 300 + 0.05 * k  # (groups with a large offset and a small spread)
    keep_all = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 0.0, "alpha_l": 0.0,
                                       "window": 4, "score_queries": 8})
    c, _, _ = chunked(q, k, v, chunks, cfg=keep_all)
    high = c.geometry.high
    requant = quantize(fake_quantize(k[0, :32], CFG.high.key_bits, CFG.high.key_groups),
                       CFG.high.key_bits, CFG.high.key_groups)
    assert not torch.equal(requant.scale, quantize(k[0, :32], CFG.high.key_bits,
                                                   CFG.high.key_groups).scale)
    for h in range(HKV):
        loc = token_locations(c.manager.table[2, 0, h][None, None], torch.tensor([[n]]),
                              high.tokens_per_page, low=False, capacity=n)
        got = read_token_codes(c.pages, high, loc.page_ids.reshape(-1), loc.slots.reshape(-1))
        want = codes_of(c.pages[:8], c, k[0, :, h], v[0, :, h])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), h


def test_prefix_probs_are_causal_over_the_stored_chunk():
    """Queries of an earlier chunk see the stored prefix up to their own position."""
    n = 40
    q, k, v = qkv(n, seed=9)
    c = new_cache()
    req = torch.tensor([0])
    c.begin_prefill(req, [n], reserve=[n + 1])
    ext = ExtendRequests.build(req, [0], [n], [0], [n + 1])  # a chunk before the last
    c.store_chunk(1, ext, q[1], k[1], v[1])
    pos = torch.tensor([3, 17, 39])
    got = paged_prefix_probs(q[1, pos], pos, c.pages, c.geometry, c.manager.table, c.counts,
                             req, 1, SCALE)
    kq = fake_quantize(k[1], CFG.high.key_bits, CFG.high.key_groups).repeat_interleave(G, 1)
    logits = torch.einsum("qhd,khd->hqk", q[1, pos], kq) * SCALE
    causal = torch.arange(n)[None, :] <= pos[:, None]
    want = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got.sum(-1) - 1).abs().max() < 1e-5


def test_an_aborted_chunked_prompt_frees_everything():
    n = 50
    q, k, v = qkv(n, seed=5)
    c = new_cache()
    req = torch.tensor([3])
    c.begin_prefill(req, [20], reserve=[n])
    ext = ExtendRequests.build(req, [3], [20], [0], [n])
    for layer in range(LAYERS):
        c.store_chunk(layer, ext, q[layer, :20], k[layer, :20], v[layer, :20])
    c.end_extend(ext)
    assert c._score_queries and int(c.counts[3, 0, 0, 0]) == 20
    c.free([3])
    assert not c._score_queries and int(c.manager.num_free_pages()) == 200
    c.manager.check_invariants()


def test_extend_requests_kinds_and_checks():
    ext = ExtendRequests.build(torch.arange(4), [5, 6, 7, 8], [10, 4, 3, 7], [0, 0, 8, 4],
                               [10, 9, 11, 12])
    assert ext.starts == (0, 10, 14, 17)
    assert (ext.whole, ext.partial, ext.last, ext.prefixed) == ([0], [1, 3], [2], [2, 3])
    assert ext.chunked and ext.rows(2) == slice(14, 17)
    assert not ExtendRequests.build(torch.arange(1), [1], [4], [0], [4]).chunked
    with pytest.raises(ValueError, match="overrun its 5-token prompt"):
        ExtendRequests.build(torch.arange(1), [1], [4], [2], [5])
    assert Tier.HIGH == 0
