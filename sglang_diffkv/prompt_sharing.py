"""Radix prefix sharing on a ``CompressedKVCache``: prompts exported with their cut counts,
and a prompt suffix prefilled over an attached prefix.

**Export.** Right after a prompt's prefill (its whole prompt, or its last chunk) and before
any decode step, each tier of a (layer, KV head) row holds the prompt's surviving tokens in
position order. So the prompt can be cut at any position: what a tier holds before
position ``x`` is its first ``n_t(x)`` tokens. ``begin_prompts`` opens a buffer for the
prompts a step completes, the prefill store ``record``\\ s each layer's counts before every
cut (multiples of ``cut_len`` tokens) from the classification, and ``export`` freezes each
prompt as a ``memory.SharedPrefix`` carrying them (``PageManager.export_prefix(copy=True)``:
the handle gets a copy of the row's private pages, so the exporting request decodes on
exactly as it would without sharing; pages the row attached are shared as they are). An
export that does not fit, leaving a decode reserve, changes nothing (its ``ok`` is False).

**Attach.** A request whose prompt matches a handle's first ``cut`` positions starts from
it (``attach``: per row and tier the full pages before the cut count are shared, the
partial page is copied; with ``copy_attach`` every page is copied, for rows the kernels'
decode may change), and its prompt suffix runs as an extend over the attached prefix:
``reserve_extend`` gives each row the suffix's all-high pages after its high tier; chunks
before the last are stored there at the high tier, in position order (``store_chunk``);
the last chunk (``store_last``) scores the suffix's tokens with the prompt's last
``min(score_queries, suffix)`` queries (the attached tokens were scored by the exporter and
are frozen), classifies them with the prefill policy at their positions in the whole prompt
and appends them to the row's tiers; ``end_step`` counts them and lets
``PageManager.reclaim_extend`` keep the pages they need.

Host loops run over the step's requests only (prefill-time work, as chunked prefill's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_diffkv.extend_attention import paged_extend_probs, stored_logits
from sglang_diffkv.memory import AllocResult, SharedPrefix, copy_pages
from sglang_diffkv.pages import read_token_codes, read_tokens, write_token_codes, write_tokens
from sglang_diffkv.policy import Tier, classify_prompt, group_max

N_HIGH, N_LOW, P_HIGH, P_LOW = range(4)  # columns of PageManager.counts


@dataclass
class Attached:
    """A request slot prefilling its prompt suffix over an attached prefix."""

    cut: int  # prompt positions the attached prefix covers
    total: int  # the whole prompt (cut + suffix)
    counts: torch.Tensor  # int64 [layers, Hkv, 2]: attached tokens per tier
    cuts: torch.Tensor  # int32 [layers, Hkv, cut // cut_len, 2]: the handle's cut counts
    stored: int = 0  # suffix tokens stored at the high tier by earlier chunks
    queries: torch.Tensor | None = None  # [layers, Q, Hq, D]: the suffix's last queries
    held: int = 0  # how many of ``queries`` are held
    kept: torch.Tensor | None = None  # int [layers, Hkv, 2]: counts after the last chunk


class PromptSharing:
    def __init__(self, cache, cut_len: int, copy_attach: bool = False) -> None:
        if cut_len < 1:
            raise ValueError(f"cut_len={cut_len} must be >= 1")
        self.cache = cache
        self.cut_len = cut_len
        self.copy_attach = copy_attach
        spec = cache.spec
        # which buffer row each request slot's cut counts go to (row 0: a sink)
        self._cut_row = torch.zeros(spec.max_reqs, dtype=torch.int64, device=cache.device)
        self._cuts: torch.Tensor | None = None  # int32 [1 + B, layers, Hkv, C, 2]
        self._prompts: tuple[list[int], list[int], int] | None = None
        self.attached: dict[int, Attached] = {}
        # exported prompts not yet handed to the tree: slot -> (handle, ok flag)
        self.exports: dict[int, tuple[SharedPrefix, torch.Tensor]] = {}

    # ---- export ------------------------------------------------------------------------

    def begin_prompts(self, slots: Sequence[int], totals: Sequence[int], keep_free: int
                      ) -> None:
        """The prompts this step completes (``totals``: their whole lengths); ``keep_free``:
        the pages their export must leave free (the decode reserve)."""
        self._prompts = None
        self._cuts = None
        if not slots:
            return
        c = self.cache
        ncuts = max(max(totals) // self.cut_len, 1)
        spec = c.spec
        self._cuts = torch.zeros(len(slots) + 1, spec.num_layers, spec.num_kv_heads, ncuts, 2,
                                 dtype=torch.int32, device=c.device)
        self._cut_row.zero_()
        self._cut_row[torch.as_tensor(list(slots), device=c.device)] = torch.arange(
            1, len(slots) + 1, device=c.device)
        self._prompts = (list(slots), list(totals), keep_free)

    def record(self, layer: int, req: torch.Tensor, tier: torch.Tensor) -> None:
        """A layer's classification of whole prompts (tier int8 [B, Hkv, Lmax], position
        order): each tier's tokens before every cut, into the step's buffer (no sync)."""
        if self._cuts is None:
            return
        ncuts, lmax = self._cuts.shape[3], tier.shape[-1]
        at = (torch.arange(1, ncuts + 1, device=tier.device) * self.cut_len - 1).clamp(
            max=max(lmax - 1, 0))
        hi = (tier == Tier.HIGH).cumsum(-1, dtype=torch.int32).index_select(-1, at)
        lo = (tier == Tier.LOW).cumsum(-1, dtype=torch.int32).index_select(-1, at)
        self._cuts[self._cut_row[req.long()], layer] = torch.stack((hi, lo), -1)

    def export(self) -> None:
        """Freeze the step's completed prompts (``begin_prompts``) as shared prefixes with
        their cut counts; ``exports`` holds each until the tree takes or drops it."""
        if self._prompts is None:
            return
        slots, totals, keep_free = self._prompts
        c = self.cache
        for r in slots:  # (a slot retracted and readmitted in one run: drop the stale one)
            self.drop_export(r)
        req = torch.as_tensor(slots, device=c.device)
        handles, res, copies = c.manager.export_prefix(
            req, totals, copy=True, keep_free=keep_free, cuts=self._cuts[1:],
            cut_len=self.cut_len)
        copy_pages(c.pages, copies)
        for r, h in zip(slots, handles, strict=True):
            self.exports[r] = (h, res.ok)
        self._prompts = self._cuts = None

    def take_export(self, slot: int) -> SharedPrefix | None:
        """The slot's exported prompt, now the caller's (None if none or it did not fit:
        an export that did not fit is released here). Reads the export's flag (a sync,
        long after the forward that set it)."""
        got = self.exports.pop(slot, None)
        if got is None:
            return None
        handle, ok = got
        if not bool(ok):
            self.cache.release_prefix([handle])
            return None
        return handle

    def drop_export(self, slot: int) -> None:
        got = self.exports.pop(slot, None)
        if got is not None:
            self.cache.release_prefix([got[0]])

    # ---- attach and the suffix -----------------------------------------------------------

    def attach(self, slot: int, handle: SharedPrefix, cut: int, suffix: int,
               alpha: tuple[float, float]) -> tuple[AllocResult, AllocResult]:
        """Start FREE ``slot`` from ``handle``'s first ``cut`` positions and reserve its
        ``suffix`` (``reserve_extend``). Both results must be ok (admission counted them)."""
        c = self.cache
        handle = c.manager.handles.get(handle.key, handle)  # (a tree may have truncated it)
        n = handle.cut_counts(cut)
        res = c.attach_prefix([slot], [handle], [alpha[0]], [alpha[1]], n_tokens=n[None],
                              copy=self.copy_attach)
        if self.copy_attach:
            self._shift_positions(slot, n, cut, cut + suffix - handle.num_tokens)
        room = c.manager.reserve_extend(c._index([slot]), [suffix])
        self.attached[slot] = Attached(cut, cut + suffix, n.long(),
                                       handle.cuts[:, :, :cut // self.cut_len])
        return res, room

    def _shift_positions(self, slot: int, n: torch.Tensor, cut: int, delta: int) -> None:
        """A copied prefix's virtual positions, moved by ``delta`` (this prompt's length less
        the exporter's): a token's score holds the exporter's scoring queries, and the decode
        policy's age ``p - pos`` must count exactly those plus this request's decode steps
        (a shared prefix needs none of this: the policy never reads it). ``n`` [layers, Hkv,
        2]: each tier's attached tokens, at most ``cut``, which bounds the pages on the host
        (no sync); columns past a row's pages add 0 to page 0."""
        if delta == 0:
            return
        c = self.cache
        rows = c.manager.table[slot]  # [layers, Hkv, row_len]
        row_len = rows.shape[-1]
        for t, layout in enumerate(c.geometry.tiers):
            per = layout.tokens_per_page
            width = min(-(-cut // per), row_len)
            if width == 0:
                continue
            k = (n[..., t].long() + per - 1) // per  # [layers, Hkv]: pages holding tokens
            j = torch.arange(width, device=c.device)
            col = j if t == 0 else row_len - 1 - j
            held = k[..., None] > j  # [layers, Hkv, width]
            ids = torch.where(held, rows[..., col].long(), 0).reshape(-1)
            add = (held.to(torch.int32) * delta).reshape(-1, 1).expand(-1, per)
            pos = c.pages[:, layout.pos_offset:layout.pos_offset + 4 * per].view(torch.int32)
            pos.index_add_(0, ids, add)

    def attach_pages(self, cut: int, suffix: int) -> int:
        """Upper bound on the pages ``attach`` takes (admission)."""
        spec = self.cache.spec
        rows = spec.heads_per_request
        attach = spec.prefill_pages(cut) if self.copy_attach else 2
        return (attach + spec.prefill_pages(suffix)) * rows

    def release(self, slot: int) -> None:
        """The slot is freed (finished, aborted or retracted)."""
        self.attached.pop(slot, None)
        self.drop_export(slot)

    def store_chunk(self, layer: int, b: int, slot: int, ext, query: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor) -> None:
        """One layer of an attached row's chunk before its last: the fresh key / value
        (packed [T, Hkv, D]) at the high tier after the stored suffix, in position order."""
        c, a = self.cache, self.attached[slot]
        high = c.geometry.high
        rows, n = ext.rows(b), ext.fresh[b]
        table = c.manager.table[ext.req[b], layer]  # [Hkv, row_len]
        hkv = table.shape[0]
        at = a.counts[layer, :, 0, None] + a.stored + torch.arange(n, device=c.device)
        page_ids = table.gather(-1, at // high.tokens_per_page)
        pos = (a.cut + a.stored + torch.arange(n, device=c.device)).int()
        write_tokens(c.pages, high, page_ids.reshape(-1),
                     (at % high.tokens_per_page).int().reshape(-1),
                     key[rows].transpose(0, 1).reshape(hkv * n, -1),
                     value[rows].transpose(0, 1).reshape(hkv * n, -1),
                     torch.zeros(hkv * n, device=c.device), pos.expand(hkv, n).reshape(-1))
        self._keep_queries(a, layer, query[rows])

    def _keep_queries(self, a: Attached, layer: int, q: torch.Tensor) -> None:
        nq = self.cache.config.score_queries
        if a.queries is None:
            a.queries = q.new_zeros(self.cache.spec.num_layers, nq, *q.shape[1:])
        kept = torch.cat([a.queries[layer, :a.held], q.to(a.queries.dtype)])[-nq:]
        a.queries[layer, :kept.shape[0]] = kept

    def _suffix_mass(self, layer: int, b: int, slot: int, ext, query: torch.Tensor,
                     key: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, int]:
        """fp32 [Hq, suffix]: the attention mass each suffix token receives from the
        prompt's last nq = min(score_queries, suffix) queries (the chunk's own, then kept
        ones of earlier chunks), and nq. The attached tokens are not scored."""
        c, a = self.cache, self.attached[slot]
        rows, n = ext.rows(b), ext.fresh[b]
        s = a.total - a.cut
        nq_all = min(c.config.score_queries, s)
        nq = min(nq_all, n)
        req = ext.req[b:b + 1]
        zero = torch.zeros(1, dtype=torch.int64, device=c.device)
        pr = paged_extend_probs(query[rows], key[rows], zero, torch.full_like(zero, n), c.pages,
                                c.geometry, c.manager.table, c.manager.counts, req, layer,
                                sm_scale, nq)
        hq = query.shape[1]
        group = hq // c.spec.num_kv_heads
        a_h = a.counts[layer, :, 0].repeat_interleave(group)  # [Hq]
        mass = torch.zeros(hq, s, device=c.device)
        if a.stored:
            at = a_h[:, None, None] + torch.arange(a.stored, device=c.device)
            high = pr.prob_high[0, :, :nq]  # [Hq, nq, C_high]
            mass[:, :a.stored] = high.gather(-1, at.expand(hq, nq, a.stored)).sum(1)
        mass[:, a.stored:] = pr.prob_fresh[0, :, :nq, :n].sum(1)
        need = nq_all - nq
        if need > 0:
            if a.held < need:
                raise RuntimeError(f"diffkv radix suffix: request slot {slot} needs {need} "
                                   f"queries of earlier chunks, {a.held} were kept")
            q_old = a.queries[layer, a.held - need:a.held]
            q_pos = a.cut + a.stored - need + torch.arange(need, device=c.device)
            mass[:, :a.stored] += self._stored_probs(layer, req, a, q_old, q_pos,
                                                     sm_scale).sum(1)
        return mass, nq_all

    def _stored_probs(self, layer: int, req: torch.Tensor, a: Attached, q: torch.Tensor,
                      q_pos: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """Probabilities fp32 [Hq, nq, stored] over the stored suffix tokens of queries q
        [nq, Hq, D] at prompt positions q_pos inside the stored suffix: they see every
        attached token and the stored suffix tokens up to their own position."""
        c = self.cache
        logits, mask, c_high = stored_logits(q, c.pages, c.geometry, c.manager.table,
                                             c.manager.counts, req, layer, sm_scale)
        hkv, nq, hq = mask.shape[0], q.shape[0], q.shape[1]
        slot = torch.arange(mask.shape[1], device=q.device)
        a_h = a.counts[layer, :, 0][:, None]  # [Hkv, 1]
        suffix_pos = a.cut + slot[None, :] - a_h  # high slot -> its prompt position
        in_suffix = (slot[None, :] >= a_h) & (slot[None, :] < c_high)
        visible = mask[:, None, None, :] & ~(
            in_suffix[:, None, None, :]
            & (suffix_pos[:, None, None, :] > q_pos[None, None, :, None]))
        logits = logits.masked_fill(~visible, float("-inf"))
        prob = torch.softmax(logits, dim=-1)  # [Hkv, G, nq, C]
        at = (a_h + torch.arange(a.stored, device=q.device))[:, None, None, :]
        return prob.gather(-1, at.expand(hkv, hq // hkv, nq, a.stored)).flatten(0, 1)

    def store_last(self, layer: int, b: int, slot: int, ext, query: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor, sm_scale: float) -> None:
        """One layer of an attached row's last chunk: score and classify the suffix (at its
        positions in the whole prompt), then append its high tokens to the high tier and its
        low tokens to the low tier (new low pages are the high run's pages after the high
        tokens', which ``reclaim_extend`` moves); pruned ones are dropped. Everything is read
        before anything is written; stored tokens that stay high keep their bytes."""
        c, a = self.cache, self.attached[slot]
        high, low = c.geometry.tiers
        mass, nq = self._suffix_mass(layer, b, slot, ext, query, key, sm_scale)
        total, cut, s = a.total, a.cut, a.total - a.cut
        req = ext.req[b:b + 1]
        hkv = c.spec.num_kv_heads
        lengths = torch.tensor([total], device=c.device)
        sig = torch.zeros(1, hkv, total, device=c.device)
        sig[0, :, cut:] = group_max(mass, hkv)
        if c.config.bench_mix is not None:
            sig = c.bench_significance(layer, req, lengths, total)
        alpha = c.alpha[req]
        cls = classify_prompt(sig, lengths, alpha[:, 0], alpha[:, 1], c.config.window, nq)
        tier = cls.tier[0, :, cut:]  # [Hkv, s]
        # the suffix's K/V [Hkv, s, D]: stored chunks from the pages, then the fresh ones
        table = c.manager.table[req[0], layer]  # [Hkv, row_len]
        rows = ext.rows(b)
        fk = key[rows].transpose(0, 1).float()
        fv = value[rows].transpose(0, 1).float()
        a_h, a_l = a.counts[layer, :, 0], a.counts[layer, :, 1]  # [Hkv]
        codes = None
        if a.stored:
            at = a_h[:, None] + torch.arange(a.stored, device=c.device)  # [Hkv, stored]
            src_pages = table.gather(-1, at // high.tokens_per_page).reshape(-1)
            src_slots = (at % high.tokens_per_page).int().reshape(-1)
            old = read_tokens(c.pages, high, src_pages, src_slots)
            codes = read_token_codes(c.pages, high, src_pages, src_slots)
            d = fk.shape[-1]
            fk = torch.cat([old.key.view(hkv, a.stored, d), fk], 1)
            fv = torch.cat([old.value.view(hkv, a.stored, d), fv], 1)
        is_high, is_low = tier == Tier.HIGH, tier == Tier.LOW
        n_hi, n_lo = is_high.sum(-1), is_low.sum(-1)  # [Hkv]
        rank_h = is_high.long().cumsum(-1) - 1 + a_h[:, None]  # high slot of each token
        rank_l = is_low.long().cumsum(-1) - 1 + a_l[:, None]
        counts = c.manager.counts[req[0], layer].long()  # [Hkv, 4]
        hp_new = -(-(a_h + n_hi) // high.tokens_per_page)
        lp_old = counts[:, P_LOW]
        m = rank_l // low.tokens_per_page
        row_len = table.shape[-1]
        low_col = torch.where(m < lp_old[:, None], row_len - 1 - m,
                              hp_new[:, None] + m - lp_old[:, None])
        score = cls.score[0, :, cut:]
        pos = cls.pos[0, cut:].expand(hkv, s)
        head = torch.arange(hkv, device=c.device)[:, None].expand(hkv, s)
        for member, rank, col, layout in (
            (is_high, rank_h, rank_h // high.tokens_per_page, high),
            (is_low, rank_l, low_col, low),
        ):
            if not bool(member.any()):
                continue
            page_ids = table.gather(-1, col.clamp(0, row_len - 1))
            write_tokens(c.pages, layout, page_ids[member],
                         (rank[member] % layout.tokens_per_page).int(), fk[member],
                         fv[member], score[member], pos[member])
        if codes is not None:
            keep = is_high[:, :a.stored]
            if bool(keep.any()):
                dst = rank_h[:, :a.stored][keep]
                write_token_codes(c.pages, high, table[head[:, :a.stored][keep],
                                                       dst // high.tokens_per_page],
                                  (dst % high.tokens_per_page).int(),
                                  [x.view(hkv, a.stored, -1)[keep] for x in codes])
        if a.kept is None:
            a.kept = torch.zeros(c.spec.num_layers, hkv, 2, dtype=torch.int64,
                                 device=c.device)
        a.kept[layer, :, 0] = a_h + n_hi
        a.kept[layer, :, 1] = a_l + n_lo
        self._record_suffix_cuts(layer, slot, a, is_high, is_low)

    def _record_suffix_cuts(self, layer: int, slot: int, a: Attached, is_high: torch.Tensor,
                            is_low: torch.Tensor) -> None:
        if self._cuts is None:
            return
        c = self.cache
        row = self._cut_row[slot]
        ncuts = self._cuts.shape[3]
        k_att = min(a.cut // self.cut_len, ncuts)
        self._cuts[row, layer, :, :k_att] = a.cuts[layer, :, :k_att]
        later = a.total // self.cut_len - k_att
        if later <= 0:
            return
        # cuts after the attached prefix: its counts plus the suffix's tokens before the cut
        at = (torch.arange(k_att + 1, k_att + later + 1, device=c.device) * self.cut_len
              - a.cut - 1)
        hi = is_high.int().cumsum(-1).index_select(-1, at) + a.counts[layer, :, 0, None]
        lo = is_low.int().cumsum(-1).index_select(-1, at) + a.counts[layer, :, 1, None]
        self._cuts[row, layer, :, k_att:k_att + later] = torch.stack((hi, lo), -1).int()

    def end_step(self, ext, rows: Sequence[int]) -> None:
        """After the last layer of a step with attached rows (``ext`` rows ``rows``): chunks
        before the last are counted at the high tier, last chunks keep their final counts
        (``reclaim_extend``) and stop being attached."""
        c = self.cache
        nq = c.config.score_queries
        for b in rows:
            slot = ext.slots[b]
            a = self.attached[slot]
            if a.cut + a.stored + ext.fresh[b] < a.total:
                grow = torch.tensor([[ext.fresh[b], 0]], device=c.device)
                c.manager.add_tokens(ext.req[b:b + 1], grow)
                a.stored += ext.fresh[b]
                a.held = min(nq, a.held + ext.fresh[b])
            else:
                c.manager.reclaim_extend(ext.req[b:b + 1], a.kept[None, ..., 0],
                                         a.kept[None, ..., 1])
                del self.attached[slot]
