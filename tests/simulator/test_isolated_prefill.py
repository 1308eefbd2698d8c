"""A prefill step long after the last one runs its kernels ``isolated_prefill_scale`` of the
grids' time (below the power limit that the grids and a burst's back-to-back chunks run at),
one right after it at the grids' time, and in between the clocks recover with
``prefill_clock_recovery_s``: the calibration fields, the cost model, the engine's gap,
validate_simulator's option."""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import replace

import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.serving.cost import StepShape
from simulator.specs.calibration import load_calibration

SINK: list = []


def _calib_file(tmp_path, **extra):
    base = load_calibration("h100")
    d = base.to_dict() | extra
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"version": 1, "gpus": {"h100": d}}))
    return f


def test_the_field_loads_round_trips_and_names_a_bad_value(tmp_path):
    cal = load_calibration("h100", str(_calib_file(tmp_path, isolated_prefill_scale=0.92)))
    assert cal.isolated_prefill_scale == 0.92
    assert cal.to_dict()["isolated_prefill_scale"] == 0.92
    assert load_calibration("h100").isolated_prefill_scale == 1.0
    assert "isolated_prefill_scale" not in load_calibration("h100").to_dict()
    for bad in (0.3, 1.1, True, "fast"):
        with pytest.raises(InputError, match=f"isolated_prefill_scale={bad!r}"):
            load_calibration("h100", str(_calib_file(tmp_path, isolated_prefill_scale=bad)))


def test_the_recovery_loads_round_trips_and_names_a_bad_value(tmp_path):
    cal = load_calibration("h100", str(_calib_file(tmp_path, prefill_clock_recovery_s=0.05)))
    assert cal.prefill_clock_recovery_s == 0.05
    assert cal.to_dict()["prefill_clock_recovery_s"] == 0.05
    assert "prefill_clock_recovery_s" not in load_calibration("h100").to_dict()
    for bad in (-0.1, 11.0, True, "slow"):
        with pytest.raises(InputError, match=f"prefill_clock_recovery_s={bad!r}"):
            load_calibration("h100", str(_calib_file(tmp_path, prefill_clock_recovery_s=bad)))


def test_the_clocks_recover_as_the_h200_duty_probe_measured():
    # one 45-ms prefill step between decode steps (benchmarks.md, session 21): its time over
    # the back-to-back time against the decode time between two prefills, floor 0.90
    cal = replace(load_calibration("h100"), isolated_prefill_scale=0.90,
                  prefill_clock_recovery_s=0.025)
    for gap_ms, measured in ((5.6, 0.981), (11.2, 0.969), (22.4, 0.939), (44.1, 0.908),
                             (86.1, 0.898)):
        assert cal.prefill_clock_scale(gap_ms / 1e3) == pytest.approx(measured, abs=0.01)
    assert cal.prefill_clock_scale(0.0) == 1.0
    assert cal.prefill_clock_scale(math.inf) == 0.90
    assert load_calibration("h100").prefill_clock_scale(0.01) == 1.0
    # the default recovery 0: any step in between and the prefill runs as if alone
    binary = replace(load_calibration("h100"), isolated_prefill_scale=0.92)
    assert binary.prefill_clock_recovery_s == 0.0
    assert binary.prefill_clock_scale(1e-4) == 0.92
    assert binary.prefill_clock_scale(0.0) == 1.0


def test_only_the_kernels_of_a_prefill_step_scale():
    sc = scenario()
    scale = 0.92
    cost = replace(sc, calibration=replace(sc.calibration, isolated_prefill_scale=scale,
                                           prefill_clock_recovery_s=0.025)).server("bf16").cost
    plain = sc.server("bf16").cost
    alone = StepShape(prefill_tokens=4096, prefill_pairs=4096 * 4096 / 2, prefill_seqs=1)
    after = replace(alone, prefill_gap_s=0.0)
    soon = replace(alone, prefill_gap_s=0.02)
    c = cost.calib
    fixed = (c.step_overhead_s + c.seq_overhead_s + c.prefill_step_overhead_s
             + c.prefill_seq_overhead_s + c.prefill_token_overhead_s * 4096
             + cost.layers * cost.layer_overhead(alone))
    assert cost.step_time(after) == plain.step_time(after) == plain.step_time(alone)
    assert cost.step_time(alone) - fixed == pytest.approx(scale * (cost.step_time(after) - fixed))
    assert cost.step_time(soon) - fixed == pytest.approx(
        c.prefill_clock_scale(0.02) * (cost.step_time(after) - fixed))
    assert cost.step_time(alone) < cost.step_time(soon) < cost.step_time(after)
    decode = StepShape(decode_reqs=8, decode_kv_tokens=8000, decode_read_bytes=1e6,
                       prefill_gap_s=0.0)
    assert cost.step_time(decode) == plain.step_time(decode)


def test_the_engine_gives_each_prefill_step_its_gap():
    # a 6,000-token prompt in three 2,048-token chunks, back to back, then decode steps; a
    # prompt arriving 5 s later comes after a long gap
    sc = scenario(chunked_prefill_size=2048)
    srv = sc.server("bf16")
    shapes, step_time = [], srv.cost.step_time

    def record(shape):
        shapes.append(shape)
        return step_time(shape)
    srv.cost.step_time = record
    trace = Trace((TraceRequest(0.0, 6000, 5), TraceRequest(5.0, 500, 2)))
    sc.run(trace, "bf16", server=srv)
    gaps = [s.prefill_gap_s for s in shapes if s.prefill_tokens]
    assert len(gaps) == 4
    assert gaps[0] == math.inf
    assert gaps[1] == gaps[2] == 0.0
    assert gaps[3] > 4.0
    assert all(s.prefill_gap_s == math.inf for s in shapes if not s.prefill_tokens)


def test_validate_simulator_rejects_a_scale_above_one(tmp_path, capsys):
    vs = importlib.import_module("simulator.validation.runs")
    rc = vs.main([str(tmp_path), "--isolated-prefill-scale", "1.09",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    assert "--isolated-prefill-scale 1.09 must be in [0.5, 1]" in capsys.readouterr().err
    rc = vs.main([str(tmp_path), "--prefill-clock-recovery-s", "-5",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    assert "--prefill-clock-recovery-s -5 must be in [0, 10]" in capsys.readouterr().err
