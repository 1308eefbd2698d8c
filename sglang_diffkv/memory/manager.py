"""PageManager: page ids for every (request, layer, KV head, tier), entirely on the device.

State (device tensors; the contract kernels and the SGLang pool read):
- ``free_list.free_pages`` int32 [num_pages] ring, ``free_list.head`` / ``free_list.tail``
  int64 0-dim monotone counters (see ``free_list``).
- ``table`` int32 [max_reqs, layers, kv_heads, row_len], -1 where empty. High page j sits at
  ``table[..., j]``, low page j at ``table[..., row_len - 1 - j]``.
- ``counts`` int32 [max_reqs, layers, kv_heads, 4] = (n_high, n_low, high_pages, low_pages).
  Token s of tier t is in that tier's page s // N_t at slot s % N_t.
- ``phase`` int8 [max_reqs] (``inputs.Phase``).
- ``shared`` int32 [max_reqs, layers, kv_heads, 2]: the row's first ``shared[..., t]`` pages
  of tier t are shared read-only (a prefix it exported or attached; ``sharing``).
- ``refs`` int32 [num_pages]: shared holders of each page (rows' shared regions and live
  handles, ``handles``); 0 for free pages and private pages.
- ``decode_hints`` int64 [max_reqs, layers, kv_heads, HINT_WORDS] or None: the fused decode
  argmin's per-row records (``sglang_diffkv.decode_hint``; allocated by
  ``enable_decode_hints``). The manager only invalidates a slot's records whenever the slot
  is (re)started or freed (``allocate_prefill``, ``attach_prefix``, ``free_requests``).

Invariants: every page id is either in the free ring, or in exactly one row's private region,
or held by ``refs`` >= 1 shared holders (and nowhere else); table entries outside
[0, high_pages) and [row_len - low_pages, row_len) are -1; 0 <= n_t <= pages_t * N_t and a
shared page is full (n_t >= shared_t * N_t). ``check_invariants`` verifies all of them.

Every op is plan -> one flat exclusive prefix sum -> disjoint runs of the free list ->
counter update, vectorised over the batch with gathers/scatters only. Allocating ops are
all-or-nothing without a host sync: they compute ``ok`` on the device, scale every take by
it and return it in an ``AllocResult``. With ``validate=True`` (the default) arguments are
checked on the host first (a sync); serving code builds the manager with ``validate=False``,
where slots in the wrong phase are skipped on the device instead, and duplicates in a batch
and out-of-range values are the caller's responsibility.

Cost: prefill, reclaim and free touch whole rows (B * layers * heads * row_len elements);
a decode step touches two entries per row. Only the decode step is per-token hot. Prefix
sharing (export / attach / release) is admission-time work: a host loop over the handles of
the call to stack their tensors, device work over whole rows plus one pass over all pages
(``num_pages``) whenever shared pages are let go (release, and free once anything was
shared), which dedups the pages whose count reaches zero without a host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_diffkv import decode_hint
from sglang_diffkv.memory.free_list import CircularFreeList, exclusive_cumsum
from sglang_diffkv.memory.inputs import (
    Phase,
    as_index,
    as_int64,
    check_phase,
    check_req_idx,
    check_shape,
    first_violation,
)
from sglang_diffkv.memory.result import AllocResult, PageTableRowFull
from sglang_diffkv.memory.sharing import PageCopies, SharedPrefix, stack_handles, tier_columns
from sglang_diffkv.memory.spec import MemorySpec

N_HIGH, N_LOW, P_HIGH, P_LOW = range(4)  # columns of ``counts``
TIER_NAMES = ("high", "low")

IndexLike = torch.Tensor | Sequence[int]


def _ceil_div(a: torch.Tensor, b: int | torch.Tensor) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


class PageManager:
    def __init__(
        self, spec: MemorySpec, device: torch.device | str = "cpu", *, validate: bool = True
    ) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.validate = validate
        s = spec
        self.row_len = s.row_len
        self.free_list = CircularFreeList(s.num_pages, self.device)
        shape = (s.max_reqs, s.num_layers, s.num_kv_heads)
        self.table = torch.full((*shape, s.row_len), -1, dtype=torch.int32, device=self.device)
        self.counts = torch.zeros((*shape, 4), dtype=torch.int32, device=self.device)
        self.phase = torch.zeros(s.max_reqs, dtype=torch.int8, device=self.device)
        self.shared = torch.zeros((*shape, 2), dtype=torch.int32, device=self.device)
        # one sink entry past the pages: masked-out lanes of a reference-count update add 0
        # there, so the update needs no boolean indexing (no host sync)
        self._refs_buf = torch.zeros(s.num_pages + 1, dtype=torch.int32, device=self.device)
        self.refs = self._refs_buf[:s.num_pages]
        # live shared prefixes by key (host registry: what the invariants count as holders)
        self.handles: dict[int, SharedPrefix] = {}
        self._next_handle = 0
        # whether any page was ever shared: until then free_requests skips the refs pass
        self._sharing = False
        self.decode_hints: torch.Tensor | None = None
        self._tokens_per_page = torch.tensor(s.tokens_per_page, dtype=torch.int64,
                                             device=self.device)
        self._pos = torch.arange(s.row_len, dtype=torch.int64, device=self.device)
        self._layer = torch.arange(s.num_layers, device=self.device).view(1, -1, 1)
        self._head = torch.arange(s.num_kv_heads, device=self.device).view(1, 1, -1)
        self._free_host_value = s.num_pages
        if self.device.type == "cuda":
            self._free_pinned = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._free_copied: torch.cuda.Event | None = None

    # -- convenience views -------------------------------------------------------------

    @property
    def free_pages(self) -> torch.Tensor:
        return self.free_list.free_pages

    @property
    def head(self) -> torch.Tensor:
        return self.free_list.head

    @property
    def tail(self) -> torch.Tensor:
        return self.free_list.tail

    def _heads(self, b: int) -> tuple[int, int, int]:
        return (b, self.spec.num_layers, self.spec.num_kv_heads)

    def _req(self, req_idx: IndexLike, op: str, allowed: tuple[Phase, ...]) -> torch.Tensor:
        req = as_index(req_idx, self.device)
        if self.validate:
            host = check_req_idx(req, self.spec.max_reqs)
            check_phase(self.phase, host, allowed, op)
        return req

    def _in_phase(self, req: torch.Tensor, phase: Phase) -> torch.Tensor:
        """bool [B, 1, 1]: which slots an op may touch. Without ``validate`` a slot in the
        wrong phase (say, one whose allocate_prefill was a no-op) is skipped on the device,
        so a caller's mistake can never break page ownership."""
        return (self.phase[req] == int(phase)).view(-1, 1, 1)

    def enable_decode_hints(self) -> torch.Tensor:
        """Allocate the fused argmin's records (all invalid) if not yet; returns them."""
        if self.decode_hints is None:
            s = self.spec
            self.decode_hints = decode_hint.allocate(s.max_reqs, s.num_layers,
                                                     s.num_kv_heads, self.device)
        return self.decode_hints

    # -- free-page count ---------------------------------------------------------------

    def num_free_pages(self) -> torch.Tensor:
        """0-dim int64 device tensor; no sync."""
        return self.free_list.num_free()

    def num_free_pages_host(self) -> int:
        """Free pages as a Python int.

        On CPU this is exact. On CUDA it never blocks: it returns the value of the most recent
        *completed* asynchronous copy (so one step stale when called once per step) and then
        enqueues a fresh copy into a pinned buffer. For an exact value: call it, synchronise
        the stream, call it again. The value errs only by the pages taken or returned since
        the previous call; allocating ops stay safe regardless because they check on device.
        """
        if self.device.type != "cuda":
            return int(self.num_free_pages())
        if self._free_copied is not None and self._free_copied.query():
            self._free_host_value = int(self._free_pinned[0])
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            self._free_pinned.copy_(self.num_free_pages().view(1), non_blocking=True)
        self._free_copied = torch.cuda.Event()
        self._free_copied.record(stream)
        return self._free_host_value

    def pages_needed_for_prefill(self, prompt_lens: Sequence[int]) -> int:
        return self.spec.pages_needed_for_prefill(prompt_lens)

    def pages_needed_for_decode(self, batch: int) -> int:
        return self.spec.pages_needed_for_decode(batch)

    # -- ops -----------------------------------------------------------------------------

    def allocate_prefill(self, req_idx: IndexLike, prompt_lens: IndexLike,
                         reserve_lens: IndexLike | None = None) -> AllocResult:
        """All-high over-allocation: every (layer, head) row of request b takes
        ``spec.prefill_pages(R_b)`` pages into row positions [0, n), R_b = ``reserve_lens[b]``
        (default: ``prompt_lens[b]``); counts = (L_b, 0, n, 0), L_b = ``prompt_lens[b]``.

        Chunked prefill reserves the whole prompt (R_b) at its first chunk of L_b tokens:
        the row's pages then hold every later chunk at the high tier (``advance_prefill``)
        until the last one is scored and ``reclaim_prefill`` compacts the row."""
        op = "allocate_prefill"
        req = self._req(req_idx, op, (Phase.FREE,))
        lens = torch.as_tensor(prompt_lens, device=self.device).to(torch.int64)
        reserve = lens if reserve_lens is None else torch.as_tensor(
            reserve_lens, device=self.device).to(torch.int64)
        b = req.shape[0]
        if self.validate:
            check_shape("prompt_lens", lens, (b,))
            check_shape("reserve_lens", reserve, (b,))
            for n, r in zip(lens.tolist(), reserve.tolist(), strict=True):
                self.spec.check_prompt_len(n)
                self.spec.check_prompt_len(r)
                if n > r:
                    raise ValueError(f"{op}: prompt length {n} exceeds its reserve {r}")
        pages = _ceil_div(reserve, self.spec.min_tokens_per_page) + 1  # == spec.prefill_pages
        free_slot = self._in_phase(req, Phase.FREE)
        per_row = (pages.view(b, 1, 1) * free_slot).expand(self._heads(b))
        take = self.free_list.take(per_row.reshape(-1))

        start = take.start.view(*self._heads(b), 1)
        got = take.count.view(*self._heads(b), 1)
        pos = self._pos
        # Rows of FREE slots are all -1, so keeping them where nothing was taken is a no-op.
        old_rows = self.table[req]
        self.table[req] = torch.where(pos < got, self.free_list.ids_at(start + pos), old_rows)

        zero = torch.zeros_like(per_row)
        new_counts = torch.stack((lens.view(b, 1, 1).expand_as(per_row), zero, per_row, zero), -1)
        done = take.ok & free_slot
        self.counts[req] = torch.where(done.unsqueeze(-1), new_counts.to(torch.int32),
                                       self.counts[req])
        self.phase[req] = torch.where(done.view(-1), int(Phase.PREFILLED), self.phase[req])
        decode_hint.invalidate(self.decode_hints, req)
        return AllocResult(op, take.ok, take.needed, take.free, torch.ones_like(take.ok))

    def advance_prefill(self, req_idx: IndexLike, n_tokens: IndexLike) -> None:
        """Chunked prefill: a PREFILLED row's pages received ``n_tokens[b]`` more tokens at
        the high tier (slots n_high .. n_high + n - 1, in position order): n_high += n.
        The pages were reserved by ``allocate_prefill``; nothing is taken or returned."""
        op = "advance_prefill"
        req = self._req(req_idx, op, (Phase.PREFILLED,))
        b = req.shape[0]
        n = torch.as_tensor(n_tokens, device=self.device).to(torch.int64)
        counts = self.counts[req].to(torch.int64)
        new = counts[..., N_HIGH] + n.view(b, 1, 1)
        if self.validate:
            check_shape("n_tokens", n, (b,))
            capacity = counts[..., P_HIGH] * self.spec.high_tokens_per_page
            hit = first_violation((n.view(b, 1, 1) < 0) | (new > capacity))
            if hit is not None:
                i, l, h = hit
                raise ValueError(f"{op}: request slot {int(req[i])}, layer {l}, head {h}: "
                                 f"{int(new[hit])} high tokens do not fit its "
                                 f"{int(counts[hit][P_HIGH])} reserved pages")
        active = self._in_phase(req, Phase.PREFILLED)
        counts[..., N_HIGH] = torch.where(active, new, counts[..., N_HIGH])
        self.counts[req] = counts.to(torch.int32)

    def reclaim_prefill(
        self, req_idx: IndexLike, n_high: torch.Tensor, n_low: torch.Tensor
    ) -> None:
        """Keep hp = ceil(n_high/N_high) high pages and then lp = ceil(n_low/N_low) low pages
        (as the compressor wrote them, left to right), return row positions [hp+lp, allocated)
        to the free list, and reverse row segment [hp, row_len) so low page j lands at
        row_len - 1 - j. Counts become (n_high, n_low, hp, lp)."""
        op = "reclaim_prefill"
        req, nh, nl, counts = self._final_counts(op, req_idx, Phase.PREFILLED, n_high, n_low)
        b = req.shape[0]
        if self.validate:
            prompt = counts[..., N_HIGH]
            self._refuse_counts(op, req, nh, nl, (
                ("n_high < 0", nh < 0),
                ("n_low < 0", nl < 0),
                ("n_high + n_low > prompt length", nh + nl > prompt),
            ), lambda hit: f"prompt length={int(prompt[hit])}")
        active = self._in_phase(req, Phase.PREFILLED)
        allocated = counts[..., P_HIGH]
        hp = _ceil_div(nh, self.spec.high_tokens_per_page)
        lp = _ceil_div(nl, self.spec.low_tokens_per_page)
        kept = hp + lp  # <= allocated by spec.prefill_pages' bound
        back = (allocated - kept) * active
        start = self.free_list.give(back.reshape(-1)).view(*self._heads(b), 1)

        pos = self._pos
        rows = self.table[req]
        kept_ = kept.unsqueeze(-1)
        returned = (pos >= kept_) & (pos < kept_ + back.unsqueeze(-1))
        self.free_list.write(start + (pos - kept_), rows, returned)
        new_rows = torch.where(returned, -1, rows)
        # Reversal as one gather: position j >= hp reads hp + row_len - 1 - j. Reversing (not
        # shifting) moves the low run to the right end with no overlap between what is read
        # and written, so a kernel can do it in place by pairwise swaps (as DiffKV does).
        hp_ = hp.unsqueeze(-1)
        src = torch.where(pos < hp_, pos, hp_ + self.row_len - 1 - pos)
        new_rows = new_rows.gather(-1, src)
        self.table[req] = torch.where(active.unsqueeze(-1), new_rows, rows)
        new_counts = torch.stack((nh, nl, hp, lp), -1)
        self.counts[req] = torch.where(active.unsqueeze(-1), new_counts, counts).to(torch.int32)
        self.phase[req] = torch.where(active.view(-1), int(Phase.DECODING), self.phase[req])

    def ensure_decode_room(self, req_idx: IndexLike, tiers: torch.Tensor) -> AllocResult:
        """For every (request, layer, head, tier t) with ``tiers[b, t]`` whose tier is exactly
        full (n_t == pages_t * N_t, 0 pages included) take one page: high at row position
        high_pages, low at row_len - 1 - low_pages. All or nothing."""
        op = "ensure_decode_room"
        req = self._req(req_idx, op, (Phase.DECODING,))
        b = req.shape[0]
        want_tier = torch.as_tensor(tiers, device=self.device).to(torch.bool)
        if self.validate:
            check_shape("tiers", want_tier, (b, 2))
        counts = self.counts[req].to(torch.int64)
        n_tok, pages = counts[..., N_HIGH:N_LOW + 1], counts[..., P_HIGH:P_LOW + 1]
        want = (n_tok == pages * self._tokens_per_page) & want_tier.view(b, 1, 1, 2)
        want &= self._in_phase(req, Phase.DECODING).unsqueeze(-1)
        rows_ok = ((pages + want).sum(-1) <= self.row_len).all()
        if self.validate and not bool(rows_ok):
            raise PageTableRowFull(f"{op}: a page-table row would exceed row_len={self.row_len}")
        take = self.free_list.take(want.reshape(-1), extra_ok=rows_ok)  # flat (b, l, h, tier)

        got = take.count.view(*self._heads(b), 2)
        ids = self.free_list.ids_at(take.start).view(*self._heads(b), 2)
        r, l, h = req.view(-1, 1, 1), self._layer, self._head
        # Clamped so a full row (which takes nothing) still indexes in range; lanes that take
        # nothing write back what they read. High is written before low is read, so the two
        # never race even when they address the same position.
        where_high = pages[..., 0].clamp(max=self.row_len - 1)
        where_low = (self.row_len - 1 - pages[..., 1]).clamp(min=0)
        for t, where in ((0, where_high), (1, where_low)):
            idx = (r, l, h, where)
            self.table[idx] = torch.where(got[..., t] > 0, ids[..., t], self.table[idx])
        counts[..., P_HIGH:P_LOW + 1] += got
        self.counts[req] = counts.to(torch.int32)
        return AllocResult(op, take.ok, take.needed, take.free, rows_ok)

    def free_requests(self, req_idx: IndexLike) -> None:
        """Return every private page of these requests (high walked from the left, then low
        from the right), drop their rows' references to shared pages (a page whose count
        reaches zero goes back too, after the private ones, in page-id order) and reset their
        rows to -1, counts and shared regions to 0, phase to FREE."""
        op = "free_requests"
        req = self._req(req_idx, op, (Phase.PREFILLED, Phase.DECODING))
        b = req.shape[0]
        counts = self.counts[req].to(torch.int64)
        shared = self.shared[req].to(torch.int64)
        private = counts[..., P_HIGH:P_LOW + 1] - shared
        hp, lp = counts[..., P_HIGH].unsqueeze(-1), counts[..., P_LOW].unsqueeze(-1)
        sh, sl = shared[..., 0:1], shared[..., 1:2]
        start = self.free_list.give(private.reshape(-1))
        start = start.view(*self._heads(b), 2)
        pos = self._pos
        rows = self.table[req]
        is_high = (pos >= sh) & (pos < hp)
        is_low = (pos >= self.row_len - lp) & (pos < self.row_len - sl)
        slot = torch.where(is_high, start[..., 0:1] + pos - sh,
                           start[..., 1:2] + self.row_len - 1 - pos - sl)
        self.free_list.write(slot, rows, is_high | is_low)
        if self._sharing:
            self._drop_refs(rows, (pos < sh) | (pos >= self.row_len - sl))
        # index_fill_, not ``x[req] = scalar``: on CUDA the latter copies the scalar from the
        # host and synchronises.
        self.table.index_fill_(0, req, -1)
        self.counts.index_fill_(0, req, 0)
        self.shared.index_fill_(0, req, 0)
        self.phase.index_fill_(0, req, int(Phase.FREE))
        decode_hint.invalidate(self.decode_hints, req)

    # -- shared prefixes (admission time) ------------------------------------------------
    #
    # The rule at the prefix boundary, per row and tier: a tier's tokens fill its pages in
    # slot order, so the row's first n_t // N_t pages of tier t are full and shared as they
    # are; the tokens of the partial last page (n_t % N_t of them) are copied into a fresh
    # page: at export into the handle's own page (the exporter keeps writing its own), at
    # attach into the attaching row's private page. Shared pages are therefore always full,
    # never written, and each row's shared region is a prefix of each tier: high pages
    # [0, shared[..., 0]) and low pages [0, shared[..., 1]).

    def _handle_width(self, num_tokens: int) -> int:
        """Pages per tier a handle of ``num_tokens`` positions needs at most."""
        return max(1, -(-num_tokens // self.spec.min_tokens_per_page))

    def _add_refs(self, pages: torch.Tensor, inc: torch.Tensor) -> None:
        """refs[pages[i]] += inc[i] (duplicates add up); lanes with inc 0 add to the sink."""
        target = torch.where(inc != 0, pages, self.spec.num_pages).reshape(-1)
        self._refs_buf.index_add_(0, target.to(torch.int64), inc.reshape(-1).to(torch.int32))

    def _drop_refs(self, pages: torch.Tensor, mask: torch.Tensor) -> None:
        """One reference fewer for every ``pages[i]`` where ``mask[i]`` (a page may appear
        several times); the pages whose count reaches zero go back to the free list, each
        once, in page-id order: a pass over all pages instead of a sort or a host sync."""
        P = self.spec.num_pages
        target = torch.where(mask, pages, P).reshape(-1).to(torch.int64)
        self._refs_buf.index_add_(0, target, -mask.reshape(-1).to(torch.int32))
        touched = torch.zeros(P + 1, dtype=torch.bool, device=self.device)
        touched.index_fill_(0, target, True)
        back = touched[:P] & (self.refs == 0)
        start = self.free_list.give(back.sum().view(1))
        ids = torch.arange(P, dtype=torch.int32, device=self.device)
        self.free_list.write(start + exclusive_cumsum(back.to(torch.int64)), ids, back)

    def _copy_plan(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor
                   ) -> PageCopies:
        return PageCopies(src.reshape(-1).to(torch.int64).clamp(min=0),
                          dst.reshape(-1).to(torch.int64), mask.reshape(-1))

    def _registered(self, handles: Sequence[SharedPrefix], op: str) -> list[SharedPrefix]:
        """The registry's entries for ``handles`` (host dict lookups, no sync)."""
        out = []
        for h in handles:
            live = self.handles.get(getattr(h, "key", None))
            if live is None or live.num_tokens != h.num_tokens:
                raise ValueError(f"{op}: handle {getattr(h, 'key', h)!r} is not a live shared "
                                 "prefix of this manager (released already?)")
            out.append(live)
        return out

    def export_prefix(
        self, req_idx: IndexLike, num_tokens: Sequence[int], *, copy: bool = False,
        keep_free: int | torch.Tensor = 0, cuts: torch.Tensor | None = None,
        cut_len: int = 0,
    ) -> tuple[list[SharedPrefix], AllocResult, PageCopies]:
        """Freeze the current rows of DECODING requests as shared prefixes, one handle per
        request covering ``num_tokens[b]`` sequence positions (every row of request b holds
        at most that many tokens). Per row and tier the full pages become shared (the
        exporting row's shared region grows to them: its policy may no longer demote or
        prune those tokens) and the partial last page is copied into a fresh page the handle
        owns. All or nothing: when the copies' pages do not fit, nothing changes and every
        handle is empty. The caller performs ``PageCopies`` on the page storage before the
        exporting request writes again.

        ``copy=True`` leaves the exporting rows as they are: every private page holding
        tokens is copied into a page the handle owns (the rows' own shared regions, pages
        they attached, are shared with the handle as they are), so the exporter keeps
        decoding exactly as if nothing was exported. ``keep_free``: the export also fails
        unless that many pages stay free after it (a decode reserve). ``cuts`` int [B,
        layers, heads, C, 2] with ``cut_len``: the tokens of each tier before positions
        ``cut_len, 2 * cut_len, ...``, kept in the handles (``SharedPrefix.cuts``) for
        ``attach_prefix`` at a cut."""
        op = "export_prefix"
        req = self._req(req_idx, op, (Phase.DECODING,))
        b = req.shape[0]
        lens = [int(n) for n in num_tokens]
        if len(lens) != b or any(not 0 <= n <= self.spec.max_context for n in lens):
            raise ValueError(f"{op}: num_tokens {lens} must give one length in "
                             f"[0, max_context={self.spec.max_context}] per request ({b})")
        width = max((self._handle_width(n) for n in lens), default=1)
        L, H, R = self.spec.num_layers, self.spec.num_kv_heads, self.row_len
        counts = self.counts[req].to(torch.int64)
        live = self._in_phase(req, Phase.DECODING).unsqueeze(-1)
        n_tok = counts[..., N_HIGH:N_LOW + 1] * live
        if self.validate:
            over = n_tok.sum(-1) > torch.tensor(lens, device=self.device).view(b, 1, 1)
            hit = first_violation(over)
            if hit is not None:
                raise ValueError(f"{op}: request slot {int(req[hit[0]])}, layer {hit[1]}, "
                                 f"head {hit[2]} holds {n_tok[hit].tolist()} tokens, more "
                                 f"than num_tokens={lens[hit[0]]}")
        full = torch.div(n_tok, self._tokens_per_page, rounding_mode="floor")
        k = _ceil_div(n_tok, self._tokens_per_page)  # pages holding tokens, per tier
        shared = self.shared[req].to(torch.int64)
        # the handle's pages [0, fresh_from) are the row's own; [fresh_from, k) are copies
        fresh_from = shared if copy else full
        free = self.free_list.num_free()
        need = (k - fresh_from).sum()
        take = self.free_list.take((k - fresh_from).reshape(-1),
                                   extra_ok=free - need >= keep_free)
        start = take.start.view(b, L, H, 2, 1)

        rows = self.table[req].to(torch.int64)
        cols = tier_columns(width, R, self.device)
        tier_pages = rows.unsqueeze(-2).expand(b, L, H, 2, R).gather(
            -1, cols.expand(b, L, H, 2, width))
        j = torch.arange(width, device=self.device)
        from_, k_ = fresh_from.unsqueeze(-1), k.unsqueeze(-1)
        is_copy = (j >= from_) & (j < k_) & take.ok
        fresh = self.free_list.ids_at(start + (j - from_).clamp(min=0)).to(torch.int64)
        pages = torch.where(j < from_, tier_pages, -1)
        pages = torch.where(is_copy, fresh, pages)
        pages = torch.where(take.ok, pages, -1)
        # +1 for the handle on each of its pages, +1 for the exporting row on each page it
        # now shares for the first time ([shared, full): private until now, refs 0)
        newly = (j >= shared.unsqueeze(-1)) & (j < from_) & take.ok
        self._add_refs(pages, (pages >= 0).to(torch.int32) + newly.to(torch.int32))
        if not copy:
            self.shared[req] = torch.where(take.ok, torch.maximum(shared, full),
                                           shared).to(torch.int32)
        n_out = torch.where(take.ok, n_tok, 0).to(torch.int32)
        copies = self._copy_plan(tier_pages, fresh, is_copy)

        handles = []
        for i, n in enumerate(lens):
            w = self._handle_width(n)
            c = None
            if cuts is not None and cut_len > 0:
                c = (cuts[i, :, :, :n // cut_len].to(self.device, torch.int32)
                     * take.ok).contiguous()
            h = SharedPrefix(pages[i, ..., :w].to(torch.int32).contiguous(), n_out[i], n,
                             self._next_handle, c, cut_len if c is not None else 0)
            self.handles[h.key] = h
            self._next_handle += 1
            handles.append(h)
        self._sharing = True
        return handles, AllocResult(op, take.ok, take.needed, take.free,
                                    torch.ones_like(take.ok)), copies

    def attach_prefix(
        self, req_idx: IndexLike, handles: Sequence[SharedPrefix],
        n_tokens: torch.Tensor | None = None, *, copy: bool = False,
    ) -> tuple[AllocResult, PageCopies]:
        """Start FREE request slots from shared prefixes (``handles[b]`` for slot b, the same
        handle any number of times): each row takes the handle's full pages of each tier as
        its shared region and a fresh private page for the partial last page (the caller
        performs ``PageCopies``), its counters the handle's tokens; the slot is DECODING.
        All or nothing: when the fresh pages do not fit, nothing changes.

        ``n_tokens`` int [B, layers, heads, 2]: attach only each tier's first tokens, at most
        the handle's (a cut of it: ``SharedPrefix.cut_counts``); the boundary rule is the
        same. ``copy=True``: nothing is shared, every page is copied into the row's private
        pages (a row the kernels' decode may change freely)."""
        op = "attach_prefix"
        req = self._req(req_idx, op, (Phase.FREE,))
        b = req.shape[0]
        if len(handles) != b:
            raise ValueError(f"{op}: {len(handles)} handles for {b} request slots")
        if b == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            true = torch.ones((), dtype=torch.bool, device=self.device)
            zero = torch.zeros((), dtype=torch.int64, device=self.device)
            return (AllocResult(op, true, zero, self.num_free_pages(), true),
                    PageCopies(empty, empty, empty.bool()))
        pages, n_tok = stack_handles(self._registered(handles, op), self.device)
        if n_tokens is not None:
            cut = torch.as_tensor(n_tokens, device=self.device).to(torch.int64)
            if self.validate:
                check_shape("n_tokens", cut, tuple(n_tok.shape))
                hit = first_violation((cut < 0) | (cut > n_tok))
                if hit is not None:
                    raise ValueError(f"{op}: n_tokens {int(cut[hit])} at request {hit[0]}, "
                                     f"layer {hit[1]}, head {hit[2]}, tier {hit[3]} is not "
                                     f"within the handle's {int(n_tok[hit])} tokens")
            n_tok = cut
        L, H, R = self.spec.num_layers, self.spec.num_kv_heads, self.row_len
        width = pages.shape[-1]
        free_slot = self._in_phase(req, Phase.FREE)
        n_tok = n_tok * free_slot.unsqueeze(-1)
        full = torch.div(n_tok, self._tokens_per_page, rounding_mode="floor")
        k = _ceil_div(n_tok, self._tokens_per_page)
        fresh_from = torch.zeros_like(full) if copy else full
        take = self.free_list.take((k - fresh_from).reshape(-1))
        start = take.start.view(b, L, H, 2, 1)

        j = torch.arange(width, device=self.device)
        from_, k_ = fresh_from.unsqueeze(-1), k.unsqueeze(-1)
        done = take.ok & free_slot  # [B, 1, 1]
        is_copy = (j >= from_) & (j < k_) & done.view(b, 1, 1, 1, 1)
        is_shared = (j < from_) & done.view(b, 1, 1, 1, 1)
        fresh = self.free_list.ids_at(start + (j - from_).clamp(min=0)).to(torch.int64)
        new_pages = torch.where(j < from_, pages, -1)
        new_pages = torch.where(is_copy, fresh, new_pages)
        col = torch.stack((j, R - 1 - j)).expand(b, L, H, 2, width)
        col = torch.where(new_pages >= 0, col, R)  # (column R: a sink past the row)
        new_rows = torch.full((b, L, H, R + 1), -1, dtype=torch.int64, device=self.device)
        new_rows.scatter_(-1, col.reshape(b, L, H, 2 * width),
                          new_pages.reshape(b, L, H, 2 * width))
        old_rows = self.table[req]
        self.table[req] = torch.where(done.unsqueeze(-1), new_rows[..., :R].to(torch.int32),
                                      old_rows)
        new_counts = torch.cat((n_tok, k), -1).to(torch.int32)
        self.counts[req] = torch.where(done.unsqueeze(-1), new_counts, self.counts[req])
        self.shared[req] = torch.where(done.unsqueeze(-1), fresh_from.to(torch.int32),
                                       self.shared[req])
        self._add_refs(pages, is_shared.to(torch.int32))
        self.phase[req] = torch.where(done.view(-1), int(Phase.DECODING), self.phase[req])
        decode_hint.invalidate(self.decode_hints, req)
        self._sharing = True
        return (AllocResult(op, take.ok, take.needed, take.free, torch.ones_like(take.ok)),
                self._copy_plan(pages, fresh, is_copy))

    # -- a prompt suffix over an attached prefix (radix hit) -------------------------------
    #
    # An attached row (DECODING) takes the rest of its prompt as a prefill: ``reserve_extend``
    # appends the suffix's all-high over-allocation after its high pages (the suffix's
    # chunks before the last are stored there at the high tier, in position order), and once
    # the suffix is classified ``reclaim_extend`` keeps the high pages its high tokens need,
    # turns the next ones into low pages (appended to the row's low tier: that is where the
    # store put its low tokens) and returns the rest.

    def reserve_extend(self, req_idx: IndexLike, lengths: IndexLike) -> AllocResult:
        """Every row of DECODING request b takes ``spec.prefill_pages(lengths[b])`` pages at
        high positions [high_pages, high_pages + K): enough for the suffix at the high tier
        and for any split of it into the two tiers. All or nothing (also when a row would
        pass ``row_len``)."""
        op = "reserve_extend"
        req = self._req(req_idx, op, (Phase.DECODING,))
        b = req.shape[0]
        # (host lengths, the radix path's, are staged without a synchronising copy)
        lens = as_int64(lengths, self.device)
        if self.validate:
            check_shape("lengths", lens, (b,))
            for n in lens.tolist():
                self.spec.check_prompt_len(n)
        pages = _ceil_div(lens, self.spec.min_tokens_per_page) + 1  # == spec.prefill_pages
        active = self._in_phase(req, Phase.DECODING)
        per_row = (pages.view(b, 1, 1) * active).expand(self._heads(b))
        counts = self.counts[req].to(torch.int64)
        hp, lp = counts[..., P_HIGH], counts[..., P_LOW]
        rows_ok = (hp + per_row + lp <= self.row_len).all()
        if self.validate and not bool(rows_ok):
            raise PageTableRowFull(f"{op}: a page-table row would exceed row_len={self.row_len}")
        take = self.free_list.take(per_row.reshape(-1), extra_ok=rows_ok)
        start = take.start.view(*self._heads(b), 1)
        got = take.count.view(*self._heads(b), 1)
        pos, hp_ = self._pos, hp.unsqueeze(-1)
        new = (pos >= hp_) & (pos < hp_ + got)
        rows = self.table[req]
        self.table[req] = torch.where(new, self.free_list.ids_at(start + pos - hp_), rows)
        counts[..., P_HIGH] = hp + got.squeeze(-1)
        self.counts[req] = counts.to(torch.int32)
        return AllocResult(op, take.ok, take.needed, take.free, rows_ok)

    def reclaim_extend(self, req_idx: IndexLike, n_high: torch.Tensor,
                       n_low: torch.Tensor) -> None:
        """A DECODING row whose suffix was stored (``reserve_extend``) gets its final counts
        (n_high, n_low): it keeps hp = ceil(n_high / N_high) high pages, the next
        lp - low_pages of its high run become its new low pages (low page low_pages + i is
        high position hp + i, where the store wrote it), the rest of the run goes back."""
        op = "reclaim_extend"
        req, nh, nl, counts = self._final_counts(op, req_idx, Phase.DECODING, n_high, n_low)
        b = req.shape[0]
        hp_run, lp_old = counts[..., P_HIGH], counts[..., P_LOW]
        hp = _ceil_div(nh, self.spec.high_tokens_per_page)
        lp = _ceil_div(nl, self.spec.low_tokens_per_page)
        grow = lp - lp_old
        if self.validate:
            shared = self.shared[req].to(torch.int64) * self._tokens_per_page
            self._refuse_counts(op, req, nh, nl, (
                ("fewer tokens than its shared pages hold",
                 (nh < shared[..., 0]) | (nl < shared[..., 1])),
                ("fewer low pages than it holds", grow < 0),
                ("more pages than its run holds", hp + grow > hp_run),
                (f"more than max_context={self.spec.max_context} tokens",
                 nh + nl > self.spec.max_context),
            ), lambda hit: f"counts={counts[hit].tolist()}")
        active = self._in_phase(req, Phase.DECODING)
        grow = grow.clamp(min=0)
        back = (hp_run - hp - grow).clamp(min=0) * active
        start = self.free_list.give(back.reshape(-1)).view(*self._heads(b), 1)
        pos, R = self._pos, self.row_len
        rows = self.table[req]
        hp_, grow_, back_ = hp.unsqueeze(-1), grow.unsqueeze(-1), back.unsqueeze(-1)
        returned = (pos >= hp_ + grow_) & (pos < hp_ + grow_ + back_)
        self.free_list.write(start + (pos - hp_ - grow_), rows, returned)
        # one gather: high positions below hp stay, new low page m (m >= lp_old) at row_len
        # - 1 - m reads high position hp + m - lp_old, old low pages stay, the rest is -1
        lo_old = lp_old.unsqueeze(-1)
        m = R - 1 - pos
        src = torch.where(pos < hp_, pos, R)
        src = torch.where((m >= lo_old) & (m < lo_old + grow_), hp_ + m - lo_old, src)
        src = torch.where(m < lo_old, pos, src)
        padded = torch.cat((rows, torch.full_like(rows[..., :1], -1)), -1)
        new_rows = padded.gather(-1, src)
        self.table[req] = torch.where(active.unsqueeze(-1), new_rows, rows)
        new_counts = torch.stack((nh, nl, hp, lp), -1)
        self.counts[req] = torch.where(active.unsqueeze(-1), new_counts, counts).to(torch.int32)

    def release_prefix(self, handles: Sequence[SharedPrefix]) -> None:
        """Drop these handles (tree eviction): one reference fewer on each of their pages;
        pages whose count reaches zero go back to the free list."""
        op = "release_prefix"
        live = self._registered(handles, op)
        keys = [h.key for h in live]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{op}: a handle appears more than once in {keys}")
        if not live:
            return
        pages, _ = stack_handles(live, self.device)
        for key in keys:
            del self.handles[key]
        self._drop_refs(pages, pages >= 0)

    def truncate_prefix(self, handle: SharedPrefix, num_tokens: int) -> SharedPrefix:
        """Shorten a live handle with cut counts to its first ``num_tokens`` positions (a
        multiple of its ``cut_len``): per row and tier it keeps the pages that hold the tier's
        tokens before that cut and lets go of the rest (pages nobody else holds go back).
        Returns the shortened handle, which replaces ``handle`` in the registry under the same
        key (attach it from now on); when a tree evicts the deeper part of a prompt, the part
        it keeps stops pinning the rest."""
        op = "truncate_prefix"
        (live,) = self._registered([handle], op)
        n_tok = live.cut_counts(num_tokens).to(self.device, torch.int64)
        k = _ceil_div(n_tok, self._tokens_per_page)  # [layers, heads, 2]
        width = max(1, self._handle_width(num_tokens))
        j = torch.arange(live.width, device=self.device)
        pages = live.pages.to(torch.int64)
        drop = (j >= k.unsqueeze(-1)) & (pages >= 0)
        self._drop_refs(pages, drop)
        kept = torch.where(drop, -1, pages)[..., :width]
        if kept.shape[-1] < width:
            kept = torch.nn.functional.pad(kept, (0, width - kept.shape[-1]), value=-1)
        short = SharedPrefix(kept.to(torch.int32).contiguous(), n_tok.to(torch.int32),
                             num_tokens, live.key,
                             live.cuts[:, :, :num_tokens // live.cut_len].contiguous(),
                             live.cut_len)
        self.handles[live.key] = short
        return short

    # -- token counters (advanced by the policy / store) ----------------------------------

    def add_tokens(self, req_idx: IndexLike, tier_deltas: torch.Tensor) -> None:
        """n_high += deltas[..., 0], n_low += deltas[..., 1]; deltas are [B, 2] (same for every
        head) or [B, layers, heads, 2]. Negative deltas model eviction and demotion."""
        req = self._req(req_idx, "add_tokens", (Phase.DECODING,))
        deltas = self._per_head_pair("tier_deltas", tier_deltas, req.shape[0])
        counts = self.counts[req].to(torch.int64)
        self._store_tokens(req, counts, counts[..., N_HIGH:N_LOW + 1] + deltas, "add_tokens")

    def set_counts(self, req_idx: IndexLike, n_tokens: torch.Tensor) -> None:
        """(n_high, n_low) = n_tokens[..., 0], n_tokens[..., 1], shaped like add_tokens'."""
        req = self._req(req_idx, "set_counts", (Phase.DECODING,))
        new = self._per_head_pair("n_tokens", n_tokens, req.shape[0])
        self._store_tokens(req, self.counts[req].to(torch.int64), new, "set_counts")

    def _per_head_pair(self, name: str, x: torch.Tensor, b: int) -> torch.Tensor:
        x = torch.as_tensor(x, device=self.device).to(torch.int64)
        if x.dim() == 2:
            if self.validate:
                check_shape(name, x, (b, 2))
            x = x.view(b, 1, 1, 2)
        elif self.validate:
            check_shape(name, x, (*self._heads(b), 2))
        return x.expand(*self._heads(b), 2)

    def _final_counts(self, op: str, req_idx: IndexLike, phase: Phase, n_high: torch.Tensor,
                      n_low: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A reclaim's inputs: the slots (in ``phase``), each row's final token counts
        int64 [B, layers, heads] (shapes checked when validating) and the slots' counters."""
        req = self._req(req_idx, op, (phase,))
        nh = torch.as_tensor(n_high, device=self.device).to(torch.int64)
        nl = torch.as_tensor(n_low, device=self.device).to(torch.int64)
        if self.validate:
            check_shape("n_high", nh, self._heads(req.shape[0]))
            check_shape("n_low", nl, self._heads(req.shape[0]))
        return req, nh, nl, self.counts[req].to(torch.int64)

    @staticmethod
    def _refuse_counts(op: str, req: torch.Tensor, nh: torch.Tensor, nl: torch.Tensor,
                       checks: Sequence[tuple[str, torch.Tensor]],
                       detail: Callable[[tuple[int, ...]], str]) -> None:
        """The first row that breaks a check, in one line naming the check, the row and its
        final counts (then ``detail(hit)``)."""
        for name, bad in checks:
            hit = first_violation(bad)
            if hit is not None:
                i, l, h = hit
                raise ValueError(
                    f"{op}: {name} at request slot {int(req[i])}, layer {l}, head {h}: "
                    f"n_high={int(nh[hit])}, n_low={int(nl[hit])}, {detail(hit)}")

    def _store_tokens(
        self, req: torch.Tensor, counts: torch.Tensor, n_tok: torch.Tensor, op: str
    ) -> None:
        if self.validate:
            capacity = counts[..., P_HIGH:P_LOW + 1] * self._tokens_per_page
            total = n_tok.sum(-1, keepdim=True).expand_as(n_tok)
            shared = self.shared[req].to(torch.int64) * self._tokens_per_page
            for what, bad in (
                ("negative token count", n_tok < 0),
                ("fewer tokens than its shared pages hold", n_tok < shared),
                ("more tokens than its pages hold", n_tok > capacity),
                (f"more than max_context={self.spec.max_context} tokens",
                 total > self.spec.max_context),
            ):
                hit = first_violation(bad)
                if hit is not None:
                    i, l, h, t = hit
                    pages = int(counts[i, l, h, P_HIGH + t])
                    raise ValueError(
                        f"{op}: {what} at request slot {int(req[i])}, layer {l}, head {h}, "
                        f"{TIER_NAMES[t]} tier: n={int(n_tok[hit])}, pages={pages}, "
                        f"capacity={int(capacity[hit])}"
                    )
        counts = counts.clone()
        active = self._in_phase(req, Phase.DECODING).unsqueeze(-1)
        counts[..., N_HIGH:N_LOW + 1] = torch.where(active, n_tok, counts[..., N_HIGH:N_LOW + 1])
        self.counts[req] = counts.to(torch.int32)

    # -- debugging -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Host-side (syncs): raise AssertionError naming the first broken invariant."""
        from sglang_diffkv.memory.invariants import check_invariants

        check_invariants(self)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of every state tensor (tests compare them around a failing op)."""
        return {
            "free_pages": self.free_pages.clone(),
            "head": self.head.clone(),
            "tail": self.tail.clone(),
            "table": self.table.clone(),
            "counts": self.counts.clone(),
            "phase": self.phase.clone(),
            "shared": self.shared.clone(),
            "refs": self.refs.clone(),
        }
