"""PageManager: page ids for every (request, layer, KV head, tier), entirely on the device.

State (device tensors; the contract kernels and the SGLang pool read):
- ``free_list.free_pages`` int32 [num_pages] ring, ``free_list.head`` / ``free_list.tail``
  int64 0-dim monotone counters (see ``free_list``).
- ``table`` int32 [max_reqs, layers, kv_heads, row_len], -1 where empty. High page j sits at
  ``table[..., j]``, low page j at ``table[..., row_len - 1 - j]``.
- ``counts`` int32 [max_reqs, layers, kv_heads, 4] = (n_high, n_low, high_pages, low_pages).
  Token s of tier t is in that tier's page s // N_t at slot s % N_t.
- ``phase`` int8 [max_reqs] (``inputs.Phase``).

Invariants: every page id is owned exactly once (free ring or one table entry); table
entries outside [0, high_pages) and [row_len - low_pages, row_len) are -1;
0 <= n_t <= pages_t * N_t. ``check_invariants`` verifies all of them.

Every op is plan -> one flat exclusive prefix sum -> disjoint runs of the free list ->
counter update, vectorised over the batch with gathers/scatters only. Allocating ops are
all-or-nothing without a host sync: they compute ``ok`` on the device, scale every take by
it and return it in an ``AllocResult``. With ``validate=True`` (the default) arguments are
checked on the host first (a sync); serving code builds the manager with ``validate=False``,
where slots in the wrong phase are skipped on the device instead, and duplicates in a batch
and out-of-range values are the caller's responsibility.

Cost: prefill, reclaim and free touch whole rows (B * layers * heads * row_len elements);
a decode step touches two entries per row. Only the decode step is per-token hot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_diffkv.memory.free_list import CircularFreeList
from sglang_diffkv.memory.inputs import (
    Phase,
    as_index,
    check_phase,
    check_req_idx,
    check_shape,
    first_violation,
)
from sglang_diffkv.memory.result import AllocResult, PageTableRowFull
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

    def allocate_prefill(self, req_idx: IndexLike, prompt_lens: IndexLike) -> AllocResult:
        """All-high over-allocation: every (layer, head) row of request b takes
        ``spec.prefill_pages(L_b)`` pages into row positions [0, n); counts = (L, 0, n, 0)."""
        op = "allocate_prefill"
        req = self._req(req_idx, op, (Phase.FREE,))
        lens = torch.as_tensor(prompt_lens, device=self.device).to(torch.int64)
        b = req.shape[0]
        if self.validate:
            check_shape("prompt_lens", lens, (b,))
            for n in lens.tolist():
                self.spec.check_prompt_len(n)
        pages = _ceil_div(lens, self.spec.min_tokens_per_page) + 1  # == spec.prefill_pages
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
        return AllocResult(op, take.ok, take.needed, take.free, torch.ones_like(take.ok))

    def reclaim_prefill(
        self, req_idx: IndexLike, n_high: torch.Tensor, n_low: torch.Tensor
    ) -> None:
        """Keep hp = ceil(n_high/N_high) high pages and then lp = ceil(n_low/N_low) low pages
        (as the compressor wrote them, left to right), return row positions [hp+lp, allocated)
        to the free list, and reverse row segment [hp, row_len) so low page j lands at
        row_len - 1 - j. Counts become (n_high, n_low, hp, lp)."""
        op = "reclaim_prefill"
        req = self._req(req_idx, op, (Phase.PREFILLED,))
        b = req.shape[0]
        nh = torch.as_tensor(n_high, device=self.device).to(torch.int64)
        nl = torch.as_tensor(n_low, device=self.device).to(torch.int64)
        counts = self.counts[req].to(torch.int64)
        if self.validate:
            check_shape("n_high", nh, self._heads(b))
            check_shape("n_low", nl, self._heads(b))
            prompt = counts[..., N_HIGH]
            for name, bad in (
                ("n_high < 0", nh < 0),
                ("n_low < 0", nl < 0),
                ("n_high + n_low > prompt length", nh + nl > prompt),
            ):
                hit = first_violation(bad)
                if hit is not None:
                    i, l, h = hit
                    raise ValueError(
                        f"{op}: {name} at request slot {int(req[i])}, layer {l}, head {h}: "
                        f"n_high={int(nh[hit])}, n_low={int(nl[hit])}, "
                        f"prompt length={int(prompt[hit])}"
                    )
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
        """Return every page of these requests (high walked from the left, then low from the
        right) and reset their rows to -1, counts to 0, phase to FREE."""
        op = "free_requests"
        req = self._req(req_idx, op, (Phase.PREFILLED, Phase.DECODING))
        b = req.shape[0]
        counts = self.counts[req].to(torch.int64)
        hp = counts[..., P_HIGH].unsqueeze(-1)
        lp = counts[..., P_LOW].unsqueeze(-1)
        start = self.free_list.give(counts[..., P_HIGH:P_LOW + 1].reshape(-1))
        start = start.view(*self._heads(b), 2)
        pos = self._pos
        is_high = pos < hp
        is_low = pos >= self.row_len - lp
        slot = torch.where(is_high, start[..., 0:1] + pos, start[..., 1:2] + self.row_len - 1 - pos)
        self.free_list.write(slot, self.table[req], is_high | is_low)
        # index_fill_, not ``x[req] = scalar``: on CUDA the latter copies the scalar from the
        # host and synchronises.
        self.table.index_fill_(0, req, -1)
        self.counts.index_fill_(0, req, 0)
        self.phase.index_fill_(0, req, int(Phase.FREE))

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

    def _store_tokens(
        self, req: torch.Tensor, counts: torch.Tensor, n_tok: torch.Tensor, op: str
    ) -> None:
        if self.validate:
            capacity = counts[..., P_HIGH:P_LOW + 1] * self._tokens_per_page
            total = n_tok.sum(-1, keepdim=True).expand_as(n_tok)
            for what, bad in (
                ("negative token count", n_tok < 0),
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
        }
