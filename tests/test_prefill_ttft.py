"""sglang_diffkv.bench.prefill_ttft against the CPU stand-in server (no GPU, no sglang), and
the simulator's side of its record (``diffkv-sim prefill-probes``)."""

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_diffkv.bench import prefill_ttft as probe
from sglang_diffkv.bench.fakeserver import READY
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.prefill_probe import plan_from_record

sim_probes = pytest.importorskip(  # (the GPU machine has no simpy; its gpu tests still run)
    "simulator.validation.prefill_probes")

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_url(tmp_path: Path):
    port = _free_port()
    log = open(tmp_path / "fake.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "sglang_diffkv.bench.fakeserver",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "FAKE_STEP_S": "0.004"}, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while READY not in (tmp_path / "fake.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "fake server died"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_phases_time_every_probe_and_the_table_summarises_them(fake_url: str,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = probe.main(["--url", fake_url, "--out", str(out), "--lengths", "4,9",
                     "--per-length", "3", "--gap-s", "0.02", "--load-batch", "2"])
    assert rc == 0
    data = json.loads((out / "prefill_ttft.json").read_text())
    rows = data["requests"]
    assert len(rows) == 3 * 2 * 3
    # the record names its plan: the simulator replays the same requests from it
    assert plan_from_record(data) == probe.ProbePlan((4, 9), 3, 0.02, 2, 512)
    assert {r["phase"] for r in rows} == set(probe.PHASES)
    # answered, within the probe timeout
    assert all(r["error"] is None and 0 < r["ttft_ms"] < 1000 * probe.PROBE_TIMEOUT_S
               for r in rows)
    summary = {(s["phase"], s["input_len"]): s for s in data["summary"]}
    assert set(summary) == {(p, n) for p in probe.PHASES for n in (4, 9)}
    for (phase, n), s in summary.items():
        t = [r["ttft_ms"] for r in rows if r["phase"] == phase and r["input_len"] == n]
        assert s["n"] == 3 and s["failed"] == 0
        assert s["median_ms"] == pytest.approx(statistics.median(t))
        assert s["p10_ms"] <= s["median_ms"] <= s["p90_ms"]


def test_the_loaded_phase_keeps_the_probes_prompts_and_outlasts_them() -> None:
    plan = probe.ProbePlan((16, 64), 2, 0.5, 3, 100)
    probes = plan.probes()
    loaded = plan.phase_requests("loaded")
    assert [s.input_len for s in loaded[:4]] == [s.input_len for s in probes]
    assert all(s.output_len == 1 for s in loaded[:4])
    assert loaded[0].arrival_s == plan.load_lead_s
    load = loaded[4:]
    assert len(load) == 3 and all(s.arrival_s == 0 and s.input_len == 100 for s in load)
    # at 4 ms a step the load still streams when the last probe arrives
    assert load[0].output_len * 0.004 > loaded[3].arrival_s


@pytest.mark.parametrize("kw, word", [
    ({"lengths": (1,)}, "lengths"), ({"lengths": ()}, "lengths"),
    ({"per_length": 0}, "per_length"), ({"gap_s": 0.0}, "gap_s"),
    ({"load_batch": -1}, "load_batch"), ({"load_input": 9000}, "load_input"),
])
def test_bad_plans_are_named(kw: dict, word: str) -> None:
    args = {"lengths": (8,), "per_length": 1, "gap_s": 0.1, "load_batch": 1,
            "load_input": 8, **kw}
    with pytest.raises(InputError, match=word):
        probe.ProbePlan(**args)


def test_an_older_record_gives_its_plan_by_its_argv() -> None:
    plan = plan_from_record({"argv": ["--model", "m", "--lengths", "64,2048", "--gap-s", "0.5",
                                      "--out", "/o"]})
    assert plan == probe.ProbePlan((64, 2048), 20, 0.5, 16, 512)
    with pytest.raises(InputError, match="plan"):
        plan_from_record({})


def test_bad_command_lines_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for argv, word in ((["--lengths", "a,b"], "--lengths"), (["--starts", "0"], "--starts"),
                       ([], "--model")):
        with pytest.raises(SystemExit) as e:
            probe.main(["--out", str(tmp_path), *argv])
        assert e.value.code == 2
        assert word in capsys.readouterr().err
    for argv, word in (([str(tmp_path)], "prefill_ttft.json"),
                       ([str(tmp_path), "--calibration", "x.json"], "--calibration")):
        assert sim_probes.main(argv) == 2
        assert word in capsys.readouterr().err


def test_the_simulator_replays_the_probes_beside_the_measurement(fake_url: str,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert probe.main(["--url", fake_url, "--out", str(out), "--lengths", "64,2048",
                       "--per-length", "2", "--gap-s", "0.02", "--load-batch", "2"]) == 0
    # as if a bf16 server had answered: the fake's log stands in for its log
    data = json.loads((out / "prefill_ttft.json").read_text())
    for r in data["requests"] + data["summary"]:
        r["config"] = "bf16"
    (out / "prefill_ttft.json").write_text(json.dumps(data))
    (out / "logs").mkdir()
    (out / "logs" / "server__0__bf16.log").write_text((tmp_path / "fake.log").read_text())
    calib = str(ROOT / "simulator" / "calibration" / "default.json")
    rows, launches = sim_probes.compare(out, "h200", {"triton": calib})
    assert launches[0]["calibration"].endswith("default.json")
    got = {(r["phase"], r["input_len"]): r for r in rows}
    assert set(got) == {(p, n) for p in probe.PHASES for n in (64, 2048)}
    for r in rows:
        assert r["model_ms"] > 0
        assert r["error"] == pytest.approx(r["model_ms"] / r["measured_ms"] - 1)
    # the model's radix cache serves the repeated prompt: a one-token extend beats the
    # 2048-token prefill; the decode batch makes a probe wait
    assert got[("cached", 2048)]["model_ms"] < 0.5 * got[("fresh", 2048)]["model_ms"]
    assert got[("loaded", 64)]["model_ms"] > got[("cached", 64)]["model_ms"]
    table = sim_probes.format_comparison(rows)
    assert "cached" in table and "model" in table
    # no file for its backend: the GPU's shipped set, as diffkv-sim --gpu h200 runs
    _, launches = sim_probes.compare(out, "h200", {"diffkv": calib})
    assert launches[0]["calibration"].endswith("h200-triton.json")


def test_a_prime_burst_runs_first_and_is_recorded(fake_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert probe.main(["--url", fake_url, "--out", str(out), "--lengths", "4",
                       "--per-length", "2", "--gap-s", "0.02", "--load-batch", "0",
                       "--prime", "6", "--prime-trace", "azure-conv"]) == 0
    data = json.loads((out / "prefill_ttft.json").read_text())
    assert data["primes"]["0"]["requests"] == 6
    assert data["primes"]["0"]["completed"] == 6
    assert data["primes"]["0"]["trace"] == "azure-conv"
    assert len(data["requests"]) == 2 * 2    # fresh and cached; no loaded phase
    assert all(r["error"] is None for r in data["requests"])


def test_a_bad_prime_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for argv, word in ((["--prime", "-1"], "--prime -1"),
                       (["--prime", "5", "--prime-trace", "nope"], "--prime-trace nope")):
        with pytest.raises(SystemExit) as e:
            probe.main(["--out", str(tmp_path), "--url", "http://127.0.0.1:9", *argv])
        assert e.value.code == 2
        assert word in capsys.readouterr().err
