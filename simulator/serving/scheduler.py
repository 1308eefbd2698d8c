"""A model of SGLang 0.5.10's scheduler (managers/scheduler.py, schedule_policy.py,
schedule_batch.py) for one server:

  * FCFS waiting queue; a prefill batch, when one can be formed, runs before decoding
    (``get_next_batch_to_run``), and with ``enable_mixed_chunk`` the running requests decode
    in the same forward;
  * PrefillAdder: ``rem_total_tokens = available - sum_running(min(max_new - gen, 4096) *
    new_token_ratio) - admitted(extend + min(max_new, 4096))``, ``cur_rem_tokens``,
    ``max_prefill_tokens`` (rem_input) and ``chunked_prefill_size`` (rem_chunk); a request is
    refused (NO_TOKEN, which also marks the batch full) when extend + min(max_new - gen, 4096)
    >= rem_total_tokens; one chunked request continues first in the next prefill batch;
  * ``new_token_ratio`` starts at 0.7 * conservativeness, decays linearly to 0.14 of that
    over 600 decode steps, is reset on idle and re-estimated after a retraction as
    min(1, (sum gen + 20 * bs) / (sum max_new + 1)) over the requests kept;
  * ``check_decode_mem`` before each decode step; on failure ``retract_decode`` pops requests
    in order of fewest outputs then longest prompt (at least one) until the step fits and sends
    them to the back of the queue to be recomputed;
  * ``batch_is_full`` stops admission attempts until a running request finishes or leaves;
  * with the radix cache (``serving/prefix_cache.py``) a request reuses its longest cached
    prefix, locks it, and unlocked cached blocks count as available and are evicted LRU first;
  * with the radix cache disabled and ignore_eos clients, ``add_one_req_ignore_eos`` admits;
  * liveness: ``submit`` rejects what an empty server could not admit, and ``next_batch``
    returns None only when nothing can run until a new arrival;
  * the overlap scheduler's lag is the engine's to model: ``next_batch(visible_until)`` admits
    only requests that arrived by then (a retracted request is always visible).

Memory is counted in the pool's units (tokens or DiffKV pages) via ``simulator.kv.pool``; the
scheduler never looks at bytes. Time is not known here: the engine passes ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress

import numpy as np

from simulator.kv.pool import KVPool
from simulator.serving.cost import StepShape
from simulator.serving.prefix_cache import PrefixCache
from simulator.serving.request import SimRequest
from simulator.serving.settings import (
    CLIP_MAX_NEW_TOKENS,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    RETRACT_DECODE_STEPS,
)

CONTINUE, NO_TOKEN, OTHER = 0, 1, 2


@dataclass(frozen=True)
class SchedulerLimits:
    chunked_prefill_size: int | None   # None: chunking off
    max_prefill_tokens: int
    max_running_requests: int
    context_len: int
    max_req_len: int                   # min(context_len, pool tokens) - 1
    conservativeness: float = 1.0
    enable_mixed_chunk: bool = False
    # SGLang admits with add_one_req_ignore_eos when the radix cache is disabled and the
    # request carries ignore_eos (bench_serving's default)
    ignore_eos_admission: bool = False


# a Batch's shape until its builder sets it: one shared instance (StepShape is frozen), not
# a new one per batch
EMPTY_SHAPE = StepShape()


@dataclass
class Batch:
    """One forward pass: prefill chunks (request, tokens) and/or the decoding running batch."""

    chunks: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: bool = False
    shape: StepShape = EMPTY_SHAPE
    retracted: int = 0

    @property
    def kind(self) -> str:
        if self.chunks and self.decode:
            return "mixed"
        return "prefill" if self.chunks else "decode"


@dataclass
class DecodePlan:
    """The formations that follow a decode step just formed, as ``next_batch`` would make
    them if no request arrived, left or was released meanwhile (``Scheduler.plan_decode``):
    each a decode step of the same requests, one token longer. ``Scheduler.next_decode``
    plans one more; ``used[i]`` is the pool units in use once the i-th is formed (0: the
    step already formed), counting the steps' own allocations only (``shift`` counts what
    else was allocated meanwhile)."""

    limit: int                    # the most formations it may plan
    n: int                        # requests in the batch
    kv_total: int                 # KV tokens of the last step planned
    free: int                     # units the next formation may allocate (evictable ones too)
    room: int                     # of which free outright (allocating more would evict)
    held: int                     # units the requests hold after the last step planned
    used: list[int] = field(default_factory=list)
    fixed_need: int | None = None  # the decode reserve when it depends on the batch size alone
    # DiffKV: (units held, attention bytes per layer) of the next formations, worked out a
    # few at a time (KVPool.decode_sums)
    ahead: list[tuple[int, float]] = field(default_factory=list)

    def shift(self, units: int) -> None:
        """``units`` more were allocated (fewer, if negative) beside the steps, before the
        next formation (a disaggregated decode server's reservations)."""
        self.free -= units
        self.room -= units


class Scheduler:
    def __init__(self, pool: KVPool, limits: SchedulerLimits, rng: np.random.Generator,
                 cache: PrefixCache | None = None):
        self.pool = pool
        self.cache = cache        # radix-cache model; None with --disable-radix-cache
        self.lim = limits
        self.rng = rng
        self.page = getattr(pool, "page_size", 1)
        self.waiting: deque[SimRequest] = deque()
        self.chunked: SimRequest | None = None
        self.used = 0              # pool units allocated, cached prefix blocks included
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * limits.conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        self.batch_is_full = False
        self._visible_until = math.inf
        self.retractions = 0
        # requests released (finished, aborted, retracted) since the last batch was built:
        # the next step pays the backend's per-release cost (calibration release_overhead_s)
        self.released = 0
        self.aborted: list[SimRequest] = []
        # a disaggregated prefill server keeps a finished prompt's KV until its transfer to
        # the decode server ends (``release``); ``holding`` counts such requests
        self.hold_finished = False
        self.holding = 0
        # the running (decoding) batch, structure of arrays aligned with run_reqs
        self.run_reqs: list[SimRequest] = []
        self.kv = np.zeros(0, dtype=np.int64)      # tokens in the KV cache
        # kept as the arrays change, since every step reads them: kv.sum(), held.sum(), and
        # min(out - gen), the decode steps until the first running request finishes
        self._kv_total = 0
        self._held_total = 0
        self._left = 0
        # counts the running batch's changes of membership (joins, filters): what is worked
        # out from its members alone can be kept until it changes
        self.batch_version = 0
        self.gen = np.zeros(0, dtype=np.int64)
        self.out = np.zeros(0, dtype=np.int64)
        self.maxnew = np.zeros(0, dtype=np.int64)
        self.held = np.zeros(0, dtype=np.int64)
        self.last = np.zeros(0, dtype=np.float64)
        self.prof: np.ndarray | None = None
        self._with_prof = pool.request_profile(np.random.default_rng(0)) is not None
        self._read_bytes = 0.0        # attention bytes per layer of the last decode allocation
        self._linear_read = hasattr(pool, "read_bytes_for_tokens")
        # page size 1: a decode step adds exactly one unit per request (no array maths)
        self._unit_growth = pool.unit == "tokens" and self.page == 1

    # ---- arrivals ------------------------------------------------------------------------
    def submit(self, r: SimRequest) -> bool:
        """Validate as SGLang's tokenizer manager and scheduler do; queue or reject."""
        if not self.admissible(r):
            return False
        self.ensure_profile(r)
        self.waiting.append(r)
        return True

    def admissible(self, r: SimRequest, need: float | None = None) -> bool:
        """SGLang's length checks (clamping ``max_new`` to the room left) and liveness: the
        request must fit an empty pool, needing ``need`` units (default: its prompt as
        prefilled plus its reserve for future tokens). False: ``r.rejected`` says why."""
        lim = self.lim
        if r.input_len + r.max_new >= lim.context_len:
            r.rejected = (f"input {r.input_len} + max_new_tokens {r.max_new} >= context length "
                          f"{lim.context_len}")
            return False
        if r.input_len >= lim.max_req_len:
            r.rejected = f"input {r.input_len} >= max request length {lim.max_req_len}"
            return False
        # scheduler clamps max_new_tokens to the room left in a request
        room = lim.max_req_len - r.input_len - 1
        if r.max_new > room:
            r.max_new = room
            r.output_len = min(r.output_len, room)
        # liveness: a request must be admissible into an empty server, or it would wait forever
        if need is None and lim.ignore_eos_admission:
            need = (self.pool.prompt_units(0, r.input_len) + self.pool.future_units(r.max_new)
                    + self.pool.decode_step_need(np.zeros(1, dtype=np.int64)))
        elif need is None:
            need = self.pool.prompt_units(0, r.input_len) + self.pool.future_units(
                min(r.max_new, CLIP_MAX_NEW_TOKENS))
        if need >= self.pool.capacity:
            r.rejected = (f"prompt of {r.input_len} tokens needs {need:.0f} of "
                          f"{self.pool.capacity} {self.pool.unit} even in an empty pool")
            return False
        return True

    def ensure_profile(self, r: SimRequest) -> None:
        """Draw the request's DiffKV tier fractions unless it has them (a disaggregated
        request draws them once, on its decode replica, and keeps them on its prefill one)."""
        if self._with_prof and r.prof is None:
            r.prof = self.pool.request_profile(self.rng)

    def warm_cache(self, served: Iterable[Sequence[int]]) -> int:
        """Start as a server that has served requests before: each entry names the blocks
        one earlier request left in the radix cache (its prompt's, then its outputs'), oldest
        first. SGLang keeps a finished request's KV as evictable cache, so they are cached
        unlocked and the least recently used are evicted to fit the pool. No-op without a
        radix cache; returns the units cached."""
        if self.cache is None:
            return 0
        if self.used or not self.idle:
            raise RuntimeError("warm_cache is for a fresh scheduler, before any request")
        for ids in served:
            self.used += self.cache.insert(ids, max_new=len(ids)) * self.cache.block
            over = self.used - self.pool.capacity
            if over > 0:
                self.used -= self.cache.evict(over)
        return self.used

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.run_reqs and self.chunked is None

    def on_idle(self) -> None:
        """SGLang's self_check_during_idle resets the ratio."""
        self.new_token_ratio = self.init_ratio

    # ---- memory --------------------------------------------------------------------------
    def _free(self) -> int:
        """Units that can be allocated now: free ones plus evictable cached blocks
        (SGLang's available_size + evictable_size)."""
        free = self.pool.capacity - self.used
        return free + self.cache.evictable_units if self.cache is not None else free

    def _make_room(self, units: int) -> None:
        """Evict unlocked cached blocks so ``units`` fit (SGLang evicts before allocating)."""
        short = units - (self.pool.capacity - self.used)
        if short > 0 and self.cache is not None:
            self.used -= self.cache.evict(short)

    def _cache_prompt(self, r: SimRequest) -> None:
        """Prefill done: the prompt's full blocks join the cache, still locked by ``r``; their
        units move from the request to the cache."""
        if self.cache is None or not r.hash_ids:
            return
        block = self.cache.block
        n = min(len(r.hash_ids), r.input_len // block)
        added = self.cache.insert_locked(r.hash_ids[:n], r.held // block)
        r.prefix_blocks = r.prefix_blocks + added
        r.held -= len(added) * block

    def _retire(self, r: SimRequest, held: int) -> None:
        """A finished request frees its own units and unlocks its cached prompt blocks."""
        self._drop_prefix(r)
        self.used -= held

    def _drop_prefix(self, r: SimRequest) -> None:
        if self.cache is not None and r.prefix_blocks:
            self.cache.unlock(r.prefix_blocks)
            r.prefix_blocks = []

    # ---- batch formation -----------------------------------------------------------------
    def next_batch(self, visible_until: float = math.inf) -> Batch | None:
        """The next forward pass; only requests that arrived by ``visible_until`` may join."""
        self._visible_until = visible_until
        if not (self.run_reqs and self.chunked is None
                and (self.batch_is_full or not self.waiting)):
            # a prefill may be formed (the test is _prefill_batch's own early exit, taken
            # here for the common decode step)
            batch = self._prefill_batch()
            if batch is not None:
                return batch
            if not self.run_reqs:
                return None
        retracted = self._update_running_batch()
        if not self.run_reqs:
            # every running request was retracted or aborted: the freed memory may admit
            # waiting ones now (returning None would idle the engine until the next arrival)
            return self._prefill_batch()
        kv_total = self._kv_total
        read = (self.pool.read_bytes_for_tokens(kv_total) if self._linear_read
                else self._read_bytes)
        return Batch(decode=True, retracted=retracted,
                     shape=StepShape(decode_reqs=len(self.run_reqs), decode_kv_tokens=kv_total,
                                     decode_read_bytes=read,
                                     released_reqs=self._take_released()))

    def _take_released(self) -> int:
        n, self.released = self.released, 0
        return n

    def _prefill_batch(self) -> Batch | None:
        lim = self.lim
        if not self.run_reqs and self.chunked is None:
            self.batch_is_full = False        # nothing left that could free memory
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(self.run_reqs)
        if running_bs >= lim.max_running_requests and self.chunked is None:
            self.batch_is_full = True        # a chunked request may always continue
            return None
        pool = self.pool
        mixed = lim.enable_mixed_chunk and running_bs > 0
        mixed_units = pool.decode_step_need(self.kv) if mixed else 0
        mixed_tokens = running_bs if mixed else 0
        reserve = 0.0
        if running_bs:
            left = np.minimum(self.maxnew - self.gen, CLIP_MAX_NEW_TOKENS)
            reserve = pool.future_units(float(left.sum()) * self.new_token_ratio)
        available = self._free()
        self._rem_total = available - (mixed_units + reserve)
        self._cur_rem = available - mixed_units
        self._rem_input = lim.max_prefill_tokens - mixed_tokens
        self._rem_chunk = (None if lim.chunked_prefill_size is None
                           else lim.chunked_prefill_size - mixed_tokens)
        chunks: list[tuple[SimRequest, int]] = []
        new_chunked: SimRequest | None = None
        cont = self.chunked
        if cont is not None:
            extend = self._add_chunked(cont)
            if extend > 0:
                chunks.append((cont, extend))
            if cont.prefilled + extend < cont.fill_len:
                new_chunked = cont          # still unfinished: no room for other requests
        if new_chunked is None:
            taken = 0
            for r in self.waiting:
                if r.queued_at > self._visible_until and not r.retractions:
                    break                   # reached the scheduler after this batch was formed
                if running_bs + len(chunks) >= lim.max_running_requests:
                    self.batch_is_full = True
                    break
                res, extend = (self._add_one_ignore_eos(r, chunks, running_bs)
                               if lim.ignore_eos_admission else self._add_one(r, bool(chunks)))
                if extend > 0:
                    chunks.append((r, extend))
                    taken += 1
                    if r.prefilled + extend < r.fill_len:
                        new_chunked = r
                if res != CONTINUE:
                    if res == NO_TOKEN:
                        self.batch_is_full = True
                    break
            for _ in range(taken):        # FCFS admits a prefix of the queue
                self.waiting.popleft()
        self.chunked = new_chunked
        if not chunks:
            return None
        return self._build_prefill(chunks, mixed)

    def _budget_state(self) -> int:
        if self._rem_total <= 0 or self._cur_rem <= 0:
            return NO_TOKEN
        if self._rem_input <= 0 or (self._rem_chunk is not None and self._rem_chunk <= 0):
            return OTHER
        return CONTINUE

    def _charge(self, units: int, extend: int, future_tokens: int) -> None:
        """PrefillAdder._update_prefill_budget (the input is charged page-aligned)."""
        paged = -(-extend // self.page) * self.page
        self._rem_total -= units + self.pool.future_units(future_tokens)
        self._cur_rem -= units
        self._rem_input -= paged
        if self._rem_chunk is not None:
            self._rem_chunk -= paged

    def _add_chunked(self, r: SimRequest) -> int:
        """PrefillAdder.add_chunked_req: continue the chunked request as far as budget allows."""
        remaining = r.fill_len - r.prefilled
        room = remaining if self._rem_chunk is None else self._rem_chunk
        room = min(room, self._tokens_for_units(r.prefilled, self._rem_total))
        extend = max(0, min(remaining, room))
        truncated = extend < remaining
        if extend > 0:
            units = self.pool.prompt_units(r.prefilled, extend)
            self._charge(units, extend,
                         0 if truncated else min(r.max_new, CLIP_MAX_NEW_TOKENS))
        return extend

    def _tokens_for_units(self, stored: int, units: float) -> int:
        """The most prompt tokens whose chunk fits in ``units`` (int(rem_total) for tokens)."""
        if units <= 0:
            return 0
        if self.pool.unit == "tokens":
            return int(units)
        lo, hi = 0, 1 << 24          # monotone in tokens: bisect (DiffKV all-high pages)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.pool.prompt_units(stored, mid) <= units:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _add_one(self, r: SimRequest, has_others: bool) -> tuple[int, int]:
        """PrefillAdder.add_one_req -> (result, tokens admitted now)."""
        pool = self.pool
        matched: list[int] = []
        if self.cache is not None and r.prefilled == 0 and r.hash_ids:
            matched = self.cache.match(r.hash_ids, r.fill_len - 1)
        start = len(matched) * self.cache.block if matched else r.prefilled
        extend = r.fill_len - start
        total = pool.prompt_units(start, extend) + pool.future_units(
            min(max(r.max_new - r.gen, 0), CLIP_MAX_NEW_TOKENS))
        if total >= self._rem_total:
            return NO_TOKEN, 0
        paged = -(-extend // self.page) * self.page
        if paged >= self._rem_input and has_others:
            return OTHER, 0
        whole = self._rem_chunk is None or paged <= self._rem_chunk
        trunc = 0 if whole else self._rem_chunk // self.page * self.page
        if not whole and trunc <= 0:
            return OTHER, 0                   # no room for even one page of this prompt
        if matched:
            # locking the matched prefix makes it unevictable: the budget shrinks (SGLang
            # re-checks after _lock_node)
            lost = self.cache.lock(matched)
            self._rem_total -= lost
            self._cur_rem -= lost
            if total >= self._rem_total:
                self.cache.unlock(matched)
                self._rem_total += lost
                self._cur_rem += lost
                return NO_TOKEN, 0
            r.prefix_blocks = matched
            r.prefilled = start
            r.cached += start
        if self.cache is not None:
            self.cache.lookups += r.fill_len
            self.cache.hits += start
        if whole:
            self._charge(pool.prompt_units(r.prefilled, extend), extend,
                         min(r.max_new, CLIP_MAX_NEW_TOKENS))
            return self._budget_state(), extend
        self._charge(pool.prompt_units(r.prefilled, trunc), trunc, 0)
        return self._budget_state(), trunc

    def _add_one_ignore_eos(self, r: SimRequest, admitted: list[tuple[SimRequest, int]],
                            running_bs: int) -> tuple[int, int]:
        """PrefillAdder.add_one_req_ignore_eos: admit only if, replaying every running and
        admitted request to its max_new_tokens (shortest first), free memory never drops to
        one step's reserve per request. No new_token_ratio: ignore_eos requests use 1.0."""
        pool = self.pool
        extend = r.fill_len - r.prefilled
        units = pool.prompt_units(r.prefilled, extend)
        if units > min(self._cur_rem, self._rem_total):
            return NO_TOKEN, 0
        states: list[tuple[float, float]] = []   # (units still to grow, units held)

        def add(left_tokens: float, held: float) -> None:
            if left_tokens > 0:
                states.append((pool.future_units(left_tokens), held))

        add(r.max_new - r.gen, pool.prompt_units(0, r.fill_len))
        if running_bs:
            for left, held in zip((self.maxnew - self.gen).tolist(), self.held.tolist(),
                                  strict=True):
                add(left, held)
        for q, _ in admitted:
            add(q.max_new - q.gen, pool.prompt_units(0, q.fill_len))
        states.sort(key=lambda x: x[0])
        per_req_reserve = pool.decode_step_need(np.zeros(1, dtype=np.int64))
        cur = self._cur_rem - units
        freed = 0.0
        for i, (left, held) in enumerate(states):
            bs = len(states) - i
            if cur + freed - left * bs <= per_req_reserve * bs:
                return NO_TOKEN, 0
            freed += held
        if self._rem_chunk is None or extend <= self._rem_chunk:
            self._charge(units, extend, min(r.max_new, CLIP_MAX_NEW_TOKENS))
            return self._budget_state(), extend
        if self._rem_chunk <= 0:
            return OTHER, 0
        trunc = self._rem_chunk
        self._charge(pool.prompt_units(r.prefilled, trunc), trunc, 0)
        return self._budget_state(), trunc

    def _build_prefill(self, chunks: list[tuple[SimRequest, int]], mixed: bool) -> Batch:
        pool = self.pool
        tokens = 0
        pairs = 0.0
        past = 0
        extends = tuple((n, r.prefilled) for r, n in chunks)
        self._make_room(sum(pool.prompt_units(r.prefilled, n) for r, n in chunks))
        for r, extend in chunks:
            units = pool.prompt_units(r.prefilled, extend)
            r.held += units
            self.used += units
            tokens += extend
            pairs += extend * r.prefilled + extend * extend / 2.0
            past += r.prefilled
            if r.prefilled + extend == r.fill_len:     # the prompt completes in this step
                pairs += pool.compression_pairs(r.fill_len)
        b = Batch(chunks=chunks, decode=mixed)
        dec_reqs = dec_kv = 0
        dec_bytes = 0.0
        if mixed:
            self._allocate_decode()
            dec_reqs, dec_kv = len(self.run_reqs), self._kv_total
            dec_bytes = (pool.read_bytes_for_tokens(dec_kv) if self._linear_read
                         else self._read_bytes)
        b.shape = StepShape(decode_reqs=dec_reqs, decode_kv_tokens=dec_kv,
                            decode_read_bytes=dec_bytes, prefill_tokens=tokens,
                            prefill_pairs=pairs, prefill_past_tokens=past,
                            prefill_seqs=len(chunks), released_reqs=self._take_released(),
                            prefill_chunks=extends)
        return b

    # ---- decode memory -------------------------------------------------------------------
    def _allocate_decode(self) -> None:
        """prepare_for_decode: one more KV token per running request."""
        self.kv = self.kv + 1
        self._kv_total += len(self.run_reqs)
        if self._unit_growth:
            self._make_room(len(self.run_reqs))
            self.held = self.held + 1
            self._held_total += len(self.run_reqs)
            self.used += len(self.run_reqs)
            return
        new_held, self._read_bytes = self.pool.decode_state(self.kv, self.prof)
        total = int(new_held.sum())
        delta = total - self._held_total
        self._make_room(delta)
        self.used += delta
        self.held = new_held
        self._held_total = total

    def _update_running_batch(self) -> int:
        """Scheduler.update_running_batch: check_decode_mem, retract or decay, allocate."""
        pool = self.pool
        retracted = 0
        if pool.decode_step_need(self.kv) > self._free():
            retracted = self._retract()
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if self.run_reqs:
            self._allocate_decode()
        return retracted

    def _retract(self) -> int:
        """ScheduleBatch.retract_decode."""
        order = sorted(range(len(self.run_reqs)),
                       key=lambda i: (self.gen[i], -self.run_reqs[i].input_len), reverse=True)
        keep = np.ones(len(self.run_reqs), dtype=bool)
        freed = 0
        popped: list[int] = []
        first = True
        while first or self.pool.decode_step_need(self.kv[keep]) > self._free() + freed:
            if len(order) == 1:
                break
            first = False
            i = order.pop()
            keep[i] = False
            freed += int(self.held[i])
            self._drop_prefix(self.run_reqs[i])      # release_req unlocks the prefix
            popped.append(i)
        for i in popped:
            r = self.run_reqs[i]
            r.gen = int(self.gen[i])
            r.held = 0
            r.prefilled = 0
            r.fill_len = r.input_len + r.gen          # recompute prompt + outputs so far
            r.last_token = float(self.last[i])
            r.retractions += 1
            self.waiting.append(r)
        self.used -= freed
        self.retractions += len(popped)
        self.released += len(popped)
        self._filter(keep)
        if len(order) == 1 and self.pool.decode_step_need(self.kv) > self._free():
            r = self.run_reqs[0]               # out of memory even after retracting
            r.rejected = "out of memory even after retracting every other request"
            self.used -= int(self.held[0])
            self._drop_prefix(r)
            self.aborted.append(r)
            self.released += 1
            self._filter(np.zeros(1, dtype=bool))
        if self.run_reqs:
            total_gen = float(self.gen.sum())
            total_max = float(self.maxnew.sum())
            self.new_token_ratio = min(
                1.0, (total_gen + RETRACT_DECODE_STEPS * len(self.run_reqs)) / (total_max + 1))
        self.batch_is_full = False
        return len(popped)

    # ---- runs of decode steps (the engine's fast path, ``Replica``) -----------------------
    def decode_run_steps(self) -> int:
        """Called after ``next_batch`` formed a decode-only step: how many steps, that one
        first, the running batch decodes until it changes by itself, i.e. up to the first
        that finishes a request. 0 when the next formation may differ from a plain decode
        step: a chunked prompt to continue, an abort to hand back, or a waiting request
        that the next formation may admit (one that ``batch_is_full`` holds back waits
        until a request finishes)."""
        if (not self.run_reqs or self.chunked is not None or self.aborted
                or (self.waiting and not self.batch_is_full)):
            return 0
        return self._left

    def plan_decode(self, steps: int) -> DecodePlan:
        """A plan of up to ``steps`` formations after a decode step just formed (``DecodePlan``),
        to be extended one at a time (``next_decode``) and committed
        (``apply_decode_steps``). Changes nothing."""
        n = len(self.run_reqs)
        return DecodePlan(steps, n, self._kv_total, self._free(),
                          self.pool.capacity - self.used, self._held_total, [self.used],
                          self.pool.decode_step_need_of(n))

    def next_decode(self, plan: DecodePlan) -> tuple[int, float] | None:
        """Plan the next formation (``_update_running_batch`` on the planned state): its
        step's (KV tokens, attention bytes per layer); None, planning nothing, past the
        plan's limit or where that formation would retract (``check_decode_mem`` fails) or
        evict cached blocks to allocate, not a plain decode step."""
        i = len(plan.used)                   # formations after the one already made
        if i > plan.limit:
            return None
        n, pool = plan.n, self.pool
        if self._unit_growth:
            # one unit per request: the reserve check_decode_mem asks for is what it takes
            if n > plan.free or (n > plan.room and self.cache is not None):
                return None
            plan.free -= n
            plan.room -= n
            plan.held += n
            plan.kv_total += n
            plan.used.append(plan.used[-1] + n)
            return plan.kv_total, pool.read_bytes_for_tokens(plan.kv_total)
        need = (plan.fixed_need if plan.fixed_need is not None
                else pool.decode_step_need(self.kv + (i - 1)))
        if need > plan.free:
            return None
        if not plan.ahead:
            # a few formations at a time, more as the run lasts: a run cut short wastes few
            k = min(max(4, i), plan.limit - i + 1, 64)
            plan.ahead = pool.decode_sums(self.kv, range(i + k - 1, i - 1, -1), self.prof)
        held, read = plan.ahead.pop()
        delta = held - plan.held
        if delta > plan.room and self.cache is not None:
            return None                      # _make_room would evict
        plan.held = held
        plan.free -= delta
        plan.room -= delta
        plan.kv_total += n
        plan.used.append(plan.used[-1] + delta)
        return plan.kv_total, (pool.read_bytes_for_tokens(plan.kv_total) if self._linear_read
                               else read)

    def apply_decode_steps(self, plan: DecodePlan, steps: int, ends: Sequence[float],
                           itl_sink: list[np.ndarray]) -> None:
        """Complete ``steps`` >= 1 decode steps, the one formed before ``plan`` was made and
        the plan's first ``steps - 1``, step i ending at ``ends[i]``, and make the plan's
        formation after each, as ``complete`` and ``next_batch`` would (no request
        finishes in them: see ``decode_run_steps``); the step after them is then formed and
        runs. The inter-token gaps go to ``itl_sink`` in the order ``complete`` would
        append them (concatenated, the same values)."""
        n = len(self.run_reqs)
        self.kv = self.kv + steps
        self._kv_total += n * steps
        if self._unit_growth:
            self.held = self.held + steps
            self._held_total += n * steps
        else:
            self.held, self._read_bytes = self.pool.decode_state(self.kv, self.prof)
            self._held_total = int(self.held.sum())
        # as a difference: what reached the scheduler meanwhile (freed memory) stays
        self.used += plan.used[steps] - plan.used[0]
        ratio, decay, least = self.new_token_ratio, self.ratio_decay, self.min_ratio
        for _ in range(steps):
            ratio = max(ratio - decay, least)
        self.new_token_ratio = ratio
        self.gen += steps
        self._left -= steps
        itl_sink.append(ends[0] - self.last)
        if steps > 1:
            itl_sink.append(np.repeat([ends[i] - ends[i - 1] for i in range(1, steps)], n))
        self.last[:] = ends[steps - 1]

    def _filter(self, keep: np.ndarray) -> None:
        self.batch_version += 1
        self.run_reqs = list(compress(self.run_reqs, keep.tolist()))
        self.kv, self.gen, self.out = self.kv[keep], self.gen[keep], self.out[keep]
        self.maxnew, self.held, self.last = self.maxnew[keep], self.held[keep], self.last[keep]
        self._kv_total = int(self.kv.sum())
        self._held_total = int(self.held.sum())
        self._left = int((self.out - self.gen).min()) if len(self.gen) else 0
        if self.prof is not None:
            self.prof = self.prof[keep]

    # ---- completion ----------------------------------------------------------------------
    def complete(self, b: Batch, now: float, itl_sink: list[np.ndarray]) -> list[SimRequest]:
        """Apply the results of batch ``b`` that finished at ``now``; return finished requests.
        Inter-token gaps of decode steps go to ``itl_sink`` as arrays."""
        finished: list[SimRequest] = []
        if b.decode and self.run_reqs:
            self.gen += 1
            self._left -= 1
            itl_sink.append(now - self.last)
            self.last[:] = now
            done = self.gen >= self.out if self._left <= 0 else None
            if done is not None and done.any():
                for i in np.flatnonzero(done):
                    r = self.run_reqs[i]
                    r.gen = int(self.gen[i])
                    r.finish = now
                    r.last_token = now
                    self._finished(r, int(self.held[i]))
                    finished.append(r)
                self._filter(~done)
                self.batch_is_full = False
        joined: list[SimRequest] = []
        for r, extend in b.chunks:
            r.prefilled += extend
            if r.prefilled < r.fill_len:
                continue                      # chunked: stays out of the running batch
            r.gen += 1                        # the prefill forward samples one token
            if r.first_token < 0:
                r.first_token = now
            else:                             # recomputed after a retraction
                if r.itl is None:
                    r.itl = []
                r.itl.append(now - r.last_token)
            r.last_token = now
            if self.cache is not None:
                self._cache_prompt(r)         # page-size-1 token pool: nothing to reclaim
            else:
                # DiffKV compresses the prompt after prefill: all-high pages -> the mix
                # (a no-op for token pools, whose held units already equal the paged KV)
                kv = np.array([r.fill_len], dtype=np.int64)
                prof = None if r.prof is None else r.prof[None]
                new_held = int(self.pool.decode_units(kv, prof)[0])
                self.used += new_held - r.held
                r.held = new_held
            if r.gen >= r.output_len:
                r.finish = now
                self._finished(r, r.held)
                finished.append(r)
                self.batch_is_full = False    # the merged prefill batch shrank
            else:
                joined.append(r)
        if joined:
            self._join(joined)
        self.released += len(finished)
        return finished

    def _finished(self, r: SimRequest, held: int) -> None:
        """``r`` is done: free what it holds, unless finished requests are held
        (``hold_finished``), which keeps ``held`` units allocated until ``release(r)``."""
        if self.hold_finished:
            r.held = held
            self.holding += 1
            return
        self._retire(r, held)
        r.held = 0

    def release(self, r: SimRequest) -> None:
        """Free a held finished request's units (its KV has left the server); the memory may
        admit waiting requests."""
        if not self.hold_finished or self.holding < 1:
            raise RuntimeError("release is for requests held by hold_finished")
        self._retire(r, r.held)
        r.held = 0
        self.holding -= 1
        self.batch_is_full = False

    # ---- a disaggregated decode server: KV that another server prefilled --------------
    def reserve(self, r: SimRequest, units: int) -> None:
        """Allocate ``units`` for ``r`` before its KV arrives: SGLang's decode server
        preallocates a request's KV before the prefill server writes into it. The caller
        decides that they fit (``simulator.serving.prealloc``)."""
        self._make_room(units)
        self.used += units
        r.held = units

    def cancel_reservation(self, r: SimRequest) -> None:
        """Give back a reservation whose KV will never come (the prefill side rejected it)."""
        self.used -= r.held
        r.held = 0

    def join_prebuilt(self, reqs: Sequence[SimRequest], now: float) -> list[SimRequest]:
        """Requests whose prompt KV has arrived in their reservation join the running batch
        without a forward (SGLang's prebuilt extend): the prefill server sampled their first
        token, which streams now. Returns those already finished (one output token).
        Call between steps only: a decode step in flight would count them."""
        finished: list[SimRequest] = []
        joined: list[SimRequest] = []
        for r in reqs:
            r.gen = 1
            r.fill_len = r.prefilled = r.input_len
            r.first_token = r.last_token = now
            if r.gen >= r.output_len:
                r.finish = now
                self._finished(r, r.held)
                finished.append(r)
            else:
                joined.append(r)
        if joined:
            self._join(joined)
        self.released += len(finished)
        return finished

    @property
    def free_units(self) -> int:
        """Units that can be allocated now, evictable cached blocks included."""
        return self._free()

    def _join(self, reqs: list[SimRequest]) -> None:
        self.batch_version += 1
        left = min(r.output_len - r.gen for r in reqs)
        self._left = min(self._left, left) if self.run_reqs else left
        self.run_reqs.extend(reqs)
        new = np.array([(r.fill_len, r.gen, r.output_len, r.max_new, r.held) for r in reqs],
                       dtype=np.int64)
        self.kv = np.concatenate([self.kv, new[:, 0]])
        self.gen = np.concatenate([self.gen, new[:, 1]])
        self.out = np.concatenate([self.out, new[:, 2]])
        self.maxnew = np.concatenate([self.maxnew, new[:, 3]])
        self.held = np.concatenate([self.held, new[:, 4]])
        self._kv_total += sum(r.fill_len for r in reqs)
        self._held_total += sum(r.held for r in reqs)
        self.last = np.concatenate([self.last, [r.last_token for r in reqs]])
        if self._with_prof:
            new = np.stack([r.prof for r in reqs])
            self.prof = new if self.prof is None or not len(self.prof) else np.concatenate(
                [self.prof, new])

    # ---- observability -------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.run_reqs)

    @property
    def held_total(self) -> int:
        """Units the running requests hold (``held.sum()``)."""
        return self._held_total

    @property
    def usage(self) -> float:
        """Pool fraction in use, evictable cache excluded (SGLang's token usage)."""
        return self.usage_of(self.used)

    def usage_of(self, used: int) -> float:
        """``usage`` had ``used`` units been in use."""
        cached = self.cache.evictable_units if self.cache is not None else 0
        return (used - cached) / self.pool.capacity

    @property
    def cache_units(self) -> int:
        return self.cache.units if self.cache is not None else 0
