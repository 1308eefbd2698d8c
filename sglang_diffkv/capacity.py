"""DiffKV capacity planning: how a KV memory budget becomes unified pages and SGLang's logical
token slots. Host arithmetic only (no torch, no sglang), so the SGLang pool
(``sglang_diffkv.sglang.runner``) and the simulator's DiffKV pool size themselves with the same
code and agree to the page."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

from sglang_diffkv.config import ConfigError, DiffKVConfig
from sglang_diffkv.layout import PageGeometry, fp16_bytes_per_token

PLANNING_MIX_ENV = "SGLANG_DIFFKV_PLANNING_MIX"
# SGLang's req_to_token rows are context_len + 4 long (model_runner_kv_cache_mixin).
EXTRA_CONTEXT = 4
# SGLang's req_to_token holds logical token slot indices as int32.
MAX_LOGICAL_SLOTS = 2**31 - 1


class PoolSize(NamedTuple):
    num_pages: int
    logical_slots: int


def cache_rows(max_running_requests: int) -> int:
    """Request rows of the DiffKV cache: SGLang's request slots (1..N) plus row 0, which
    SGLang never allocates and CUDA-graph padding rows point at
    (``DiffKVTokenToKVPool.pad_req``)."""
    return max_running_requests + 1


def planning_mix(
    config: DiffKVConfig, environ: dict[str, str] | None = None
) -> tuple[float, float]:
    """Expected (high, low) token fractions used to size the logical slot count; the rest is
    pruned. ``SGLANG_DIFFKV_PLANNING_MIX="h,l"`` overrides. Defaults: the benchmark mix's
    (high, low) in benchmark mode (``config.bench_mix``), else all high without a low tier,
    half/half with one. The physical term of ``available_size`` keeps any mix safe: the
    mix only decides how many logical slots SGLang may hand out."""
    env = os.environ if environ is None else environ
    text = env.get(PLANNING_MIX_ENV, "").strip()
    if text:
        try:
            hi, lo = (float(x) for x in text.split(","))
        except ValueError as e:
            raise ConfigError(
                f"{PLANNING_MIX_ENV}={text!r}: expected two fractions 'high,low', e.g. '0.5,0.5'"
            ) from e
        if not (0 < hi <= 1 and 0 <= lo <= 1 and hi + lo <= 1 + 1e-9):  # (NaN fails too)
            raise ConfigError(
                f"{PLANNING_MIX_ENV}={text!r}: need high > 0, low >= 0 and high + low <= 1"
            )
        return hi, lo
    if config.bench_mix is not None:
        return config.bench_mix[0], config.bench_mix[1]
    return (0.5, 0.5) if config.has_low_tier else (1.0, 0.0)


@dataclass(frozen=True)
class CapacityPlan:
    """How a KV memory budget becomes pages and logical slots for one model."""

    config: DiffKVConfig
    geometry: PageGeometry
    num_layers: int
    num_kv_heads: int
    mix: tuple[float, float]

    @classmethod
    def build(
        cls, config: DiffKVConfig, head_dim: int, num_layers: int, num_kv_heads: int
    ) -> CapacityPlan:
        geometry = PageGeometry.for_config(config, head_dim)
        return cls(config, geometry, num_layers, num_kv_heads, planning_mix(config))

    @property
    def rows_per_request(self) -> int:
        """(layer, KV head) rows one request owns: every token occupies one entry in each."""
        return self.num_layers * self.num_kv_heads

    @property
    def min_pages(self) -> int:
        """The fewest pages a pool may have: four per (layer, KV head) row of one request
        (the backend refuses to start below it, the simulator to size such a pool)."""
        return self.rows_per_request * 4

    @property
    def planning_tokens_per_page(self) -> float:
        """*Logical* tokens of one (layer, head) row a page holds at the planning mix,
        pruned tokens included: SGLang hands out one slot per token whether or not DiffKV
        keeps it. ``bytes_per_token(hi, lo)`` already charges a pruned token 0 bytes (it is
        bytes per logical token), so the page divided by it is the logical count; scaling it
        by the kept fraction hi + lo would count kept tokens only and understate the slots
        by the pruned fraction (at 30/50/20, 3.42x fp16 instead of 4.27x)."""
        hi, lo = self.mix
        return self.geometry.page_bytes / self.geometry.bytes_per_token(hi, lo)

    @property
    def cell_bytes(self) -> int:
        """Bytes per logical token (pruned ones included, at 0 bytes) over all layers and
        heads at the planning mix, i.e. rows x ``bytes_per_token(hi, lo)`` rounded up: what
        SGLang's ``get_cell_size_per_token`` returns for diffkv."""
        return math.ceil(
            self.rows_per_request * self.geometry.page_bytes / self.planning_tokens_per_page
        )

    def request_state_bytes(self, max_reqs: int, max_context: int) -> int:
        """Per-request device state of the reference cache: page table (int32), counters
        (int32 x4), prompt tier counts (int64 x2), shared-page counts of an attached radix
        prefix (int32 x2) and thresholds."""
        rows = max_reqs * self.rows_per_request
        return rows * (self.geometry.row_len(max_context) * 4 + 16 + 16 + 8) + max_reqs * 9

    @property
    def pool_bytes_per_page(self) -> int:
        """Device bytes one page costs: the page, its free-list entry and its reference
        count (int32 each; the counts let radix prefixes share pages)."""
        return self.geometry.page_bytes + 4 + 4

    def num_pages(self, budget_bytes: int, max_reqs: int, max_context: int) -> int:
        usable = budget_bytes - self.request_state_bytes(max_reqs, max_context)
        return max(0, usable // self.pool_bytes_per_page)

    def size_pool(self, max_total_num_tokens: int, max_running_requests: int,
                  context_len: int) -> PoolSize:
        """The pool SGLang's start-up builds: its profiled ``max_total_num_tokens`` (logical
        tokens of ``cell_bytes``, before any per-request state) back to bytes, the page
        tables of ``cache_rows(max_running_requests)`` rows off the top, the rest in pages,
        and the logical slots SGLang then hands out (its new ``max_total_num_tokens``)."""
        budget = max_total_num_tokens * self.cell_bytes
        pages = self.num_pages(budget, cache_rows(max_running_requests),
                               context_len + EXTRA_CONTEXT)
        return PoolSize(pages, self.logical_slots(pages))

    def logical_slots(self, num_pages: int) -> int:
        """SGLang token slots for ``num_pages`` pages: every token of a request takes one
        slot, so this is logical tokens (kept and pruned) at the planning mix. A mix with
        almost nothing kept (a high fraction near 0 in bench_mix or
        SGLANG_DIFFKV_PLANNING_MIX) would ask for more slots than SGLang can index."""
        slots = num_pages * self.planning_tokens_per_page / self.rows_per_request
        if not slots <= MAX_LOGICAL_SLOTS:  # (inf / NaN included)
            hi, lo = self.mix
            raise ConfigError(
                f"planning mix high {hi:g} / low {lo:g} (bench_mix or {PLANNING_MIX_ENV}) "
                f"gives {slots:.3g} logical token slots for {num_pages} pages, more than the "
                f"{MAX_LOGICAL_SLOTS} SGLang's int32 slot indices address; use a larger "
                "high fraction")
        return int(num_pages * self.planning_tokens_per_page) // self.rows_per_request


def capacity_report(plan: CapacityPlan, num_pages: int, slots: int, max_reqs: int,
                    context_len: int) -> list[str]:
    """The start-up block (like vLLM's KV-cache report)."""
    g, rows = plan.geometry, plan.rows_per_request
    fp16_tokens = num_pages * g.page_bytes // (rows * fp16_bytes_per_token(g.head_dim))
    all_high = num_pages * g.high.tokens_per_page // rows
    all_low = num_pages * g.low.tokens_per_page // rows
    c = plan.config
    lines = [
        f"DiffKV KV cache: config {c.name!r} high={c.high.name} low={c.low.name} "
        f"alpha_h={c.alpha_h} alpha_l={c.alpha_l} window={c.window} "
        f"(set with SGLANG_DIFFKV_CONFIG=<preset name | inline JSON | path.json>)",
        f"DiffKV KV cache: page {g.page_bytes} B; tokens per page: high {g.high.tokens_per_page}, "
        f"low {g.low.tokens_per_page}; {rows} (layer, KV head) rows per request",
        f"DiffKV KV cache: {num_pages} pages = {num_pages * g.page_bytes / 2**30:.2f} GiB; "
        f"capacity {all_high} tokens all-high, {all_low} all-low; "
        f"the same memory holds {fp16_tokens} fp16/bf16 tokens",
        f"DiffKV KV cache: planning mix high {plan.mix[0]:.2f} / low {plan.mix[1]:.2f} -> "
        f"{slots} logical token slots ({slots / max(fp16_tokens, 1):.2f}x fp16); "
        f"expected max concurrency at context {context_len}: "
        f"{min(max_reqs, slots / max(context_len, 1)):.2f} requests "
        f"(max running requests {max_reqs})",
    ]
    if c.bench_note is not None:
        lines.append(f"DiffKV KV cache: {c.bench_note}")
    return lines
