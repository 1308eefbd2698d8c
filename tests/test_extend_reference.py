"""The torch reference of extend attention over a compressed prefix (extend_attention.py):
whole-prompt prefill attention with no prefix, the LSE merge of decode attention with one
fresh token, its probabilities, and chunked prefill (through CompressedKVCache) against the
whole prompt within the K8V4 quantisation error."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.attention import gather_cache, paged_decode_attention
from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED, DiffKVConfig
from sglang_diffkv.extend_attention import paged_extend_attention, paged_extend_probs
from sglang_diffkv.kernels.testing import random_extend_case
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.policy import PromptClassification, Tier
from sglang_diffkv.prompt_attention import PackedPrompts, attend_padded
from sglang_diffkv.quant import error_bound, fake_quantize, quantize

D = 64
SCALE = D**-0.5
# request b's row keeps (n_high, n_low) per KV head: no prefix, one token, partial pages,
# several pages of both tiers (what a prefix held beyond these counts was pruned)
PREFIX = [[(0, 0), (0, 0)], [(1, 0), (0, 1)], [(20, 7), (13, 40)], [(70, 90), (100, 3)]]


def _run(case, layer=1, **kw):
    c = case.cache
    return paged_extend_attention(case.q, case.k, case.v, case.starts, case.lens, c.pages,
                                  c.geometry, c.table, c.counts, c.req_idx, layer, SCALE, **kw)


def _exact_causal_lse(q, k, prompts):
    """Natural-log LSE [T, Hq] of whole-prompt causal attention (padded, explicit)."""
    qp, kp = prompts.pad(q).float(), prompts.pad(k).float()
    kp = kp.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = qp @ kp.transpose(-1, -2) * SCALE
    causal = torch.ones(prompts.max_len, prompts.max_len, dtype=torch.bool).tril()
    lse = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1)
    return prompts.unpad(lse.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("group", [1, 4])
def test_no_prefix_equals_whole_prompt_prefill_attention(group):
    geo = PageGeometry.build(D, K8V4, K4V2)
    lens = [1, 9, 33]
    case = random_extend_case(geo, [[(0, 0)] * 2] * 3, lens, group, dtype=torch.float32,
                              seed=group)
    res = _run(case)
    prompts = PackedPrompts.from_lengths(lens, "cpu")
    want, _ = attend_padded(case.q, case.k, case.v, prompts, SCALE)
    n = prompts.num_tokens
    torch.testing.assert_close(res.out[:n], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.lse[:n], _exact_causal_lse(case.q, case.k, prompts),
                               rtol=1e-5, atol=1e-5)
    # rows of no request are left as they were
    assert (res.out[n:] == 0).all() and torch.isinf(res.lse[n:]).all()


@pytest.mark.parametrize("tiers", [(K8V4, K4V2), (K8V4_GROUPED, K4V2_GROUPED)])
def test_one_fresh_token_is_the_lse_merge_of_decode_attention_and_itself(tiers):
    # the prefix part reads exactly what decode attention reads
    geo = PageGeometry.build(D, *tiers)
    case = random_extend_case(geo, PREFIX, [1, 1, 1, 1], 4, dtype=torch.float32, seed=3)
    c = case.cache
    res = _run(case)
    rows = case.starts
    dec = paged_decode_attention(case.q[rows], c.pages, geo, c.table, c.counts, c.req_idx, 1,
                                 SCALE)
    kf = case.k[rows].repeat_interleave(4, 1)
    vf = case.v[rows].repeat_interleave(4, 1)
    s = (case.q[rows] * kf).sum(-1) * SCALE  # [B, Hq]: the fresh token's own logit
    lse = torch.logaddexp(dec.lse, s)
    out = dec.out * torch.exp(dec.lse - lse)[..., None] + vf * torch.exp(s - lse)[..., None]
    torch.testing.assert_close(res.lse[rows], lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.out[rows], out, rtol=1e-5, atol=1e-5)


def test_probs_of_the_last_queries_reproduce_output_and_lse():
    geo = PageGeometry.build(D, K8V4_GROUPED, K4V2_GROUPED)
    lens = [1, 5, 20, 12]
    case = random_extend_case(geo, PREFIX, lens, 2, dtype=torch.float32, seed=4)
    c = case.cache
    res = _run(case)
    nq = 8
    pr = paged_extend_probs(case.q, case.k, case.starts, case.lens, c.pages, geo, c.table,
                            c.counts, c.req_idx, 1, SCALE, nq)
    cache = gather_cache(c.pages, geo, c.table, c.counts, c.req_idx, 1)
    for b, n in enumerate(lens):
        m = min(nq, n)
        rows = pr.rows[b]
        assert rows[:m].tolist() == list(range(int(case.starts[b]) + n - m,
                                               int(case.starts[b]) + n))
        assert (rows[m:] == -1).all()
        probs = torch.cat([pr.prob_high[b], pr.prob_low[b], pr.prob_fresh[b]], -1)[:, :m]
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]))
        for prob, mask in ((pr.prob_high[b], cache.mask_high[b]),
                           (pr.prob_low[b], cache.mask_low[b])):
            assert (torch.where(mask.repeat_interleave(2, 0)[:, None], 0.0, prob) == 0).all()
        assert (pr.prob_fresh[b][..., n:] == 0).all() and (pr.prob_fresh[b][:, m:] == 0).all()
        h = torch.arange(case.q.shape[1]) // 2
        vals = torch.cat([torch.where(cache.mask_high[b][..., None], cache.high.value[b], 0),
                          torch.where(cache.mask_low[b][..., None], cache.low.value[b], 0),
                          case.v[case.starts[b]:case.starts[b] + n].transpose(0, 1)], 1)
        out = torch.einsum("hqc,hcd->qhd", probs[..., :vals.shape[1]], vals[h])
        torch.testing.assert_close(out, res.out[rows[:m]], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pr.lse[b][:, :m].T, res.lse[rows[:m]], rtol=1e-5,
                                   atol=1e-5)


def _quantisation_bound(q, k, v, out, prompts, first, high):
    """Elementwise bound on |chunked - whole| for the chunk-2 rows of each prompt (packed as
    ``out``), prefix = its first ``first[b]`` tokens stored at the ``high`` tier, unpruned:

        |o' - o| <= max_j e_v(j) + (exp(2 eps) - 1) * max_{j <= i} |v_j - o|,
        eps = scale * max_j sum_d |q_d| e_k(j, d),

    e_k, e_v: the per-element round-trip bounds of K8 / V4 (``quant.error_bound``: half a
    quantisation step), j over prefix tokens for e and over all keys query i sees for v.
    (Each stored logit moves by at most eps, so every probability by a factor within
    exp(+-2 eps): the sum over keys of |p' - p| |v - o| is at most (exp(2 eps) - 1) max |v - o|,
    and the stored values add at most max e_v.) Returns the bound [rows, Hq, D] and eps
    [rows, Hq] (also the bound on the LSE's change)."""
    g = q.shape[1] // k.shape[1]
    bounds, epss = [], []
    for b, (s, n) in enumerate(zip(prompts.starts.tolist(), prompts.lengths.tolist(),
                                   strict=True)):
        f = first[b]
        kp, vp = k[s:s + f].float(), v[s:s + f].float()  # [f, Hkv, D]
        ek = error_bound(quantize(kp, high.key_bits, high.key_groups).scale, D)
        ev = error_bound(quantize(vp, high.value_bits, high.value_groups).scale, D)
        ek, ev = ek.repeat_interleave(g, 1), ev.repeat_interleave(g, 1)  # [f, Hq, D]
        qi = q[s + f:s + n].float().abs()  # [n - f, Hq, D]
        eps = SCALE * torch.einsum("qhd,jhd->qhj", qi, ek).amax(-1)
        vall = v[s:s + n].float().repeat_interleave(g, 1)  # [n, Hq, D]
        o = out[s + f:s + n]
        spread = torch.stack([(vall[:f + r + 1] - o[r]).abs().amax(0) for r in range(n - f)])
        bounds.append(ev.amax(0) + torch.expm1(2 * eps)[..., None] * spread)
        epss.append(eps)
    return torch.cat(bounds), torch.cat(epss)


@pytest.mark.parametrize("preset_name", ["llama-3-8b", "qwq-32b"])
def test_two_chunks_equal_the_whole_prompt_within_k8v4_error(preset_name):
    """Chunked prefill as stage 2 runs it: chunk 1 stored all-high (K8V4, nothing pruned),
    chunk 2 attends over it through CompressedKVCache.extend_layer_attend. It equals
    whole-prompt attention on the K8V4 round trip of chunk 1's K/V (to fp32 rounding), and
    the unquantised whole-prompt attention within the bound of ``_quantisation_bound``."""
    cfg = DiffKVConfig.from_dict({"preset": preset_name})
    hkv, group = 2, 4
    lens, first = [150, 77, 40], [96, 40, 39]
    g = torch.Generator().manual_seed(11)
    t = sum(lens)
    q = torch.randn(t, hkv * group, D, generator=g)
    k = torch.randn(t, hkv, D, generator=g) * 1.5
    v = torch.randn(t, hkv, D, generator=g)
    whole = PackedPrompts.from_lengths(lens, "cpu")

    cache = CompressedKVCache(cfg, head_dim=D, num_layers=1, num_kv_heads=hkv, num_pages=60,
                              max_reqs=4, max_context=256)
    req = torch.tensor([3, 0, 1])
    assert bool(cache.begin_prefill(req, torch.tensor(lens)).ok)
    chunk1 = torch.cat([torch.arange(s, s + f) for s, f in zip(whole.starts.tolist(), first,
                                                                  strict=True)])
    p1 = PackedPrompts.from_lengths(first, "cpu")
    lmax = p1.max_len
    pos = torch.arange(lmax)
    in1 = pos[None, :] < torch.tensor(first)[:, None]  # [B, Lmax]
    cls = PromptClassification(
        tier=torch.where(in1, int(Tier.HIGH), int(Tier.PRUNED)).to(torch.int8)[:, None]
        .expand(-1, hkv, -1),
        score=torch.zeros(len(lens), hkv, lmax),
        pos=pos.int()[None].expand(len(lens), -1),
        n_high=torch.tensor(first, dtype=torch.int32)[:, None].expand(-1, hkv),
        n_low=torch.zeros(len(lens), hkv, dtype=torch.int32),
    )
    cache.store_prefill(0, req, p1.pad(k[chunk1]), p1.pad(v[chunk1]), cls)
    cache.end_prefill(req)
    cnt = cache.counts[req, 0]
    assert cnt[..., 0].tolist() == [[f] * hkv for f in first] and (cnt[..., 1] == 0).all()

    chunk2 = torch.cat([torch.arange(s + f, s + n) for s, f, n in
                        zip(whole.starts.tolist(), first, lens, strict=True)])
    lens2 = torch.tensor([n - f for n, f in zip(lens, first, strict=True)])
    res = cache.extend_layer_attend(0, req, q[chunk2], k[chunk2], v[chunk2],
                                    torch.cumsum(lens2, 0) - lens2, lens2, SCALE)

    # whole prompt, chunk 1's K/V through the K8V4 round trip: equal up to fp32 rounding
    kq, vq = k.clone(), v.clone()
    kq[chunk1] = fake_quantize(k[chunk1], cfg.high.key_bits, cfg.high.key_groups)
    vq[chunk1] = fake_quantize(v[chunk1], cfg.high.value_bits, cfg.high.value_groups)
    want_q, _ = attend_padded(q, kq, vq, whole, SCALE)
    torch.testing.assert_close(res.out, want_q[chunk2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.lse, _exact_causal_lse(q, kq, whole)[chunk2], rtol=1e-5,
                               atol=1e-5)

    # unquantised whole prompt: within the K8V4 bound, elementwise
    want, _ = attend_padded(q, k, v, whole, SCALE)
    bound, eps = _quantisation_bound(q, k, v, want, whole, first, cfg.high)
    err = (res.out - want[chunk2]).abs()
    assert (err <= bound + 1e-5).all(), float((err - bound).max())
    lse_err = (res.lse - _exact_causal_lse(q, k, whole)[chunk2]).abs()
    assert (lse_err <= eps + 1e-5).all()
    # (the prefix really went through the quantiser; on this data the largest error is
    # ~0.15 and at most ~0.2 of its bound, which is rigorous rather than tight)
    assert err.max() > 1e-3
