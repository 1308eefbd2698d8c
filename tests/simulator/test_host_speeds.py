"""The server starts' host speeds: the calibration field ``host_speed_factors``,
``Calibration.on_host``, the mean over hosts of a replay's summaries, and validate_simulator's
--host-launches-ms, which replays every run once per probe start's host and averages."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
from sim_helpers import H100_DATA, h100_calibration_with, validator_options

from simulator.errors import SimulatorInputError
from simulator.specs.calibration import load_calibration
from simulator.validation.harness import load_harness, mean_over_hosts

HOST_TIMES = {"eager_prefill_launch_s": 0.02, "eager_prefill_turnaround_s": 0.002,
              "eager_decode_host_s": 0.006, "eager_decode_host_per_req_s": 5e-5}


def _with_host_times(tmp_path, extra=None):
    return h100_calibration_with(tmp_path, {
        **HOST_TIMES, "first_token_latency_s": 0.004,
        "eager_prefill_launch_s_by_format": {"fp8": 0.025},
        "eager_prefill_turnaround_s_by_format": {"fp8": 0.003},
        "eager_decode_host_s_by_format": {"fp8": 0.007},
        "eager_decode_host_per_req_s_by_format": {"fp8": 6e-5}, **(extra or {})})


def test_the_field_loads_round_trips_and_defaults_to_one_host(tmp_path):
    assert load_calibration("h100").host_speeds == (1.0,)
    cal = _with_host_times(tmp_path, {"host_speed_factors": [0.9, 1.25]})
    assert cal.host_speed_factors == (0.9, 1.25) and cal.host_speeds == (0.9, 1.25)
    assert cal.to_dict()["host_speed_factors"] == [0.9, 1.25]
    assert "host_speed_factors" not in load_calibration("h100").to_dict()


@pytest.mark.parametrize("bad", [[0.0], [-1.0], [4.5], [True], ["1.1"], 1.1, [float("nan")]])
def test_a_bad_factor_is_named(tmp_path, bad):
    with pytest.raises(SimulatorInputError, match="host_speed_factors.*must be a list"):
        h100_calibration_with(tmp_path, {"host_speed_factors": bad})


def test_on_host_scales_the_host_times_and_nothing_else(tmp_path):
    cal = _with_host_times(tmp_path, {"host_speed_factors": [0.8, 1.2]})
    slow = cal.on_host(1.5)
    for name, v in HOST_TIMES.items():
        assert getattr(slow, name) == pytest.approx(1.5 * v)
    assert slow.prefill_launch_s("fp8") == pytest.approx(0.0375)
    assert slow.prefill_turnaround_s("fp8") == pytest.approx(0.0045)
    assert slow.decode_host_s("fp8") == pytest.approx(0.0105)
    assert slow.decode_host_per_req_s("fp8") == pytest.approx(9e-5)
    # the GPU's costs and the client's latency stay; the copy is one host
    assert (slow.step_overhead_s, slow.first_token_latency_s) == (cal.step_overhead_s, 0.004)
    assert slow.host_speeds == (1.0,)
    for bad in (0.0, -1.0, 5.0, float("nan")):
        with pytest.raises(SimulatorInputError, match="host speed factor"):
            cal.on_host(bad)


def test_the_mean_over_hosts_averages_numbers_and_keeps_the_median_hosts_series():
    a = {"ttft": 10.0, "n": 4, "hit": None, "full": {"tok": 100.0}, "series": [1, 2]}
    b = {"ttft": 20.0, "n": 6, "hit": None, "full": {"tok": 300.0}, "series": [3]}
    c = {"ttft": 60.0, "n": 8, "hit": None, "full": {"tok": 200.0}, "series": [5, 6, 7]}
    m = mean_over_hosts([a, b, c], [1.3, 0.7, 1.0])
    assert m["ttft"] == pytest.approx(30.0) and m["n"] == pytest.approx(6.0)
    assert m["full"]["tok"] == pytest.approx(200.0) and m["hit"] is None
    assert m["series"] == [5, 6, 7]                 # host 1.0 is the median of 0.7, 1.0, 1.3
    assert mean_over_hosts([a], [1.0]) == a         # one host: as it is, ints kept
    with pytest.raises(ValueError, match="2 summaries for 3 hosts"):
        mean_over_hosts([a, b], [1.0, 1.1, 1.2])


def test_validate_simulator_reads_the_launches_per_key():
    vs = importlib.import_module("simulator.validation.runs")
    got = vs.host_launches_arg(["diffkv=27.6,35.5", "bf16=18", "bf16=22"])
    assert got == {"diffkv": (27.6, 35.5), "bf16": (18.0, 22.0)}
    for bad in ("flashinfer=3", "diffkv", "diffkv=", "diffkv=30,,31", "diffkv=0",
                "diffkv=fast", "triton=1000"):
        with pytest.raises(SimulatorInputError, match="--host-launches-ms"):
            vs.host_launches_arg([bad])


def test_the_factors_are_each_start_over_its_keys_pooled_launch():
    vs = importlib.import_module("simulator.validation.runs")
    cal = replace(load_calibration("h100"), eager_prefill_launch_s=0.02,
                  eager_prefill_launches={"fp8": 0.025})
    launches = {"bf16": (18.0, 24.0), "fp8": (20.0,), "diffkv": (30.0,)}
    assert vs.host_speeds(cal, "triton", launches) == pytest.approx((0.9, 1.2, 0.8))
    assert vs.host_speeds(cal, "diffkv", launches) == pytest.approx((1.5,))
    assert vs.host_speeds(cal, "diffkv", {"bf16": (18.0,)}) == ()
    with pytest.raises(SimulatorInputError, match="no eager prefill launch time"):
        vs.host_speeds(load_calibration("h100"), "triton", {"triton": (18.0,)})
    with pytest.raises(SimulatorInputError, match=r"factor must be in \(0, 4\]"):
        vs.host_speeds(cal, "triton", {"triton": (90.0,)})


def test_the_given_launches_reach_the_backends_calibration():
    vs = importlib.import_module("simulator.validation.runs")
    a = validator_options(vs, eager_prefill_launch_ms={"diffkv": 30.0, "triton": 20.0},
                          host_launches_ms=vs.host_launches_arg(["diffkv=27,36", "bf16=22"]))
    cal = load_calibration("h100")
    assert vs.with_given(cal, "diffkv", a).host_speed_factors == pytest.approx((0.9, 1.2))
    assert vs.with_given(cal, "triton", a).host_speed_factors == pytest.approx((1.1,))
    assert vs.with_given(cal, "diffkv", validator_options(vs)).host_speed_factors == ()


def test_validation_predicts_the_mean_of_its_runs_on_each_host(tmp_path):
    vs = importlib.import_module("simulator.validation.runs")
    h = load_harness(H100_DATA / "e2e-fit-fp8-lowrate", tmp_path / "logs")
    cal = replace(load_calibration("h100"), eager_prefill_launch_s=0.02,
                  eager_prefill_turnaround_s=0.002)

    def predicted(c):
        rows = vs.validate(h, {"base": c}, "llama-3-8b", "h100", set())[0]
        return {r["metric"]: r["predicted"] for r in rows}

    fast, slow = predicted(cal.on_host(0.8)), predicted(cal.on_host(1.6))
    both = predicted(replace(cal, host_speed_factors=(0.8, 1.6)))
    assert slow["TTFT mean (ms)"] > fast["TTFT mean (ms)"] * 1.05   # the launch bounds it
    for metric in ("TTFT mean (ms)", "TPOT mean (ms)", "mean running batch",
                   "output tok/s (window)"):
        assert both[metric] == pytest.approx((fast[metric] + slow[metric]) / 2)
    assert both["KV pool tokens"] == fast["KV pool tokens"]
