"""Capacity planning arithmetic: cell size, pages, logical slots, the planning mix."""

from __future__ import annotations

import math

import harness  # noqa: F401  (sglang importable on CPU)
import pytest

from sglang_diffkv.capacity import CapacityPlan, capacity_report, planning_mix
from sglang_diffkv.config import ConfigError, DiffKVConfig, preset
from sglang_diffkv.layout import fp16_bytes_per_token


def test_cell_size_and_slots_agree_for_an_8b_shape():
    plan = CapacityPlan.build(preset("default"), 128, 32, 8)
    g = plan.geometry
    assert (g.page_bytes, g.high.tokens_per_page, g.low.tokens_per_page) == (6784, 32, 52)
    # half high / half low: 1 / (0.5/32 + 0.5/52) tokens per page
    assert plan.planning_tokens_per_page == pytest.approx(1 / (0.5 / 32 + 0.5 / 52))
    pages = 1_000_000
    slots = plan.logical_slots(pages)
    # the slot count spends the pages at the planning mix, within one cell of rounding
    assert abs(slots * plan.cell_bytes - pages * g.page_bytes) <= plan.cell_bytes + 256 * 6784
    # the budget SGLang profiles comes back as pages after the per-request state
    budget = slots * plan.cell_bytes
    got = plan.num_pages(budget, 64, 8196)
    assert got == (budget - plan.request_state_bytes(64, 8196)) // plan.pool_bytes_per_page


def test_pruned_tokens_still_take_logical_slots():
    # Benchmark mode 30/50/20 on the Llama-3-8B shape (the H100 run): SGLang takes one slot
    # per token, pruned or not, so the slots are the pages over the bytes per *logical*
    # token (bytes_per_token(0.3, 0.5) charges pruned tokens 0 bytes).
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]})
    plan = CapacityPlan.build(cfg, 128, 32, 8)
    g, rows = plan.geometry, plan.rows_per_request
    assert plan.mix == (0.3, 0.5)
    bpt = g.bytes_per_token(0.3, 0.5)
    assert plan.planning_tokens_per_page == pytest.approx(g.page_bytes / bpt)
    assert plan.cell_bytes == math.ceil(rows * bpt)
    pages = 1_000_000
    slots = plan.logical_slots(pages)
    assert slots == int(pages * g.page_bytes / bpt) // rows
    # kept tokens (80% of the slots) fill the pages at the tiers' physical sizes
    kept_bytes = slots * rows * (0.3 * g.high.bytes_per_token + 0.5 * g.low.bytes_per_token)
    assert kept_bytes == pytest.approx(pages * g.page_bytes, rel=1e-4)
    # against fp16: 4.27x (counting kept tokens only, the old formula, said 3.42x)
    fp16_tokens = pages * g.page_bytes // (rows * fp16_bytes_per_token(128))
    assert slots / fp16_tokens == pytest.approx(4.27, abs=0.01)
    report = "\n".join(capacity_report(plan, pages, slots, 512, 8192))
    assert f"-> {slots} logical token slots (4.27x fp16)" in report


def test_planning_mix_defaults_and_override():
    assert planning_mix(preset("no-compression"), {}) == (1.0, 0.0)
    assert planning_mix(preset("default"), {}) == (0.5, 0.5)
    assert planning_mix(preset("default"), {"SGLANG_DIFFKV_PLANNING_MIX": "0.3,0.4"}) == (0.3, 0.4)
    with pytest.raises(ConfigError, match="high > 0, low >= 0 and high \\+ low <= 1"):
        planning_mix(preset("default"), {"SGLANG_DIFFKV_PLANNING_MIX": "0.8,0.4"})
    with pytest.raises(ConfigError, match="expected two fractions"):
        planning_mix(preset("default"), {"SGLANG_DIFFKV_PLANNING_MIX": "half"})
