"""The host's turnaround after an eager prefill's launches (``eager_prefill_turnaround_s``):
from the end of the launches to the next step's launch the GPU idles, so a launch-bound prefill
step lasts launches + turnaround and a kernel-bound one its kernels. The calibration field,
the cost model, the interval fit's launch floor, a simulated run and validate_simulator's
option."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
from sim_helpers import h100_calibration_with, scenario, validator_options

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.serving.cost import StepShape
from simulator.specs.calibration import load_calibration
from simulator.validation.step_fit import _kernels

LAUNCH, TURN = 0.009, 0.0027


def _prefill(tokens: int, past: int = 0) -> StepShape:
    return StepShape(prefill_tokens=tokens, prefill_pairs=tokens * past + tokens * tokens / 2,
                     prefill_past_tokens=past, prefill_seqs=1)


def _with(turn: float, launch: float = LAUNCH):
    sc = scenario()
    return replace(sc, calibration=replace(sc.calibration, eager_prefill_launch_s=launch,
                                           eager_prefill_turnaround_s=turn))


def test_the_fields_load_round_trip_and_name_a_bad_value(tmp_path):
    def load(extra: dict):
        return h100_calibration_with(tmp_path, extra)

    cal = load({"eager_prefill_launch_s": LAUNCH, "eager_prefill_turnaround_s": TURN,
                "eager_prefill_turnaround_s_by_format": {"diffkv": 0.004}})
    assert (cal.prefill_turnaround_s("bf16"), cal.prefill_turnaround_s("diffkv")) == (
        TURN, 0.004)
    d = cal.to_dict()
    assert d["eager_prefill_turnaround_s"] == TURN
    assert d["eager_prefill_turnaround_s_by_format"] == {"diffkv": 0.004}
    plain = load_calibration("h100")
    assert plain.prefill_turnaround_s("bf16") == 0.0
    assert "eager_prefill_turnaround_s" not in plain.to_dict()
    with pytest.raises(InputError, match="eager_prefill_turnaround_s=-0.001"):
        load({"eager_prefill_launch_s": LAUNCH, "eager_prefill_turnaround_s": -0.001})
    # it counts from the end of timed launches: without them it would never be used
    with pytest.raises(InputError, match="needs eager_prefill_launch_s"):
        load({"eager_prefill_turnaround_s": TURN})
    with pytest.raises(InputError,
                       match=r"turnaround_s_by_format\.fp8=0\.002 needs a launch time"):
        load({"eager_prefill_launch_s_by_format": {"bf16": LAUNCH},
              "eager_prefill_turnaround_s_by_format": {"fp8": 0.002}})


def test_a_launch_bound_prefill_lasts_its_launches_and_the_turnaround():
    bare, cost = _with(0.0).server("bf16").cost, _with(TURN).server("bf16").cost
    extend, long = _prefill(1, 1000), _prefill(8192)
    assert bare.step_time(extend) < bare.step_time(long)
    # launch-bound: the GPU idles through the host's turnaround
    assert cost.step_time(extend) == pytest.approx(bare.step_time(extend) + TURN)
    assert cost.launch_floor_s(extend) == pytest.approx(LAUNCH + TURN)
    # kernel-bound: the turnaround runs under the kernels
    assert cost.step_time(long) == bare.step_time(long)
    # the loop's hold and the token streaming still wait for the launches alone
    assert cost.launch_s(extend) == bare.launch_s(extend) == pytest.approx(LAUNCH)
    # decode steps and prefills without timed launches pay nothing
    decode = StepShape(decode_reqs=8, decode_kv_tokens=8000, decode_read_bytes=1e6)
    assert cost.step_time(decode) == bare.step_time(decode)
    assert cost.launch_floor_s(decode) == 0.0
    untimed = _with(0.0, launch=0.0).server("bf16").cost
    assert untimed.launch_floor_s(extend) == 0.0


def test_kernels_between_the_launches_and_the_turnaround_end_wait_for_the_host():
    bare = _with(0.0).server("bf16").cost
    extend = _prefill(1, 1000)
    kernels = bare.step_time(extend, launch_floor=False)
    fixed = bare.step_time(extend) - LAUNCH
    # launches 1 ms shorter than the kernels, turnaround 3 ms: the host's end holds
    launch = kernels - fixed - 0.001
    cost = _with(0.003, launch=launch).server("bf16").cost
    assert cost.step_time(extend) == pytest.approx(fixed + launch + 0.003)
    assert cost.step_time(extend) == pytest.approx(kernels + 0.002)


def test_the_interval_fits_launch_floor_holds_the_turnaround():
    extend = _prefill(1, 1000)
    floors = [_kernels(_with(t).server("bf16"), extend)[3] for t in (0.0, TURN)]
    assert floors[1] - floors[0] == pytest.approx(TURN)


def test_a_simulated_prefill_delays_the_next_step_by_the_turnaround():
    trace = Trace((TraceRequest(0.0, 64, 20),))
    runs = [_with(t).run(trace, "bf16") for t in (0.0, TURN)]
    (a,), (b,) = (r.requests for r in runs)
    # the prompt's first token streams when the decode step after it is launched
    assert b.first_token - a.first_token == pytest.approx(TURN)
    assert b.finish - a.finish == pytest.approx(TURN)
    logs = [r.replicas[0].log for r in runs]
    assert logs[1].dt[0] - logs[0].dt[0] == pytest.approx(TURN)   # the prefill step
    assert list(logs[1].dt[1:]) == pytest.approx(list(logs[0].dt[1:]))


def test_validate_simulator_reads_the_option_and_names_a_turnaround_without_launches(
        tmp_path, capsys):
    vs = importlib.import_module("simulator.validation.runs")
    base = scenario().calibration
    ns = validator_options(
        vs, eager_prefill_launch_s=vs.key_seconds_arg("eager_prefill_launch_s", ["diffkv=0.0299"]),
        eager_prefill_turnaround_s=vs.key_seconds_arg("eager_prefill_turnaround_s",
                                                      ["diffkv=0.0027", "fp8=0.002"]))
    dk = vs.with_given(base, "diffkv", ns)
    assert (dk.eager_prefill_launch_s, dk.eager_prefill_turnaround_s) == pytest.approx(
        (0.0299, 0.0027))
    # fp8 has no launch time: its turnaround could never apply
    with pytest.raises(InputError, match="gives fp8 a turnaround but fp8 has no"):
        vs.with_given(base, "triton", ns)
    rc = vs.main([str(tmp_path), "--eager-prefill-turnaround-s", "diffkv=-1",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    assert "--eager-prefill-turnaround-s 'diffkv=-1'" in capsys.readouterr().err
