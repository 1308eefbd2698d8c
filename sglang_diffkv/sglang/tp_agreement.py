"""One free-page count for every tensor-parallel rank's scheduler.

At ``--tp-size N`` every rank runs SGLang's scheduler on the same requests (rank 0
broadcasts them on the TP CPU group, ``SchedulerRequestReceiver``) and SGLang never
all-reduces memory per step: it relies on every rank's pools answering ``available_size``
identically, which holds for its own pools because every rank allocates the same slots. With
DiffKV each rank holds its own KV heads' unified pages, free list and page tables, and the
per-head budgets make ranks consume different numbers of pages. Left alone, one rank would
admit a prompt (or keep a decode batch) that another retracts, and the ranks' batches,
then their collectives, would diverge.

Invariant (TP > 1): inside a scheduler step (``Scheduler.get_next_batch_to_run``, where
SGLang takes every admission and retraction decision) every read of the physical term that
feeds ``available_size`` and the admission hook returns the same value on every TP rank, and
that value is at most every rank's own free pages:

    agreed = MIN over TP ranks of the rank's free-page lower bound (``FreePagesBound``)

It is refreshed with one all-reduce on the TP CPU group at the first read of a step and at
the first read after a release inside the step (a retraction returns pages, and SGLang reads
again to decide whether to retract more); every other read of the step reuses it. The reads
inside a step happen in the same order on every rank (same requests, same decisions, by
induction from identical idle pools), so the collectives match. Outside a step (SGLang's
metrics, load reports and idle checks, which decide nothing and may run on one rank only)
nothing is all-reduced: the last agreed value is returned. When no request holds pages the
pool reads its exact local count instead (``DiffKVTokenToKVPool.free_pages``): the pages
are all free on every rank then, unless one leaked, which SGLang's idle check reports.
At TP 1 there is no agreement object and nothing of this runs.

The all-reduce is one int64 on the CPU (gloo) group, on the host, while the previous
forward runs on the GPU under the overlap scheduler: it costs the host tens of microseconds
per step and the GPU nothing (the local read it reduces is the sync-free bound).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any


class RanksDisagreeError(RuntimeError):
    """The TP ranks built pools of different sizes, so no agreed page count can exist."""


def all_reduce_ints(group: Any, values: Sequence[int], op: str) -> list[int]:
    """``values`` reduced element-wise over ``group`` ("min" or "max"), on the CPU."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX,
                    group=group)
    return [int(x) for x in t]


class FreePagesAgreement:
    """The agreed free-page count of one rank's DiffKV pool (see the module docstring)."""

    def __init__(self, group: Any, local_free_pages: Callable[[], int],
                 reduce_min: Callable[[int], int] | None = None) -> None:
        self.group = group
        self._local = local_free_pages
        self._reduce_min = reduce_min or (lambda v: all_reduce_ints(group, [v], "min")[0])
        self._value: int | None = None
        self._stale = True
        self._in_step = False
        self.reductions = 0  # all-reduces so far (tests and logs)

    def check_same_pool(self, num_pages: int, slots: int) -> None:
        """At start-up: every rank must have the same pages and logical slots (SGLang sizes
        the KV budget from the MIN of the ranks' free memory, and every rank holds the same
        number of KV heads), or no count can agree."""
        lo = all_reduce_ints(self.group, [num_pages, slots], "min")
        hi = all_reduce_ints(self.group, [num_pages, slots], "max")
        if lo != hi:
            raise RanksDisagreeError(
                f"--attention-backend diffkv: TP ranks built different DiffKV pools (pages "
                f"{lo[0]}..{hi[0]}, logical slots {lo[1]}..{hi[1]}); every rank needs the "
                "same KV budget and KV heads per rank"
            )

    @contextmanager
    def scheduler_step(self) -> Iterator[None]:
        """The span of one scheduler step's decisions (the hook on ``get_next_batch_to_run``)."""
        self._in_step, self._stale = True, True
        try:
            yield
        finally:
            self._in_step = False

    def released(self) -> None:
        """A request's pages are going back: the next read inside a step agrees anew."""
        self._stale = True

    def read(self) -> int:
        if self._in_step and self._stale:
            self._value = self._reduce_min(self._local())
            self._stale = False
            self.reductions += 1
        if self._value is None:  # before the first step: nothing has been agreed yet
            return self._local()
        return self._value


def scheduler_step_hook(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.get_next_batch_to_run``: the scheduler step whose reads agree."""
    pool = getattr(scheduler.token_to_kv_pool_allocator, "diffkv_pool", None)
    agreement = getattr(pool, "agreement", None)
    if agreement is None:  # TP 1, or another backend: SGLang's own code alone
        return original(scheduler, *args, **kwargs)
    with agreement.scheduler_step():
        return original(scheduler, *args, **kwargs)


def tp_cpu_group(ps: Any) -> Any | None:
    """The CPU group the TP ranks' schedulers share (``ps``: SGLang's ParallelState);
    None at TP 1."""
    if ps.tp_size == 1:
        return None
    from sglang.srt.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group
