"""What a lone prefill costs a live SGLang server, per KV cache configuration and per server
start, timed from the client. One GPU run.

A mid-ladder server spends its prefill steps on one-token extends (a prompt whose prefix the
radix cache holds) and short uncached prompts, launched eagerly: their time is mostly the
host's. This starts each configuration's server ``--starts`` times, alternating (bf16, fp8,
bf16, fp8, ...: a host that drifts shows in both), and times single requests of one output
token, each ``--gap-s`` after the last:

  fresh L    a prompt of L tokens the server has not seen (an uncached prefill)
  cached L   the same prompts again: a one-token extend on an (L-1)-token cached prefix
  loaded L   the cached prompts once more while ``--load-batch`` requests stream tokens (the
             decode batch of a mid-ladder server; each probe waits for the step in flight)

for every L of ``--lengths``. ``--prime N`` first sends the first N requests of a bundled
trace (``--prime-trace``, default azure-conv) all at once, as bench_e2e.py's burst does, so the
phases run on a server in the state such a burst leaves (its radix cache full, its pool
churned). The table gives each (start, configuration, phase, L) the
median and the 10th / 90th percentile of the time to the first token, with a host-speed
reading (``simulator/calibration/host_probe.py``) taken before the start. Writes
OUT/prefill_ttft.json (every request) and OUT/logs/ (the servers' logs).

    python -m sglang_diffkv.bench.prefill_ttft --model /tmp/dummy-llama3-8b --configs bf16,fp8 \
        --starts 2 --out "$OUT"
    python -m sglang_diffkv.bench.prefill_ttft --url http://127.0.0.1:30000 --out /tmp/p
                                           # a server already running (no start, no stop)

``--compare`` (CPU only) replays the same phases (not the prime burst) through the simulator,
for each start with that server's settings (its log) and the calibration of its backend, and
prints the measured median beside the model's:

    C=docs/simulator-validation-h200/calibration-fitted
    python -m sglang_diffkv.bench.prefill_ttft --compare docs/data/h200-2026-11-24/s23-probes/a \
        --gpu h200 --calibration triton=$C-triton.json --calibration diffkv=$C-diffkv.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.bench import client as cl
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.server import (
    LaunchOptions,
    ServerConfig,
    ServerProcess,
    ServerStartError,
    launch_command,
    launch_env,
    make_config,
    parse_config_list,
)
from simulator.calibration.host_probe import python_loop_ms
from simulator.errors import SimulatorInputError

PHASES = ("fresh", "cached", "loaded")
MAX_CONTEXT = 8192   # Llama-3-8B's
PROBE_TIMEOUT_S = 5.0  # a probe not answered by then counts as failed
PRIME_WINDOW_S = 120.0
PRIME_SEED_OFFSET = 1   # the burst's prompts must share no prefix with the probes'


@dataclass(frozen=True)
class ProbePlan:
    lengths: tuple[int, ...]
    per_length: int
    gap_s: float
    load_batch: int
    load_input: int
    load_lead_s: float = 2.0   # the load's prefill and first decode steps finish first

    def __post_init__(self) -> None:
        if not self.lengths or any(not 2 <= n < MAX_CONTEXT for n in self.lengths):
            raise BenchInputError(f"lengths {self.lengths}: give at least one, each in 2.."
                                  f"{MAX_CONTEXT - 1} (a cached prompt extends by its last "
                                  "token)")
        if self.per_length < 1:
            raise BenchInputError(f"per_length={self.per_length}: must be >= 1")
        if not self.gap_s > 0:
            raise BenchInputError(f"gap_s={self.gap_s}: must be > 0")
        if self.load_batch < 0 or not 1 <= self.load_input <= MAX_CONTEXT - 64:
            raise BenchInputError(f"load_batch={self.load_batch}, load_input="
                                  f"{self.load_input}: need >= 0 and 1..{MAX_CONTEXT - 64}")

    def probes(self, start_s: float = 0.0) -> list[cl.RequestSpec]:
        """The probe requests, one every gap_s from start_s; list position i always makes the
        same prompt (``client.prompt_ids``), so a phase that repeats the list hits the cache."""
        lens = [n for n in self.lengths for _ in range(self.per_length)]
        return [cl.RequestSpec(start_s + i * self.gap_s, n, 1) for i, n in enumerate(lens)]

    def phase_specs(self, phase: str) -> list[cl.RequestSpec]:
        if phase != "loaded":
            return self.probes()
        probes = self.probes(self.load_lead_s)
        last = probes[-1].arrival_s + 1.0
        # enough tokens to outlast the probes at 4 ms a step (faster than any server's step at
        # this batch); the client cancels them once the probes are done
        out = max(16, min(int(last / 0.004), MAX_CONTEXT - self.load_input - 1))
        # after the probes in the list: their positions, hence prompts, stay the cached ones
        return probes + [cl.RequestSpec(0.0, self.load_input, out)
                         for _ in range(self.load_batch)]


def ttft_ms(rec: cl.RequestRecord) -> float | None:
    if rec.first_token_s is None or rec.error is not None:
        return None
    return (rec.first_token_s - rec.arrival_s) * 1e3


def prime(url: str, n: int, trace_name: str, seed: int = 0) -> dict[str, Any]:
    """Send the first ``n`` requests of the bundled trace ``trace_name`` at once and wait
    for the server to go idle; what it took."""
    from sglang_diffkv.bench.workloads import sharegpt_trace, to_specs

    specs = to_specs(sharegpt_trace(n, trace_name))
    t0 = time.monotonic()
    run = cl.run_async(cl.replay(url, specs, all_at_once=True, seed=seed + PRIME_SEED_OFFSET,
                                 max_duration_s=PRIME_WINDOW_S))
    if run.time_limited:
        cl.run_async(cl.abort_all(url))
    cl.run_async(cl.wait_idle(url, 60.0))
    done = sum(r.completed for r in run.records)
    return {"requests": n, "trace": trace_name, "completed": done,
            "seconds": round(time.monotonic() - t0, 1)}


def run_phases(url: str, plan: ProbePlan, seed: int = 0) -> list[dict[str, Any]]:
    """Each phase in order on the server at ``url``; one row per probe request."""
    rows: list[dict[str, Any]] = []
    n_probes = len(plan.probes())
    for phase in PHASES:
        if phase == "loaded" and plan.load_batch == 0:
            continue
        specs = plan.phase_specs(phase)
        window = specs[n_probes - 1].arrival_s + PROBE_TIMEOUT_S
        run = cl.run_async(cl.replay(url, specs, seed=seed, max_duration_s=window))
        if run.time_limited:
            cl.run_async(cl.abort_all(url))
        cl.run_async(cl.wait_idle(url, 60.0))
        for rec in run.records[:n_probes]:
            rows.append({"phase": phase, "input_len": rec.input_len,
                         "ttft_ms": ttft_ms(rec), "error": rec.error})
    return rows


# what a lone prefill step pays besides its kernels, zeroed to time the kernels alone
FIXED_COST_FIELDS = ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
                     "prefill_seq_overhead_s", "prefill_token_overhead_s",
                     "eager_layer_overhead_s", "layer_overhead_s", "eager_prefill_launch_s")
LAUNCH_MAX_MS, LAUNCH_STEP_MS = 50.0, 0.1
# the simulated phases start this far apart: each has drained long before the next
SIM_PHASE_GAP_S = 30.0
SIM_BLOCK_TOKENS = 16   # prefix-cache block of the simulated prompts


def server_scenario(cfg: ServerConfig, log_path: Path, calib_path: str, gpu: str,
                    model: str = "llama-3-8b") -> tuple[Any, str]:
    """(the simulator's Scenario of the server ``cfg`` started with, its KV format): SGLang's
    resolved settings from its log, the calibration at ``calib_path``."""
    from simulator.kv.mix import TierMix
    from simulator.specs.calibration import load_calibration
    from simulator.specs.gpu import load_gpu
    from simulator.specs.model import load_model
    from simulator.studies.scenario import Scenario
    from simulator.validation.harness import diffkv_mix, server_settings
    from simulator.validation.sglang_log import parse_server_log

    spec = load_gpu(gpu)
    calib = load_calibration(spec.key, calib_path)
    harness_cfg = {"attention_backend": cfg.attention_backend,
                   "kv_cache_dtype": cfg.kv_cache_dtype, "env": cfg.env_dict}
    settings, fmt = server_settings(harness_cfg, parse_server_log(log_path))
    dcfg, mix = diffkv_mix(harness_cfg)
    return Scenario(load_model(model), spec, calib, settings, diffkv_config=dcfg,
                    mix=TierMix(mix[0], mix[1]) if mix else None), fmt


def model_rows(plan: ProbePlan, sc: Any, fmt: str) -> list[dict[str, Any]]:
    """The simulator's TTFT for every probe of every phase, on the scenario ``sc``."""
    from simulator.workload.schema import Trace, TraceRequest

    calib = sc.calibration

    def prompt(i: int, n: int) -> tuple[int, ...]:
        return tuple(1_000_000 * (i + 1) + b for b in range(n // SIM_BLOCK_TOKENS))

    reqs: list[tuple[str, TraceRequest]] = []
    for k, phase in enumerate(PHASES):
        if phase == "loaded" and plan.load_batch == 0:
            continue
        t0 = k * SIM_PHASE_GAP_S
        for i, s in enumerate(plan.phase_specs(phase)):
            probe = s.output_len == 1 and i < len(plan.probes())
            ids = prompt(i, s.input_len) if probe else prompt(10_000 + i, s.input_len)
            reqs.append((phase if probe else "", TraceRequest(
                t0 + s.arrival_s, s.input_len, s.output_len, prefix_hash_ids=ids)))
    reqs.sort(key=lambda pr: pr[1].arrival_s)
    res = sc.run(Trace(tuple(r for _, r in reqs), name="prefill-probe",
                       prefix_block_tokens=SIM_BLOCK_TOKENS), fmt)
    lat = calib.first_token_latency_s
    return [{"phase": phase, "input_len": r.input_len,
             "ttft_ms": (r.first_token - r.arrival + lat) * 1e3 if r.first_token >= 0 else None,
             "error": None}
            for (phase, _), r in zip(reqs, res.requests, strict=True) if phase]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (start, config, phase, input_len): n, failed, median / p10 / p90 TTFT in ms."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("start", 0), r.get("config", "-"), r["phase"],
                           r["input_len"]), []).append(r)
    out = []
    for (start, config, phase, n), rs in groups.items():
        t = sorted(r["ttft_ms"] for r in rs if r["ttft_ms"] is not None)
        q = statistics.quantiles(t, n=10, method="inclusive") if len(t) >= 2 else t * 9
        out.append({"start": start, "config": config, "phase": phase, "input_len": n,
                    "n": len(t), "failed": len(rs) - len(t),
                    "median_ms": statistics.median(t) if t else None,
                    "p10_ms": q[0] if t else None, "p90_ms": q[-1] if t else None})
    return out


def format_table(summary: list[dict[str, Any]], hosts: dict[int, float]) -> str:
    head = (f"{'start':>5} {'host ms':>7} {'config':>10} {'phase':>7} {'L':>6} {'n':>4} "
            f"{'fail':>4} {'median':>8} {'p10':>8} {'p90':>8}")
    lines = [head, "-" * len(head)]
    for s in summary:
        cells = [f"{s[k]:8.1f}" if s[k] is not None else f"{'-':>8}"
                 for k in ("median_ms", "p10_ms", "p90_ms")]
        host = hosts.get(s["start"])
        lines.append(f"{s['start']:>5} {'-' if host is None else f'{host:.0f}':>7} "
                     f"{s['config']:>10} {s['phase']:>7} {s['input_len']:>6} {s['n']:>4} "
                     f"{s['failed']:>4} {' '.join(cells)}")
    lines.append("TTFT ms from the client (arrival to first streamed token), one request at a "
                 "time; host ms: simulator/calibration/host_probe.py's Python loop, lower is "
                 "faster")
    return "\n".join(lines)


def compare(results: Path, calibrations: dict[str, str], gpu: str
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(measured against simulated medians for every (start, config, phase, length) of the
    probe run in ``results``, each start's ``launch_fit``); ``calibrations``: backend
    (triton, diffkv) -> calibration."""
    data = json.loads((results / "prefill_ttft.json").read_text())
    plan = plan_from_args(build_parser().parse_args(data["argv"]))
    measured = {(s["start"], s["phase"], s["input_len"]): s for s in data["summary"]}
    out: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []
    for start, name in sorted({(r["start"], r["config"]) for r in data["requests"]}):
        cfg = make_config(name)
        backend = "diffkv" if cfg.is_diffkv else "triton"
        if backend not in calibrations:
            raise BenchInputError(f"start {start} ({name}) needs --calibration {backend}=PATH")
        log = results / "logs" / f"server__{start}__{name}.log"
        sc, fmt = server_scenario(cfg, log, calibrations[backend], gpu)
        sim = summarize(model_rows(plan, sc, fmt))
        zero_load = [m for m in data["summary"] if m["start"] == start
                     and m["phase"] != "loaded" and m["median_ms"]]
        kernels = kernel_times(sc, fmt)
        points = [(kernels(m["phase"], m["input_len"]), m["median_ms"]) for m in zero_load]
        launches.append({"start": start, "config": name, "backend": backend,
                         **launch_fit(points)})
        for s in sim:
            m = measured[(start, s["phase"], s["input_len"])]
            err = (s["median_ms"] / m["median_ms"] - 1) if m["median_ms"] else None
            out.append({"start": start, "config": name, "phase": s["phase"],
                        "input_len": s["input_len"], "measured_ms": m["median_ms"],
                        "model_ms": s["median_ms"], "error": err})
    return out, launches


def kernel_times(sc: Any, fmt: str) -> Callable[[str, int], float]:
    """(phase, prompt length) -> the modelled kernel time, ms, of a lone probe's prefill step
    (no fixed cost): a whole prompt, or with the radix cache on a one-token extend for a
    cached prompt."""
    from simulator.validation.fit import prefill_shape

    calib = replace(sc.calibration, **{f: 0.0 for f in FIXED_COST_FIELDS})
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
        raise BenchInputError(f"{len(points)} lone-prefill medians: the launch fit needs >= 3")
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


def format_launches(launches: list[dict[str, Any]]) -> str:
    lines = ["lone prefills fitted to TTFT = c + max(launch, kernels), and to c + kernels:"]
    for f in launches:
        lines.append(f"  start {f['start']} {f['config']:>10} ({f['backend']}): launch "
                     f"{f['launch_ms']:.1f} ms, c {f['offset_ms']:.1f} ms, rms "
                     f"{f['rms']:.1%}; sum: c {f['sum_offset_ms']:.1f} ms, rms "
                     f"{f['sum_rms']:.1%}")
    for be in sorted({f["backend"] for f in launches}):
        v = [f["launch_ms"] for f in launches if f["backend"] == be]
        lines.append(f"  {be}: --eager-prefill-launch-ms {be}={statistics.median(v):.1f} "
                     f"(median of {len(v)} start(s))")
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


def plan_from_args(a: argparse.Namespace) -> ProbePlan:
    try:
        lengths = tuple(int(x) for x in a.lengths.split(",") if x.strip())
    except ValueError:
        raise BenchInputError(f"--lengths {a.lengths!r}: want integers, e.g. 128,1024,4096"
                              ) from None
    return ProbePlan(lengths, a.per_length, a.gap_s, a.load_batch, a.load_input)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="results folder (required unless --compare)")
    ap.add_argument("--compare", type=Path, metavar="RESULTS",
                    help="no GPU: the simulator's TTFT beside a probe run's (its --out folder)")
    ap.add_argument("--calibration", action="append", default=[], metavar="BACKEND=PATH",
                    help="with --compare: the calibration for triton (bf16, fp8) or diffkv "
                         "servers, e.g. simulator/calibration/h200-triton.json")
    ap.add_argument("--gpu", default="h200", help="with --compare: the GPU (default h200)")
    ap.add_argument("--url", help="probe this running server instead of starting any")
    ap.add_argument("--model", help="model path for the servers this starts")
    ap.add_argument("--configs", default="bf16,fp8",
                    help="configurations to start, as bench_e2e.py names them (bf16, fp8, "
                         "diffkv, diffkv-mix, ...); default: bf16,fp8")
    ap.add_argument("--starts", type=int, default=1,
                    help="server starts per configuration, alternating (default 1)")
    ap.add_argument("--lengths", default="128,1024,4096",
                    help="prompt lengths in tokens, comma-separated (default 128,1024,4096)")
    ap.add_argument("--per-length", type=int, default=20,
                    help="probe requests per length and phase (default 20)")
    ap.add_argument("--gap-s", type=float, default=0.15,
                    help="seconds between probe requests (default 0.15)")
    ap.add_argument("--load-batch", type=int, default=16,
                    help="decode requests streaming during the loaded phase (0: no such "
                         "phase; default 16)")
    ap.add_argument("--load-input", type=int, default=512,
                    help="prompt tokens of each load request (default 512)")
    ap.add_argument("--prime", type=int, default=0, metavar="N",
                    help="first send N requests of --prime-trace all at once (default 0)")
    ap.add_argument("--prime-trace", default="azure-conv",
                    help="bundled trace of the --prime burst (default azure-conv)")
    ap.add_argument("--ready-timeout-s", type=float, default=400.0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a start that the longest start so far says would end past "
                         "this many seconds from launch (default: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.compare is not None:
        return main_compare(ap, a)
    if a.out is None:
        ap.error("--out is required (or --compare RESULTS)")
    try:
        plan = plan_from_args(a)
    except BenchInputError as e:
        ap.error(str(e))
    if a.starts < 1:
        ap.error(f"--starts {a.starts}: must be >= 1")
    if a.budget_s is not None and not a.budget_s > 0:
        ap.error(f"--budget-s {a.budget_s}: must be > 0")
    if a.prime < 0:
        ap.error(f"--prime {a.prime}: must be >= 0")
    if a.prime:
        from sglang_diffkv.bench.workloads import sharegpt_trace
        try:
            sharegpt_trace(a.prime, a.prime_trace)
        except (BenchInputError, SimulatorInputError) as e:
            ap.error(f"--prime {a.prime} --prime-trace {a.prime_trace}: {e}")
    primes: dict[int, dict[str, Any]] = {}
    if a.url is None and a.model is None:
        ap.error("give --model (servers to start) or --url (a running server)")
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    hosts: dict[int, float] = {}
    if a.url is not None:
        hosts[0] = python_loop_ms()
        if a.prime:
            primes[0] = prime(a.url, a.prime, a.prime_trace, a.seed)
        rows += [{**r, "start": 0, "config": "url"} for r in run_phases(a.url, plan, a.seed)]
    else:
        try:
            configs = parse_config_list(a.configs)
        except BenchInputError as e:
            ap.error(str(e))
        opts = LaunchOptions(model=a.model)
        cl.raise_fd_limit()
        order = [c for _ in range(a.starts) for c in configs]
        t_launch, longest = time.monotonic(), 0.0
        for i, cfg in enumerate(order):
            t_start = time.monotonic()
            if a.budget_s is not None and t_start - t_launch + longest > a.budget_s:
                print(f"start {i}: {cfg.name} skipped: {a.budget_s - (t_start - t_launch):.0f} s "
                      f"left of --budget-s, a start took up to {longest:.0f} s", flush=True)
                break
            hosts[i] = python_loop_ms()
            server = ServerProcess(launch_command(cfg, opts), launch_env(cfg),
                                   a.out / "logs" / f"server__{i}__{cfg.name}.log")
            try:
                server.start(opts.host, opts.port)
                ready = server.wait_ready(a.ready_timeout_s)
                print(f"start {i}: {cfg.name} ready after {ready:.0f} s; host {hosts[i]:.0f} "
                      "ms", flush=True)
                t0 = time.monotonic()
                if a.prime:
                    primes[i] = prime(opts.base_url, a.prime, a.prime_trace, a.seed)
                    print(f"start {i}: primed: {primes[i]}", flush=True)
                rows += [{**r, "start": i, "config": cfg.name}
                         for r in run_phases(opts.base_url, plan, a.seed)]
                print(f"start {i}: probed in {time.monotonic() - t0:.0f} s", flush=True)
            except ServerStartError as e:
                print(f"start {i}: {cfg.name} did not start: {e}", flush=True)
            finally:
                server.stop()
                longest = max(longest, time.monotonic() - t_start)
    summary = summarize(rows)
    (a.out / "prefill_ttft.json").write_text(json.dumps(
        {"argv": sys.argv[1:] if argv is None else argv, "host_ms": hosts, "primes": primes,
         "summary": summary, "requests": rows}, indent=1))
    print(format_table(summary, hosts))
    return 0


def main_compare(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    calibrations = {}
    for item in a.calibration:
        backend, sep, path = item.partition("=")
        if not sep or backend not in ("triton", "diffkv") or not path:
            ap.error(f"--calibration {item!r}: want triton=PATH or diffkv=PATH")
        calibrations[backend] = path
    if not (a.compare / "prefill_ttft.json").is_file():
        ap.error(f"--compare {a.compare}: no prefill_ttft.json there (a probe run's --out)")
    try:
        rows, launches = compare(a.compare, calibrations, a.gpu)
    except (BenchInputError, SimulatorInputError) as e:
        print(f"prefill_ttft: error: {e}", file=sys.stderr)
        return 2
    print(format_comparison(rows))
    print(format_launches(launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
