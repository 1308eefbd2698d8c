"""Unified-page geometry: the one source of truth for every byte size in the project.

A unified page is ``page_bytes`` of raw memory that is configured to one precision tier when
it leaves the free list. It holds N tokens of one KV head in six segments:

    key data | key meta | value data | value meta | score (fp32) | pos (int32)

Data segments are packed little-end-first (element i of a byte sits at bits
[i*b, (i+1)*b)); a metadata entry is (scale, zero) as two fp16 per quantisation group.
Segment starts are aligned (value data to 128 B so a page's value rows start on a cache
line, the rest to 32 B, positions to their natural 4 B), which reproduces DiffKV's offsets.

The page size is searched once per head_dim and tier set: the smallest page holding at
least ``MIN_HIGH_TOKENS`` tokens of the widest tier that wastes at most 2% in every tier.
For head_dim 128 and DiffKV's four tier formats this is
DiffKV's 6784-byte page (32 K8V4 tokens, 60 K4V2 tokens with one group, 52 with (2, 4)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from sglang_diffkv.config import (
    K4V2,
    K4V2_GROUPED,
    K8V4,
    K8V4_GROUPED,
    SUPPORTED_HEAD_DIMS,
    ConfigError,
    DiffKVConfig,
    TierConfig,
)

SEGMENTS = ("key", "key_meta", "value", "value_meta", "score", "pos")
SEGMENT_ALIGN = {"key": 32, "key_meta": 32, "value": 128, "value_meta": 32, "score": 32, "pos": 4}
META_BYTES_PER_GROUP = 4  # fp16 scale + fp16 zero
SCORE_BYTES = 4
POS_BYTES = 4
PAGE_ALIGN = 32
MIN_HIGH_TOKENS = 32  # kernel tiles want >= 32 tokens of the high tier per page
MAX_PAGE_SCAN = 2  # scan page sizes up to 2x the smallest candidate
WASTE_TOLERANCE = 0.02  # accept the first page wasting at most 2% in every tier

# The tier formats DiffKV sizes its page for (vllm/config.py hetero_kv_bits).
DIFFKV_TIER_FAMILY = (K8V4_GROUPED, K8V4, K4V2_GROUPED, K4V2)


def fp16_bytes_per_token(head_dim: int) -> int:
    """Bytes one token of one KV head takes in a bf16/fp16 cache (key + value)."""
    return 4 * head_dim


def ideal_bit_ratio(tier: TierConfig) -> float:
    """The papers' idealised memory ratio vs 16-bit K and V: no metadata, no padding."""
    return (tier.key_bits + tier.value_bits) / 32


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _segment_sizes(tier: TierConfig, head_dim: int, n: int) -> dict[str, int]:
    return {
        "key": n * head_dim * tier.key_bits // 8,
        "key_meta": n * tier.key_groups * META_BYTES_PER_GROUP,
        "value": n * head_dim * tier.value_bits // 8,
        "value_meta": n * tier.value_groups * META_BYTES_PER_GROUP,
        "score": n * SCORE_BYTES,
        "pos": n * POS_BYTES,
    }


def segment_offsets(tier: TierConfig, head_dim: int, n: int) -> tuple[dict[str, int], int]:
    """Start offset of each segment for ``n`` tokens, and the byte just past the last one."""
    offsets: dict[str, int] = {}
    cursor = 0
    for name, size in _segment_sizes(tier, head_dim, n).items():
        cursor = _align(cursor, SEGMENT_ALIGN[name])
        offsets[name] = cursor
        cursor += size
    return offsets, cursor


def tokens_per_page(tier: TierConfig, head_dim: int, page_bytes: int) -> int:
    """The most tokens of ``tier`` whose six segments fit in ``page_bytes``."""
    # bytes grow monotonically in n; start from the unaligned estimate and walk down.
    per_token = sum(_segment_sizes(tier, head_dim, 1).values())
    n = page_bytes // per_token
    while n > 0 and segment_offsets(tier, head_dim, n)[1] > page_bytes:
        n -= 1
    return n


def _check_tiers(head_dim: int, tiers: Sequence[TierConfig]) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ConfigError(f"head_dim={head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    for t in tiers:
        t.check_head_dim(head_dim, t.name)


@cache
def search_page_bytes(head_dim: int, tiers: tuple[TierConfig, ...]) -> int:
    """The smallest page (a multiple of 32 B, holding >= MIN_HIGH_TOKENS of the widest tier)
    whose worst unused fraction over ``tiers`` is within WASTE_TOLERANCE; failing that, the
    smallest page with the least worst waste up to MAX_PAGE_SCAN times the smallest size."""
    _check_tiers(head_dim, tiers)
    widest = max(tiers, key=lambda t: sum(_segment_sizes(t, head_dim, 1).values()))
    start = _align(segment_offsets(widest, head_dim, MIN_HIGH_TOKENS)[1], PAGE_ALIGN)
    best_bytes, best_waste = start, math.inf
    for page in range(start, MAX_PAGE_SCAN * start + 1, PAGE_ALIGN):
        waste = max(
            (page - segment_offsets(t, head_dim, tokens_per_page(t, head_dim, page))[1]) / page
            for t in tiers
        )
        if waste <= WASTE_TOLERANCE:
            return page
        if waste < best_waste - 1e-12:
            best_bytes, best_waste = page, waste
    return best_bytes


@dataclass(frozen=True)
class TierLayout:
    """Where one tier's tokens live inside a unified page."""

    tier: TierConfig
    head_dim: int
    page_bytes: int
    tokens_per_page: int
    key_offset: int
    key_meta_offset: int
    value_offset: int
    value_meta_offset: int
    score_offset: int
    pos_offset: int
    used_bytes: int

    @classmethod
    def build(cls, tier: TierConfig, head_dim: int, page_bytes: int) -> TierLayout:
        n = tokens_per_page(tier, head_dim, page_bytes)
        if n < 1:
            raise ConfigError(f"a {page_bytes}-byte page cannot hold one {tier.name} token")
        off, end = segment_offsets(tier, head_dim, n)
        return cls(
            tier,
            head_dim,
            page_bytes,
            n,
            off["key"],
            off["key_meta"],
            off["value"],
            off["value_meta"],
            off["score"],
            off["pos"],
            end,
        )

    @property
    def key_bytes_per_token(self) -> int:
        return self.head_dim * self.tier.key_bits // 8

    @property
    def value_bytes_per_token(self) -> int:
        return self.head_dim * self.tier.value_bits // 8

    @property
    def bytes_per_token(self) -> float:
        """Physical bytes per token: the page divided by its tokens (metadata, score, position
        and the page's unused tail included)."""
        return self.page_bytes / self.tokens_per_page

    @property
    def waste_fraction(self) -> float:
        return (self.page_bytes - self.used_bytes) / self.page_bytes

    @property
    def ideal_bit_ratio(self) -> float:
        return ideal_bit_ratio(self.tier)

    @property
    def physical_ratio(self) -> float:
        """Physical bytes per token relative to a 16-bit cache."""
        return self.bytes_per_token / fp16_bytes_per_token(self.head_dim)

    def offsets(self) -> dict[str, int]:
        return {
            "key": self.key_offset,
            "key_meta": self.key_meta_offset,
            "value": self.value_offset,
            "value_meta": self.value_meta_offset,
            "score": self.score_offset,
            "pos": self.pos_offset,
        }


@dataclass(frozen=True)
class PageGeometry:
    """The unified page for one head_dim and a (high, low) tier pair. Tier 0 is high, 1 low."""

    head_dim: int
    page_bytes: int
    high: TierLayout
    low: TierLayout

    @classmethod
    def build(
        cls,
        head_dim: int,
        high: TierConfig,
        low: TierConfig,
        size_for: Sequence[TierConfig] | None = None,
    ) -> PageGeometry:
        """``size_for``: the tier set the page is sized for (default: just high and low)."""
        family = tuple(size_for) if size_for is not None else (high, low)
        _check_tiers(head_dim, (high, low, *family))
        page = search_page_bytes(head_dim, family)
        return cls(
            head_dim,
            page,
            TierLayout.build(high, head_dim, page),
            TierLayout.build(low, head_dim, page),
        )

    @classmethod
    def for_config(cls, config: DiffKVConfig, head_dim: int) -> PageGeometry:
        return cls.build(head_dim, config.high, config.low)

    @property
    def tiers(self) -> tuple[TierLayout, TierLayout]:
        return (self.high, self.low)

    @property
    def min_tokens_per_page(self) -> int:
        return min(self.high.tokens_per_page, self.low.tokens_per_page)

    def row_len(self, max_context: int) -> int:
        """Page-table row length per (request, layer, KV head): both tiers share one row."""
        return math.ceil(max_context / self.min_tokens_per_page) + 2

    def pages_for(self, n_high: int, n_low: int) -> int:
        return math.ceil(n_high / self.high.tokens_per_page) + math.ceil(
            n_low / self.low.tokens_per_page
        )

    def bytes_per_token(self, high_frac: float, low_frac: float) -> float:
        """Physical bytes per token of one KV head for a tier mix (the rest is pruned)."""
        return high_frac * self.high.bytes_per_token + low_frac * self.low.bytes_per_token


def geometry_table(head_dims: Sequence[int] = (64, 128)) -> list[dict[str, object]]:
    """Rows for the docs: each tier format of DiffKV's family on its own page size."""
    rows: list[dict[str, object]] = []
    for d in head_dims:
        page = search_page_bytes(d, DIFFKV_TIER_FAMILY)
        for tier in (K8V4, K8V4_GROUPED, K4V2, K4V2_GROUPED):
            t = TierLayout.build(tier, d, page)
            rows.append(
                {
                    "head_dim": d,
                    "tier": tier.name,
                    "page_bytes": page,
                    "tokens_per_page": t.tokens_per_page,
                    "bytes_per_token": round(t.bytes_per_token, 1),
                    "fp16_bytes_per_token": fp16_bytes_per_token(d),
                    "physical_ratio": round(t.physical_ratio, 4),
                    "ideal_ratio": t.ideal_bit_ratio,
                }
            )
    return rows


def _print_geometry_table() -> None:
    header = ("head_dim", "tier", "page_bytes", "tokens_per_page", "bytes_per_token",
              "fp16_bytes_per_token", "physical_ratio", "ideal_ratio")
    print(" | ".join(header))
    for row in geometry_table((64, 128, 256)):
        print(" | ".join(str(row[h]) for h in header))


if __name__ == "__main__":
    _print_geometry_table()
