"""A lower bound on the free page count that the host reads without waiting for the GPU.

SGLang's scheduler asks for free memory several times per step. Reading the device count
exactly is a host sync that (under the overlap scheduler) waits for the forward in flight,
so the GPU idles while the host prepares the next step. Instead:

* the count is copied asynchronously into pinned memory (one copy in flight at a time);
* ``read()`` takes the latest copy that has landed and subtracts the worst case of every
  allocation issued after that copy was enqueued (``taken``). Pages freed since then are
  not counted, so the bound is never above the true count;
* when the bound falls below ``exact_below`` pages (or the caller's own threshold) it is too
  coarse to decide admission or the next decode step near a full pool, so ``read()``
  synchronises once and returns the exact count.

Invariant: ``read() <= true free pages`` whenever every allocation that can take pages
after a ``read()`` reports its worst case through ``taken`` before the next one.
On a CPU device (or without a completed copy yet) ``read()`` is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class FreePagesBound:
    def __init__(self, device_count: Callable[[], torch.Tensor], device: torch.device,
                 exact_below: int) -> None:
        self._count = device_count  # 0-dim int64 device tensor of the current free pages
        self.device = torch.device(device)
        self.exact_below = exact_below
        self._landed: int | None = None
        self._taken_since_landed = 0
        self._event: object | None = None  # the copy in flight (a CUDA event)
        self._taken_since_inflight = 0
        self._pinned = (torch.zeros(1, dtype=torch.int64, pin_memory=True)
                        if self.device.type == "cuda" else None)
        self.exact_reads = 0  # how often read() had to synchronise (for logs and tests)

    def taken(self, worst_pages: int) -> None:
        """An allocation of at most ``worst_pages`` pages was enqueued."""
        self._taken_since_landed += worst_pages
        if self._event is not None:
            self._taken_since_inflight += worst_pages

    def exact(self) -> int:
        value = int(self._count())  # (a sync on CUDA)
        self.exact_reads += 1
        self._landed, self._taken_since_landed = value, 0
        self._event, self._taken_since_inflight = None, 0
        return value

    # the asynchronous copy (overridden by tests to land copies by hand)
    def _enqueue(self) -> object:
        self._pinned.copy_(self._count().view(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _landed_value(self, event: object) -> int | None:
        return int(self._pinned[0]) if event.query() else None

    def read(self, exact_below: int = 0) -> int:
        """The bound; exact (one sync) below ``max(self.exact_below, exact_below)``."""
        if self._pinned is None:
            return int(self._count())
        if self._event is not None:
            value = self._landed_value(self._event)
            if value is not None:
                self._landed, self._event = value, None
                self._taken_since_landed = self._taken_since_inflight
        if self._event is None:
            self._event = self._enqueue()
            self._taken_since_inflight = 0
        if self._landed is None:
            return self.exact()
        bound = self._landed - self._taken_since_landed
        return bound if bound >= max(self.exact_below, exact_below) else self.exact()


class ManualFreePagesBound(FreePagesBound):
    """A test double on any device: each copy captures the count when enqueued and lands
    only at ``land()``, so tests can hold the bound stale through a serving loop and check
    that every allocation path reports its worst case (``read() <= true count``)."""

    def __init__(self, device_count: Callable[[], torch.Tensor], exact_below: int = 0) -> None:
        super().__init__(device_count, torch.device("cpu"), exact_below)
        self._pinned = torch.zeros(1, dtype=torch.int64)  # (takes the lagged path)
        self._copies: list[list] = []

    def _enqueue(self) -> object:
        copy = [int(self._count()), False]
        self._copies.append(copy)
        return copy

    def _landed_value(self, event: object) -> int | None:
        return event[0] if event[1] else None

    def land(self) -> None:
        for copy in self._copies:
            copy[1] = True
        self._copies.clear()
