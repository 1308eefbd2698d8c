"""The simulator beside a lone-prefill probe run (``python -m sglang_diffkv.bench.prefill_ttft
--out DIR``, one GPU run): the same phases replayed (not the prime burst), for each server
start with that server's settings (its log) and the calibration of its backend, the measured
median TTFT beside the model's, and each start's lone prefills fitted to TTFT = c +
max(launch, kernels): the eager prefill launch time they imply (``eager_prefill_launch_s``).
CPU only.

    diffkv-sim prefill-probes docs/data/h200-2026-11-24/s23-probes/a --gpu h200
    diffkv-sim prefill-probes DIR --gpu h200 --calibration triton=FILE --calibration diffkv=FILE

(``python -m simulator.validation.prefill_probes`` takes the same arguments.) The probe plan,
its requests and the record's format are ``sglang_diffkv.serving_io.prefill_probe``'s, shared
with the bench tool that measured them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.prefill_probe import ProbePlan, plan_from_record, summarize
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.errors import SimulatorInputError
from simulator.kv.mix import TierMix
from simulator.specs.calibration import Calibration, load_calibration
from simulator.specs.calibration_set import BACKENDS, load_calibration_set
from simulator.specs.gpu import load_gpu
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario
from simulator.validation.fit import prefill_shape
from simulator.validation.harness import diffkv_mix, server_settings

PROG = "diffkv-sim prefill-probes"
RECORD = "prefill_ttft.json"

# what a lone prefill step pays besides its kernels, zeroed to time the kernels alone
FIXED_COST_FIELDS = ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
                     "prefill_seq_overhead_s", "prefill_token_overhead_s",
                     "eager_layer_overhead_s", "layer_overhead_s", "eager_prefill_launch_s",
                     "eager_prefill_turnaround_s")
FIXED_COST_MAPS = ("eager_prefill_launch_s_by_format", "eager_prefill_turnaround_s_by_format")
LAUNCH_MAX_MS, LAUNCH_STEP_MS = 50.0, 0.1
# the simulated phases start this far apart: each has drained long before the next
SIM_PHASE_GAP_S = 30.0
SIM_BLOCK_TOKENS = 16   # prefix-cache block of the simulated prompts


def server_scenario(cfg: dict[str, Any], log_path: Path, calib: Calibration, gpu: str,
                    model: str = "llama-3-8b") -> tuple[Scenario, str]:
    """(the simulator's Scenario of a server started as ``cfg`` says (attention_backend,
    kv_cache_dtype, env; empty: the log's own arguments), its KV format): SGLang's resolved
    settings from its log, the calibration ``calib``."""
    settings, fmt = server_settings(cfg, parse_server_log(log_path))
    dcfg, mix = diffkv_mix(cfg)
    if fmt == "diffkv" and dcfg is None:
        raise SimulatorInputError(f"{log_path}: a DiffKV server whose SGLANG_DIFFKV_CONFIG the "
                                  f"record does not give (its \"configs\"): the mix is unknown")
    return Scenario(load_model(model), load_gpu(gpu), calib, settings, diffkv_config=dcfg,
                    mix=TierMix(mix[0], mix[1]) if mix else None), fmt


def model_rows(plan: ProbePlan, sc: Scenario, fmt: str) -> list[dict[str, Any]]:
    """The simulator's TTFT for every probe of every phase, on the scenario ``sc``."""
    def prompt(i: int, n: int) -> tuple[int, ...]:
        return tuple(1_000_000 * (i + 1) + b for b in range(n // SIM_BLOCK_TOKENS))

    n_probes = len(plan.probes())
    reqs: list[tuple[str, TraceRequest]] = []
    for k, phase in enumerate(plan.phases()):
        t0 = k * SIM_PHASE_GAP_S
        for i, s in enumerate(plan.phase_requests(phase)):
            probe = s.output_len == 1 and i < n_probes
            ids = prompt(i, s.input_len) if probe else prompt(10_000 + i, s.input_len)
            reqs.append((phase if probe else "", TraceRequest(
                t0 + s.arrival_s, s.input_len, s.output_len, prefix_hash_ids=ids)))
    reqs.sort(key=lambda pr: pr[1].arrival_s)
    res = sc.run(Trace(tuple(r for _, r in reqs), name="prefill-probe",
                       prefix_block_tokens=SIM_BLOCK_TOKENS), fmt)
    lat = sc.calibration.first_token_latency_s
    return [{"phase": phase, "input_len": r.input_len,
             "ttft_ms": (r.first_token - r.arrival + lat) * 1e3 if r.first_token >= 0 else None,
             "error": None}
            for (phase, _), r in zip(reqs, res.requests, strict=True) if phase]


def kernel_times(sc: Scenario, fmt: str) -> Callable[[str, int], float]:
    """(phase, prompt length) -> the modelled kernel time, ms, of a lone probe's prefill step
    (no fixed cost): a whole prompt, or with the radix cache on a one-token extend for a
    cached prompt."""
    calib = replace(sc.calibration, **{f: 0.0 for f in FIXED_COST_FIELDS},
                    **{f: {} for f in FIXED_COST_MAPS})
    server = replace(sc, calibration=calib).server(fmt)

    def kernel_ms(phase: str, input_len: int) -> float:
        cached = phase != "fresh" and not sc.settings.disable_radix_cache
        tokens, past = (1, input_len - 1) if cached else (input_len, 0)
        return server.cost.step_time(prefill_shape(server, 1, tokens, past)) * 1e3

    return kernel_ms


def launch_fit(points: list[tuple[float, float]]) -> dict[str, Any]:
    """Lone prefills as (modelled kernel ms, measured TTFT ms) fitted to TTFT = c +
    max(launch, kernels): the eager launch time (``eager_prefill_launch_s``) and the rest,
    by a search over the launch time in LAUNCH_STEP_MS steps (c: the median offset), against
    the sum c + kernels; both with their rms relative error."""
    if len(points) < 3:
        raise SimulatorInputError(f"{len(points)} lone-prefill medians: the launch fit needs "
                                  ">= 3")
    k = np.array([p[0] for p in points])
    m = np.array([p[1] for p in points])

    def rms(pred: np.ndarray) -> float:
        return float(np.sqrt(np.mean((pred / m - 1.0) ** 2)))

    best = None
    for launch in np.arange(0.0, LAUNCH_MAX_MS, LAUNCH_STEP_MS):
        body = np.maximum(k, launch)
        c = float(np.median(m - body))
        err = rms(body + c)
        if best is None or err < best[0] - 1e-12:
            best = (err, float(launch), c)
    c_sum = float(np.median(m - k))
    return {"launch_ms": round(best[1], 2), "offset_ms": round(best[2], 2),
            "rms": best[0], "sum_offset_ms": round(c_sum, 2), "sum_rms": rms(k + c_sum)}


def read_record(results: Path) -> dict[str, Any]:
    path = results / RECORD
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise SimulatorInputError(f"{results}: no {RECORD} there (a probe run's --out): "
                                  f"{e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SimulatorInputError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None


def compare(results: Path, gpu: str, calibrations: dict[str, str] | None = None
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(measured against simulated medians for every (start, config, phase, length) of the
    probe run in ``results``, each start's ``launch_fit``); ``calibrations``: backend
    (triton, diffkv) -> calibration file, in place of the GPU's shipped (or default) set."""
    data = read_record(results)
    plan = plan_from_record(data)
    shipped = load_calibration_set(load_gpu(gpu).key)
    given = {b: load_calibration(load_gpu(gpu).key, p) for b, p in (calibrations or {}).items()}
    measured = {(s["start"], s["phase"], s["input_len"]): s for s in data["summary"]}
    configs = data.get("configs") or {}
    out: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []
    for start, name in sorted({(r["start"], r["config"]) for r in data["requests"]}):
        log = results / "logs" / f"server__{start}__{name}.log"
        cfg = configs.get(name, {})
        settings, fmt = server_settings(cfg, parse_server_log(log))
        backend = "diffkv" if fmt == "diffkv" else "triton"
        calib = given.get(backend) or shipped.by_backend[backend]
        sc, fmt = server_scenario(cfg, log, calib, gpu)
        sim = summarize(model_rows(plan, sc, fmt))
        zero_load = [m for m in data["summary"] if m["start"] == start
                     and m["phase"] != "loaded" and m["median_ms"]]
        kernels = kernel_times(sc, fmt)
        points = [(kernels(m["phase"], m["input_len"]), m["median_ms"]) for m in zero_load]
        launches.append({"start": start, "config": name, "backend": backend,
                         "calibration": calib.source_file, **launch_fit(points)})
        for s in sim:
            m = measured[(start, s["phase"], s["input_len"])]
            err = (s["median_ms"] / m["median_ms"] - 1) if m["median_ms"] else None
            out.append({"start": start, "config": name, "phase": s["phase"],
                        "input_len": s["input_len"], "measured_ms": m["median_ms"],
                        "model_ms": s["median_ms"], "error": err})
    return out, launches


def format_launches(launches: list[dict[str, Any]]) -> str:
    lines = ["lone prefills fitted to TTFT = c + max(launch, kernels), and to c + kernels:"]
    for f in launches:
        lines.append(f"  start {f['start']} {f['config']:>10} ({f['backend']}): launch "
                     f"{f['launch_ms']:.1f} ms, c {f['offset_ms']:.1f} ms, rms "
                     f"{f['rms']:.1%}; sum: c {f['sum_offset_ms']:.1f} ms, rms "
                     f"{f['sum_rms']:.1%}")
    for be in sorted({f["backend"] for f in launches}):
        v = [f["launch_ms"] for f in launches if f["backend"] == be]
        lines.append(f"  {be}: eager_prefill_launch_s {statistics.median(v) / 1e3:.4f} "
                     f"(median of {len(v)} start(s); diffkv-sim validate-runs "
                     f"--eager-prefill-launch-s {be}=S)")
    return "\n".join(lines)


def format_comparison(rows: list[dict[str, Any]]) -> str:
    head = (f"{'start':>5} {'config':>10} {'phase':>7} {'L':>6} {'measured':>9} {'model':>7} "
            f"{'error':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(f"{r['start']:>5} {r['config']:>10} {r['phase']:>7} {r['input_len']:>6} "
                     f"{r['measured_ms']:9.1f} {r['model_ms']:7.1f} {err:>7}")
    lines.append("median TTFT ms; model: the simulator on the same phases, with the server's "
                 "settings from its log; error: model / measured - 1")
    return "\n".join(lines)


def calibration_arg(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        backend, sep, path = item.partition("=")
        if not sep or backend not in BACKENDS or not path:
            raise SimulatorInputError(f"--calibration {item!r}: want BACKEND=PATH, BACKEND one "
                                      f"of {', '.join(BACKENDS)}")
        out[backend] = path
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path,
                    help="a probe run's folder (python -m sglang_diffkv.bench.prefill_ttft "
                         f"--out DIR: {RECORD} and logs/)")
    ap.add_argument("--gpu", default="h200", help="the GPU (default: %(default)s)")
    ap.add_argument("--calibration", action="append", default=[], metavar="BACKEND=PATH",
                    help="the calibration of triton (bf16, fp8) or diffkv servers; repeatable; "
                         "default: the GPU's shipped set, as diffkv-sim --gpu GPU runs")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        rows, launches = compare(a.results, a.gpu, calibration_arg(a.calibration))
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(format_comparison(rows))
    print(format_launches(launches))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "launches": launches}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
