"""Circular free list of page ids with its counters on the device.

Invariants (checked by ``memory.invariants``):
- ``head`` and ``tail`` are 0-dim int64 tensors that only grow; slot = counter % num_pages.
- 0 <= head <= tail <= head + num_pages; ``tail - head`` pages are free.
- ring slots of counters [head, tail) hold exactly the free page ids, each once.

Allocation hands out the run [head, head + n) and recycling writes at [tail, tail + n); both
take one exclusive prefix sum over all requesters, so each gets a disjoint run without any
host round trip.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Take(NamedTuple):
    """Runs handed out by :meth:`CircularFreeList.take`; all tensors stay on the device."""

    start: torch.Tensor  # int64 [M]: ring counter of each requester's first page
    count: torch.Tensor  # int64 [M]: pages each requester got (0 everywhere when not ok)
    ok: torch.Tensor  # bool 0-dim
    needed: torch.Tensor  # int64 0-dim, before scaling by ok
    free: torch.Tensor  # int64 0-dim, before the take


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """One flat prefix sum: element i gets the sum of counts[:i]."""
    return torch.cumsum(counts, dim=0) - counts


class CircularFreeList:
    def __init__(self, num_pages: int, device: torch.device | str) -> None:
        self.num_pages = num_pages
        # One extra slot past the ring is a sink: masked-out scatter lanes write there, so a
        # scatter of a variable number of ids needs no boolean indexing (no host sync).
        self._buf = torch.empty(num_pages + 1, dtype=torch.int32, device=device)
        self.free_pages = self._buf[:num_pages]
        self.free_pages.copy_(torch.arange(num_pages, dtype=torch.int32, device=device))
        self.head = torch.zeros((), dtype=torch.int64, device=device)
        self.tail = torch.full((), num_pages, dtype=torch.int64, device=device)

    def num_free(self) -> torch.Tensor:
        return self.tail - self.head

    def take(self, counts: torch.Tensor, extra_ok: torch.Tensor | None = None) -> Take:
        """Reserve ``counts[i]`` pages for requester i, all or nothing, and advance head.

        When the total exceeds the free pages (or ``extra_ok`` is False) every count is
        scaled to 0, so the op degrades to a no-op with no data-dependent control flow.
        """
        counts = counts.to(torch.int64)
        needed = counts.sum()
        free = self.num_free()
        ok = needed <= free
        if extra_ok is not None:
            ok = ok & extra_ok
        count = counts * ok
        start = self.head + exclusive_cumsum(count)
        self.head.add_(needed * ok)
        return Take(start, count, ok, needed, free)

    def ids_at(self, counters: torch.Tensor) -> torch.Tensor:
        """Page ids in ring slots ``counters % num_pages`` (any shape)."""
        return self.free_pages[counters % self.num_pages]

    def give(self, counts: torch.Tensor) -> torch.Tensor:
        """Reserve ring slots for ``counts[i]`` returned pages per requester and advance tail.

        Returns each requester's first ring counter; the caller must then :meth:`write` the
        ids. Callers only return pages they own, so tail - head stays <= num_pages.
        """
        counts = counts.to(torch.int64)
        start = self.tail + exclusive_cumsum(counts)
        self.tail.add_(counts.sum())
        return start

    def write(self, counters: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Store ``ids`` at ring slots ``counters % num_pages`` where ``mask`` holds."""
        slots = torch.where(mask, counters % self.num_pages, self.num_pages)
        self._buf.index_put_((slots.reshape(-1),), ids.reshape(-1).to(torch.int32))
