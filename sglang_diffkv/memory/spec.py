"""MemorySpec: the static shape of one GPU's page pool and page table.

Everything here is host-side arithmetic (no tensors), so the scheduler can bound page needs
without touching the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from sglang_diffkv.layout import PageGeometry

MAX_PAGE_ID = 2**31 - 1  # page ids are int32


@dataclass(frozen=True)
class MemorySpec:
    """Pool and table sizes. Tier 0 is high precision, tier 1 low.

    ``high_tokens_per_page`` / ``low_tokens_per_page`` come from ``layout.PageGeometry``
    (use :meth:`from_geometry`); tests may pass small numbers directly.
    """

    num_pages: int
    max_reqs: int
    num_layers: int
    num_kv_heads: int
    high_tokens_per_page: int
    low_tokens_per_page: int
    max_context: int

    def __post_init__(self) -> None:
        for name in (
            "num_pages", "max_reqs", "num_layers", "num_kv_heads",
            "high_tokens_per_page", "low_tokens_per_page", "max_context",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemorySpec.{name}={value!r} must be a positive integer")
        if self.num_pages > MAX_PAGE_ID:
            raise ValueError(
                f"MemorySpec.num_pages={self.num_pages} does not fit int32 page ids "
                f"(at most {MAX_PAGE_ID})"
            )

    @classmethod
    def from_geometry(
        cls,
        geometry: PageGeometry,
        *,
        num_pages: int,
        max_reqs: int,
        num_layers: int,
        num_kv_heads: int,
        max_context: int,
    ) -> MemorySpec:
        spec = cls(
            num_pages=num_pages,
            max_reqs=max_reqs,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            high_tokens_per_page=geometry.high.tokens_per_page,
            low_tokens_per_page=geometry.low.tokens_per_page,
            max_context=max_context,
        )
        # layout.py owns the row-length rule; row_len below mirrors it for geometry-free specs.
        if spec.row_len != geometry.row_len(max_context):
            raise AssertionError(
                f"row_len {spec.row_len} disagrees with PageGeometry.row_len "
                f"{geometry.row_len(max_context)}"
            )
        return spec

    @property
    def tokens_per_page(self) -> tuple[int, int]:
        return (self.high_tokens_per_page, self.low_tokens_per_page)

    @property
    def min_tokens_per_page(self) -> int:
        return min(self.tokens_per_page)

    @property
    def row_len(self) -> int:
        """Same rule as ``PageGeometry.row_len``: any split of ``max_context`` tokens over the
        two tiers, plus one spare page per tier taken by a decode step, fits in one row."""
        return math.ceil(self.max_context / self.min_tokens_per_page) + 2

    @property
    def heads_per_request(self) -> int:
        """(layer, KV head) pairs, each owning one table row per request."""
        return self.num_layers * self.num_kv_heads

    def prefill_pages(self, prompt_len: int) -> int:
        """Pages one (layer, head) row takes for a prompt before compression.

        ``ceil(L / N_min) + 1``: the compressor writes high tokens into pages
        [0, ceil(n_hi/N_hi)) and low tokens right after them, and for every split
        n_hi + n_lo <= L, ceil(n_hi/N_hi) + ceil(n_lo/N_lo) <= ceil(L/N_min) + 1, whereas
        ceil(L/N_hi) alone is too small (e.g. N=(32, 60), L=96, split 65/31 needs 4 > 3).
        """
        self.check_prompt_len(prompt_len)
        return -(-prompt_len // self.min_tokens_per_page) + 1

    def check_prompt_len(self, prompt_len: int) -> None:
        if not 1 <= prompt_len <= self.max_context:
            raise ValueError(
                f"prompt length {prompt_len} is outside [1, max_context={self.max_context}]"
            )

    def pages_needed_for_prefill(self, prompt_lens: Iterable[int]) -> int:
        """Exact pages ``allocate_prefill`` takes for these prompts (host arithmetic)."""
        return sum(self.prefill_pages(int(n)) for n in prompt_lens) * self.heads_per_request

    def pages_needed_for_decode(self, batch: int) -> int:
        """Upper bound on pages one ``ensure_decode_room`` takes for ``batch`` requests:
        at most one page per (layer, head, tier)."""
        if batch < 0:
            raise ValueError(f"batch={batch} must be >= 0")
        return batch * self.heads_per_request * 2

    def pages_needed_for_sharing(self, batch: int) -> int:
        """Upper bound on pages one ``export_prefix`` or ``attach_prefix`` of ``batch``
        requests takes: one copy of a partial page per (layer, head, tier). (What a caller
        reports to ``FreePagesBound.taken``.)"""
        return self.pages_needed_for_decode(batch)
