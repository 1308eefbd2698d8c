"""Measured eta grids: loading, log-space interpolation held at the edges, the cost model using
them (a grid point reproduces the measured kernel time), the build from micro-benchmark
measurements, and the fixed-cost fit recovering known constants from SGLang-shaped lines."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from simulator.calibration.build import build_calibration
from simulator.serving.cost import StepShape
from simulator.specs.calibration import EtaGrid1D, EtaGrid2D, load_calibration
from simulator.validation.fit import decode_samples, prefill_shape
from simulator.validation.step_fit import fit_step_costs, step_rows


def _entry_with(measured: dict) -> dict:
    base = load_calibration("h100").to_dict()
    base["measured"] = measured
    return {"gpus": {"h100": base}}


def _write(tmp_path, data) -> str:
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_1d_grid_interpolates_in_log_space_and_holds_outside():
    g = EtaGrid1D.from_dict({"m": [1, 4, 16], "eta": [0.2, 0.6, 0.8], "n": 8, "k": 8}, "t")
    assert g(1) == 0.2 and g(4) == 0.6 and g(16) == 0.8
    assert g(2) == pytest.approx(0.4)              # halfway in log2(m), not at m=2.5
    assert g(0.25) == 0.2 and g(1e6) == 0.8        # held, never extrapolated
    xs = np.geomspace(0.5, 64, 50)
    assert np.all(np.diff([g(x) for x in xs]) >= 0)   # monotone data -> monotone eta


def test_2d_grid_bilinear_and_held():
    g = EtaGrid2D.from_dict({"batch": [1, 4], "context": [256, 1024],
                             "eta": [[0.1, 0.3], [0.5, 0.7]]}, ("batch", "context"), "t")
    assert g(1, 256) == 0.1 and g(4, 1024) == 0.7
    assert g(2, 512) == pytest.approx(0.4)
    assert g(100, 1e6) == 0.7 and g(0.5, 1) == 0.1


@pytest.mark.parametrize("bad, match", [
    ({"m": [1, 1], "eta": [0.5, 0.5]}, "strictly increasing"),
    ({"m": [0, 2], "eta": [0.5, 0.5]}, "numbers > 0"),
    ({"m": [1, 2], "eta": [0.5, 2.5]}, r"eta 2.5: every measured eta must be in \(0, 1.5\]"),
    ({"m": [1, 2], "eta": [0.5]}, "shape"),
])
def test_bad_grids_name_the_value(tmp_path, bad, match):
    path = _write(tmp_path, _entry_with({"gemm": {"qkv": bad}}))
    with pytest.raises(InputError, match=match):
        load_calibration("h100", path)


def test_unknown_op_and_kind_are_errors(tmp_path):
    with pytest.raises(InputError, match="unknown op"):
        load_calibration("h100", _write(tmp_path, _entry_with(
            {"gemm": {"mlp": {"m": [1], "eta": [0.5]}}})))
    with pytest.raises(InputError, match="unknown grid kind"):
        load_calibration("h100", _write(tmp_path, _entry_with({"allreduce": {}})))


def test_version1_file_still_loads_without_grids():
    c = load_calibration("h100")
    assert not c.measured and c.to_dict()["eta_mem_gemm"] == c.eta_mem_gemm


def _measurements(step_ms: float = 1.0) -> dict:
    """Synthetic kernel times: GEMMs at 70% of their speed-of-light time at m<=64 and 80%
    above, decode at a made-up rising efficiency, prefill at 50%."""
    cost = scenario().server("bf16").cost
    ops = {"qkv": cost.gemms[0], "o": cost.gemms[1], "gate_up": cost.gemms[2],
           "down": cost.gemms[3], "lm_head": cost.lm_head}
    gemm = [{"op": op, "m": m, "time_s": cost.gemm_sol(m, shape) / (0.7 if m <= 64 else 0.8)}
            for op, shape in ops.items() for m in (1, 16, 64, 512, 4096)]
    decode = []
    for b in (1, 16, 128):
        for ctx in (512, 4096):
            eta = 0.3 + 0.1 * math.log2(b) / 7 + 0.4 * math.log2(ctx / 512) / 3
            sol = cost.decode_attention_sol(b, b * ctx, cost.write_bpt * b * ctx)
            decode.append({"format": "bf16", "batch": b, "context": ctx, "time_s": sol / eta})
    decode.append({"format": "bf16", "batch": 512, "context": 4096, "time_s": None,
                   "skipped": "memory cap"})
    prefill = [{"format": "bf16", "chunk": c, "past": p,
                "time_s": cost.prefill_attention_sol(c, p, c * p + c * c / 2) / 0.5}
               for c in (512, 4096) for p in (0, 4096)]
    return {"gpu": "h100", "model": "llama-3-8b", "gemm": gemm, "decode": decode,
            "prefill": prefill, "provenance": {"gpu_name": "H100 (synthetic)", "date": "x"}}


def test_build_and_cost_model_reproduce_measured_times(tmp_path):
    meas = _measurements()
    cal = build_calibration(meas, None, "synthetic")
    path = _write(tmp_path, cal)
    calib = load_calibration("h100", path)
    assert set(calib.measured.gemm) == {"qkv", "o", "gate_up", "down", "lm_head"}
    g = calib.measured.decode_attention["bf16"]
    # the unmeasured cell (B=512, L=4096) holds its row's nearest measured... there is none
    # in its row, so its column's nearest (B=128)
    assert g(512, 4096) == pytest.approx(g(128, 4096))
    srv = replace(scenario(), calibration=calib).server("bf16")
    cost = srv.cost
    for r in meas["gemm"]:
        op = (dict(zip(cost.gemm_names, cost.gemms, strict=True)) | {"lm_head": cost.lm_head}
              )[r["op"]]
        grid = calib.measured.gemm_grid(r["op"], op[3], op[2])
        assert cost._gemm(r["m"], op, grid) == pytest.approx(r["time_s"], rel=1e-4)
    for r in meas["decode"]:
        if r["time_s"] is None:
            continue
        b, ctx = r["batch"], r["context"]
        t = cost.decode_attention_time(b, b * ctx, cost.write_bpt * b * ctx)
        assert t == pytest.approx(r["time_s"], rel=1e-4)
    for r in meas["prefill"]:
        c, p = r["chunk"], r["past"]
        t = cost.prefill_attention_time(c, p, c * p + c * c / 2, 1)
        assert t == pytest.approx(r["time_s"], rel=1e-4)
    # without grids the same step is priced by the scalar etas: the grids change the model
    shape = StepShape(decode_reqs=16, decode_kv_tokens=16 * 2048,
                      decode_read_bytes=cost.write_bpt * 16 * 2048)
    assert cost.step_time(shape) != pytest.approx(scenario().server("bf16").cost.step_time(shape),
                                                  rel=0.01)
    # between grid points the decode time follows the log-interpolated eta (monotone here)
    ts = [cost.decode_attention_time(16, 16 * c, cost.write_bpt * 16 * c) / c
          for c in (512, 1024, 2048, 4096, 8192, 16384)]
    assert all(a >= b * 0.999 for a, b in zip(ts, ts[1:], strict=False))


def test_build_rejects_bad_rows_with_their_number():
    meas = _measurements()
    meas["decode"][2]["time_s"] = -1
    with pytest.raises(InputError, match="decode row 3: time_s=-1"):
        build_calibration(meas)
    meas = _measurements()
    meas["decode"].append({"format": "diffkv", "batch": 1, "context": 64, "time_s": 1e-5})
    with pytest.raises(InputError, match="read_bytes=None"):
        build_calibration(meas)


def test_skipped_rows_need_no_read_bytes_and_stay_unmeasured(tmp_path):
    """calibrate_gpu.py writes skipped points (memory cap, budget) as time_s None without
    read_bytes, also for diffkv, whose measured rows must carry read_bytes."""
    meas = _measurements()
    cost = scenario().server("diffkv").cost
    for b in (1, 16):
        rb = 1e6 * b
        meas["decode"].append({"format": "diffkv", "batch": b, "context": 1024,
                               "time_s": cost.decode_attention_sol(b, b * 1024, rb) / 0.4,
                               "read_bytes": rb})
    meas["decode"].append({"format": "diffkv", "batch": 512, "context": 1024, "time_s": None,
                           "skipped": "memory cap"})
    cal = build_calibration(meas, None, "synthetic")
    grid = cal["gpus"]["h100"]["measured"]["decode_attention"]["diffkv"]
    assert grid["batch"] == [1, 16, 512]
    assert grid["measured"] == [[True], [True], [False]]
    assert grid["time_s"][2] == [None]
    # the skipped batch holds its column's nearest measured eta (B=16), not an invented one
    assert grid["eta"][2][0] == pytest.approx(0.4, rel=1e-4)
    assert grid["eta"][1][0] == pytest.approx(0.4, rel=1e-4)
    calib = load_calibration("h100", _write(tmp_path, cal))
    assert calib.measured.decode_attention["diffkv"](512, 1024) == pytest.approx(0.4, rel=1e-4)
    # a grid with only skipped points is left out: the scalar eta stays in charge
    only = _measurements()
    only["decode"].append({"format": "fp8", "batch": 4, "context": 64, "time_s": None})
    assert "fp8" not in build_calibration(only)["gpus"]["h100"]["measured"]["decode_attention"]


def _fitting_log(srv, step_s: float, seq_s: float, interval: int = 10) -> str:
    """SGLang-shaped lines from a decode run of shrinking batches: throughput over each
    interval of ``interval`` steps, with a prefill (whose time lands in the next interval)
    every fourth interval, and a first line whose interval includes start-up."""
    lines = ["[2026-11-22 09:00:00] server_args=ServerArgs(mem_fraction_static=0.85, "
             "chunked_prefill_size=8192, disable_cuda_graph=False, "
             f"decode_log_interval={interval})",
             "[2026-11-22 09:00:00] max_total_num_tokens=409907, max_running_requests=4096",
             "[2026-11-22 09:00:01] Decode batch, #running-req: 250, #token: 250000, token "
             "usage: 0.5, cuda graph: True, gen throughput (token/s): 3.00, #queue-req: 0"]
    b, ctx, step = 250, 1000, 0
    for k in range(40):
        toks, t = 0, 0.0
        for _ in range(interval):
            step += 1
            b -= step % 2                              # requests finish: the batch shrinks
            kv = np.full(b, ctx)
            shape = StepShape(decode_reqs=b, decode_kv_tokens=b * ctx,
                              decode_read_bytes=srv.pool.read_bytes_per_layer(kv, None))
            t += srv.cost.step_time(shape) + step_s + seq_s * b
            toks += b
            ctx += 1
        if k % 4 == 3:
            lines.append("[2026-11-22 09:00:02] Prefill batch, #new-seq: 1, #new-token: 4000, "
                         "#cached-token: 0, token usage: 0.5, #running-req: 200, #queue-req: 0")
            t += 0.25                                  # the prefill stalls this interval
        lines.append(f"[2026-11-22 09:00:02] Decode batch, #running-req: {b}, #token: "
                     f"{b * ctx}, token usage: 0.5, cuda graph: True, gen throughput "
                     f"(token/s): {toks / t:.3f}, #queue-req: 0")
    return "\n".join(lines) + "\n"


def test_step_fit_recovers_constants_and_times_prefill_intervals(tmp_path):
    base = load_calibration("h100")
    zero = replace(base, step_overhead_s=0.0, seq_overhead_s=0.0, prefill_step_overhead_s=0.0,
                   prefill_seq_overhead_s=0.0, prefill_token_overhead_s=0.0)
    srv = replace(scenario(), calibration=zero).server("bf16")
    p = tmp_path / "server.log"
    p.write_text(_fitting_log(srv, 1.5e-3, 0.0))
    log = parse_server_log(p)
    assert log.server_args["mem_fraction_static"] == "0.85"
    assert len(decode_samples(log, graphed=True)) == 30  # 40 - 10 after a prefill; start-up
    rows = step_rows(srv, log, "fit", graphed=True)
    assert rows.kind.count("prefill-interval") == 10 and rows.kind.count("decode") == 30
    decode_only = fit_step_costs(srv, rows.of_kinds("decode"))
    # (the interval's mean batch is estimated from its two end lines: small error)
    assert decode_only["step_overhead_s"] == pytest.approx(1.5e-3, rel=0.1)
    assert decode_only["seq_overhead_s"] < 1e-6
    assert decode_only["mape"] < 0.01 < 0.05 < decode_only["mape_before"]
    # with the prefill intervals: each holds a 0.25 s prefill step (one 4000-token prompt
    # each: nothing varies, so the part the kernels leave is charged per prompt token)
    fit = fit_step_costs(srv, rows)
    assert "prefill_token_overhead_s" in fit["fitted"]
    pf = srv.cost.step_time(prefill_shape(srv, 1, 4000, 0))
    assert pf + 4000 * fit["prefill_token_overhead_s"] == pytest.approx(0.25, rel=0.05)
    assert fit["step_overhead_s"] == pytest.approx(1.5e-3, rel=0.1)



def test_calibrate_fixed_runs_the_joint_step_fit(tmp_path):
    """``diffkv-sim calibrate --fit fixed``: the same fit as the validation script, written
    as a calibration the simulator loads."""
    import io

    from simulator.cli import main

    srv = scenario().server("bf16")
    cal = srv.deployment.calibration
    p = tmp_path / "server.log"
    p.write_text(_fitting_log(srv, 1.5e-3, 0.0))
    out_cal = tmp_path / "cal.json"
    text = io.StringIO()
    assert main(["calibrate", "--server-log", str(p), "--fit", "fixed", "--out",
                 str(out_cal)], out=text) == 0
    assert "prefill_token_overhead_s" in text.getvalue()
    fitted = load_calibration("h100", out_cal)
    # the log's steps carry 1.5 ms more per step than the calibration it was made with
    assert fitted.step_overhead_s == pytest.approx(cal.step_overhead_s + 1.5e-3, rel=0.1)
