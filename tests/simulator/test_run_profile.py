"""diffkv-sim profile-run (simulator/validation/run_profile.py) on the synthetic harness folder
of test_sim_validation_harness: a run whose "server log" the simulator wrote with a hidden
step cost, replayed with that cost, reads the same on both sides (prefill and decode step
counts, the decode step on the measured line, the implied prefill step, the batch window by
window); replayed with a dearer decode step, the profile puts the difference on the decode
step and nowhere else; the DiffKV step profile's lines are read; bad options end in one
line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_validation_harness import HIDDEN_STEP_S, make_results

from sglang_diffkv.serving_io.profile_lines import profile_line
from simulator.specs.calibration import load_calibration
from simulator.validation.harness import load_harness
from simulator.validation.run_profile import main, profile_run, profile_text, step_profile

RUN = "bf16/ladder@0.5x"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness")
    make_results(root)
    return root


def _profile(results: Path, extra_step_s: float = 0.0) -> dict:
    h = load_harness(results)
    calib = replace(load_calibration("h100"), step_overhead_s=HIDDEN_STEP_S + extra_step_s)
    return profile_run(h, h.run(RUN), calib, "llama-3-8b", "h100", window_s=5.0)


def test_the_log_and_its_own_replay_read_alike(results):
    p = _profile(results)
    m, s = p["measured"], p["simulated"]
    assert m["prefill_steps"] == pytest.approx(s["prefill_steps"], abs=2)
    assert m["decode_steps"] == pytest.approx(s["decode_steps"], rel=0.02)
    # the decode step on the line through the log's decode-only intervals is the replay's
    assert p["decode_line"]["intervals"] >= 10
    assert s["decode_ms_at_measured_line"] == pytest.approx(s["decode_ms"], rel=0.02)
    assert m["decode_ms"] == pytest.approx(s["decode_ms"], rel=0.02)
    # the prefill step the log implies (its intervals with prefills, less their decode steps)
    assert m["prefill_ms"] == pytest.approx(s["prefill_ms"], rel=0.10)
    assert m["prefill_share"] + m["decode_share"] == pytest.approx(
        s["prefill_share"] + s["decode_share"], abs=0.02)
    for k in ("mean_tpot_ms", "mean_ttft_ms", "mean_batch"):
        v = p["metrics"][k]
        assert v["simulated"] == pytest.approx(v["measured"], rel=0.02), k
    wm, ws = p["windows"]["measured"], p["windows"]["simulated"]
    assert len(wm) == len(ws) == 2
    for a, b in zip(wm, ws, strict=True):
        assert a["prefills"] == pytest.approx(b["prefills"], abs=2)
        assert a["batch"] == pytest.approx(b["batch"], rel=0.05)
    bins = {r["batch"]: r for r in p["decode_bins"]}
    assert bins[(0, 20)]["model_ms"] == pytest.approx(bins[(0, 20)]["measured_ms"], rel=0.02)
    text = profile_text(p)
    assert "where the window goes" in text and "Measured decode step:" in text


def test_a_dearer_decode_step_shows_on_the_decode_step(results):
    base, slow = _profile(results), _profile(results, extra_step_s=1e-3)
    s = slow["simulated"]
    # the measured side is the log's: unchanged
    assert slow["measured"] == base["measured"]
    # the replay's decode step is 1 ms over the measured line at its own batches
    assert s["decode_ms"] - s["decode_ms_at_measured_line"] == pytest.approx(1.0, abs=0.1)
    assert s["decode_steps"] < 0.92 * slow["measured"]["decode_steps"]


def test_the_diffkv_step_profile_lines_are_read():
    win = {"step": 300.0, "alloc": 3.0, "reclaim": 1.0, "free": 0.0, "policy": 0.0}
    text = "\n".join([
        "[2026-11-25 20:06:21] " + profile_line("prefill", 10, win, 10, win, host_ms=250.0),
        "[2026-11-25 20:06:22] " + profile_line("prefill", 30, {**win, "step": 1200.0}, 40,
                                                win, host_ms=1050.0),
        "[2026-11-25 20:06:22] " + profile_line("decode", 100, {**win, "step": 900.0}, 100,
                                                win)])
    got = step_profile(text)
    # step-weighted: (10 x 30 + 30 x 40) / 40 ms
    assert got["prefill"]["steps"] == 40
    assert got["prefill"]["step_ms"] == pytest.approx(37.5)
    assert got["prefill"]["host_ms"] == pytest.approx((250.0 + 1050.0) / 40)
    assert got["decode"]["step_ms"] == pytest.approx(9.0)
    assert got["decode"]["host_ms"] != got["decode"]["host_ms"]   # no host field: nan
    assert step_profile("no profile here") == {}


def test_the_command(results, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["--results", str(results), "--run", RUN, "--gpu", "h100",
               "--json", str(out)])
    assert rc == 0
    assert "where the window goes" in capsys.readouterr().out
    got = json.loads(out.read_text())
    assert [p["run"] for p in got] == [RUN]
    assert main(["--results", str(results), "--run", RUN, "--window-s", "0"]) == 2
    assert "--window-s 0 must be > 0" in capsys.readouterr().err
    assert main(["--results", str(results), "--run", "bf16/nope"]) == 2
    assert "no run 'bf16/nope'" in capsys.readouterr().err
    assert main(["--run", RUN]) == 2
    assert "no result folder" in capsys.readouterr().err
