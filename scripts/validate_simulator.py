#!/usr/bin/env python3
"""Validate diffkv-sim against the end-to-end harness's real SGLang runs (issue 8). CPU only.

    python scripts/validate_simulator.py RESULTS_DIR \
        --calibration results/calibration/calibration.json \
        [--fit-run bf16/longgen] [--doc docs/simulator-validation.md]

RESULTS_DIR is ``scripts/bench_e2e.py --out`` (results.json, bench_serving.jsonl, logs/ or
logs.tar.gz; layout in simulator/validation/harness.py). Steps:

1. calibration: the kernel-grid calibration from scripts/calibrate_gpu.py (``--calibration``);
   its fixed per-step / per-request costs are fitted here from the clean Decode intervals of
   the FITTING run (``--fit-run``, default bf16/longgen; ``none`` keeps the file's). The fitted
   file is written next to the report. The fitting run is never validated.
2. every other run (sharegpt saturation, ladder rates; bf16, fp8, diffkv) is replayed from its
   exact trace file with the server settings from its log, and measured vs predicted rows are
   built over the run's window: KV pool, saturation output tok/s and req/s, mean and peak
   running batch, TPOT, TTFT (target only below 80% load), the DiffKV/bf16 throughput ratio;
   each with its error, the target and PASS/MISS.
3. the report (markdown with provenance and commands) and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.errors import SimulatorInputError  # noqa: E402
from simulator.specs.calibration import Calibration, load_calibration  # noqa: E402
from simulator.specs.gpu import load_gpu  # noqa: E402
from simulator.specs.model import load_model  # noqa: E402
from simulator.studies.scenario import Scenario  # noqa: E402
from simulator.validation.fit import (  # noqa: E402
    calibration_file,
    decode_samples,
    fit_fixed_costs,
    write_calibration,
)
from simulator.validation.harness import (  # noqa: E402
    TARGETS,
    TTFT_MAX_LOAD,
    HarnessResults,
    HarnessRun,
    load_harness,
    measured_series,
    row,
    server_settings,
    windowed_summary,
)
from simulator.validation.sglang_log import ServerLog, parse_server_log  # noqa: E402
from simulator.workload.loaders import load_trace  # noqa: E402


def slice_log(run: HarnessRun, whole: Path) -> ServerLog:
    """The run's slice of the server log, with the start-up lines (pool, server args) of the
    whole log."""
    head = parse_server_log(whole)
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(f"max_total_num_tokens={head.max_total_num_tokens or 0}\n")
        f.write(run.log_slice)
        name = f.name
    try:
        log = parse_server_log(name)
    finally:
        Path(name).unlink()
    log.server_args = head.server_args
    log.max_total_num_tokens = head.max_total_num_tokens
    log.max_running_requests = head.max_running_requests
    return log


def scenario(model: str, gpu: str, calib: Calibration, settings: Any) -> Scenario:
    return Scenario(load_model(model), load_gpu(gpu), calib, settings)


def fit(h: HarnessResults, key: str, model: str, gpu: str, calib: Calibration,
        out: Path) -> tuple[Calibration, dict[str, Any]]:
    run = h.run(key)
    log = slice_log(run, h.server_logs[run.config])
    settings, fmt = server_settings(h.configs[run.config], log)
    srv = scenario(model, gpu, calib, settings).server(fmt)
    res = fit_fixed_costs(srv, decode_samples(log, not settings.disable_cuda_graph))
    res["fixed_only"] = True
    path = write_calibration(out, calibration_file(
        srv, res, f"{h.root.name}/logs/server__{run.config}.log ({run.key})"))
    return load_calibration(load_gpu(gpu).key, path), {**res, "run": run.key, "file": str(path)}


def validate(h: HarnessResults, calib: Calibration, model: str, gpu: str,
             fitting: set[str]) -> tuple[list[dict], dict[str, Any]]:
    rows: list[dict] = []
    sims: dict[str, Any] = {}
    pools_done: set[str] = set()
    for run in h.runs:
        if run.key in fitting or f"{run.config}/{run.workload}" in fitting:
            continue
        log = slice_log(run, h.server_logs[run.config])
        settings, fmt = server_settings(h.configs[run.config], log)
        trace = load_trace(run.trace_path)
        sc = scenario(model, gpu, calib, settings)
        res = sc.run(trace, fmt)
        s = windowed_summary(res, run.window_s)
        sims[run.key] = {"summary": s, "format": fmt, "run": run}
        c = run.client
        if run.config not in pools_done:
            pools_done.add(run.config)
            measured_pool = h.configs[run.config].get("max_total_num_tokens") \
                or log.max_total_num_tokens
            rows.append(row("KV pool tokens", run.config, measured_pool, s["kv_pool_tokens"],
                            TARGETS["kv_pool"] if fmt != "diffkv" else None,
                            note="" if fmt != "diffkv" else "DiffKV: tokens at the mean mix"))
        mb = float(sum(log.decode_running) / len(log.decode_running)) \
            if log.decode_running else None
        pk = float(max(log.decode_running)) if log.decode_running else None
        if run.workload == "sharegpt":
            rows += [
                row("saturation output tok/s (steady)", run.key,
                    c.get("steady_output_throughput"), s["steady_output_throughput"],
                    TARGETS["throughput"]),
                row("saturation req/s (steady)", run.key, c.get("steady_request_throughput"),
                    s["steady_request_throughput"], TARGETS["throughput"]),
                row("mean running batch", run.key, mb, s["mean_batch"], TARGETS["mean_batch"]),
                row("peak running batch", run.key, pk, float(s["peak_batch"]), None),
                row("TPOT mean (ms)", run.key, c.get("mean_tpot_ms"), s["mean_tpot_ms"],
                    TARGETS["tpot"]),
                row("TTFT mean (ms)", run.key, c.get("mean_ttft_ms"), s["mean_ttft_ms"], None,
                    note="saturation (all at t=0): no target"),
            ]
        elif run.workload == "ladder":
            load = (run.rate_req_s / run.saturation_req_s
                    if run.rate_req_s and run.saturation_req_s else None)
            sims[run.key]["load"] = load
            lt = f"load {load:.0%}" if load is not None else "load ?"
            ttft_target = TARGETS["ttft"] if load is not None and load < TTFT_MAX_LOAD else None
            rows += [
                row("TTFT mean (ms)", run.key, c.get("mean_ttft_ms"), s["mean_ttft_ms"],
                    ttft_target, note=lt),
                row("TPOT mean (ms)", run.key, c.get("mean_tpot_ms"), s["mean_tpot_ms"],
                    TARGETS["tpot"], note=lt),
                row("mean running batch", run.key, mb, s["mean_batch"], TARGETS["mean_batch"],
                    note=lt),
                row("output tok/s (window)", run.key, c.get("output_throughput"),
                    s["output_throughput"], None, note=lt),
            ]
        else:
            rows.append(row("output tok/s (window)", run.key, c.get("output_throughput"),
                            s["output_throughput"], None, note=f"{run.workload}"))
    # DiffKV / bf16 saturation throughput ratio, both measured on the same workload
    for wl in ("sharegpt", "longgen"):
        d, b = sims.get(f"diffkv/{wl}"), sims.get(f"bf16/{wl}")
        if d and b:
            m = (d["run"].client.get("steady_output_throughput") or 0) / max(
                b["run"].client.get("steady_output_throughput") or 0, 1e-9)
            p = d["summary"]["steady_output_throughput"] / max(
                b["summary"]["steady_output_throughput"], 1e-9)
            rows.append(row("DiffKV / bf16 output tok/s", wl, m, p, TARGETS["ratio_pp"],
                            absolute=True, note="error in ratio points"))
    return rows, sims


# ---- report ---------------------------------------------------------------------------------
def fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def err_str(r: dict) -> str:
    if r["error"] is None:
        return "-"
    return f"{r['error']:+.3f}" if r["absolute"] else f"{100 * r['error']:+.1f}%"


def target_str(r: dict) -> str:
    if r["target"] is None:
        return "-"
    return f"±{r['target']:.2f}" if r["absolute"] else f"±{100 * r['target']:.0f}%"


def table(rows: list[dict]) -> str:
    out = ["| metric | run | measured | predicted | error | target | verdict | note |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['metric']} | {r['run']} | {fmt(r['measured'])} | "
                   f"{fmt(r['predicted'])} | {err_str(r)} | {target_str(r)} | "
                   f"**{r['verdict']}** | {r['note']} |" if r["verdict"] == "MISS" else
                   f"| {r['metric']} | {r['run']} | {fmt(r['measured'])} | "
                   f"{fmt(r['predicted'])} | {err_str(r)} | {target_str(r)} | {r['verdict']} | "
                   f"{r['note']} |")
    return "\n".join(out)


def plots(sims: dict[str, Any], h: HarnessResults, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    ladders: dict[str, list] = {}
    for s in sims.values():
        run = s["run"]
        if run.workload == "ladder" and run.rate_req_s:
            ladders.setdefault(run.config, []).append((run.rate_req_s, run.client, s["summary"]))
    if ladders:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for cfg, pts in sorted(ladders.items()):
            pts.sort(key=lambda p: p[0])
            rates = [p[0] for p in pts]
            for ax, key in ((a1, "mean_ttft_ms"), (a2, "mean_tpot_ms")):
                line, = ax.plot(rates, [p[1].get(key) or math.nan for p in pts], "o-",
                                label=f"{cfg} measured")
                ax.plot(rates, [p[2][key] for p in pts], "s--", color=line.get_color(),
                        label=f"{cfg} simulated")
        a1.set_ylabel("TTFT mean (ms)")
        a2.set_ylabel("TPOT mean (ms)")
        for ax in (a1, a2):
            ax.set_xlabel("request rate (req/s)")
        a1.legend(fontsize=8)
        fig.suptitle("ladder: measured vs simulated")
        fig.tight_layout()
        p = out_dir / "latency_vs_rate.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    sat = [(k, s) for k, s in sims.items() if s["run"].workload in ("sharegpt",)]
    if sat:
        fig, axes = plt.subplots(len(sat), 1, figsize=(9, 2.6 * len(sat)), squeeze=False)
        for ax, (key, s) in zip(axes[:, 0], sat, strict=True):
            t, b = measured_series(s["run"].log_slice)
            ax.plot(t, b, label="measured (Decode lines)", lw=1)
            ax.plot(s["summary"]["series_t"], s["summary"]["series_batch"], label="simulated",
                    lw=1)
            ax.set_title(key, fontsize=9)
            ax.set_ylabel("running batch")
        axes[-1, 0].set_xlabel("time in window (s)")
        axes[0, 0].legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "batch_timeseries.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def report(rows: list[dict], h: HarnessResults, calib: Calibration, fitinfo: dict | None,
           plot_paths: list[Path], doc: Path, argv: list[str]) -> str:
    n_pass = sum(r["verdict"] == "PASS" for r in rows)
    n_miss = sum(r["verdict"] == "MISS" for r in rows)
    env = h.environment
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    fitted = sorted({fitinfo["run"]} if fitinfo else set())
    validated = sorted({r["run"] for r in rows if "/" in r["run"]})
    lines = [
        "# Simulator validation against real SGLang runs",
        "",
        f"Generated by `scripts/validate_simulator.py` on {dt.date.today().isoformat()} "
        f"(commit {commit[:12]}): **{n_pass} PASS, {n_miss} MISS** of {n_pass + n_miss} rows "
        "with a target.",
        "",
        "Targets (issue 8): KV pool within 1%; saturation throughput and mean batch within 5%; "
        "TPOT within 5%; TTFT within 10% below 80% load; DiffKV/bf16 throughput ratio within "
        "5 points. Error = predicted / measured - 1 (the ratio: predicted - measured).",
        "",
        table(rows),
        "",
        "## Runs",
        "",
        f"- fitting (never validated): {', '.join(fitted) or 'none (calibration as given)'}",
        f"- validated: {', '.join(validated)}",
        f"- harness results: `{h.root}`; GPU {env.get('gpu', '?')}, sglang "
        f"{env.get('sglang', env.get('versions', '?'))}",
        "",
        "## Calibration",
        "",
        f"- file: `{calib.source_file}`; kernel grids: "
        f"{', '.join(f'{k}' for k in calib.measured.to_dict() if calib.measured.to_dict()[k])}"
        if calib.measured else f"- file: `{calib.source_file}` (no kernel grids)",
        f"- provenance: {json.dumps(calib.provenance.get('kernels', calib.provenance['source']))}",
    ]
    if calib.measured_raw.get("provenance"):
        p = calib.measured_raw["provenance"]
        lines.append(f"- measured on {p.get('gpu_name')} (driver {p.get('driver')}, CUDA "
                     f"{p.get('cuda')}, torch {p.get('torch')}, triton {p.get('triton')}, "
                     f"sglang {p.get('sglang')}) on {p.get('date')}, commit "
                     f"{p.get('git_commit')}: `{p.get('command')}`")
    if fitinfo:
        lines.append(f"- fixed costs fitted from {fitinfo['run']}: step "
                     f"{1e3 * fitinfo['step_overhead_s']:.3f} ms, per request "
                     f"{1e6 * fitinfo['seq_overhead_s']:.2f} us over {fitinfo['samples']} clean "
                     f"decode intervals; MAPE {100 * fitinfo['mape_before']:.1f}% -> "
                     f"{100 * fitinfo['mape']:.1f}% (`{fitinfo['file']}`)")
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.relative_to(doc.parent)})" for p in plot_paths]
    lines += ["", "## Command", "", "```", "python scripts/validate_simulator.py "
              + " ".join(argv), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="scripts/bench_e2e.py --out directory")
    ap.add_argument("--calibration", default=None,
                    help="calibration JSON (scripts/calibrate_gpu.py's calibration.json); "
                         "default: the shipped one")
    ap.add_argument("--fit-run", default="bf16/longgen",
                    help="CONFIG/WORKLOAD whose Decode lines fit the fixed costs, or 'none' "
                         "(default: %(default)s)")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "simulator-validation.md"))
    ap.add_argument("--plots", default=None, help="plot folder (default: next to --doc, "
                                                  "simulator-validation/)")
    ap.add_argument("--json", default=None, help="write the rows as JSON")
    a = ap.parse_args(argv)
    args_used = list(argv if argv is not None else sys.argv[1:])
    try:
        h = load_harness(a.results)
        calib = load_calibration(load_gpu(a.gpu).key, a.calibration)
        doc = Path(a.doc)
        plot_dir = Path(a.plots) if a.plots else doc.parent / "simulator-validation"
        plot_dir.mkdir(parents=True, exist_ok=True)
        fitinfo = None
        fitting: set[str] = set()
        if a.fit_run.lower() != "none":
            calib, fitinfo = fit(h, a.fit_run, a.model, a.gpu, calib,
                                 plot_dir / "calibration-fitted.json")
            fitting.add(fitinfo["run"])
        rows, sims = validate(h, calib, a.model, a.gpu, fitting)
    except SimulatorInputError as e:
        print(f"validate_simulator: error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    paths = plots(sims, h, plot_dir)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(report(rows, h, calib, fitinfo, paths, doc, args_used))
    print(f"wrote {doc} and {len(paths)} plot(s) in {plot_dir}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "fit": fitinfo}, indent=1,
                                           default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
