"""The pieces of ``kernels.extend_store`` one at a time, under TRITON_INTERPRET=1 (their
composition against the cache reference: tests/test_extend_stores.py).

- ``prefill_scores``' mode for prompts over stored tokens (``key_first``, ``num_queries``,
  ``q_starts``, fp32 keys) against a dense oracle: per head, keys before ``key_first``
  invisible; the last min(score_queries, L, num_queries) queries, read from their own rows;
  ``score_from``: the same sums from that key on, nothing written before it;
- ``gather_prompts`` against the reference reads: attached tokens right-aligned per head
  (high ones, then low ones: ``gather_cache``'s order), stored ones, fresh ones, zeros before
  ``key_first``; the stored tokens' bytes (``read_token_codes``); outputs poisoned first.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.kernels import extend_store, prefill_scores
from sglang_diffkv.kernels.extend_store import PromptGroup
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import alloc_page_storage
from sglang_diffkv.pages import read_token_codes, read_tokens, write_tokens

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels run on the CPU under the interpreter")

HKV, G, D, Q = 2, 2, 64, 8


def test_scores_with_key_first_and_own_query_rows():
    g = torch.Generator().manual_seed(0)
    lengths = [40, 13, 70]
    first = torch.tensor([[0, 5], [3, 0], [20, 33]], dtype=torch.int32)
    nq = torch.tensor([8, 4, 3], dtype=torch.int32)  # (13: 4 < 8 queries; 70: 3 queries)
    total = sum(lengths)
    k = torch.randn(total, HKV, D, generator=g) * 1.5
    starts = torch.tensor([0, 40, 53])
    used = [min(Q, n, int(m)) for n, m in zip(lengths, nq.tolist(), strict=True)]
    q = (torch.randn(sum(used), HKV * G, D, generator=g) * 1.5).bfloat16()
    rows = torch.tensor([0, used[0], used[0] + used[1]])
    q_starts = rows - torch.tensor([n - u for n, u in zip(lengths, used, strict=True)])
    out = torch.full((3, HKV, max(lengths)), float("nan"))
    prefill_scores(q, k, torch.tensor(lengths, dtype=torch.int32), 0.125, Q, starts=starts,
                   max_len=max(lengths), out=out, q_starts=q_starts, key_first=first,
                   num_queries=nq)
    for b, n in enumerate(lengths):
        u = used[b]
        kb = k[starts[b]:starts[b] + n].float()  # [n, Hkv, D]
        qb = q[rows[b]:rows[b] + u].float().view(u, HKV, G, D)
        s = torch.einsum("qhgd,khd->hgqk", qb, kb) * 0.125
        kpos, qpos = torch.arange(n), torch.arange(n - u, n)
        hide = (kpos[None, None, :] > qpos[None, :, None]) | (
            kpos[None, None, :] < first[b][:, None, None].long())  # [Hkv, u, n]
        p = torch.softmax(s.masked_fill(hide[:, None], float("-inf")), -1)
        want = p.sum(2).amax(1)  # [Hkv, n]
        torch.testing.assert_close(out[b, :, :n], want, rtol=1e-5, atol=1e-6)


def test_fp32_keys_split_exactly_into_three_bf16_pieces():
    """``prefill._split3`` (the GPU scoring's fp32 keys as three bf16 pieces for tensor-core
    dots; the interpreter keeps its IEEE dot, its bf16 dot being broken): the pieces sum to
    each key exactly, so with bf16 queries every product is the IEEE dot's own, for keys
    dequantised from pages (K8 and K4 codes, fp16 scale and zero) and for keys of any
    magnitude fp32 holds."""
    from sglang_diffkv.kernels.prefill import split3_reference

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (512, D), generator=g).float()
    scale = (torch.rand(512, 1, generator=g) * 0.1).half().float()
    zero = (torch.randn(512, 1, generator=g) * 4).half().float()
    dequant = codes * scale + zero  # (fp32, as the gather computes it)
    # (|x| >= 2**-110: smaller, the last piece may fall below fp32's normal range and lose
    # bits worth less than 2**-149, which no score sees; fp16 scales and zeros keep page
    # keys far from both ends)
    wide = torch.randn(512, D, generator=g) * torch.logspace(-25, 30, D)
    for x in (dequant, wide, torch.tensor([0.0, -0.0, 1e-33, 3.3e38, -1.0 / 3])):
        k1, k2, k3 = split3_reference(x)
        assert torch.equal(k1.double() + k2.double() + k3.double(), x.double())
    q = torch.randn(8, D, generator=g).bfloat16().double()
    k1, k2, k3 = (p.double() for p in split3_reference(dequant))
    assert torch.equal(q[:, None, :] * dequant.double()[None],
                       q[:, None, :] * k1[None] + q[:, None, :] * k2[None]
                       + q[:, None, :] * k3[None])


def test_scores_from_a_position_leave_earlier_keys_alone():
    """``score_from``: keys before it stay in the softmax (the sums after it are those of a
    full scoring) but get no significance (their entries are not written)."""
    g = torch.Generator().manual_seed(2)
    lengths, start = [150, 90], [70, 0]  # (70: a prefix whose tiles are skipped)
    k = torch.randn(sum(lengths), HKV, D, generator=g) * 1.5
    q = (torch.randn(sum(lengths), HKV * G, D, generator=g) * 1.5).bfloat16()
    starts = torch.tensor([0, lengths[0]])
    first = torch.tensor([[0, 9], [0, 0]], dtype=torch.int32)
    nq = torch.tensor([Q, Q], dtype=torch.int32)
    args = (q, k, torch.tensor(lengths, dtype=torch.int32), 0.125, Q)
    kw = dict(starts=starts, max_len=max(lengths), key_first=first, num_queries=nq)
    full = torch.full((2, HKV, max(lengths)), float("nan"))
    prefill_scores(*args, out=full, **kw)
    part = torch.full_like(full, float("nan"))
    prefill_scores(*args, out=part, score_from=torch.tensor(start, dtype=torch.int32),
                   score_len=max(n - s for n, s in zip(lengths, start, strict=True)), **kw)
    for b, (n, s) in enumerate(zip(lengths, start, strict=True)):
        assert torch.equal(part[b, :, s:n], full[b, :, s:n])
        assert part[b, :, :s].isnan().all()


def test_gather_puts_every_token_where_the_scoring_reads_it():
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", "score_queries": Q})
    geo = PageGeometry.for_config(cfg, D)
    high, low = geo.tiers
    pages = alloc_page_storage(64, geo.page_bytes, "cpu")
    pages.fill_(0xFF)
    g = torch.Generator().manual_seed(1)
    # request 1: attached (a_h, a_l) = (5, 7) / (9, 0) at cut 16, 6 stored suffix tokens
    # request 2: a chunked prompt, 40 stored tokens; each then has fresh ones
    req = torch.tensor([1, 2])
    a = torch.tensor([[[5, 7], [9, 0]], [[0, 0], [0, 0]]], dtype=torch.int32)
    att, stored, fresh = [16, 0], [6, 40], [4, 7]
    # rows as the page manager lays them out: high pages from the left, low ones from the
    # right end, every page distinct
    row_len = 12
    table = torch.full((3, 1, HKV, row_len), -1, dtype=torch.int32)
    table[1:, 0, :, :3] = torch.arange(2 * HKV * 3, dtype=torch.int32).view(2, HKV, 3)
    table[1:, 0, :, -1] = torch.arange(20, 20 + 2 * HKV, dtype=torch.int32).view(2, HKV)
    want_k, codes = {}, {}
    for b in range(2):
        for h in range(HKV):
            row = table[int(req[b]), 0, h]
            a_h, a_l = (int(x) for x in a[b, h])
            n_hi = a_h + stored[b]
            hk = torch.randn(n_hi, D, generator=g)
            s = torch.arange(n_hi)
            ids, sl = row[s // high.tokens_per_page], (s % high.tokens_per_page).int()
            write_tokens(pages, high, ids, sl, hk, hk, torch.zeros(n_hi), s.int())
            lk = torch.randn(a_l, D, generator=g)
            s = torch.arange(a_l)
            lids = row[row_len - 1 - s // low.tokens_per_page]
            lsl = (s % low.tokens_per_page).int()
            write_tokens(pages, low, lids, lsl, lk, lk, torch.zeros(a_l), s.int())
            hi = read_tokens(pages, high, ids, sl).key
            lo = read_tokens(pages, low, lids, lsl).key
            # positions: attached right-aligned (high then low), stored, then fresh
            want_k[b, h] = (att[b] - a_h - a_l, torch.cat([hi[:a_h], lo, hi[a_h:]]))
            codes[b, h] = [x[a_h:] for x in read_token_codes(pages, high, ids, sl)]
    kf = torch.randn(sum(fresh), HKV, D, generator=g).bfloat16()
    totals = [att[b] + stored[b] + fresh[b] for b in range(2)]
    grp = PromptGroup(req=req, total=torch.tensor(totals, dtype=torch.int32),
                      attached=torch.tensor(att, dtype=torch.int32),
                      stored=torch.tensor(stored, dtype=torch.int32),
                      fresh_start=torch.tensor([0, fresh[0]]),
                      packed_start=torch.tensor([0, totals[0]]), max_total=max(totals),
                      max_span=max(t - c for t, c in zip(totals, att, strict=True)),
                      num_rows=sum(totals))
    rows = (sum(totals), HKV, D)
    pk = torch.full(rows, float("nan"))
    raw = torch.full((*rows[:2], extend_store.raw_bytes(high)), 0x7F, dtype=torch.uint8)
    key_first = torch.full((2, HKV), -7, dtype=torch.int32)
    extend_store.gather_prompts(pages, geo, table, 0, grp, a, kf, out_k=pk, raw=raw,
                                key_first=key_first)
    for b in range(2):
        p0, fr = int(grp.packed_start[b]), slice(sum(fresh[:b]), sum(fresh[:b + 1]))
        for h in range(HKV):
            first, stored_k = want_k[b, h]
            assert int(key_first[b, h]) == first
            got = pk[p0:p0 + totals[b], h]
            assert torch.equal(got[:first], torch.zeros(first, D))
            assert torch.equal(got[first:att[b] + stored[b]], stored_k)
            assert torch.equal(got[att[b] + stored[b]:], kf[fr, h].float())
            kept = raw[p0 + att[b]:p0 + att[b] + stored[b], h]
            assert torch.equal(kept, torch.cat(codes[b, h], -1))
