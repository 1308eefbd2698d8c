"""``release_overhead_s``: optional (0 when absent), validated and round-tripped; the
scheduler hands the requests released since the last step (finished or retracted) to the
next step, which pays the cost per request; the step fit recovers it from decode intervals
whose batch shrinks, and leaves it out where releases cost nothing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sim_helpers import req, scenario, token_scheduler
from test_step_fit import TRUE, _intervals, _log, _server

from simulator.errors import SimulatorInputError
from simulator.serving.cost import StepShape
from simulator.specs.calibration import Calibration, load_calibration
from simulator.validation.step_fit import fit_step_costs, step_rows


def test_optional_field_round_trip_and_bad_values(tmp_path):
    cal = load_calibration("h100")
    assert cal.release_overhead_s == 0.0 and "release_overhead_s" not in cal.to_dict()
    entry = {**cal.to_dict(), "release_overhead_s": 2e-3}
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"gpus": {"h100": Calibration.from_dict("h100", entry,
                                                                    "t").to_dict()}}))
    assert load_calibration("h100", p).release_overhead_s == 2e-3
    for bad in (-1e-6, "1e-3"):
        with pytest.raises(SimulatorInputError, match="release_overhead_s"):
            Calibration.from_dict("h100", {**entry, "release_overhead_s": bad}, "t")


def test_each_released_request_costs_the_next_step():
    base = load_calibration("h100")
    c0 = replace(scenario(), calibration=base).server("bf16").cost
    c1 = replace(scenario(), calibration=replace(base, release_overhead_s=2e-3)).server(
        "bf16").cost
    shape = StepShape(decode_reqs=30, decode_kv_tokens=30 * 400, decode_read_bytes=1e6)
    assert c1.step_time(shape) == c0.step_time(shape)
    released = replace(shape, released_reqs=3)
    assert c1.step_time(released) - c0.step_time(released) == pytest.approx(3 * 2e-3)


def test_the_scheduler_reports_releases_once_to_the_next_batch():
    s = token_scheduler(100_000)
    for i, out in enumerate((2, 3, 3, 5)):
        s.submit(req(i, 100, out))
    t, seen, finished = 0.0, [], 0
    while True:
        b = s.next_batch()
        if b is None:
            break
        seen.append(b.shape.released_reqs)
        t += 0.01
        finished += len(s.complete(b, t, []))
    # prefill samples token 1; decode steps 2..5: one request done at step 2, two at step 3,
    # one at step 5; each release shows once, on the batch after it
    assert seen == [0, 0, 1, 2, 0]
    assert finished == 4 and s.released == 1      # the last one: no batch after it


def test_fit_recovers_the_release_cost_and_skips_it_when_free(tmp_path):
    srv = _server(**{**{k: 0.0 for k in TRUE}, "decode_attention_scale": 1.0})
    costly = _log(tmp_path, _intervals(prefill=False), release_s=3e-3)
    res = fit_step_costs(srv, step_rows(srv, costly, "costly", None))
    assert "release_overhead_s" in res["fitted"]
    assert res["release_overhead_s"] == pytest.approx(3e-3, rel=0.05)
    assert res["release_gain"] > 0.05
    free = _log(tmp_path, _intervals(prefill=False))
    res = fit_step_costs(srv, step_rows(srv, free, "free", None))
    assert "release_overhead_s" in res["kept"] and res["release_overhead_s"] == 0.0
    assert res["release_gain"] < 0.05
