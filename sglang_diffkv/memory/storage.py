"""The raw page pool. The manager hands out ids into it; kernels own its bytes."""

from __future__ import annotations

import torch


def alloc_page_storage(
    num_pages: int, page_bytes: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``uint8 [num_pages, page_bytes]``, uninitialised: a page's bytes are only meaningful
    for the slots its counters say are filled."""
    for name, value in (("num_pages", num_pages), ("page_bytes", page_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"alloc_page_storage: {name}={value!r} must be a positive integer")
    return torch.empty((num_pages, page_bytes), dtype=torch.uint8, device=device)
