"""SGLang's overlap loop seen from an eager prefill, where the calibration says its launches
hold the loop (``eager_launch_holds_loop``): the host forms the next batch once it has launched
the current one, and streams a step's tokens only after it has launched the next (``Replica``,
``CostModel.launch_s``)."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.serving.cost import StepShape

LAUNCH_S = 0.05


def _run(arrivals: list[float], overlap: bool = True, launch_s: float = LAUNCH_S,
         prompt: int = 64, fmt: str = "bf16", holds: bool = True):
    sc = scenario()
    run = replace(sc, calibration=replace(sc.calibration, eager_prefill_launch_s=launch_s,
                                          first_token_latency_s=0.0,
                                          eager_launch_holds_loop=holds),
                  settings=replace(sc.settings, disable_overlap_schedule=not overlap))
    res = run.run(Trace(tuple(TraceRequest(t, prompt, 20) for t in arrivals)), fmt)
    log = res.replicas[0].log
    ends = list(log.t_end)
    return res.requests, list(log.kind), ends, list(log.dt)


def test_launch_s_is_a_prefills_launch_floor_less_its_head_start():
    sc = scenario()
    cost = replace(sc, calibration=replace(sc.calibration, eager_prefill_launch_s=0.03)
                   ).server("bf16").cost
    prefill = StepShape(prefill_tokens=100, prefill_pairs=5000.0, prefill_seqs=1)
    assert cost.launch_s(prefill) == pytest.approx(0.03)
    assert cost.launch_s(replace(prefill, launch_head_start_s=0.01)) == pytest.approx(0.02)
    assert cost.launch_s(replace(prefill, launch_head_start_s=0.04)) == 0.0
    assert cost.launch_s(StepShape(decode_reqs=8, decode_kv_tokens=800,
                                   decode_read_bytes=1e6)) == 0.0
    assert sc.server("bf16").cost.launch_s(prefill) == 0.0   # launches not timed


@pytest.mark.parametrize("fmt", ["bf16", "diffkv"])
def test_a_request_arriving_during_a_prefills_launch_is_prefilled_next(fmt):
    # B arrives 20 ms into A's 50 ms of launches: the host, still launching A, has not
    # formed the next batch yet, so B's prefill follows A's at once
    reqs, kind, ends, dt = _run([0.0, 0.02], fmt=fmt)
    assert kind[:2] == [0, 0]
    a, b = reqs
    # A's first token streams once B's launches are done (no head start: a prefill's own
    # launches kept the host busy), B's when the decode step after it is launched
    assert a.first_token == pytest.approx(ends[0] + LAUNCH_S)
    assert kind[2] == 1 and b.first_token == pytest.approx(ends[1])
    assert a.first_token <= ends[1]


def test_a_request_arriving_after_the_launches_waits_a_step_more():
    # A's kernels (8,000 tokens) outlast its 1 ms of launches: B, arriving 10 ms in, is seen
    # only by the batch formed after the next launch, so a decode step runs between
    reqs, kind, ends, dt = _run([0.0, 0.01], launch_s=0.001, prompt=8000)
    assert dt[0] > 0.02
    assert kind[:3] == [0, 1, 0]
    a, b = reqs
    assert a.first_token == pytest.approx(ends[0])   # a decode step launches next: no wait


def test_without_overlap_tokens_stream_at_the_steps_end():
    reqs, kind, ends, dt = _run([0.0, 0.02], overlap=False)
    assert kind[:2] == [0, 0]
    assert reqs[0].first_token == pytest.approx(ends[0])


def test_the_last_token_waits_for_a_prefill_launched_after_it():
    # A finishes in a decode step; C arrives during the step before it, so C is prefilled
    # right after A's last step: A's last token streams after C's launches (DiffKV's start
    # when that step ends), and A's E2E grows by them, its TTFT does not
    alone, kind, ends, _ = _run([0.0], fmt="diffkv")
    last = len(kind) - 1
    assert kind[last] == 1 and alone[0].finish == pytest.approx(ends[last])
    reqs, kind2, ends2, _ = _run([0.0, ends[last - 1] - 0.001], fmt="diffkv")
    assert kind2[:last + 2] == kind[:last + 1] + [0]
    assert reqs[0].finish == pytest.approx(ends[last] + LAUNCH_S)
    assert reqs[0].first_token == pytest.approx(alone[0].first_token)


def test_a_batch_formed_on_an_idle_loop_does_not_hold_the_tokens_before_it():
    # C arrives during A's last decode step: the loop, finding nothing to launch after it,
    # streams A's last token first and only then forms C's prefill
    alone, kind, ends, _ = _run([0.0], fmt="diffkv")
    last = len(kind) - 1
    reqs, kind2, ends2, _ = _run([0.0, ends[last] - 0.001], fmt="diffkv")
    assert kind2[last + 1] == 0
    assert reqs[0].finish == pytest.approx(ends[last])


def test_off_by_default_the_next_batch_is_formed_at_the_steps_start():
    assert scenario().calibration.eager_launch_holds_loop is False
    reqs, kind, ends, dt = _run([0.0, 0.02], holds=False)
    assert kind[:3] == [0, 1, 0]                      # B waits for the step after A's
    assert reqs[0].first_token == pytest.approx(ends[0])


def test_the_calibration_field_round_trips_and_names_a_bad_value(tmp_path):
    import json

    from simulator.errors import SimulatorInputError
    from simulator.specs.calibration import load_calibration
    cal = replace(scenario().calibration, eager_launch_holds_loop=True)
    entry = cal.to_dict()
    assert entry["eager_launch_holds_loop"] is True
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"version": 1, "gpus": {"h100": entry}}))
    assert load_calibration("h100", path).eager_launch_holds_loop is True
    entry["eager_launch_holds_loop"] = "yes"
    path.write_text(json.dumps({"version": 1, "gpus": {"h100": entry}}))
    with pytest.raises(SimulatorInputError, match="eager_launch_holds_loop='yes'"):
        load_calibration("h100", path)
    assert "eager_launch_holds_loop" not in scenario().calibration.to_dict()


@pytest.mark.parametrize("backend", ["triton", "diffkv"])
def test_validate_simulator_turns_it_on_per_backend(monkeypatch, capsys, tmp_path, backend):
    from sim_helpers import validator_options
    vs = importlib.import_module("simulator.validation.runs")
    seen = {}

    def fake_fit(h, keys, model, gpu, base, *a, **k):
        seen["base"] = base
        return keys[0], base, {"backend": keys[0]}
    monkeypatch.setattr(vs, "fit", fake_fit)
    a = validator_options(vs, eager_prefill_launch_s={"diffkv": 0.03},
                          eager_launch_holds_loop=["diffkv"], plots=str(tmp_path),
                          doc=str(tmp_path / "d.md"))
    _, cal, info = vs.fit_backend(None, a, scenario().calibration, (backend, [backend]))
    assert cal.eager_launch_holds_loop is (backend == "diffkv")
    assert info.get("given", {}).get("eager_launch_holds_loop", False) is (backend == "diffkv")
    with pytest.raises(SystemExit) as bad:
        vs.main([str(tmp_path), "--eager-launch-holds-loop", "vllm", "--doc",
                 str(tmp_path / "d.md")])
    assert bad.value.code == 2
    assert "--eager-launch-holds-loop: invalid choice: 'vllm'" in capsys.readouterr().err
