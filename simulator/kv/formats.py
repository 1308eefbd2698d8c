"""KV-cache formats: bf16, fp8, uniform K8V4 / K4V2, and DiffKV (two tiers + pruning).

Every byte size comes from ``sglang_diffkv.layout`` (physical bytes: quantisation metadata,
score and position fields and the page's unused tail included). A format knows its bytes and
builds the pool that does the memory accounting (``simulator.kv.pool``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_diffkv.capacity import CapacityPlan
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

    def max_total_num_tokens(self, model: ModelSpec, tp: int, rest_bytes: float) -> int:
        """SGLang's profile_max_num_token: ``rest // cell_size``, aligned down to the page."""
        cell = model.num_layers * model.kv_heads_per_rank(tp) * self.bytes_per_token_head
        tokens = int(max(rest_bytes, 0) // cell)
        return tokens // self.page_size * self.page_size

    def build_pool(self, model: ModelSpec, tp: int, max_total_num_tokens: int,
                   max_running_requests: int, context_len: int) -> KVPool:
        heads = model.kv_heads_per_rank(tp)
        return TokenPool(max_total_num_tokens // self.page_size * self.page_size,
                         self.page_size, heads * self.bytes_per_token_head)

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

    def capacity_plan(self, model: ModelSpec, tp: int) -> CapacityPlan:
        """The backend's own sizing (``sglang_diffkv.capacity``), planned at this format's mean
        mix: the server's planning mix (``SGLANG_DIFFKV_PLANNING_MIX``) is assumed to be the
        mix the deployment expects, so its logical slots are the pool's tokens at that mix."""
        return CapacityPlan(self.config, self.geometry, model.num_layers,
                            model.kv_heads_per_rank(tp), (self.mix.high, self.mix.low))

    def max_total_num_tokens(self, model: ModelSpec, tp: int, rest_bytes: float) -> int:
        """SGLang's profile_max_num_token with the backend's cell size (bytes per logical
        token at the planning mix), before the backend takes its per-request state."""
        return int(max(rest_bytes, 0) // self.capacity_plan(model, tp).cell_bytes)

    def build_pool(self, model: ModelSpec, tp: int, max_total_num_tokens: int,
                   max_running_requests: int, context_len: int) -> KVPool:
        """The pages the backend builds from SGLang's token budget: page tables for every
        request row come off the top, as in ``sglang_diffkv.sglang.runner.init_pools``."""
        plan = self.capacity_plan(model, tp)
        size = plan.size_pool(max_total_num_tokens, max_running_requests, context_len)
        if size.num_pages < plan.min_pages:
            raise SimulatorInputError(
                f"the DiffKV pool gets {size.num_pages} pages from {max_total_num_tokens} "
                f"profiled tokens after the page tables of {max_running_requests} requests "
                f"(context {context_len}); one request needs at least "
                f"{plan.min_pages}: lower max_running_requests or context_len, or "
                "give the KV cache more memory")
        return DiffKVPool(size.num_pages, self.geometry, self.config.window, self.mix,
                          model.num_layers, model.kv_heads_per_rank(tp),
                          self.config.score_queries)

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
