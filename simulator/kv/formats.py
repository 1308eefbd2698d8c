"""KV-cache formats: bf16, fp8, uniform K8V4 / K4V2, and DiffKV (two tiers + pruning).

Every byte size comes from ``sglang_diffkv.layout`` (physical bytes: quantisation metadata,
score and position fields and the page's unused tail included). A format knows its bytes and
builds the pool that does the memory accounting (``simulator.kv.pool``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_diffkv.config import K4V2, K8V4, ConfigError, DiffKVConfig, TierConfig
from sglang_diffkv.layout import (
    PageGeometry,
    TierLayout,
    fp16_bytes_per_token,
    search_page_bytes,
)
from simulator.errors import SimulatorInputError
from simulator.kv.mix import TierMix
from simulator.kv.pool import DiffKVPool, KVPool, TokenPool
from simulator.specs.model import ModelSpec

FORMAT_NAMES = ("bf16", "fp8", "k8v4", "k4v2", "diffkv")
DEFAULT_MIX = TierMix(0.3, 0.5)


@dataclass(frozen=True)
class UniformFormat:
    """Every token of every head stored alike. bf16/fp8 use SGLang's token pool (page size 1);
    a uniform quantised tier uses pages of ``page_size`` tokens per (layer, head)."""

    name: str
    bytes_per_token_head: float
    page_size: int
    calibration_key: str

    def build_pool(self, model: ModelSpec, tp: int, rest_bytes: float) -> KVPool:
        heads = model.kv_heads_per_rank(tp)
        return TokenPool.from_rest_bytes(
            rest_bytes=rest_bytes,
            cell_bytes=model.num_layers * heads * self.bytes_per_token_head,
            page_size=self.page_size,
            read_bytes_per_token_layer=heads * self.bytes_per_token_head,
        )

    def describe(self) -> str:
        page = "" if self.page_size == 1 else f", pages of {self.page_size} tokens"
        return f"{self.name}: {self.bytes_per_token_head:g} B per token per KV head{page}"


@dataclass(frozen=True)
class DiffKVFormat:
    """DiffKV: high and low tiers in unified pages, a recent window kept high, a tier mix."""

    name: str
    config: DiffKVConfig
    mix: TierMix
    geometry: PageGeometry
    calibration_key: str = "diffkv"

    def build_pool(self, model: ModelSpec, tp: int, rest_bytes: float) -> KVPool:
        return DiffKVPool.from_rest_bytes(
            rest_bytes=rest_bytes,
            geometry=self.geometry,
            window=self.config.window,
            mix=self.mix,
            layers=model.num_layers,
            heads_per_rank=model.kv_heads_per_rank(tp),
            score_queries=self.config.score_queries,
        )

    def describe(self) -> str:
        g = self.geometry
        return (f"{self.name}: {self.config.high.name}/{self.config.low.name} tiers "
                f"({g.high.tokens_per_page}/{g.low.tokens_per_page} tokens per "
                f"{g.page_bytes}-byte page), window {self.config.window}, {self.mix.describe()}")


KVFormat = UniformFormat | DiffKVFormat


def uniform_tier_format(tier: TierConfig, head_dim: int) -> UniformFormat:
    page = search_page_bytes(head_dim, (tier,))
    layout = TierLayout.build(tier, head_dim, page)
    return UniformFormat(tier.name, layout.bytes_per_token, layout.tokens_per_page, tier.name)


def make_format(name: str, head_dim: int, diffkv_config: DiffKVConfig | None = None,
                mix: TierMix | None = None) -> KVFormat:
    """One of FORMAT_NAMES. ``diffkv_config`` (tiers, window) and ``mix`` only apply to
    diffkv; their defaults are the 'llama-3-8b' preset and 30/50/20 high/low/pruned."""
    key = name.strip().lower()
    try:
        if key == "bf16":
            return UniformFormat("bf16", float(fp16_bytes_per_token(head_dim)), 1, "bf16")
        if key == "fp8":
            return UniformFormat("fp8", fp16_bytes_per_token(head_dim) / 2, 1, "fp8")
        if key == "k8v4":
            return uniform_tier_format(K8V4, head_dim)
        if key == "k4v2":
            return uniform_tier_format(K4V2, head_dim)
        if key == "diffkv":
            from sglang_diffkv.config import preset

            cfg = diffkv_config or preset("llama-3-8b")
            geometry = PageGeometry.for_config(cfg, head_dim)
            return DiffKVFormat("diffkv", cfg, mix or DEFAULT_MIX, geometry)
    except ConfigError as e:
        raise SimulatorInputError(f"KV format {name!r} with head_dim={head_dim}: {e}") from e
    raise SimulatorInputError(f"unknown KV format {name!r}; choose from {', '.join(FORMAT_NAMES)}")
