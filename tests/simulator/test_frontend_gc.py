"""The tokenizer manager's full garbage collections (``FrontEnd``): where the pauses fall by
the requests received since the server started, what they hold (requests on their way in,
tokens on their way out), the calibration fields, --freeze-gc, the harness's count of the
requests a server took before a run, and validate_simulator's --frontend-gc."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
from sim_helpers import h100_calibration_with, scenario

from simulator.errors import SimulatorInputError
from simulator.serving.frontend import FrontEnd
from simulator.specs.calibration import load_calibration
from simulator.validation.harness import _warmup_requests
from simulator.workload.schema import Trace, TraceRequest


def test_pauses_fall_at_the_first_count_then_every_count_after_it():
    fe = FrontEnd(first_reqs=3, every_reqs=2, pause_s=0.5)
    reached = [fe.admit(t) for t in (0.0, 1.0, 2.0, 2.2, 3.0, 4.0, 5.0, 6.0)]
    # requests 3, 5 and 7 start a pause; one arriving inside it waits for its end
    assert reached == [0.0, 1.0, 2.5, 2.5, 3.5, 4.0, 5.5, 6.0]
    assert (fe.starts, fe.ends) == ([2.0, 3.0, 5.0], [2.5, 3.5, 5.5])
    assert fe.seen_at(2.49) == 2.5 and fe.seen_at(2.5) == 2.5 and fe.seen_at(1.9) == 1.9


def test_requests_before_the_run_shift_the_pauses_and_one_pause_may_be_all():
    fe = FrontEnd(first_reqs=10, every_reqs=0, pause_s=0.4, received=8)
    assert [fe.admit(float(t)) for t in range(4)] == [0.0, 1.4, 2.0, 3.0]
    assert fe.starts == [1.0]                       # the 10th since the start, the run's 2nd
    late = FrontEnd(first_reqs=10, every_reqs=5, pause_s=0.4, received=30)
    assert [late.admit(float(t)) for t in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.4]  # the 35th


def test_a_pause_that_starts_inside_another_starts_at_its_end():
    fe = FrontEnd(first_reqs=1, every_reqs=1, pause_s=1.0)
    assert [fe.admit(0.0), fe.admit(0.5)] == [1.0, 2.0]
    assert fe.ends == [1.0, 2.0]


@pytest.mark.parametrize("kw, match", [
    ({"first_reqs": -1}, "first_reqs=-1"), ({"every_reqs": 1.5}, "every_reqs=1.5"),
    ({"pause_s": float("nan")}, "pause_s=nan"), ({"received": -2}, r"\(-2\)"),
])
def test_bad_values_are_named(kw, match):
    with pytest.raises(SimulatorInputError, match=match):
        FrontEnd(**kw)


def _run(first: int, every: int = 0, pause: float = 0.3, before: int = 0, out: int = 8,
         **settings):
    sc = scenario(**settings)
    sc = replace(sc, calibration=replace(sc.calibration, frontend_gc_first_reqs=first,
                                         frontend_gc_every_reqs=every,
                                         frontend_gc_pause_s=pause))
    trace = Trace(tuple(TraceRequest(0.5 * i, 64, out) for i in range(6)))
    return sc.run(trace, "bf16", requests_before=before).requests


def test_a_simulated_pause_holds_the_request_that_starts_it_and_the_tokens_streamed_in_it():
    base = _run(0, pause=0.0)
    held = _run(3)
    for i, (a, b) in enumerate(zip(base, held, strict=True)):
        if i == 2:              # the third request starts the pause at its arrival, t=1.0
            assert b.queued_at == pytest.approx(1.3) and a.queued_at == pytest.approx(1.0)
            assert b.first_token - a.first_token == pytest.approx(0.3)
        elif i < 2:
            # served before the pause: nothing it streamed fell inside
            assert (b.first_token, b.finish) == pytest.approx((a.first_token, a.finish))
    # the run's own count starts from the requests before it: request 1 of the run is the 3rd
    shifted = _run(3, before=2)
    assert shifted[0].queued_at == pytest.approx(0.3)


def test_a_token_streamed_inside_a_pause_reaches_the_client_at_its_end():
    # a long pause at the second request: the first's tokens, streamed inside it, wait
    base, held = _run(0, pause=0.0, out=100), _run(2, pause=2.0, out=100)
    first = held[0]
    assert 0.5 < base[0].finish < 2.5
    assert first.finish == pytest.approx(2.5)           # the pause runs 0.5 -> 2.5
    assert first.first_token == pytest.approx(base[0].first_token)  # before the pause


def test_freeze_gc_removes_the_pauses():
    base = _run(0, pause=0.0)
    frozen = _run(3, freeze_gc=True)
    assert [r.first_token for r in frozen] == pytest.approx([r.first_token for r in base])


def test_the_calibration_fields_load_round_trip_and_come_in_pairs(tmp_path):
    def load(extra: dict):
        return h100_calibration_with(tmp_path, extra)

    cal = load({"frontend_gc_first_reqs": 910, "frontend_gc_every_reqs": 1590,
                "frontend_gc_pause_s": 0.45})
    assert (cal.frontend_gc_first_reqs, cal.frontend_gc_every_reqs,
            cal.frontend_gc_pause_s) == (910, 1590, 0.45)
    d = cal.to_dict()
    assert (d["frontend_gc_first_reqs"], d["frontend_gc_every_reqs"]) == (910, 1590)
    assert "frontend_gc_first_reqs" not in load_calibration("h100").to_dict()
    with pytest.raises(SimulatorInputError, match="frontend_gc_first_reqs=1.5"):
        load({"frontend_gc_first_reqs": 1.5, "frontend_gc_pause_s": 0.45})
    with pytest.raises(SimulatorInputError, match="a pause needs the request"):
        load({"frontend_gc_pause_s": 0.45})
    with pytest.raises(SimulatorInputError, match="a pause needs the request"):
        load({"frontend_gc_every_reqs": 100})


def test_the_harness_counts_bench_e2es_warmup_requests():
    from sglang_diffkv.bench.e2e import warmup_phases

    for n in (1, 4, 16):
        sent = sum(len(specs) for specs, _ in warmup_phases(n))
        assert _warmup_requests({"options": {"warmup": n}}) == sent
    assert _warmup_requests({"options": {"warmup": 0}}) == 0
    assert _warmup_requests({}) == 0


def test_validate_simulator_reads_frontend_gc_and_names_a_bad_value():
    vs = importlib.import_module("simulator.validation.runs")
    cal = vs.with_frontend_gc(load_calibration("h100"), "910,1590,450")
    assert (cal.frontend_gc_first_reqs, cal.frontend_gc_every_reqs) == (910, 1590)
    assert cal.frontend_gc_pause_s == pytest.approx(0.45)
    for bad in ("910,1590", "0,1590,450", "910,-1,450", "910,1590,0", "a,b,c"):
        with pytest.raises(SimulatorInputError, match=f"--frontend-gc '{bad}'"):
            vs.with_frontend_gc(load_calibration("h100"), bad)
