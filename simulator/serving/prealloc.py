"""SGLang's disaggregated decode server: which waiting requests get their KV preallocated.

A request reaches a decode server (``--disaggregation-mode decode``) before its prompt is
prefilled. It waits, FIFO, in ``DecodePreallocQueue``; ``pop_preallocated`` reserves its KV
slots once they fit, and only then is the prefill server told where to write (so a prefill
server never computes a prompt that has nowhere to go). The KV arrives into the reservation;
the request then joins the running batch without a forward (a "prebuilt" extend) and
decodes. The rule, from ``sglang/srt/disaggregation/decode.py`` (``pop_preallocated``,
``_allocatable_token_budgets``), in tokens:

  retractable   = sum over running requests of (prompt + outputs so far)
  need_single   = max over running requests of (prompt + min(max_new, 4096)) - retractable
                  (0 with nothing running)
  allocatable   = available - max(NUM_RESERVED x active, need_single)
                  active = running + reserved-but-not-running + waiting (retracted)
                  + the ones preallocated in this pass
  admit iff max(prompt + NUM_RESERVED, prompt + min(max_new, 4096) - retractable)
            <= allocatable, in queue order (the first that does not fit stops the pass)

Here in the pool's units: a token pool counts tokens; DiffKV counts pages, a request's
prompt at the pages it takes at its tier mix after the prefill server compressed it (the
pages that arrive), and token amounts (the reserve, future tokens, retractable outputs) at
the mix's mean pages per token (``KVPool.future_units``). The decode-side radix cache and
the request-slot limit of preallocation (``pre_alloc_size``) are not modelled: SGLang's
decode radix cache is off by default, and the slots exceed what memory admits here.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from simulator.serving.request import SimRequest
from simulator.serving.scheduler import Scheduler
from simulator.serving.settings import CLIP_MAX_NEW_TOKENS

# SGLANG_NUM_RESERVED_DECODE_TOKENS (ServerArgs.num_reserved_decode_tokens): decode room kept
# free per active request
NUM_RESERVED_DECODE_TOKENS = 512


def prompt_units(sched: Scheduler, r: SimRequest) -> int:
    """Units the prompt's KV takes when it arrives: as the decode pool stores it after the
    prefill (DiffKV: compressed to the request's tier mix; a token pool: its slots)."""
    kv = np.array([r.input_len], dtype=np.int64)
    prof = None if r.prof is None else r.prof[None]
    return int(sched.pool.decode_units(kv, prof)[0])


class PreallocQueue:
    """The decode server's queue of requests waiting for their KV to be preallocated."""

    def __init__(self, sched: Scheduler, reserved_tokens: int = NUM_RESERVED_DECODE_TOKENS):
        self.sched = sched
        self.reserved_tokens = reserved_tokens
        self.queue: deque[SimRequest] = deque()
        # each queued request's prompt_units, worked out once: the head of the queue is
        # tried at every batch formation until it fits
        self._units: dict[int, int] = {}
        # the running batch's largest prompt + min(max_new, 4096), as of a batch version
        self._largest: tuple[int, float] = (-1, 0.0)

    def __len__(self) -> int:
        return len(self.queue)

    def admissible(self, r: SimRequest) -> bool:
        """SGLang's checks before a request waits here, and liveness: its reservation must
        fit an empty pool, or it would wait forever (False: ``r.rejected`` says why)."""
        self.sched.ensure_profile(r)
        pool = self.sched.pool
        units = self._units[r.rid] = prompt_units(self.sched, r)
        return self.sched.admissible(r, units + pool.future_units(self.reserved_tokens))

    def add(self, r: SimRequest) -> None:
        if r.rid not in self._units:
            self._units[r.rid] = prompt_units(self.sched, r)
        self.queue.append(r)

    def pop_preallocated(self, in_flight: int, held: int | None = None,
                         free: int | None = None) -> list[SimRequest]:
        """Reserve KV for the requests at the head of the queue that fit now, in order;
        ``in_flight``: requests reserved earlier whose KV has not yet joined the running
        batch. ``held``, ``free``: the running requests' units and the free ones where the
        scheduler's own are not yet up to date (the engine's runs of decode steps,
        ``DecodePlan``). Returns the requests reserved (removed from the queue)."""
        sched, pool = self.sched, self.sched.pool
        if not self.queue:
            return []
        reserve = pool.future_units(self.reserved_tokens)
        running = sched.running
        held = sched.held_total if held is None else held
        retractable = float(held) if running else 0.0
        need_single = 0.0
        if running:
            version, largest = self._largest
            if version != sched.batch_version:
                inputs = np.array([q.input_len for q in sched.run_reqs], dtype=np.float64)
                grow = np.minimum(sched.maxnew, CLIP_MAX_NEW_TOKENS)
                largest = float((inputs + grow).max())
                self._largest = (sched.batch_version, largest)
            need_single = pool.future_units(largest) - retractable
        active = running + in_flight + len(sched.waiting)
        free = sched.free_units if free is None else free
        taken: list[SimRequest] = []
        while self.queue:
            r = self.queue[0]
            allocatable = free - max(reserve * (active + len(taken)), need_single)
            units = self._units[r.rid]
            whole = units + pool.future_units(min(r.max_new, CLIP_MAX_NEW_TOKENS)) - retractable
            if max(units + reserve, whole) > allocatable:
                break
            self.queue.popleft()
            del self._units[r.rid]
            sched.reserve(r, units)
            free -= units
            taken.append(r)
        return taken
