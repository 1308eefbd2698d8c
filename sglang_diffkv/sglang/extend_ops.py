"""The kernel path's stores of an extend step with chunks or radix suffixes, without host
syncs and with a constant number of launches per layer (``DiffKVOps``).

The torch reference (``CompressedKVCache.store_chunk`` / ``store_last_chunk``,
``PromptSharing.store_chunk`` / ``store_last``) loops over requests per layer and reads
sizes and masks on the host (``nonzero``, boolean indexing, ``.any()``, ``.max()``): on a
GPU every layer waited for the device several times per request. Here everything the host
needs is known when the step starts (``ExtendRequests``, the attached prefixes' cuts), so
``ExtendStores.build`` makes the step's index tensors once (one host-to-device copy) and
every layer only issues work:

- ``store_chunks``: every chunk before its prompt's last (a chunked prompt's, or a radix
  suffix's), stored at the high tier after the row's stored tokens, in position order: one
  ``kernels.store_tokens`` launch for all of them, plus a few index ops, and the kept
  scoring queries of each (the reference's own ``_keep_*`` methods: two ops a request);
- ``store_prompt_ends``: every prompt that ends in this step over stored tokens (a chunked
  prompt's last chunk, a radix suffix's last or only chunk), as one group
  (``kernels.extend_store``): gather the packed scoring prompt (one launch), assemble the
  scoring queries (two ops, and one copy per prompt that needs earlier chunks' queries),
  score (``prefill_scores``: two launches; the LSE pass over the whole prompt, the column
  sums over the span only: an attached prefix is frozen, nothing reads its significance),
  classify and store (two launches), and, when the
  step's prompts are exported to the radix tree, their cut counts (a dozen ops);
- ``end_step``: hands each row's final counts to the reference's end-of-step bookkeeping
  (``end_extend`` / ``PromptSharing.end_step``), which is per step.

Results equal the reference's (tiers, counts, stored bytes) up to the fp32 rounding of the
significance sums, which moves a tier only for a token exactly at a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.kernels import extend_store, prefill_scores, store_tokens
from sglang_diffkv.kernels.extend_store import PromptGroup
from sglang_diffkv.sglang.ops import upload


@dataclass
class _Chunks:
    """The step's chunks before their prompts' last, token-major: token t of the group is
    fresh row ``src[t]`` at high slot ``base[layer, req_of[t], h] + off[t]``."""

    req: torch.Tensor  # int64 [N]: each token's request slot
    req_of: torch.Tensor  # int64 [N]: each token's index among the chunk requests
    src: torch.Tensor  # int64 [N]: its row in the step's packed k / v
    off: torch.Tensor  # int64 [N]: its high slot less the row's attached high tokens
    pos: torch.Tensor  # int32 [N * Hkv]: its position, once per head
    zeros: torch.Tensor  # fp32 [N * Hkv]: its score (unscored until the last chunk)
    base: torch.Tensor | None  # int64 [layers, B, Hkv]: attached high tokens (None: none)
    keep: list[tuple[Any, int, slice]]  # (attached or None, request slot, fresh rows)


@dataclass
class _Ends:
    """The step's prompts that end over stored tokens (``extend_store.PromptGroup``), with
    their scoring queries and scratch."""

    group: PromptGroup
    base: torch.Tensor  # int32 [layers, B, Hkv, 2]: attached (a_h, a_l) per layer
    alpha_h: torch.Tensor  # fp32 [B]
    alpha_l: torch.Tensor  # fp32 [B]
    bench: tuple[torch.Tensor, torch.Tensor] | None  # benchmark mode: (seed int64 [B], mix)
    q_starts: torch.Tensor  # int64 [B]: prefill_scores' q_starts over ``queries``
    num_queries: torch.Tensor  # int32 [B]: min(score_queries, span)
    q_src: torch.Tensor  # int64 [M]: fresh scoring queries' rows in the step's q
    q_dst: torch.Tensor  # int64 [M]: their rows in ``queries``
    kept: list[tuple[int, int, torch.Tensor, int, int]]  # (dst row, n, buffer, lo, hi)
    num_q: int  # rows of ``queries``
    members: list[tuple[int, Any]]  # (request slot, attached or None), group order
    chunked: torch.Tensor | None  # int64: the members that are chunked prompts (None: all)
    packed_k: torch.Tensor
    raw: torch.Tensor
    key_first: torch.Tensor
    sig: torch.Tensor
    tier: torch.Tensor
    block_counts: torch.Tensor
    totals: torch.Tensor  # int32 [layers, B, Hkv, 2]: each row's final counts per layer
    queries: torch.Tensor | None = None  # [num_q, Hq, D] in q's dtype (first layer)
    cuts: tuple[torch.Tensor, ...] | None = None  # the radix cut-count plan (exporting)


class ExtendStores:
    """One extend step's chunk and prompt-end stores on the kernel path (module docstring).
    ``build`` once per step; ``store_chunks`` and ``store_prompt_ends`` once per layer, in
    that order, after the step's whole prompts; ``end_step`` after the last layer, before
    the reference's ``end_extend`` / ``PromptSharing.end_step``."""

    def __init__(self, cache: CompressedKVCache, ext: ExtendRequests,
                 chunks: _Chunks | None, ends: _Ends | None) -> None:
        self.cache = cache
        self.ext = ext
        self.chunks = chunks
        self.ends = ends

    @classmethod
    def build(cls, cache: CompressedKVCache, ext: ExtendRequests,
              bench_mix: torch.Tensor | None = None) -> ExtendStores:
        """``bench_mix``: benchmark mode's mix, float64 [3] on the device (None: off)."""
        radix = cache.radix
        attached = radix.attached if radix is not None else {}
        return cls(cache, ext, _build_chunks(cache, ext, attached),
                   _build_ends(cache, ext, attached, bench_mix))

    # ---- chunks before the last --------------------------------------------------------

    def store_chunks(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> None:
        ch = self.chunks
        if ch is None:
            return
        c = self.cache
        high = c.geometry.high
        hkv, d = k.shape[1], k.shape[2]
        slot = ch.off[:, None].expand(-1, hkv)
        if ch.base is not None:
            slot = ch.base[layer].index_select(0, ch.req_of) + slot
        heads = torch.arange(hkv, device=k.device)
        pages = c.manager.table[:, layer][ch.req[:, None], heads[None, :],
                                          slot // high.tokens_per_page]
        store_tokens(c.pages, high, pages.reshape(-1),
                     (slot % high.tokens_per_page).int().reshape(-1),
                     k.index_select(0, ch.src).reshape(-1, d),
                     v.index_select(0, ch.src).reshape(-1, d), ch.zeros, ch.pos)
        radix = c.radix
        for a, slot_id, rows in ch.keep:  # the prompt's last scoring queries so far
            if a is None:
                c._keep_score_queries(layer, slot_id, q[rows])
            else:
                radix._keep_queries(a, layer, q[rows])

    # ---- prompts that end over stored tokens ---------------------------------------------

    def store_prompt_ends(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, sm_scale: float) -> None:
        e = self.ends
        if e is None:
            return
        c = self.cache
        cfg = c.config
        g = e.group
        base = e.base[layer]
        extend_store.gather_prompts(c.pages, c.geometry, c.manager.table, layer, g, base, k,
                                    out_k=e.packed_k, raw=e.raw, key_first=e.key_first)
        if e.queries is None:
            e.queries = q.new_empty(e.num_q, *q.shape[1:])
        e.queries.index_copy_(0, e.q_dst, q.index_select(0, e.q_src))
        for dst, n, buf, lo, hi in e.kept:  # earlier chunks' queries of a short last chunk
            e.queries[dst:dst + n] = buf[layer, lo:hi]
        prefill_scores(e.queries, e.packed_k, g.total, sm_scale, cfg.score_queries,
                       starts=g.packed_start, max_len=g.max_total, out=e.sig,
                       q_starts=e.q_starts, key_first=e.key_first,
                       num_queries=e.num_queries, score_from=g.attached,
                       score_len=g.max_span)
        extend_store.compress_span(
            c.pages, c.geometry, c.manager.table, c.manager.counts, layer, g, base,
            e.packed_k, v, e.raw, e.sig, e.alpha_h, e.alpha_l, cfg.window,
            cfg.score_queries, tier_out=e.tier, block_counts=e.block_counts,
            totals=e.totals[layer], bench=e.bench)
        if e.cuts is not None:
            self._record_cuts(layer, base)

    def _record_cuts(self, layer: int, base: torch.Tensor) -> None:
        """Each tier's tokens before every cut of the ending prompts, into the radix
        export's buffer (``PromptSharing.record`` / ``_record_suffix_cuts``): the attached
        prefix's own cut counts before its cut, the attached counts plus the span's
        members up to the cut after it (columns past a suffix's last cut: left as are)."""
        e = self.ends
        at, from_att, skip, att_cuts, rows = e.cuts
        hi = (e.tier == 0).cumsum(-1, dtype=torch.int32).gather(-1, at)
        lo = (e.tier == 1).cumsum(-1, dtype=torch.int32).gather(-1, at)
        val = torch.stack((hi, lo), -1) + base[:, :, None, :]
        val = torch.where(from_att, att_cuts[layer], val)
        buf = self.cache.radix._cuts
        buf[rows, layer] = torch.where(skip, buf[rows, layer], val)

    def end_step(self) -> None:
        """The rows' final counts where the reference's end-of-step bookkeeping reads them:
        a chunked prompt's in ``_prompt_kept`` (``end_extend`` reclaims from it), an
        attached one's in its ``Attached.kept`` (``PromptSharing.end_step``)."""
        e = self.ends
        if e is None:
            return
        for i, (_, a) in enumerate(e.members):
            if a is not None:
                a.kept = e.totals[:, i]
        if e.chunked is None:
            req, tot = e.group.req, e.totals
        elif e.chunked.numel():
            req, tot = e.group.req[e.chunked], e.totals[:, e.chunked]
        else:
            return
        self.cache._prompt_kept[req] = tot.transpose(0, 1).long()


def _build_chunks(c: CompressedKVCache, ext: ExtendRequests, attached: dict
                  ) -> _Chunks | None:
    part = ext.partial
    if not part:
        return None
    atts = [attached.get(ext.slots[b]) for b in part]
    lens = [ext.fresh[b] for b in part]
    # the slot offset of the chunk's first token: a chunked prompt's high slot s holds
    # position s; an attached row's suffix follows its a_h attached high tokens
    off0 = [ext.prefix[b] if a is None else a.stored for b, a in zip(part, atts, strict=True)]
    slots, starts, off0, lens_d, pos0 = upload(
        [[ext.slots[b] for b in part], [ext.starts[b] for b in part], off0, lens,
         [ext.prefix[b] for b in part]], c.device)
    n = sum(lens)
    hkv = c.spec.num_kv_heads
    req_of = torch.repeat_interleave(torch.arange(len(part), device=c.device), lens_d,
                                     output_size=n)
    first = torch.cumsum(lens_d, 0) - lens_d
    t = torch.arange(n, device=c.device) - first[req_of]
    base = None
    if any(a is not None for a in atts):
        zero = torch.zeros(c.spec.num_layers, hkv, dtype=torch.int64, device=c.device)
        base = torch.stack([zero if a is None else a.counts[..., 0].to(torch.int64)
                            for a in atts], 1)
    return _Chunks(
        req=slots[req_of], req_of=req_of, src=starts[req_of] + t, off=off0[req_of] + t,
        pos=(pos0[req_of] + t).int().repeat_interleave(hkv),
        zeros=torch.zeros(n * hkv, device=c.device), base=base,
        keep=[(a, ext.slots[b], ext.rows(b)) for b, a in zip(part, atts, strict=True)])


def _build_ends(c: CompressedKVCache, ext: ExtendRequests, attached: dict,
                bench_mix: torch.Tensor | None) -> _Ends | None:
    ends = ext.last
    if not ends:
        return None
    cfg = c.config
    nq_cfg = cfg.score_queries
    spec = c.spec
    hkv = spec.num_kv_heads
    members, att_len, stored, totals, kept = [], [], [], [], []
    q_src, q_dst, q_starts, num_q = [], [], [], []
    rows_q = 0
    for b in ends:
        slot = ext.slots[b]
        a = attached.get(slot)
        total = ext.total[b] if a is None else a.total
        cut = 0 if a is None else a.cut
        members.append((slot, a))
        att_len.append(cut)
        stored.append(ext.prefix[b] - cut)  # (an attached prompt's extend starts at cut)
        totals.append(total)
        n = ext.fresh[b]
        nq_all = min(nq_cfg, total - cut)  # the span's last queries score it
        nq = min(nq_all, n)
        need = nq_all - nq
        if need:
            held = c._score_queries_held.get(slot, 0) if a is None else a.held
            if held < need:
                raise RuntimeError(
                    f"diffkv chunked prefill: request slot {slot} needs {need} queries of "
                    f"its earlier chunks to score its {total}-token prompt, but {held} were "
                    "kept")
            buf = c._score_queries[slot] if a is None else a.queries
            kept.append((rows_q, need, buf, held - need, held))
        q_src += range(ext.starts[b] + n - nq, ext.starts[b] + n)
        q_dst += range(rows_q + need, rows_q + nq_all)
        q_starts.append(rows_q - (total - nq_all))  # query position total - nq_all + r
        num_q.append(nq_all)
        rows_q += nq_all
    packed, at = [], 0
    for t in totals:
        packed.append(at)
        at += t
    spans = [t - a for t, a in zip(totals, att_len, strict=True)]
    chunked = [i for i, (_, a) in enumerate(members) if a is None]
    (req, total_d, att_d, stored_d, fresh_start, packed_start, q_starts_d, num_q_d, q_src_d,
     q_dst_d, chunked_d) = upload([[ext.slots[b] for b in ends], totals, att_len, stored,
                                   [ext.starts[b] for b in ends], packed, q_starts, num_q,
                                   q_src, q_dst, chunked], c.device)
    group = PromptGroup(req=req, total=total_d.int(), attached=att_d.int(),
                        stored=stored_d.int(), fresh_start=fresh_start,
                        packed_start=packed_start, max_total=max(totals),
                        max_span=max(spans), num_rows=at)
    zero = torch.zeros(spec.num_layers, hkv, 2, dtype=torch.int32, device=c.device)
    base = torch.stack([zero if a is None else a.counts.int() for _, a in members], 1)
    alpha = c.alpha[req]
    d = c.geometry.head_dim
    b = len(ends)
    dev = c.device
    e = _Ends(
        group=group, base=base, alpha_h=alpha[:, 0].contiguous(),
        alpha_l=alpha[:, 1].clone(memory_format=torch.contiguous_format),  # (never a view: aligned)
        bench=None if bench_mix is None else (c.bench_seed[req].contiguous(), bench_mix),
        q_starts=q_starts_d, num_queries=num_q_d.int(), q_src=q_src_d, q_dst=q_dst_d,
        kept=kept, num_q=rows_q, members=members,
        chunked=None if len(chunked) == len(members) else chunked_d,
        packed_k=torch.empty(at, hkv, d, device=dev),
        raw=torch.empty(at, hkv, extend_store.raw_bytes(c.geometry.high), dtype=torch.uint8,
                        device=dev),
        key_first=torch.empty(b, hkv, dtype=torch.int32, device=dev),
        sig=torch.empty(b, hkv, group.max_total, device=dev),
        tier=torch.empty(b, hkv, group.max_span, dtype=torch.int8, device=dev),
        block_counts=torch.empty(b, hkv, group.span_blocks, 2, dtype=torch.int32,
                                 device=dev),
        totals=torch.empty(spec.num_layers, b, hkv, 2, dtype=torch.int32, device=dev),
    )
    radix = c.radix
    if radix is not None and radix._cuts is not None:
        e.cuts = _cut_plan(c, radix, members, totals, att_len, spans, req)
    return e


def _cut_plan(c: CompressedKVCache, radix: Any, members: list, totals: list[int],
              att_len: list[int], spans: list[int], req: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
    """The cut-count plan of ``ExtendStores._record_cuts``: per (prompt, cut column) the
    span index it counts up to, whether it is the attached prefix's own (a cut before the
    attach point) and whether it is left alone; the attached cut counts; the buffer rows."""
    length, ncuts = radix.cut_len, radix._cuts.shape[3]
    hkv, layers = c.spec.num_kv_heads, c.spec.num_layers
    at, from_att, skip = [], [], []
    att_cuts = torch.zeros(layers, len(members), hkv, ncuts, 2, dtype=torch.int32,
                           device=c.device)
    for i, ((_, a), total, cut, span) in enumerate(zip(members, totals, att_len, spans,
                                                       strict=True)):
        if a is None:  # PromptSharing.record: every column, the last ones clamped
            at += [min((k + 1) * length - 1, total - 1) for k in range(ncuts)]
            from_att += [0] * ncuts
            skip += [0] * ncuts
            continue
        k_att = min(cut // length, ncuts)
        end = total // length  # _record_suffix_cuts: columns [k_att, end) from the span
        att_cuts[:, i, :, :k_att] = a.cuts[:, :, :k_att]
        at += [min(max((k + 1) * length - cut - 1, 0), span - 1) for k in range(ncuts)]
        from_att += [int(k < k_att) for k in range(ncuts)]
        skip += [int(k >= end) for k in range(ncuts)]
    at_d, att_d, skip_d = upload([at, from_att, skip], c.device)
    shape = (len(members), 1, ncuts)
    return (at_d.view(shape).expand(-1, hkv, -1).contiguous(),
            att_d.view(*shape, 1).bool(), skip_d.view(*shape, 1).bool(), att_cuts,
            radix._cut_row[req])
