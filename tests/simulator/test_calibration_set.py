"""The calibration a user gets: ``--gpu h100`` / ``--gpu h200`` run the shipped calibration
fitted to that GPU's real runs (one file per attention backend), any other GPU runs the
published defaults and every output says it is an uncalibrated estimate."""

from __future__ import annotations

import io
import json

from simulator.cli import main
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration_set import backend_of, load_calibration_set, measured_gpus
from simulator.specs.gpu import load_gpu
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario


def run(*argv: str) -> str:
    out = io.StringIO()
    assert main(list(argv), out=out) == 0
    return out.getvalue()


def test_measured_gpus_ship_one_file_per_backend():
    assert measured_gpus() == ["h100", "h200"]
    for gpu in measured_gpus():
        s = load_calibration_set(gpu)
        assert s.kind == "measured" and s.gpu == gpu
        assert s.files == {"triton": f"simulator/calibration/{gpu}-triton.json",
                           "diffkv": f"simulator/calibration/{gpu}-diffkv.json"}
        assert "docs/simulator-validation" in s.report
        # the fitted host terms are what makes these the validated model
        assert s.by_backend["diffkv"].step_overhead_s != s.by_backend["triton"].step_overhead_s


def test_formats_run_on_their_backends_calibration():
    assert [backend_of(k) for k in ("bf16", "fp8", "K8V4", "K4V2", "diffkv", "triton")] == [
        "triton", "triton", "diffkv", "diffkv", "diffkv", "triton"]
    cset = load_calibration_set("h200")
    sc = Scenario(load_model("llama-3-8b"), load_gpu("h200"), cset, ServerSettings())
    for fmt, be in (("bf16", "triton"), ("fp8", "triton"), ("k8v4", "diffkv"),
                    ("diffkv", "diffkv")):
        assert sc.server(fmt).deployment.calibration is cset.by_backend[be], fmt


def test_outputs_say_which_calibration_ran(tmp_path):
    text = run("compare", "--gpu", "h200", "--trace", "sharegpt", "-n", "40",
               "--json", str(tmp_path / "c.json"))
    assert "calibration: fitted to measured H200 runs" in text
    assert "simulator/calibration/h200-diffkv.json" in text
    cal = json.loads((tmp_path / "c.json").read_text())["scenario"]["calibration"]
    assert cal["kind"] == "measured" and cal["files"]["triton"].endswith("h200-triton.json")

    text = run("replay", "--gpu", "a100", "--trace", "sharegpt", "-n", "20")
    assert "UNCALIBRATED ESTIMATE for a100" in text and "default.json" in text

    text = run("replay", "--gpu", "h100", "-n", "20", "--calibration",
               "simulator/calibration/default.json")
    assert "given with --calibration" in text
    assert "h100 (measured)" in run("list") and "l40 (uncalibrated)" in run("list")
