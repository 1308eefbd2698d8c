"""Outcome of an allocating op, kept on the device until someone asks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class OutOfPages(RuntimeError):
    """An allocating op needed more pages than the free list held; nothing was changed."""

    def __init__(self, needed: int, free: int, op: str) -> None:
        super().__init__(f"{op}: needed {needed} pages but only {free} are free")
        self.needed = needed
        self.free = free
        self.op = op


class PageTableRowFull(RuntimeError):
    """A decode step would push some (request, layer, head) row past row_len pages (possible
    only when tokens were demoted/evicted without returning pages); nothing was changed."""


@dataclass(frozen=True)
class AllocResult:
    """0-dim device tensors. ``ok`` is False iff the op was a no-op because it did not fit.

    ``needed`` and ``free`` are measured before the op; ``rows_ok`` is False when some
    table row had no room (decode only, True otherwise).
    """

    op: str
    ok: torch.Tensor
    needed: torch.Tensor
    free: torch.Tensor
    rows_ok: torch.Tensor

    def raise_if_failed(self) -> None:
        """Host sync: raise PageTableRowFull or OutOfPages when the op did nothing."""
        if bool(self.ok):
            return
        if not bool(self.rows_ok):
            raise PageTableRowFull(
                f"{self.op}: a page-table row is full; the request cannot grow further"
            )
        raise OutOfPages(int(self.needed), int(self.free), self.op)
