"""A later decode kernel's own grid (a kernel comparison file such as
docs/data/h100-2026-11-22/kernels/cuda-split/grid_cuda_vs_asm.json) replacing the decode grids
of the formats it measured: row mapping, replacement, provenance, errors, and that the committed
calibration the validation report uses is exactly a rebuild from its two sources."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from sim_helpers import scenario

from simulator.calibration.build import (
    build_calibration,
    kernel_grid_decode_rows,
    main,
    with_decode_grid,
)
from simulator.errors import SimulatorInputError
from simulator.specs.calibration import load_calibration

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data" / "h100-2026-11-22"
MEAS = DATA / "calibration" / "measurements.json"
GRID = DATA / "kernels" / "cuda-split" / "grid_cuda_vs_asm.json"
COMMITTED = ROOT / "docs" / "simulator-validation" / "calibration-cuda-split.json"


def _kernel_grid() -> dict:
    rows = []
    for variant, scale in (("cuda", 1.0), ("asm", 2.0)):
        for mix in ("K8V4", "K4V2", "30/50/20", "20/60/20"):
            for b in (8, 32):
                for ctx in (1024, 4096):
                    mb = b * ctx * (0.5 if mix == "K8V4" else 0.25) * 256 / 1e6
                    rows.append({"variant": variant, "batch": b, "context": ctx, "mix": mix,
                                 "ms": scale * mb / 1.5e6 * 1e3 + 0.01, "stored_mb": mb})
    return {"meta": {"gpu": "H100 (synthetic)", "copy_tbs": 3.0}, "decode": rows}


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


@pytest.mark.skipif(not (MEAS.exists() and GRID.exists() and COMMITTED.exists()),
                    reason="session-4 H100 data not in this checkout")
def test_committed_calibration_is_a_rebuild_of_its_sources(tmp_path, monkeypatch):
    """One source of truth: the calibration the validation report loads is exactly what the
    documented build makes from measurements.json and the kernel grid file."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "rebuilt.json"
    assert main([str(MEAS.relative_to(ROOT)), "--decode-grid", str(GRID.relative_to(ROOT)),
                 "--decode-grid-date", "2026-11-22", "--out", str(out)]) == 0
    rebuilt, committed = json.loads(out.read_text()), json.loads(COMMITTED.read_text())
    assert rebuilt == committed
    e = committed["gpus"]["h100"]
    g = e["measured"]["decode_attention"]["diffkv"]
    assert (g["batch"], g["context"]) == ([8, 32, 128], [1024, 4096, 16384])
    # the cuda kernel at 128 x 16k, 30/50/20: 877.4 us per layer call in the kernel file
    assert g["time_s"][2][2] == pytest.approx(877.4e-6, rel=1e-3)
    assert e["measured"]["provenance"]["decode_overrides"]["gpu"] == "NVIDIA H100 80GB HBM3"
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
