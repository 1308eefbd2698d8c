"""A prefill step that follows no prefill step runs its kernels ``isolated_prefill_scale`` of
the grids' time (below the power limit that the grids and a burst's back-to-back chunks run
at): the calibration field, the cost model, the scheduler's flag, validate_simulator's option."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sim_helpers import load_script, req, scenario, token_scheduler

from simulator.errors import SimulatorInputError
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
        with pytest.raises(SimulatorInputError, match=f"isolated_prefill_scale={bad!r}"):
            load_calibration("h100", str(_calib_file(tmp_path, isolated_prefill_scale=bad)))


def test_only_the_kernels_of_a_prefill_step_alone_scale():
    sc = scenario()
    scale = 0.92
    cost = replace(sc, calibration=replace(sc.calibration, isolated_prefill_scale=scale)
                   ).server("bf16").cost
    plain = sc.server("bf16").cost
    alone = StepShape(prefill_tokens=4096, prefill_pairs=4096 * 4096 / 2, prefill_seqs=1)
    after = replace(alone, after_prefill=True)
    c = cost.calib
    fixed = (c.step_overhead_s + c.seq_overhead_s + c.prefill_step_overhead_s
             + c.prefill_seq_overhead_s + c.prefill_token_overhead_s * 4096
             + cost.layers * cost.layer_overhead(alone))
    assert cost.step_time(after) == plain.step_time(after) == plain.step_time(alone)
    assert cost.step_time(alone) - fixed == pytest.approx(scale * (cost.step_time(after) - fixed))
    assert cost.step_time(alone) < cost.step_time(after)
    decode = StepShape(decode_reqs=8, decode_kv_tokens=8000, decode_read_bytes=1e6,
                       after_prefill=True)
    assert cost.step_time(decode) == plain.step_time(decode)


def test_the_scheduler_flags_a_prefill_that_follows_a_prefill():
    s = token_scheduler(100_000, chunk=8192)
    s.submit(req(0, 20000, 5))
    flags, kinds = [], []
    for t in range(1, 6):
        b = s.next_batch()
        kinds.append(b.kind)
        flags.append(b.shape.after_prefill)
        s.complete(b, float(t), SINK)
    # three chunks back to back, then decode steps; a new prompt after a decode step is not
    assert kinds[:4] == ["prefill", "prefill", "prefill", "decode"]
    assert flags[:3] == [False, True, True]
    s.submit(req(1, 500, 2))
    b = s.next_batch()
    assert b.kind == "prefill" and b.shape.after_prefill is False


def test_validate_simulator_rejects_a_scale_above_one(tmp_path, capsys):
    vs = load_script("validate_simulator")
    rc = vs.main([str(tmp_path), "--isolated-prefill-scale", "1.09",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    assert "--isolated-prefill-scale 1.09 must be in [0.5, 1]" in capsys.readouterr().err
