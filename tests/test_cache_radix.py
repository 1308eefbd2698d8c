"""Radix prefix sharing through the reference cache (no SGLang): ``prompt_sharing``'s export
with cut counts, attach at a cut and the prompt suffix over the attached prefix, on random K/V
sharp enough to use all three tiers.

The rules (docs/backend.md, "Radix prefix sharing: built"): the exporting request is left
exactly as without sharing; an attached request holds, per row and tier, the exporter's first
``n_t(cut)`` tokens (bit for bit) followed by its suffix's tokens in position order; the
suffix is scored by the prompt's last ``min(score_queries, suffix)`` queries over the attached
tokens and the suffix (causal), and classified at its positions in the whole prompt. A suffix
in several chunks scores like one in a single chunk up to the K8 error of its stored keys.
"""

from __future__ import annotations

import pytest
import torch
from extend_case import CFG, HKV, LAYERS, SCALE, D, G, qkv

from sglang_diffkv import prompt_sharing
from sglang_diffkv.attention import gather_cache
from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.pages import read_scores, token_locations
from sglang_diffkv.policy import Tier, classify_prompt, group_max
from sglang_diffkv.prompt_sharing import PromptSharing
from sglang_diffkv.quant import error_bound, fake_quantize, quantize

CUT = 8


def new_cache(radix: bool = True, copy_attach: bool = False) -> CompressedKVCache:
    c = CompressedKVCache(CFG, head_dim=D, num_layers=LAYERS, num_kv_heads=HKV,
                          num_pages=300, max_reqs=5, max_context=256)
    if radix:
        c.radix = PromptSharing(c, CUT, copy_attach=copy_attach)
    return c


def prefill(c: CompressedKVCache, slot: int, q, k, v) -> None:
    n = q.shape[1]
    assert bool(c.begin_prefill([slot], [n]).ok)
    if c.radix is not None:
        c.radix.begin_prompts([slot], [n], keep_free=0)
    for layer in range(LAYERS):
        c.prefill_layer(layer, [slot], torch.tensor([n]), q[layer].transpose(0, 1)[None],
                        k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None], SCALE)
    c.end_prefill([slot])
    if c.radix is not None:
        c.radix.export()


def tokens(c: CompressedKVCache, slot: int, layer: int) -> list[tuple[torch.Tensor, ...]]:
    """Per tier: the row's dequantised keys / values [Hkv, n_max, D] and its mask."""
    g = gather_cache(c.pages, c.geometry, c.manager.table, c.manager.counts,
                     torch.tensor([slot]), layer)
    return [(g.high.key[0], g.high.value[0], g.mask_high[0]),
            (g.low.key[0], g.low.value[0], g.mask_low[0])]


def suffix(c: CompressedKVCache, slot: int, handle, cut: int, q, k, v, chunks: list[int],
           seen: list | None = None) -> list[torch.Tensor]:
    """Attach ``handle`` at ``cut`` in ``slot`` and prefill the suffix (q / k / v
    [layers, s, H, D]) in ``chunks``; returns each chunk's extend-attention outputs."""
    s = q.shape[1]
    assert sum(chunks) == s
    r = c.radix
    res, room = r.attach(slot, handle, cut, s, (CFG.alpha_h, CFG.alpha_l))
    res.raise_if_failed()
    room.raise_if_failed()
    req = torch.tensor([slot])
    outs, at = [], 0
    for m in chunks:
        rows = slice(at, at + m)
        last = at + m == s
        ext = ExtendRequests.build(req, [slot], [m], [cut + at], [cut + s])
        if last:
            r.begin_prompts([slot], [cut + s], keep_free=0)
        step = []
        for layer in range(LAYERS):
            res = c.extend_layer_attend(layer, req, q[layer, rows], k[layer, rows],
                                        v[layer, rows], torch.tensor([0]), torch.tensor([m]),
                                        SCALE)
            step.append(res.out)
            if last:
                r.store_last(layer, 0, slot, ext, q[layer, rows], k[layer, rows],
                             v[layer, rows], SCALE)
            else:
                r.store_chunk(layer, 0, slot, ext, q[layer, rows], k[layer, rows],
                              v[layer, rows])
        r.end_step(ext, [0])
        if last:
            r.export()
        c.manager.check_invariants()
        outs.append(torch.stack(step))
        at += m
    return outs


def expected_suffix_tiers(att: list[tuple[torch.Tensor, ...]], q, k, cut: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's suffix significance [Hkv, s] and tiers [Hkv, s], computed densely: the
    last nq queries over the attached tokens (dequantised) and the fresh keys, causal."""
    s = q.shape[0]
    nq = min(CFG.score_queries, s)
    keys = torch.cat([att[0][0], att[1][0]], 1)  # [Hkv, C, D]
    mask = torch.cat([att[0][2], att[1][2]], 1)
    qg = q[s - nq:].float().view(nq, HKV, G, D)
    pre = torch.einsum("qhgd,hcd->hgqc", qg, torch.where(mask[..., None], keys, 0.0)) * SCALE
    pre = pre.masked_fill(~mask[:, None, None, :], float("-inf"))
    fresh = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * SCALE
    causal = torch.arange(s)[None, :] <= torch.arange(s - nq, s)[:, None]
    fresh = fresh.masked_fill(~causal[None, None], float("-inf"))
    prob = torch.softmax(torch.cat([pre, fresh], -1), -1)[..., keys.shape[1]:]
    mass = group_max(prob.sum(2).flatten(0, 1), HKV)  # [Hkv, s]
    sig = torch.zeros(1, HKV, cut + s)
    sig[0, :, cut:] = mass
    cls = classify_prompt(sig, torch.tensor([cut + s]), torch.tensor([CFG.alpha_h]),
                          torch.tensor([CFG.alpha_l]), CFG.window, nq)
    return mass, cls.tier[0, :, cut:]


def test_the_exporter_is_left_as_without_sharing() -> None:
    q, k, v = qkv(45, seed=1)
    plain, shared = new_cache(radix=False), new_cache()
    prefill(plain, 1, q, k, v)
    prefill(shared, 1, q, k, v)
    assert torch.equal(plain.counts[1], shared.counts[1])
    for layer in range(LAYERS):
        for a, b in zip(tokens(plain, 1, layer), tokens(shared, 1, layer), strict=True):
            assert torch.equal(a[2], b[2])  # (bytes past a row's tokens are anything)
            assert torch.equal(a[0][a[2]], b[0][b[2]]) and torch.equal(a[1][a[2]], b[1][b[2]])
    handle = shared.radix.take_export(1)
    assert handle is not None and handle.num_tokens == 45 and handle.cut_len == CUT
    assert torch.equal(handle.n_tokens, shared.counts[1, ..., :2])
    assert handle.cuts.shape[2] == 45 // CUT
    # a decode step of the exporter changes its own pages, never the handle's
    before = shared.pages[handle.pages[handle.pages >= 0].long()].clone()
    for step in range(3):
        assert bool(shared.begin_decode([1]).ok)
        for layer in range(LAYERS):
            kk = torch.randn(1, HKV, D)
            shared.decode_layer_store(layer, [1], torch.tensor([45 + step]), kk, kk)
            shared.decode_layer_attend(layer, [1], torch.randn(1, HKV * G, D), SCALE)
    assert torch.equal(before, shared.pages[handle.pages[handle.pages >= 0].long()])
    shared.free([1])
    shared.release_prefix([handle])
    shared.manager.check_invariants()
    assert int(shared.manager.num_free_pages()) == shared.spec.num_pages


@pytest.mark.parametrize("copy_attach", [False, True])
@pytest.mark.parametrize("cut,s", [(16, 20), (40, 5), (8, 37), (136, 30)])
def test_a_suffix_over_an_attached_cut(cut: int, s: int, copy_attach: bool) -> None:
    qa, ka, va = qkv(max(45, cut + 20), seed=2)
    qs, ks, vs = qkv(s, seed=3)
    c = new_cache(copy_attach=copy_attach)
    prefill(c, 1, qa, ka, va)
    handle = c.radix.take_export(1)
    seen = []
    orig = prompt_sharing.classify_prompt

    def spy(sig, *args):
        seen.append(sig)
        return orig(sig, *args)

    prompt_sharing.classify_prompt = spy
    try:
        suffix(c, 2, handle, cut, qs, ks, vs, [s])
    finally:
        prompt_sharing.classify_prompt = orig
    n_cut = handle.cut_counts(cut)
    for layer in range(LAYERS):
        mine, theirs = tokens(c, 2, layer), tokens(c, 1, layer)
        att = []
        for t in (0, 1):  # the exporter's tokens before the cut, per head
            key, val, mask = theirs[t]
            j = torch.arange(mask.shape[1])
            att.append((key, val, mask & (j[None, :] < n_cut[layer, :, t, None])))
        mass, tier = expected_suffix_tiers(att, qs[layer], ks[layer], cut)
        torch.testing.assert_close(seen[layer][0, :, cut:], mass, rtol=1e-5, atol=1e-6)
        for h in range(HKV):
            for t, tier_id in ((0, Tier.HIGH), (1, Tier.LOW)):
                n = int(n_cut[layer, h, t])
                key, val, mask = mine[t]
                # the exporter's first n tokens, bit for bit
                assert torch.equal(key[h, :n], theirs[t][0][h, :n])
                assert torch.equal(val[h, :n], theirs[t][1][h, :n])
                # then the suffix's tokens of this tier, in position order
                picked = (tier[h] == tier_id).nonzero().squeeze(1)
                assert int(mask[h].sum()) == n + picked.numel()
                assert int(c.counts[2, layer, h, t]) == n + picked.numel()
                tier_cfg = CFG.high if t == 0 else CFG.low
                want = fake_quantize(ks[layer, picked, h], tier_cfg.key_bits,
                                     tier_cfg.key_groups)
                torch.testing.assert_close(key[h, n:n + picked.numel()], want, rtol=0,
                                           atol=1e-5)
    # the shared full pages are the exporter's; the boundary pages are private copies
    # the attached tokens' virtual positions: the exporter's, moved by the difference of the
    # prompt lengths when copied (the decode policy reads them), as they are when shared
    delta = 0 if not copy_attach else cut + s - qa.shape[1]
    for layer in range(LAYERS):
        for t in (0, 1):
            layout = c.geometry.tiers[t]
            pos = []
            for slot in (1, 2):
                n = c.counts[slot, layer, :, t].long()
                if slot == 2:
                    n = handle.cut_counts(cut)[layer, :, t].long()
                loc = token_locations(c.manager.table[slot, layer][None], n[None],
                                      layout.tokens_per_page, low=t == 1,
                                      capacity=max(int(n.max()), 1))
                _, p = read_scores(c.pages, layout, loc.page_ids[loc.mask], loc.slots[loc.mask])
                pos.append((p, n))
            (pa, _), (pb, nb) = pos
            # (the exporter's first nb tokens per head, in the same flattened head order)
            la = c.counts[1, layer, :, t].long()
            keep = torch.cat([torch.arange(int(la[h])) < int(nb[h]) for h in range(HKV)])
            assert torch.equal(pb, pa[keep] + delta)
    per_page = torch.tensor(c.spec.tokens_per_page)
    want_shared = torch.zeros_like(n_cut) if copy_attach else n_cut // per_page
    assert torch.equal(c.manager.shared[2], want_shared.int())
    if cut > 100 and not copy_attach:
        assert want_shared.sum() > 0  # (a cut long enough to share full pages)
    # B's prompt is exported too: its cuts up to the attach are the handle's
    h2 = c.radix.take_export(2)
    assert h2 is not None and h2.num_tokens == cut + s
    k_att = cut // CUT
    assert torch.equal(h2.cuts[:, :, :k_att], handle.cuts[:, :, :k_att])
    if (cut + s) // CUT * CUT == cut + s:
        assert torch.equal(h2.cut_counts(cut + s), c.counts[2, ..., :2])
    for slot in (1, 2):
        c.free([slot])
    c.release_prefix([handle, h2])
    c.manager.check_invariants()
    assert int(c.manager.num_free_pages()) == c.spec.num_pages


@pytest.mark.parametrize("chunks", [[20, 17], [30, 3, 4], [8, 8, 8, 8, 5]],
                         ids=["full-last", "short-last", "many"])
def test_a_suffix_in_chunks_scores_as_in_one(chunks: list[int]) -> None:
    s, cut = sum(chunks), 16
    qa, ka, va = qkv(45, seed=4)
    qs, ks, vs = qkv(s, seed=5)
    runs = {}
    for name, parts in (("one", [s]), ("chunks", chunks)):
        c = new_cache()
        prefill(c, 1, qa, ka, va)
        handle = c.radix.take_export(1)
        seen = []
        orig = prompt_sharing.classify_prompt
        prompt_sharing.classify_prompt = lambda sig, *a, _o=orig, _s=seen: (
            _s.append((sig, a)) or _o(sig, *a))
        try:
            outs = suffix(c, 2, handle, cut, qs, ks, vs, parts)
        finally:
            prompt_sharing.classify_prompt = orig
        runs[name] = (c, seen, outs)
    (c1, seen1, outs1), (c2, seen2, outs2) = runs["one"], runs["chunks"]
    # the first chunk attends exactly as the one-chunk suffix's first rows
    torch.testing.assert_close(outs2[0], outs1[0][:, :chunks[0]], rtol=1e-5, atol=1e-5)
    stored = s - chunks[-1]
    nq = min(CFG.score_queries, s)
    ek = error_bound(quantize(ks[:, :stored], CFG.high.key_bits, CFG.high.key_groups).scale,
                     D)  # [layers, stored, Hkv, D]
    for layer in range(LAYERS):
        sig1, sig2 = seen1[layer][0][0], seen2[layer][0][0]
        qsc = qs[layer, s - nq:].abs().view(nq, HKV, G, D)
        eps = SCALE * torch.einsum("qhgd,jhd->hqgj", qsc, ek[layer]).amax((1, 2, 3))
        band = torch.expm1(2 * eps)[:, None]  # relative, per KV head
        assert ((sig2 - sig1).abs() <= band * sig1 * nq + 1e-6).all()
    c1.manager.check_invariants()
    c2.manager.check_invariants()
