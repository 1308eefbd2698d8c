"""Capacity planning arithmetic: cell size, pages, logical slots, the planning mix."""

from __future__ import annotations

import harness  # noqa: F401  (sglang importable on CPU)
import pytest

from sglang_diffkv.config import ConfigError, preset
from sglang_diffkv.sglang.pool import CapacityPlan, planning_mix


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
    assert got == (budget - plan.request_state_bytes(64, 8196)) // (g.page_bytes + 4)


def test_planning_mix_defaults_and_override():
    assert planning_mix(preset("no-compression"), {}) == (1.0, 0.0)
    assert planning_mix(preset("default"), {}) == (0.5, 0.5)
    assert planning_mix(preset("default"), {"SGLANG_DIFFKV_PLANNING_MIX": "0.3,0.4"}) == (0.3, 0.4)
    with pytest.raises(ConfigError, match="high > 0, low >= 0 and high \\+ low <= 1"):
        planning_mix(preset("default"), {"SGLANG_DIFFKV_PLANNING_MIX": "0.8,0.4"})
    with pytest.raises(ConfigError, match="expected two fractions"):
        planning_mix(preset("default"), {"SGLANG_DIFFKV_PLANNING_MIX": "half"})
