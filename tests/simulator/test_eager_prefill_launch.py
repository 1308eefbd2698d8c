"""An eager prefill step whose launches the calibration times (``eager_prefill_launch_s``)
runs its kernels under them and lasts the longer of the two: the calibration field, the cost
model, validate-runs' option, and the probe fit (diffkv-sim prefill-probes) that estimates it."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace

import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from simulator.serving.cost import StepShape
from simulator.specs.calibration import load_calibration


def _prefill(tokens: int, past: int = 0) -> StepShape:
    return StepShape(prefill_tokens=tokens, prefill_pairs=tokens * past + tokens * tokens / 2,
                     prefill_past_tokens=past, prefill_seqs=1)


def test_the_field_loads_round_trips_and_names_a_bad_value(tmp_path):
    base = load_calibration("h100").to_dict()
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | {
        "eager_prefill_launch_s": 0.009}}}))
    cal = load_calibration("h100", str(f))
    assert cal.eager_prefill_launch_s == 0.009
    assert cal.to_dict()["eager_prefill_launch_s"] == 0.009
    assert load_calibration("h100").eager_prefill_launch_s == 0.0
    assert "eager_prefill_launch_s" not in load_calibration("h100").to_dict()
    f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | {
        "eager_prefill_launch_s": -0.001}}}))
    with pytest.raises(InputError, match="eager_prefill_launch_s"):
        load_calibration("h100", str(f))


def test_a_kv_format_may_have_its_own_launch_time(tmp_path):
    base = load_calibration("h100").to_dict()
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | {
        "eager_prefill_launch_s": 0.015,
        "eager_prefill_launch_s_by_format": {"fp8": 0.0174}}}}))
    cal = load_calibration("h100", str(f))
    assert (cal.prefill_launch_s("fp8"), cal.prefill_launch_s("bf16")) == (0.0174, 0.015)
    assert cal.to_dict()["eager_prefill_launch_s_by_format"] == {"fp8": 0.0174}
    sc = replace(scenario(), calibration=cal)
    extend = _prefill(1, 1000)   # launch-bound on both caches
    gap = sc.server("fp8").cost.step_time(extend) - sc.server("bf16").cost.step_time(extend)
    assert gap == pytest.approx(0.0024, abs=1e-9)
    for bad in ({"fp8": -0.001}, [0.01]):
        f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | {
            "eager_prefill_launch_s_by_format": bad}}}))
        with pytest.raises(InputError, match="eager_prefill_launch_s_by_format"):
            load_calibration("h100", str(f))


def test_a_short_prefill_lasts_its_launches_a_long_one_its_kernels():
    sc = scenario()
    launch = 0.009
    summed = sc.server("bf16").cost
    cost = replace(sc, calibration=replace(sc.calibration,
                                           eager_prefill_launch_s=launch)).server("bf16").cost
    c = cost.calib

    def fixed(s: StepShape) -> float:
        return (c.step_overhead_s + c.seq_overhead_s * s.prefill_seqs
                + c.prefill_step_overhead_s + c.prefill_seq_overhead_s * s.prefill_seqs
                + c.prefill_token_overhead_s * s.prefill_tokens)

    def kernels(s: StepShape) -> float:
        return summed.step_time(s) - fixed(s) - summed.layers * summed.layer_overhead(s)

    extend, long = _prefill(1, 1000), _prefill(8192)
    assert kernels(extend) < launch < kernels(long)
    # launch-bound: the kernels hide under the launches
    assert cost.step_time(extend) == pytest.approx(fixed(extend) + launch)
    # kernel-bound: the launches hide under the kernels, and no per-layer launch cost is added
    assert cost.step_time(long) == pytest.approx(fixed(long) + kernels(long))
    assert cost.step_time(long) < summed.step_time(long)
    # decode steps keep their graph or eager per-layer costs
    decode = StepShape(decode_reqs=8, decode_kv_tokens=8000, decode_read_bytes=1e6)
    assert cost.step_time(decode) == summed.step_time(decode)


def test_the_per_prompt_token_cost_runs_under_the_launches_with_the_kernels():
    sc = scenario()
    extend = _prefill(1, 1000)
    tok = extend.prefill_tokens
    bare = sc.server("bf16").cost
    c0 = bare.calib
    fixed = (c0.step_overhead_s + c0.seq_overhead_s + c0.prefill_step_overhead_s
             + c0.prefill_seq_overhead_s)
    kernels = (bare.step_time(extend) - bare.layers * bare.layer_overhead(extend) - fixed
               - c0.prefill_token_overhead_s * tok)
    launch = kernels + 0.001

    def cost(p_tok: float):
        cal = replace(sc.calibration, eager_prefill_launch_s=launch,
                      prefill_token_overhead_s=p_tok)
        return replace(sc, calibration=cal).server("bf16").cost

    # 0.5 ms of per-token work fits in the 1 ms the launches outlast the kernels: hidden
    assert cost(0.0005 / tok).step_time(extend) == pytest.approx(fixed + launch)
    # 2 ms does not: the step lasts its kernels and that work, not the launches plus it
    assert cost(0.002 / tok).step_time(extend) == pytest.approx(fixed + kernels + 0.002)
    # the fit's kernel-bound side ignores the launches
    assert cost(0.0005 / tok).step_time(extend, launch_floor=False) == pytest.approx(
        fixed + kernels + 0.0005)


def test_validate_simulator_reads_the_option_per_backend(tmp_path, capsys):
    vs = importlib.import_module("simulator.validation.runs")
    def launch(items: list[str]) -> dict[str, float]:
        return vs.key_seconds_arg("eager_prefill_launch_s", items)
    assert launch(["triton=0.0089", "diffkv=0.0138"]) == {"triton": 0.0089, "diffkv": 0.0138}
    assert launch(["triton=0.015", "fp8=0.0174"]) == {"triton": 0.015, "fp8": 0.0174}
    for bad in ("flashinfer=0.003", "triton", "triton=-1", "diffkv=fast", "triton=18.6"):
        with pytest.raises(InputError, match="--eager-prefill-launch-s"):
            launch([bad])
    rc = vs.main([str(tmp_path), "--eager-prefill-launch-s", "triton=x",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    assert "--eager-prefill-launch-s 'triton=x'" in capsys.readouterr().err


def test_the_probe_fit_finds_the_launch_time_it_was_built_with():
    from simulator.validation import prefill_probes as probe
    launch, offset = 9.0, 10.0
    kernels = [3.1, 4.4, 6.0, 11.8, 23.1, 104.0]
    points = [(k, offset + max(launch, k)) for k in kernels]
    fit = probe.launch_fit(points)
    assert fit["launch_ms"] == pytest.approx(launch, abs=0.11)
    assert fit["offset_ms"] == pytest.approx(offset, abs=0.11)
    assert fit["rms"] < 0.01 < fit["sum_rms"]
    # kernels that always outlast the launches cannot tell a launch time from none
    summed = probe.launch_fit([(k, 5.0 + k) for k in (40.0, 60.0, 90.0)])
    assert summed["launch_ms"] <= 40.0 and summed["rms"] < 1e-9
    with pytest.raises(Exception, match=">= 3"):
        probe.launch_fit(points[:2])


def test_launches_begun_under_the_step_before_count_toward_the_floor():
    sc = scenario()
    launch = 0.009
    cost = replace(sc, calibration=replace(sc.calibration,
                                           eager_prefill_launch_s=launch)).server("bf16").cost
    extend = _prefill(1, 1000)
    alone = cost.step_time(extend)
    # 2 ms of the launches ran under the decode step before: 2 ms fewer remain
    assert cost.step_time(replace(extend, launch_head_start_s=0.002)) == pytest.approx(
        alone - 0.002)
    # launches done before the step starts leave the kernels alone: never below them
    kernels_only = cost.step_time(replace(extend, launch_head_start_s=1.0))
    assert alone - launch < kernels_only < alone - 0.002
    assert cost.step_time(replace(extend, launch_head_start_s=0.05)) == kernels_only
    # without a launch time the head start changes nothing
    summed = sc.server("bf16").cost
    assert summed.step_time(replace(extend, launch_head_start_s=0.004)) == summed.step_time(
        extend)


def _two_requests(sc, overlap: bool, fmt: str = "bf16"):
    """A on an idle server at 0 s, decoding 40 tokens; B, alike, arriving while A decodes:
    (step kinds, step times) of the run."""
    from sglang_diffkv.serving_io.trace import Trace, TraceRequest
    cal = replace(sc.calibration, eager_prefill_launch_s=0.05)  # every prefill launch-bound
    run = replace(sc, calibration=cal, settings=replace(
        sc.settings, disable_overlap_schedule=not overlap))
    trace = Trace((TraceRequest(0.0, 64, 40), TraceRequest(0.12, 64, 40)))
    log = run.run(trace, fmt).replicas[0].log
    return log.kind, log.dt


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prefill_formed_while_a_decode_step_ran_launched_during_it(overlap):
    kind, dt = _two_requests(scenario(), overlap)
    prefills = [i for i, k in enumerate(kind) if k == 0]
    assert len(prefills) == 2 and prefills[0] == 0
    a, b = prefills
    assert kind[b - 1] == 1     # B's prefill follows a decode step
    if overlap:
        # B's launches began when that decode step started: they end 50 ms after it
        assert dt[b - 1] + dt[b] == pytest.approx(dt[a], rel=1e-6)
    else:
        assert dt[b] == pytest.approx(dt[a], rel=1e-6)


def test_a_prefill_whose_allocation_waits_for_the_step_in_flight_gets_no_head_start():
    # DiffKV's prefill allocation syncs with the forward in flight, so its launches begin
    # only when the decode step before it has ended, even under the overlap scheduler
    from simulator.serving.cost import SYNCED_PREFILL_KEYS
    assert "diffkv" in SYNCED_PREFILL_KEYS and "bf16" not in SYNCED_PREFILL_KEYS
    kind, dt = _two_requests(scenario(), overlap=True, fmt="diffkv")
    a, b = [i for i, k in enumerate(kind) if k == 0]
    assert kind[b - 1] == 1
    assert dt[b] == pytest.approx(dt[a], rel=1e-6)
    assert dt[b - 1] + dt[b] > dt[a] * 1.05
