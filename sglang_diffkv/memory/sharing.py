"""Shared read-only prefixes: what a radix-tree node holds, and the page copies that the
copy-on-write boundary needs.

A :class:`SharedPrefix` is a frozen snapshot of the compressed rows of one request: for every
(layer, KV head) row and tier t, the tier's first ``n_tokens[..., t]`` tokens (its slots
[0, n_t), which is all of them at export), held in ``ceil(n_t / N_t)`` pages. The
``n_t // N_t`` full pages are shared with every row that attached the prefix (and with the
exporting row); the partial last page, if any, is the handle's own copy, and every attaching
row copies it again into a private page (copy-on-write at the boundary), so no shared page is
ever written.

Reference counts (``PageManager.refs``) count *shared* holders only: a page in a handle or
in a row's shared region has ``refs`` = the number of handles and rows holding it; a free
page and a row's private page have ``refs`` 0 (a private page has exactly one holder, its
row, as in stage 1). So the allocation paths that only ever hand out private pages (prefill,
reclaim, the decode step and its CUDA compaction) never touch ``refs``: a count is written
only when a page becomes shared (export, attach) or a holder lets go (free, release).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """A frozen compressed prefix (device tensors; never written after export).

    ``pages``: int32 [layers, kv_heads, 2, width]: tier t's page j at ``[..., t, j]``, -1 past
    the tier's ``ceil(n_t / N_t)`` pages. ``n_tokens``: int32 [layers, kv_heads, 2]. An export
    that did not fit yields an empty handle (no pages, no tokens), so callers need no sync to
    keep handles consistent. ``num_tokens``: the sequence positions it covers (host metadata:
    the radix key's length; every row holds at most that many tokens). ``key``: its entry in
    the manager's registry (``PageManager.handles``).

    A prompt exported right after its prefill holds each tier's tokens in position order, so
    it can be cut at earlier positions: ``cuts`` int32 [layers, kv_heads, C, 2] holds each
    tier's tokens before positions ``cut_len, 2 * cut_len, ..., C * cut_len``
    (``cut_counts``); None (and ``cut_len`` 0) for a handle that may only be attached
    whole."""

    pages: torch.Tensor
    n_tokens: torch.Tensor
    num_tokens: int
    key: int
    cuts: torch.Tensor | None = None
    cut_len: int = 0

    @property
    def width(self) -> int:
        return self.pages.shape[-1]

    def cut_counts(self, position: int) -> torch.Tensor:
        """int32 [layers, kv_heads, 2]: each tier's tokens before ``position``, a multiple of
        ``cut_len`` in (0, num_tokens] (what ``PageManager.attach_prefix`` takes as
        ``n_tokens`` to attach that cut)."""
        have = 0 if self.cuts is None else self.cuts.shape[2]
        c = position // self.cut_len if self.cut_len > 0 else 0
        if not 0 < c <= have or position != c * self.cut_len:
            raise ValueError(f"shared prefix {self.key}: no cut at position {position} "
                             f"({have} cuts every {self.cut_len} tokens)")
        return self.cuts[:, :, c - 1]


class PageCopies(NamedTuple):
    """Whole-page copies the caller performs on the page storage after an export or attach
    (``pages[dst[i]] = pages[src[i]]`` where ``mask[i]``); flat over (request, layer, head,
    tier). The destinations are fresh pages, never a source, so the lanes are independent."""

    src: torch.Tensor  # int64 [M]
    dst: torch.Tensor  # int64 [M]
    mask: torch.Tensor  # bool [M]


def copy_pages(pages: torch.Tensor, copies: PageCopies) -> None:
    """Perform ``copies`` on page storage ``pages`` without a host sync: masked-out lanes
    repeat the first real copy (the same bytes to the same page), or copy a page onto itself
    when there is none. Destinations are fresh pages, never a source."""
    if copies.mask.numel() == 0:
        return
    m = copies.mask
    # a one-element index, not a 0-dim one: indexing with a 0-dim integer tensor is a
    # ``select`` at ``.item()`` of it, which reads the device (a sync)
    first = torch.argmax(m.to(torch.int8)).view(1)
    src = torch.where(m, copies.src, copies.src.index_select(0, first))
    dst = torch.where(m, copies.dst, copies.dst.index_select(0, first))
    dst = torch.where(m.any(), dst, src)
    pages.index_copy_(0, dst, pages.index_select(0, src))


def tier_columns(width: int, row_len: int, device: torch.device) -> torch.Tensor:
    """int64 [2, width]: row position of tier page j (high j, low row_len - 1 - j), clamped
    into the row so a gather past a tier's pages stays in range."""
    j = torch.arange(width, device=device)
    return torch.stack((j, row_len - 1 - j)).clamp(0, row_len - 1)


def stack_handles(handles: list[SharedPrefix], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages int64 [K, layers, heads, 2, W] padded with -1, n_tokens int64 [K, layers,
    heads, 2]) of ``handles``, W the widest; host-side list work (admission time)."""
    width = max(h.width for h in handles)
    pages = torch.stack([
        torch.nn.functional.pad(h.pages.to(device, torch.int64), (0, width - h.width), value=-1)
        for h in handles
    ])
    n_tokens = torch.stack([h.n_tokens.to(device, torch.int64) for h in handles])
    return pages, n_tokens
