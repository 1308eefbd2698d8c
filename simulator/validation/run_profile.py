"""A run's server log beside its replay (``diffkv-sim profile-run``): where each spends the
run's window (prefill steps times their mean length, decode steps times theirs, idle), the
decode step against its batch, and the running batch, prefill steps and queue window by window.
CPU only; nothing is fitted.

    diffkv-sim profile-run --recipe h200 --run 'diffkv-mix/ladder@23.03rps#n3'
    diffkv-sim profile-run --results DIR#TAG --run KEY --gpu h200 [--calibration FILE]

The replay is ``validate-runs``': the run's exact trace, its server settings, and the
calibration ``diffkv-sim --gpu GPU`` loads (or ``--calibration``). From the server log:

- prefill steps: one per Prefill line, with its new sequences;
- decode steps: ``decode_log_interval`` per Decode line;
- the decode step against its batch: a line through the Decode intervals that hold no Prefill
  line (the interval's wall over its steps, against its batch; graphed batches only);
- the mean prefill step, implied: the Decode intervals that hold Prefill lines, less their
  decode steps at that line, over their Prefill lines (idle time inside them counts);
- with ``SGLANG_DIFFKV_PROFILE=1``, the DiffKV step profile's own prefill and decode step
  times (CUDA events from ``init_forward_metadata`` to the last layer's attention:
  ``sglang_diffkv.serving_io.profile_lines``), a second reading of both.

The replay's are its step log's. Its decode steps are also put on the measured line (the
line at the replay's own batches), so the two decode columns differ by the step's cost
alone, not by the batch it ran at. Log lines carry whole seconds, so the windows of the
series are aligned to about a second.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.profile_lines import PROFILE_LINE_RE
from sglang_diffkv.serving_io.sglang_log import ServerLog, decode_intervals
from simulator.engine.cluster import RunResult
from simulator.errors import SimulatorInputError
from simulator.serving.server import ResolvedServer
from simulator.specs.calibration import Calibration, load_calibration
from simulator.specs.calibration_set import backend_of, load_calibration_set
from simulator.specs.gpu import load_gpu
from simulator.validation.fit import _shape
from simulator.validation.harness import (
    HarnessResults,
    HarnessRun,
    load_harness,
    merge_harness,
    server_settings,
    windowed_summary,
)
from simulator.validation.step_fit import decode_log_interval

PROG = "diffkv-sim profile-run"
BATCH_BINS = (0, 20, 40, 60, 80, 100, 120, 160, 256, 512, 1024, 4096)
MIN_LINE_ROWS = 3   # decode-only intervals needed for the measured line
_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)\]")
_RUNNING = re.compile(r"#running-req: (\d+)")
_QUEUE = re.compile(r"#queue-req: (\d+)")
_NEW_SEQ = re.compile(r"#new-seq: (\d+)")


def decode_line(log: ServerLog, server: ResolvedServer) -> dict[str, Any] | None:
    """The measured decode step against its batch: least squares of wall / steps on the batch
    over the Decode intervals without a Prefill line whose batch a CUDA graph runs; None with
    fewer than MIN_LINE_ROWS of them."""
    steps = decode_log_interval(log)
    b, y = [], []
    for iv in decode_intervals(log, steps):
        if iv.prefills or not server.cost.graphed(_shape(server, iv.batch, iv.tokens)):
            continue
        b.append(iv.batch)
        y.append(iv.wall_s / steps)
    if len(b) < MIN_LINE_ROWS:
        return None
    bb, yy = np.array(b), np.array(y)
    if np.ptp(bb) > 0:
        slope, icpt = np.polyfit(bb, yy, 1)
    else:
        slope, icpt = 0.0, float(yy.mean())
    return {"intercept_s": float(icpt), "per_req_s": float(slope), "intervals": len(b)}


def _at(line: dict[str, Any] | None, batch: np.ndarray) -> float:
    if line is None or batch.size == 0:
        return math.nan
    return float(np.mean(line["intercept_s"] + line["per_req_s"] * batch))


def implied_prefill_s(log: ServerLog, line: dict[str, Any] | None) -> float:
    """The mean prefill step the log implies: its Decode intervals with Prefill lines, less
    their decode steps at the measured line, over those lines (nan without a line)."""
    if line is None:
        return math.nan
    steps = decode_log_interval(log)
    wall = dec = 0.0
    n = 0
    for iv in decode_intervals(log, steps):
        if not iv.prefills:
            continue
        wall += iv.wall_s
        dec += steps * (line["intercept_s"] + line["per_req_s"] * iv.batch)
        n += len(iv.prefills)
    return (wall - dec) / n if n else math.nan


def step_profile(log_slice: str) -> dict[str, dict[str, float]]:
    """The DiffKV step profile's step-weighted mean ``step`` and ``host`` ms per mode over the
    slice's profile lines ({} without them)."""
    acc: dict[str, list[float]] = {}
    for ln in log_slice.splitlines():
        m = PROFILE_LINE_RE.search(ln)
        if not m:
            continue
        n = int(m["steps"])
        a = acc.setdefault(m["mode"], [0.0, 0.0, 0.0, 0.0])
        a[0] += n
        a[1] += n * float(m["step_ms"])
        if m["host_ms"] is not None:
            a[2] += n
            a[3] += n * float(m["host_ms"])
    return {mode: {"steps": int(a[0]), "step_ms": a[1] / a[0] if a[0] else math.nan,
                   "host_ms": a[3] / a[2] if a[2] else math.nan}
            for mode, a in acc.items()}


def measured_windows(log_slice: str, window_s: float, span_s: float) -> list[dict[str, Any]]:
    """Per window of ``window_s`` from the slice's first scheduler line: the mean
    ``#running-req`` of its Decode lines, its Prefill lines and their new sequences, the mean
    ``#queue-req`` of its scheduler lines."""
    rows: list[dict[str, Any]] = []
    t0: float | None = None
    n = max(1, math.ceil(span_s / window_s))
    acc = [{"running": [], "prefills": 0, "seqs": 0, "queue": []} for _ in range(n)]
    for ln in log_slice.splitlines():
        dec, pre = "Decode batch" in ln, "Prefill batch" in ln
        if not (dec or pre):
            continue
        m = _TS.search(ln)
        if not m:
            continue
        t = dt.datetime.fromisoformat(m.group(1).replace("T", " ")).timestamp()
        t0 = t if t0 is None else t0
        i = int((t - t0) // window_s)
        if i >= n:
            continue
        if dec and (r := _RUNNING.search(ln)):
            acc[i]["running"].append(int(r.group(1)))
        if pre:
            acc[i]["prefills"] += 1
            if s := _NEW_SEQ.search(ln):
                acc[i]["seqs"] += int(s.group(1))
        if q := _QUEUE.search(ln):
            acc[i]["queue"].append(int(q.group(1)))
    for i, a in enumerate(acc):
        rows.append({"t_s": i * window_s,
                     "batch": float(np.mean(a["running"])) if a["running"] else math.nan,
                     "prefills": a["prefills"], "seqs": a["seqs"],
                     "queue": float(np.mean(a["queue"])) if a["queue"] else math.nan})
    return rows


def simulated_windows(res: RunResult, window_s: float, span_s: float) -> list[dict[str, Any]]:
    """The replay's ``measured_windows``: from its first arrival, the mean running batch of
    its decode steps, its prefill steps and their prompt chunks, its mean queue per step."""
    lg = res.replicas[0].log.arrays()
    t = lg["t_end"] - min(r.arrival for r in res.requests)
    n = max(1, math.ceil(span_s / window_s))
    rows = []
    for i in range(n):
        m = (t >= i * window_s) & (t < (i + 1) * window_s)
        dec = m & (lg["kind"] == 1)
        pre = m & (lg["kind"] != 1)
        rows.append({"t_s": i * window_s,
                     "batch": float(lg["running"][dec].mean()) if dec.any() else math.nan,
                     "prefills": int(pre.sum()), "seqs": int(lg["seqs"][pre].sum()),
                     "queue": float(lg["waiting"][m].mean()) if m.any() else math.nan})
    return rows


def decode_bins(log: ServerLog, server: ResolvedServer, res: RunResult, window: float
                ) -> list[dict[str, Any]]:
    """Per batch bin: the measured Decode intervals without a Prefill line (median wall per
    step), the cost model at their logged batch and context (median), and the replay's own
    decode steps in the window (median)."""
    steps = decode_log_interval(log)
    ivs = [iv for iv in decode_intervals(log, steps) if not iv.prefills]
    mb = np.array([iv.batch for iv in ivs])
    mw = np.array([iv.wall_s / steps for iv in ivs])
    model = np.array([server.cost.step_time(_shape(server, iv.batch, iv.tokens))
                      for iv in ivs])
    ctx = np.array([server.pool.context_from_logged(max(1, int(round(iv.batch))), iv.tokens)
                    for iv in ivs])
    lg = res.replicas[0].log.arrays()
    t0 = min(r.arrival for r in res.requests)
    sd = (lg["kind"] == 1) & (lg["t_end"] <= t0 + window)
    out = []
    for lo, hi in zip(BATCH_BINS, BATCH_BINS[1:], strict=False):
        m = (mb >= lo) & (mb < hi)
        q = sd & (lg["running"] >= lo) & (lg["running"] < hi)
        if not (m.any() or q.any()):
            continue

        def med(v: np.ndarray, k: np.ndarray) -> float:
            return float(np.median(v[k])) if k.any() else math.nan
        out.append({"batch": (lo, hi), "measured_n": int(m.sum()),
                    "measured_ms": 1e3 * med(mw, m), "model_ms": 1e3 * med(model, m),
                    "context": med(ctx, m), "simulated_n": int(q.sum()),
                    "simulated_ms": 1e3 * med(lg["dt"], q)})
    return out


def profile_run(h: HarnessResults, run: HarnessRun, calib: Calibration, model: str, gpu: str,
                window_s: float = 5.0) -> dict[str, Any]:
    """The run's log beside its replay (the module docstring): the time budget of each side,
    the decode step by batch bin, the window series and the client metrics."""
    from simulator.validation.runs import scenario, slice_log

    log = slice_log(run, run.server_log or h.server_logs[run.config])
    settings, fmt = server_settings(h.configs[run.config], log)
    sc = scenario(model, gpu, calib, settings, h, run.config)
    server = sc.server(fmt)
    trace, warm = run.replay_inputs(radix_cache=not settings.disable_radix_cache)
    res = sc.run(trace, fmt, server=server, warm_cache=warm)
    window = run.simulated_window_s
    s = windowed_summary(res, window)
    w = float(s["window_s"])
    steps = decode_log_interval(log)
    line = decode_line(log, server)
    batches = np.array(log.decode_running, dtype=float)
    n_pre, n_dec = len(log.prefill_new_seqs), steps * len(log.decode_running)
    pre_s = implied_prefill_s(log, line)
    dec_s = _at(line, batches)
    prof = step_profile(run.log_slice)
    measured = {
        "prefill_steps": n_pre,
        "seqs_per_prefill": (float(np.mean(log.prefill_new_seqs)) if n_pre else math.nan),
        "prefill_ms": 1e3 * pre_s,
        "decode_steps": n_dec,
        "decode_ms": 1e3 * dec_s,
        "mean_batch": float(batches.mean()) if batches.size else math.nan,
        "prefill_share": n_pre * pre_s / w if w > 0 else math.nan,
        "decode_share": n_dec * dec_s / w if w > 0 else math.nan,
        "step_profile": prof,
    }
    lg = res.replicas[0].log.arrays()
    t0 = min(r.arrival for r in res.requests)
    inw = lg["t_end"] <= t0 + w
    kind, dts = lg["kind"][inw], lg["dt"][inw]
    pre, dec = kind != 1, kind == 1
    running = lg["running"][inw][dec].astype(float)
    simulated = {
        "prefill_steps": int(pre.sum()),
        "seqs_per_prefill": (float(lg["seqs"][inw][pre].mean()) if pre.any() else math.nan),
        "prefill_ms": 1e3 * float(dts[pre].mean()) if pre.any() else math.nan,
        "decode_steps": int(dec.sum()),
        "decode_ms": 1e3 * float(dts[dec].mean()) if dec.any() else math.nan,
        "decode_ms_at_measured_line": 1e3 * _at(line, running),
        "mean_batch": s["mean_batch"],
        "prefill_share": float(dts[pre].sum()) / w if w > 0 else math.nan,
        "decode_share": float(dts[dec].sum()) / w if w > 0 else math.nan,
    }
    c = run.client
    metrics = {k: {"measured": c.get(k), "simulated": s[k]}
               for k in ("mean_tpot_ms", "mean_ttft_ms", "median_ttft_ms")}
    metrics["mean_batch"] = {"measured": measured["mean_batch"],
                             "simulated": simulated["mean_batch"]}
    return {"run": run.key, "format": fmt, "window_s": w,
            "calibration": calib.source_file, "decode_line": line,
            "measured": measured, "simulated": simulated, "metrics": metrics,
            "decode_bins": decode_bins(log, server, res, w),
            "windows": {"window_s": window_s,
                        "measured": measured_windows(run.log_slice, window_s, w),
                        "simulated": simulated_windows(res, window_s, w)}}


def _f(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def profile_text(p: dict[str, Any]) -> str:
    """Markdown tables of ``profile_run``'s result."""
    m, s = p["measured"], p["simulated"]
    line = p["decode_line"]
    lines = [f"### {p['run']} ({p['format']}; window {p['window_s']:.1f} s; calibration "
             f"{p['calibration'] or 'given'})", ""]
    lines += ["| | measured | replay | error |", "|---|---|---|---|"]
    for key, label in (("mean_tpot_ms", "TPOT mean (ms)"), ("mean_ttft_ms", "TTFT mean (ms)"),
                       ("median_ttft_ms", "TTFT median (ms)"),
                       ("mean_batch", "mean running batch")):
        a, b = p["metrics"][key]["measured"], p["metrics"][key]["simulated"]
        err = f"{100 * (b / a - 1):+.1f}%" if a and b and math.isfinite(a * b) else "-"
        lines.append(f"| {label} | {_f(a)} | {_f(b)} | {err} |")
    lines += ["", "| where the window goes | measured | replay |", "|---|---|---|",
              f"| prefill steps | {m['prefill_steps']} | {s['prefill_steps']} |",
              f"| requests per prefill step | {_f(m['seqs_per_prefill'], 2)} | "
              f"{_f(s['seqs_per_prefill'], 2)} |",
              f"| mean prefill step (ms) | {_f(m['prefill_ms'])} implied | "
              f"{_f(s['prefill_ms'])} |",
              f"| decode steps | {m['decode_steps']} | {s['decode_steps']} |",
              f"| mean decode step (ms) | {_f(m['decode_ms'], 2)} at the measured line | "
              f"{_f(s['decode_ms'], 2)} (measured line at its batches: "
              f"{_f(s['decode_ms_at_measured_line'], 2)}) |",
              f"| share of the window: prefill / decode | {_f(100 * m['prefill_share'])}% / "
              f"{_f(100 * m['decode_share'])}% | {_f(100 * s['prefill_share'])}% / "
              f"{_f(100 * s['decode_share'])}% |"]
    for mode, v in m["step_profile"].items():
        lines.append(f"| DiffKV step profile, {mode} (ms): step / host | "
                     f"{_f(v['step_ms'], 2)} / {_f(v['host_ms'], 2)} over {v['steps']} steps "
                     "| |")
    if line:
        lines += ["", f"Measured decode step: {1e3 * line['intercept_s']:.2f} ms + "
                  f"{1e6 * line['per_req_s']:.1f} us x batch ({line['intervals']} Decode "
                  "intervals without a Prefill line)."]
    lines += ["", "| batch | measured intervals | measured ms/step | model ms at their batch "
              "and context | context | replay steps | replay ms/step |",
              "|---|---|---|---|---|---|---|"]
    for r in p["decode_bins"]:
        lo, hi = r["batch"]
        lines.append(f"| {lo}-{hi} | {r['measured_n']} | {_f(r['measured_ms'], 2)} | "
                     f"{_f(r['model_ms'], 2)} | {_f(r['context'], 0)} | {r['simulated_n']} | "
                     f"{_f(r['simulated_ms'], 2)} |")
    win = p["windows"]
    lines += ["", f"| t (s, {win['window_s']:g} s windows) | batch: measured / replay | "
              "prefill steps | requests prefilled | queue |", "|---|---|---|---|---|"]
    for a, b in zip(win["measured"], win["simulated"], strict=True):
        lines.append(f"| {a['t_s']:g} | {_f(a['batch'])} / {_f(b['batch'])} | "
                     f"{a['prefills']} / {b['prefills']} | {a['seqs']} / {b['seqs']} | "
                     f"{_f(a['queue'])} / {_f(b['queue'])} |")
    return "\n".join(lines)


def _calibration(run: HarnessRun, h: HarnessResults, gpu: str, path: str | None) -> Calibration:
    from simulator.validation.runs import slice_log

    if path is not None:
        return load_calibration(load_gpu(gpu).key, path)
    log = slice_log(run, run.server_log or h.server_logs[run.config])
    _, fmt = server_settings(h.configs[run.config], log)
    return load_calibration_set(load_gpu(gpu).key).by_backend[backend_of(fmt)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=None,
                    help="a validation recipe (a JSON file, or a shipped one: h200): its "
                         "result folders (only those whose tag a --run names are read) and GPU")
    ap.add_argument("--results", action="append", default=[],
                    help="a bench_e2e.py result folder, DIR[#TAG] as validate-runs takes it "
                         "(repeatable)")
    ap.add_argument("--run", action="append", required=True,
                    help="the run to profile, CONFIG/LABEL[#TAG] (repeatable)")
    ap.add_argument("--gpu", default=None, help="GPU (default: the recipe's, else h100)")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--calibration", default=None,
                    help="a calibration file (default: the one diffkv-sim --gpu GPU loads for "
                         "the run's backend)")
    ap.add_argument("--window-s", type=float, default=5.0,
                    help="width of the series' windows (default: %(default)s)")
    ap.add_argument("--scratch", default=None,
                    help="where packed logs are unpacked (default: the recipe's scratch, else "
                         "results/validation-logs)")
    ap.add_argument("--json", default=None, help="write the profiles as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        from simulator.validation.recipe import load_recipe
        from simulator.validation.runs import results_arg, scratch_name

        if a.window_s <= 0:
            raise SimulatorInputError(f"--window-s {a.window_s:g} must be > 0")
        r = load_recipe(a.recipe) if a.recipe else {}
        gpu = a.gpu or r.get("gpu", "h100")
        tags = {k.partition("#")[2] for k in a.run}
        folders = list(a.results)
        for arg in r.get("results", []):
            tag = results_arg(arg)[1]
            if tag in tags or "" in tags:
                folders.append(arg)
        if not folders:
            raise SimulatorInputError("no result folder: give --results DIR[#TAG], or "
                                      "--recipe with a --run whose tag it names")
        scratch = Path(a.scratch or r.get("scratch", "results/validation-logs"))
        parts = []
        for arg in folders:
            d, tag, rename = results_arg(arg)
            parts.append(load_harness(d, scratch / scratch_name(d), tag=tag, rename=rename))
        h = merge_harness(parts)
        out = []
        for key in a.run:
            run = h.run(key)
            calib = _calibration(run, h, gpu, a.calibration)
            out.append(profile_run(h, run, calib, a.model, gpu, a.window_s))
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(profile_text(p) for p in out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
