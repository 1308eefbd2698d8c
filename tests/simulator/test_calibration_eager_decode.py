"""``eager_decode_layer_overhead_s``: optional, defaults to ``eager_layer_overhead_s``, is
validated at load, survives a round trip, and the cost model charges it to decode steps
outside the CUDA graphs only (prefill steps keep ``eager_layer_overhead_s``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sim_helpers import scenario

from simulator.errors import SimulatorInputError
from simulator.serving.cost import StepShape
from simulator.specs.calibration import Calibration, load_calibration


def test_absent_means_the_eager_layer_cost():
    cal = load_calibration("h100")
    assert cal.eager_decode_layer_overhead_s is None
    assert cal.eager_decode_layer_s == cal.eager_layer_overhead_s
    assert "eager_decode_layer_overhead_s" not in cal.to_dict()


def test_round_trip_and_bad_values(tmp_path):
    entry = {**load_calibration("h100").to_dict(), "eager_decode_layer_overhead_s": 7e-4}
    cal = Calibration.from_dict("h100", entry, "test")
    assert cal.eager_decode_layer_s == 7e-4
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"gpus": {"h100": cal.to_dict()}}))
    assert load_calibration("h100", p).eager_decode_layer_overhead_s == 7e-4
    for bad in (-1e-6, "1e-4", True):
        with pytest.raises(SimulatorInputError, match="eager_decode_layer_overhead_s"):
            Calibration.from_dict("h100", {**entry, "eager_decode_layer_overhead_s": bad}, "t")


def test_only_eager_decode_steps_pay_it():
    base = load_calibration("h100")
    extra = 5e-4

    def cost(cal):
        return replace(scenario(), calibration=cal).server("bf16").cost

    c0 = cost(base)
    c1 = cost(replace(base, eager_decode_layer_overhead_s=base.eager_layer_overhead_s + extra))
    top = c0.graph_max
    eager_decode = StepShape(decode_reqs=top + 64, decode_kv_tokens=(top + 64) * 500,
                             decode_read_bytes=1e6)
    graphed = StepShape(decode_reqs=top // 2, decode_kv_tokens=top * 250, decode_read_bytes=1e6)
    prefill = StepShape(prefill_tokens=512, prefill_pairs=512 * 256.0, prefill_seqs=1)
    assert c1.step_time(eager_decode) - c0.step_time(eager_decode) == pytest.approx(
        extra * c0.layers)
    assert c1.step_time(graphed) == c0.step_time(graphed)
    assert c1.step_time(prefill) == c0.step_time(prefill)
