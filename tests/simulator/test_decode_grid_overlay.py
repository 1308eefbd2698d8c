"""A later decode kernel's own grid (kernel comparison files such as
docs/data/h100-2026-11-22/kernels/cuda-split/grid_cuda_vs_asm.json and grid_large_batch.json)
replacing the decode grids of the formats it measured: row mapping, replacement, the union of
several files, interpolation of interior gaps, provenance, errors, and that the committed
calibration the validation report uses is exactly a rebuild from its three sources."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from sim_helpers import H100_DATA, ROOT, scenario

from simulator.calibration.build import (
    _fill_held,
    build_calibration,
    kernel_grid_decode_rows,
    main,
    with_decode_grid,
)
from simulator.errors import SimulatorInputError
from simulator.specs.calibration import load_calibration

DATA = H100_DATA
MEAS = DATA / "calibration" / "measurements.json"
GRID = DATA / "kernels" / "cuda-split" / "grid_cuda_vs_asm.json"
LARGE = DATA / "kernels" / "cuda-split" / "grid_large_batch.json"
COMMITTED = ROOT / "docs" / "simulator-validation" / "calibration-cuda-split.json"


def _kernel_grid(batches=(8, 32), contexts=(1024, 4096), gpu="H100 (synthetic)") -> dict:
    rows = []
    for variant, scale in (("cuda", 1.0), ("asm", 2.0)):
        for mix in ("K8V4", "K4V2", "30/50/20", "20/60/20"):
            for b in batches:
                for ctx in contexts:
                    mb = b * ctx * (0.5 if mix == "K8V4" else 0.25) * 256 / 1e6
                    rows.append({"variant": variant, "batch": b, "context": ctx, "mix": mix,
                                 "ms": scale * mb / 1.5e6 * 1e3 + 0.01, "stored_mb": mb})
    return {"meta": {"gpu": gpu, "copy_tbs": 3.0}, "decode": rows}


def _measurements() -> dict:
    decode = [{"format": f, "batch": b, "context": c, "time_s": 1e-5 + 2e-9 * b * c,
               "read_bytes": 2.0 * b * c}
              for f in ("bf16", "diffkv", "K8V4") for b in (1, 512) for c in (256, 16384)]
    return {"gpu": "h100", "model": "llama-3-8b", "decode": decode,
            "provenance": {"gpu_name": "H100 (synthetic)", "date": "x"}}


def test_rows_of_one_variant_map_mixes_to_calibration_keys():
    rows = kernel_grid_decode_rows(_kernel_grid(), "cuda", "g.json")
    # 3 mapped mixes x 2 batches x 2 contexts; the unmapped mix 20/60/20 and asm are skipped
    assert len(rows) == 12
    assert {r["format"] for r in rows} == {"diffkv", "K8V4", "K4V2"}
    src = next(r for r in _kernel_grid()["decode"] if r["variant"] == "cuda"
               and r["mix"] == "30/50/20" and r["batch"] == 32 and r["context"] == 4096)
    got = next(r for r in rows if r["format"] == "diffkv" and r["batch"] == 32
               and r["context"] == 4096)
    assert got["time_s"] == pytest.approx(src["ms"] / 1e3)
    assert got["read_bytes"] == pytest.approx(src["stored_mb"] * 1e6)
    asm = kernel_grid_decode_rows(_kernel_grid(), "asm", "g.json")
    assert next(r for r in asm if r["format"] == "diffkv" and r["batch"] == 32
                and r["context"] == 4096)["time_s"] > got["time_s"]


def test_overlay_replaces_only_the_measured_keys_and_names_its_source(tmp_path):
    meas = with_decode_grid(_measurements(), _kernel_grid(), "cuda", "g.json", "2026-11-22")
    fmts = [r["format"] for r in meas["decode"]]
    assert fmts.count("bf16") == 4                       # untouched
    assert fmts.count("diffkv") == 4 and fmts.count("K8V4") == 4 and fmts.count("K4V2") == 4
    assert all(r["batch"] in (8, 32) for r in meas["decode"] if r["format"] == "diffkv")
    o = meas["provenance"]["decode_overrides"]
    assert (o["file"], o["variant"], o["date"], o["keys"]) == (
        "g.json", "cuda", "2026-11-22", ["K4V2", "K8V4", "diffkv"])
    cal = build_calibration(meas, None, "m.json + g.json")
    e = cal["gpus"]["h100"]
    assert e["measured"]["decode_attention"]["diffkv"]["batch"] == [8, 32]
    assert e["measured"]["decode_attention"]["bf16"]["batch"] == [1, 512]
    assert "cuda kernel, g.json (2026-11-22, H100 (synthetic))" in e["provenance"]["kernels"]
    # the built grid reproduces the kernel file's time at its points
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal))
    calib = load_calibration("h100", p)
    cost = replace(scenario(), calibration=calib).server("diffkv").cost
    for r in (r for r in meas["decode"] if r["format"] == "diffkv"):
        b, c = r["batch"], r["context"]
        assert cost.decode_attention_time(b, b * c, r["read_bytes"]) == pytest.approx(
            r["time_s"], rel=1e-3)    # etas are stored to 5 decimals


def test_overlay_errors_say_what_is_missing():
    with pytest.raises(SimulatorInputError, match="no decode rows of variant 'triton'"):
        kernel_grid_decode_rows(_kernel_grid(), "triton", "g.json")
    bad = _kernel_grid()
    bad["decode"][0]["ms"] = float("nan")
    with pytest.raises(SimulatorInputError, match=r"decode row 1 \(cuda, K8V4\): ms=nan"):
        kernel_grid_decode_rows(bad, "cuda", "g.json")
    with pytest.raises(SimulatorInputError, match="no meta.date"):
        with_decode_grid(_measurements(), _kernel_grid(), "cuda", "g.json")
    with pytest.raises(SimulatorInputError, match="'decode' list"):
        kernel_grid_decode_rows({"meta": {}}, "cuda", "g.json")


def test_fill_interpolates_interior_gaps_in_log_context_and_holds_the_edges():
    nan = float("nan")
    eta = np.array([[0.2, nan, 0.4, nan], [nan, 0.5, 0.6, nan], [nan, nan, nan, nan]])
    out = _fill_held(eta, [1024, 2048, 4096, 16384])
    # 2048 is halfway between 1024 and 4096 in log2: the mean of its row neighbours
    assert out[0, 1] == pytest.approx(0.3)
    assert out[0, 3] == pytest.approx(0.4)          # past the last measured column: held
    assert out[1, 0] == pytest.approx(0.5) and out[1, 3] == pytest.approx(0.6)
    assert out[2].tolist() == pytest.approx(out[1].tolist())   # empty row: column held
    # unequal log spacing: 1024 -> 16384 is 4 octaves, 4096 sits at w = 0.5
    out = _fill_held(np.array([[0.2, nan, 0.6]]), [1024, 4096, 16384])
    assert out[0, 1] == pytest.approx(0.4)
    out = _fill_held(np.array([[0.2, nan, 0.6]]), [1024, 2048, 16384])
    assert out[0, 1] == pytest.approx(0.2 + 0.4 * 0.25)
    # without coordinates (the old behaviour): the nearest measured cell
    assert _fill_held(np.array([[0.2, nan, 0.6]]))[0, 1] == pytest.approx(0.2)


def test_several_files_are_a_union_and_a_repeated_point_is_an_error():
    small = _kernel_grid()                                        # batch 8/32 x 1k/4k
    large = _kernel_grid(batches=(256,), contexts=(1024, 2048))   # batch 256 x 1k/2k
    meas = with_decode_grid(_measurements(), [small, large], "cuda", ["s.json", "l.json"],
                            "2026-11-22")
    dk = [(r["batch"], r["context"]) for r in meas["decode"] if r["format"] == "diffkv"]
    assert sorted(dk) == [(8, 1024), (8, 4096), (32, 1024), (32, 4096), (256, 1024),
                          (256, 2048)]
    o = meas["provenance"]["decode_overrides"]
    assert o["files"] == ["s.json", "l.json"] and o["file"] == "s.json + l.json"
    cal = build_calibration(meas, None, "m.json + s.json + l.json")
    g = cal["gpus"]["h100"]["measured"]["decode_attention"]["diffkv"]
    assert (g["batch"], g["context"]) == ([8, 32, 256], [1024, 2048, 4096])
    assert g["measured"] == [[True, False, True], [True, False, True], [True, True, False]]
    # 8 x 2048 lies between two measured cells of its row: interpolated, not held
    assert g["eta"][0][1] == pytest.approx(0.5 * (g["eta"][0][0] + g["eta"][0][2]), abs=1e-5)
    assert g["eta"][0][1] not in (g["eta"][0][0], g["eta"][0][2])
    assert g["eta"][2][2] == g["eta"][2][1]                       # 256 x 4096: held
    with pytest.raises(SimulatorInputError,
                       match=r"dup\.json: K8V4 batch 8 context 1024 is also in s\.json"):
        with_decode_grid(_measurements(), [small, _kernel_grid(batches=(8,))], "cuda",
                         ["s.json", "dup.json"], "2026-11-22")
    with pytest.raises(SimulatorInputError, match="measured on different GPUs"):
        with_decode_grid(_measurements(), [small, _kernel_grid(batches=(256,), gpu="A100")],
                         "cuda", ["s.json", "a.json"], "2026-11-22")


@pytest.mark.skipif(not (MEAS.exists() and GRID.exists() and LARGE.exists()
                         and COMMITTED.exists()),
                    reason="session-4 H100 data not in this checkout")
def test_committed_calibration_is_a_rebuild_of_its_sources(tmp_path, monkeypatch):
    """One source of truth: the calibration the validation report loads is exactly what the
    documented build makes from measurements.json and the two kernel grid files."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "rebuilt.json"
    assert main([str(MEAS.relative_to(ROOT)), "--decode-grid", str(GRID.relative_to(ROOT)),
                 "--decode-grid", str(LARGE.relative_to(ROOT)),
                 "--decode-grid-date", "2026-11-22", "--out", str(out)]) == 0
    rebuilt, committed = json.loads(out.read_text()), json.loads(COMMITTED.read_text())
    assert rebuilt == committed
    e = committed["gpus"]["h100"]
    g = e["measured"]["decode_attention"]["diffkv"]
    assert (g["batch"], g["context"]) == ([8, 32, 128, 256, 512], [1024, 2048, 4096, 16384])
    # the cuda kernel at 128 x 16k, 30/50/20: 877.4 us per layer call in grid_cuda_vs_asm
    assert g["time_s"][2][3] == pytest.approx(877.4e-6, rel=1e-3)
    # and at 512 x 2048: 531.0 us in grid_large_batch (65% of copy bandwidth)
    assert g["time_s"][4][1] == pytest.approx(531.0e-6, rel=1e-3)
    assert g["measured"][4] == [True, True, True, False]     # no 16k point at batch 512
    assert g["measured"][2] == [True, False, True, True]     # no 2k point at batch 128
    assert e["measured"]["provenance"]["decode_overrides"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert e["measured"]["provenance"]["decode_overrides"]["files"] == [
        str(GRID.relative_to(ROOT)), str(LARGE.relative_to(ROOT))]
    # the other formats keep calibrate_gpu.py's grids
    old = json.loads((DATA / "calibration" / "calibration.json").read_text())["gpus"]["h100"]
    assert e["measured"]["decode_attention"]["bf16"] == old["measured"]["decode_attention"][
        "bf16"]
    assert e["measured"]["gemm"] == old["measured"]["gemm"]
    # the cuda kernel is faster than the kernel calibrate_gpu.py timed, at every shared point
    cal_new = load_calibration("h100", COMMITTED)
    cal_old = load_calibration("h100", DATA / "calibration" / "calibration.json")
    for b in (32, 128):
        for c in (4096, 16384):
            assert (cal_new.measured.decode_attention["diffkv"](b, c)
                    > 1.5 * cal_old.measured.decode_attention["diffkv"](b, c))
    # the fitting run's shape (batch 368, ~2.7k tokens): eta from the measured 256/512 x
    # 2k/4k cells, no longer held at batch 128's (0.535 there before the large-batch grid)
    eta = cal_new.measured.decode_attention["diffkv"](368, 2650)
    assert 0.59 < eta < 0.62
    assert eta > cal_new.measured.decode_attention["diffkv"](128, 2650) + 0.05
