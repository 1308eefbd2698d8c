"""Held-out runs (simulator/validation/held_out.py): named in the recipe, refused to the fitter
before anything is fitted, scored apart by load band; the shipped H200 recipe holds out
traces and load levels its fit never replays."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from test_sim_validation_harness import make_results

from simulator.validation.held_out import BANDS, band, band_table, score_by_band
from simulator.validation.recipe import load_recipe


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness")
    make_results(root)
    return root


def _runs():
    return importlib.import_module("simulator.validation.runs")


def test_bands_split_a_ladder_by_its_load_and_bursts_are_saturation():
    assert [band(x, "ladder") for x in (0.2, 0.5, 0.79, 0.8, 1.05)] == [
        "< 50%", "50-80%", "50-80%", ">= 80%", ">= 80%"]
    assert band(None, "ladder") == "load ?"
    assert band(None, "sharegpt") == band(0.6, "longgen") == "saturation"
    rows = [{"band": "50-80%", "verdict": v} for v in ("PASS", "MISS", "-")]
    assert score_by_band(rows) == {"50-80%": (1, 2)}
    table = band_table({"held out": rows, "other": []})
    assert "| 50-80% | 1 / 2 | - |" in table and "| all | **1 / 2** | **0 / 0** |" in table
    assert set(BANDS) >= {"< 50%", "50-80%", ">= 80%", "saturation"}


def test_held_out_rows_are_reported_apart_with_their_load_band(results, tmp_path, capsys):
    vs = _runs()
    doc, out = tmp_path / "d.md", tmp_path / "rows.json"
    assert vs.main([str(results), "--doc", str(doc), "--json", str(out),
                    "--held-out", "bf16/ladder*"]) == 0
    # minutes of fitting and replay say where they are, one line per stage and run
    err = capsys.readouterr().err
    assert "fitting step costs on 1 run(s): bf16/longgen" in err
    assert "replaying run 1/" in err and "bf16/ladder@0.5x" in err
    got = json.loads(out.read_text())
    assert got["held_out"] == {"bf16/ladder@0.5x": "load level"}
    held = [r for r in got["rows"] if r["held_out"]]
    assert held and {r["run"] for r in held} == {"bf16/ladder@0.5x"}
    assert {r["band"] for r in held} == {"50-80%"}    # half the saturation rate
    others = [r for r in got["rows"] if r["run"] == "bf16/sharegpt"]
    assert others and all(r["held_out"] is None and r["band"] == "saturation" for r in others)
    text = doc.read_text()
    assert "Held out by construction (`--held-out`; below)" in text
    assert "## Held out by construction" in text and "## Validated, not held out" in text
    assert "held-out load levels (1 runs): bf16/ladder@0.5x" in text


@pytest.mark.parametrize("argv, words", [
    (["--held-out", "bf16/longgen"], "fitting run bf16/longgen is held out"),
    (["--held-out", "nope/*"], "'nope/*' matches no run"),
    # the two sharegpt runs replay one request file: holding one out and fitting the other
    # would fit its requests under another name
    (["--fit-run", "diffkv/sharegpt", "--held-out", "bf16/sharegpt"],
     "held-out run bf16/sharegpt replays the request file of fitting run diffkv/sharegpt"),
])
def test_the_fitter_refuses_a_held_out_run_before_fitting(results, tmp_path, capsys, argv,
                                                          words):
    vs = _runs()
    assert vs.main([str(results), "--doc", str(tmp_path / "d.md"), *argv]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").glob("calibration-*"))


def test_the_h200_recipe_holds_out_traces_and_load_levels_its_fit_never_runs():
    r = load_recipe("h200")
    held, fitted = r["held_out"], r["fit_run"] + r["fit_decode_run"]
    # every fitted ladder rate is one of 4, 6, 10, 12, 14 req/s; every held-out one is not
    assert all(any(f"ladder@{x}rps" in k for x in (4, 6, 10, 12, 14)) or "sharegpt" in k
               for k in fitted)
    assert {"*#l", "*#z"} <= set(held)    # long prompts, Azure code: traces never fitted
    assert any("23.03rps" in p for p in held)
