"""``python -m sglang_diffkv.bench.e2e`` (``scripts/bench_e2e.py`` on the GPU machine):
configurations x workloads against real SGLang servers, one server
start per configuration, inside one wall-clock budget (see docs/e2e.md).

It assumes SGLang is importable by ``--python`` and the model folder exists
(``scripts/gpu_e2e_run.sh`` does the install on the GPU machine). Writes into ``--out``:
  results.json        everything: environment, command lines, start-up, per-run metrics and
                      server-log statistics, budget notes, the table
  bench_serving.jsonl one bench_serving-style line per run
                      (simulator.validation.bench_result.read_bench_result, index = run)
  summary.txt         the printed table and notes
  logs.tar.gz         server logs, per-request records, the exact traces (Mooncake JSONL)
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from sglang_diffkv.bench import admission as adm
from sglang_diffkv.bench import client as cl
from sglang_diffkv.bench.budget import Budget
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.logstats import mm_ms_per_step, slice_stats, startup_info
from sglang_diffkv.bench.metrics import summarize_run, write_bench_jsonl
from sglang_diffkv.bench.server import (
    LaunchOptions,
    ServerConfig,
    ServerProcess,
    ServerStartError,
    launch_command,
    launch_env,
    parse_config_list,
    shell_line,
)
from sglang_diffkv.bench.workloads import (
    AUTO_FACTOR,
    WORKLOADS,
    LongGen,
    PrefixReuse,
    auto_longgen_n,
    hit_ceiling,
    ladder_trace,
    paced_trace,
    parse_rates,
    parse_workloads,
    sharegpt_trace,
    to_specs,
)
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl

MIN_WINDOW_S = 15.0
STOP_EST_S = 15.0
WARMUP_EST_S = 15.0
TAR_LIMIT = 15 * 2**20  # files coming back from the GPU machine are capped at 16 MiB each


def _kv_pairs(items: list[str], what: str, sep: str = "=") -> dict[str, str]:
    out: dict[str, str] = {}
    for it in items:
        key, eq, val = it.partition(sep)
        if not eq or not key.strip():
            raise BenchInputError(f"{what} {it!r}: expected NAME{sep}VALUE")
        out[key.strip()] = val
    return out


# Prompt lengths the warm-up cycles through: short, the long-generation range and
# ShareGPT-like long prompts (first-use compiles of the prefill path depend on them).
WARMUP_PROMPT_LENS = (17, 128, 640, 2048)
WARMUP_OUTPUT_LEN = 16


def warmup_phases(n: int) -> list[tuple[list[cl.RequestSpec], bool]]:
    """``n`` warm-up requests in two phases: the first of each length sent one at a time
    (1 s apart: each prefills alone), then all ``n`` at once, lengths cycling."""
    lens = [WARMUP_PROMPT_LENS[i % len(WARMUP_PROMPT_LENS)] for i in range(n)]
    singles = [cl.RequestSpec(float(i), length, WARMUP_OUTPUT_LEN)
               for i, length in enumerate(lens[:len(WARMUP_PROMPT_LENS)])]
    together = [cl.RequestSpec(0.0, length, WARMUP_OUTPUT_LEN) for length in lens]
    return [(singles, False), (together, True)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_diffkv.bench.e2e", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="bf16,fp8,diffkv-mix",
                   help="bf16, fp8, diffkv, diffkv-<variant> (comma-separated)")
    p.add_argument("--workloads", default="longgen,sharegpt,ladder",
                   help=f"subset of {','.join(WORKLOADS)}; always run in that order")
    p.add_argument("--model", default="/tmp/dummy-llama3-8b")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/diffkv_e2e")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget of the whole run; steps that do not fit are "
                        "shortened or skipped")
    p.add_argument("--window-s", type=float, default=60.0, help="sharegpt window (s)")
    p.add_argument("--longgen-window-s", type=float, default=120.0)
    p.add_argument("--ladder-window-s", type=float, default=45.0, help="window per rate (s)")
    p.add_argument("--longgen-n", default="auto",
                   help="long-generation requests: a number, or 'auto' (default): "
                        "--longgen-n-factor x the requests of mean length each server's "
                        "reported KV capacity holds (never fewer than an earlier "
                        "configuration's), so memory, not the request count, caps the batch")
    p.add_argument("--longgen-n-factor", type=float, default=AUTO_FACTOR,
                   help="auto N's multiple of the capacity in requests (> 1)")
    p.add_argument("--longgen-out", type=int, default=4096)
    p.add_argument("--longgen-in", default="256,768", help="MIN,MAX prompt tokens (uniform)")
    p.add_argument("--sharegpt-n", type=int, default=1500)
    p.add_argument("--sharegpt-trace", default="sharegpt",
                   help="bundled trace name or trace file for sharegpt and ladder lengths")
    p.add_argument("--sharegpt-skip", type=int, default=0,
                   help="leave out the trace's first SKIP requests (sharegpt and ladder "
                        "lengths); e.g. 1500 with --sharegpt-n 500 replays the bundled "
                        "ShareGPT requests that the default runs never use")
    p.add_argument("--ladder-rates", default="0.25,0.5,0.75",
                   help="fractions of the saturation req/s measured by sharegpt (see "
                        "--paced-basis)")
    p.add_argument("--ladder-abs-rates", default=None,
                   help="absolute req/s instead of fractions (sharegpt not needed)")
    p.add_argument("--prefix-trace", default=PrefixReuse.source,
                   help="prefix workload: a bundled trace or file with Mooncake hash_ids")
    p.add_argument("--prefix-n", type=int, default=PrefixReuse.n,
                   help="prefix workload: the trace's first N requests")
    p.add_argument("--prefix-max-input", type=int, default=PrefixReuse.max_input,
                   help="prefix workload: prompts cut to this many tokens (leading blocks "
                        "kept); with --prefix-max-output it must fit the served context")
    p.add_argument("--prefix-max-output", type=int, default=PrefixReuse.max_output)
    p.add_argument("--prefix-window-s", type=float, default=60.0,
                   help="prefix workload: the saturation window (s); its paced runs use "
                        "--ladder-window-s")
    p.add_argument("--prefix-rates", default="0.25,0.5",
                   help="prefix workload: fractions of its saturation req/s (measured first, "
                        "all requests at t=0) at which the trace is replayed paced")
    p.add_argument("--paced-basis", choices=("first", "own"), default="first",
                   help="whose saturation req/s the ladder and prefix fractions multiply: "
                        "'first' (default), the first configuration that measured one, so "
                        "every configuration is paced at the same absolute rates and their "
                        "latencies compare at equal load; 'own', each server's own")
    p.add_argument("--diffkv-config", action="append", default=[], metavar="NAME=JSON",
                   help="SGLANG_DIFFKV_CONFIG of a diffkv variant (default: "
                        "the llama-3-8b preset with bench_mix [0.3, 0.5, 0.2])")
    p.add_argument("--diffkv-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of every diffkv variant (default "
                        "SGLANG_DIFFKV_PROFILE=1; give SGLANG_DIFFKV_PROFILE=0 to turn it off)")
    p.add_argument("--diffkv-variant-env", action="append", default=[],
                   metavar="NAME:KEY=VALUE",
                   help="extra environment of one diffkv variant, e.g. "
                        "'diffkv-fused:SGLANG_DIFFKV_FUSED_ARGMIN=1' for one side of an A/B")
    p.add_argument("--server-args", default="", help="extra launch_server arguments, all "
                   "configurations (one shell-quoted string)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--python", default=sys.executable, help="interpreter that runs SGLang")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--stream-interval", type=int, default=4)
    p.add_argument("--decode-log-interval", type=int, default=10)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--start-estimate-s", type=float, default=150.0,
                   help="expected first (cold) start; later starts use the measured one")
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument("--max-inflight", type=int, default=None,
                   help="open streams at most (default: from the open-file limit, <= 4096)")
    p.add_argument("--min-window-s", type=float, default=MIN_WINDOW_S,
                   help="a window the budget would cut below this is skipped instead")
    p.add_argument("--warmup", type=int, default=4,
                   help="warm-up requests per server (0: none): prompts of "
                        f"{', '.join(map(str, WARMUP_PROMPT_LENS))} tokens, first one at a "
                        "time, then all together")
    p.add_argument("--freeze-gc", action="store_true",
                   help="after the warm-up, POST /freeze_gc (SGLang's advice against GC "
                        "pauses: the tokenizer manager's first full collection otherwise "
                        "stalls every request in flight for ~0.3-0.5 s, around the 900th "
                        "request on the H200 runs); results.json records the answer")
    p.add_argument("--git-commit", default=None, help="recorded in results.json when the "
                   "machine has no .git")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and command lines, write the traces, start nothing")
    return p


@dataclass(frozen=True)
class Plan:
    configs: list[ServerConfig]
    workloads: list[str]
    launch: LaunchOptions
    longgen: LongGen  # (with --longgen-n auto, its n is replaced per server)
    longgen_auto: bool
    longgen_factor: float
    sharegpt_n: int
    sharegpt_source: str
    sharegpt_skip: int
    ladder_rates: list[float]
    ladder_absolute: bool
    windows: dict[str, float]
    prefix: PrefixReuse
    prefix_rates: list[float]


def make_plan(a: argparse.Namespace) -> Plan:
    diffkv_env = {"SGLANG_DIFFKV_PROFILE": "1", **_kv_pairs(a.diffkv_env, "--diffkv-env")}
    variant_env: dict[str, dict[str, str]] = {}
    for item in a.diffkv_variant_env:
        ((name, kv),) = _kv_pairs([item], "--diffkv-variant-env", ":").items()
        variant_env.setdefault(name, {}).update(_kv_pairs([kv], "--diffkv-variant-env"))
    configs = parse_config_list(a.configs, _kv_pairs(a.diffkv_config, "--diffkv-config"),
                                diffkv_env, variant_env)
    names = parse_workloads(a.workloads)
    workloads = [w for w in WORKLOADS if w in names]
    absolute = a.ladder_abs_rates is not None
    rates = parse_rates(a.ladder_abs_rates if absolute else a.ladder_rates,
                        "--ladder-abs-rates" if absolute else "--ladder-rates")
    if "ladder" in workloads and not absolute and "sharegpt" not in workloads:
        raise BenchInputError(
            "ladder with fractional --ladder-rates needs sharegpt in --workloads (it measures "
            "the saturation rate); or give --ladder-abs-rates in req/s")
    windows = {"longgen": a.longgen_window_s, "sharegpt": a.window_s,
               "ladder": a.ladder_window_s, "prefix": a.prefix_window_s}
    if not a.min_window_s > 0:
        raise BenchInputError(f"--min-window-s {a.min_window_s!r} must be > 0")
    for k, v in windows.items():
        if not v >= a.min_window_s:
            raise BenchInputError(f"{k} window {v!r} s must be >= --min-window-s "
                                  f"{a.min_window_s:g} s")
    try:
        lo, hi = (int(x) for x in a.longgen_in.split(","))
    except ValueError as e:
        raise BenchInputError(f"--longgen-in {a.longgen_in!r}: expected MIN,MAX, e.g. "
                              "256,768") from e
    try:
        extra = tuple(shlex.split(a.server_args))
    except ValueError as e:
        raise BenchInputError(f"--server-args {a.server_args!r}: {e}") from e
    launch = LaunchOptions(model=a.model, host=a.host, port=a.port,
                           mem_fraction_static=a.mem_fraction_static,
                           decode_log_interval=a.decode_log_interval,
                           stream_interval=a.stream_interval, python=a.python,
                           extra_args=extra)
    if not a.budget_s > 0:
        raise BenchInputError(f"--budget-s {a.budget_s!r} must be > 0")
    if {"sharegpt", "ladder"} & set(workloads):
        sharegpt_trace(a.sharegpt_n, a.sharegpt_trace, a.sharegpt_skip)  # fail before a start
    prefix = PrefixReuse(a.prefix_n, a.prefix_max_input, a.prefix_max_output, a.prefix_trace)
    prefix_rates = parse_rates(a.prefix_rates, "--prefix-rates")
    if "prefix" in workloads:
        prefix.trace()  # fail before a start
    auto = str(a.longgen_n).strip().lower() == "auto"
    if auto:
        n = 512  # a placeholder: each server's start-up capacity decides
        if not a.longgen_n_factor > 1:
            raise BenchInputError(f"--longgen-n-factor {a.longgen_n_factor!r} must be > 1")
    else:
        try:
            n = int(a.longgen_n)
        except ValueError as e:
            raise BenchInputError(f"--longgen-n {a.longgen_n!r}: a number or 'auto'") from e
    return Plan(configs, workloads, launch, LongGen(n, lo, hi, a.longgen_out, a.seed), auto,
                a.longgen_n_factor, a.sharegpt_n, a.sharegpt_trace, a.sharegpt_skip, rates,
                absolute, windows, prefix, prefix_rates)


_ALL_HIGH = re.compile(r"capacity (\d+) tokens all-high")


def reported_all_high(report: list[str]) -> int | None:
    """DiffKV's all-high capacity in tokens from its start-up report lines, if any."""
    for ln in report:
        if m := _ALL_HIGH.search(ln):
            return int(m.group(1))
    return None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first ``model name`` of ``cpuinfo`` (None where there is none, e.g. off Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def environment_info(git_commit: str | None) -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("sglang", "torch", "sglang-kernel", "triton",
                                             "flashinfer-python", "aiohttp", "sglang-diffkv")},
    }
    # the host CPU matters: eager (prefill) steps are bound by their launches
    info["cpu"] = cpu_model()
    info["cpus"] = os.cpu_count()
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["gpu"] = q.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    commit = git_commit
    if commit is None:
        root = Path(__file__).resolve().parents[2]
        try:
            r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                               capture_output=True, text=True, timeout=10)
            commit = r.stdout.strip() or None
            d = subprocess.run(["git", "-C", str(root), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
            if commit and d.stdout.strip():
                commit += " (+ local changes)"
        except (OSError, subprocess.SubprocessError):
            commit = None
    info["git_commit"] = commit or "unknown (no git here; pass --git-commit)"
    return info


def _fmt(v: Any, spec: str = ".0f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


TABLE_COLS = (
    ("config", 12), ("workload", 14), ("win s", 6), ("out tok/s", 9), ("steady", 8),
    ("req/s", 6), ("done", 5), ("batch", 6), ("peak", 5), ("pool tok", 9), ("peak #tok", 9),
    ("TPOT ms", 7), ("TPOT med", 8), ("TTFT ms", 8), ("mm ms", 6), ("retr", 5),
    ("hit %", 5), ("admit", 6),
)


def table_row(run: dict[str, Any]) -> list[str]:
    c, s, pool = run["client"], run["server_log"], run.get("pool_tokens")
    return [
        run["config"], run["label"], _fmt(c["window_s"]), _fmt(c["output_throughput"]),
        _fmt(c["steady_output_throughput"]), _fmt(c["request_throughput"], ".2f"),
        _fmt(c["completed"]), _fmt(s.get("mean_running"), ".1f"), _fmt(s.get("peak_running")),
        _fmt(pool), _fmt(s.get("peak_tokens_used")), _fmt(c["mean_tpot_all_ms"], ".1f"),
        _fmt(c["median_tpot_all_ms"], ".1f"), _fmt(c["mean_ttft_all_ms"]),
        _fmt(mm_ms_per_step(s), ".2f"), _fmt(s.get("retractions")),
        _fmt(None if c.get("cache_hit_rate") is None else 100 * c["cache_hit_rate"], ".1f"),
        adm.SHORT.get(run.get("admission_rule") or "", "-"),
    ]


def format_table(runs: list[dict[str, Any]]) -> str:
    head = " ".join(f"{n:>{w}}" for n, w in TABLE_COLS)
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(" ".join(f"{v:>{w}}" for v, (_, w) in zip(table_row(r), TABLE_COLS,
                                                                  strict=True)))
    lines.append("out tok/s: tokens received in the window / window; steady: the window's "
                 "second half; TPOT/TTFT: every request that streamed (completed or not); "
                 "batch/peak/#tok: 'Decode batch' log lines; mm ms: DiffKV memory "
                 "management per step (SGLANG_DIFFKV_PROFILE); hit %: prompt tokens served from "
                 "the prefix cache (meta_info.cached_tokens) over prompt tokens, requests "
                 "that streamed; admit: SGLang's admission rule, strict = ignore_eos_strict "
                 "(ignore_eos and the radix cache off: every admitted request can reach its "
                 "max_new_tokens, no retraction), ratio = new_token_ratio (optimistic, may "
                 "retract)")
    lines += adm.mixed_rule_warnings(runs)
    return "\n".join(lines)


def saturation_rate(client: dict[str, Any]) -> float:
    """A run with every request at t = 0: its request throughput over the window's second
    half (after the start-up prefill burst) when the window cut it, else over the run."""
    steady = client["steady_request_throughput"]
    return steady if client["time_limited"] and steady > 0 else client["request_throughput"]


class Harness:
    """Runs the plan; every result and note lands in ``self.results``."""

    def __init__(self, plan: Plan, a: argparse.Namespace, argv: list[str]) -> None:
        self.plan, self.a = plan, a
        self.out = Path(a.out)
        self.logs = self.out / "logs"
        self.traces = self.logs / "traces"
        self.budget = Budget(a.budget_s)
        self.fd_limit = cl.raise_fd_limit()
        self.max_inflight = a.max_inflight or cl.default_max_inflight(self.fd_limit)
        self.start_est = a.start_estimate_s
        self.drain_est = 20.0
        self.runs: list[dict[str, Any]] = []
        self.configs: dict[str, dict[str, Any]] = {}
        self.results: dict[str, Any] = {
            "command": shell_line([sys.executable, sys.argv[0], *argv]),
            "argv": argv,
            "fd_limit": self.fd_limit,
            "max_inflight": self.max_inflight,
            "options": {k: v for k, v in vars(a).items()},
            "plan": {"workloads": plan.workloads, "windows_s": plan.windows,
                     "longgen": asdict(plan.longgen), "longgen_n_auto": plan.longgen_auto,
                     "longgen_n_factor": plan.longgen_factor,
                     "sharegpt_n": plan.sharegpt_n,
                     "sharegpt_source": plan.sharegpt_source,
                     "sharegpt_skip": plan.sharegpt_skip,
                     "ladder_rates": plan.ladder_rates,
                     "prefix": asdict(plan.prefix), "prefix_rates": plan.prefix_rates,
                     "ladder_rates_are": "req/s" if plan.ladder_absolute else
                     "fractions of the sharegpt saturation req/s"},
        }
        self._traces: dict[str, Trace] = {}
        self.longgen_n_max = 0  # the largest auto N so far (later configurations never run fewer)
        # workload -> (configuration, req/s): the first saturation measured per workload,
        # the pacing basis of every later configuration under --paced-basis first
        self.paced_basis: dict[str, tuple[str, float]] = {}

    def say(self, text: str) -> None:
        line = self.budget.note(text)
        print(line, flush=True)

    # ---- traces ------------------------------------------------------------------------

    def trace(self, key: str, longgen_n: int | None = None) -> Trace:
        if key == "longgen" and longgen_n is not None:
            key = f"longgen-{longgen_n}"
        if key not in self._traces:
            if key == "longgen":
                self._traces[key] = self.plan.longgen.trace()
            elif key.startswith("longgen-"):
                self._traces[key] = replace(self.plan.longgen, n=longgen_n).trace()
            elif key == "prefix":
                self._traces[key] = self.plan.prefix.trace()
            elif key == "sharegpt":
                self._traces[key] = sharegpt_trace(self.plan.sharegpt_n,
                                                   self.plan.sharegpt_source,
                                                   self.plan.sharegpt_skip)
            else:
                raise KeyError(key)
        return self._traces[key]

    def write_trace(self, trace: Trace, stem: str) -> str:
        self.traces.mkdir(parents=True, exist_ok=True)
        p = write_mooncake_jsonl(trace, self.traces / f"{stem}.jsonl")
        return str(p.relative_to(self.out))

    # ---- one workload run ----------------------------------------------------------------

    def run_workload(self, server: ServerProcess, cfg: ServerConfig, label: str, trace: Trace,
                     all_at_once: bool, window: float, trace_file: str,
                     extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        base = self.plan.launch.base_url
        specs = to_specs(trace)
        self.say(f"{cfg.name}/{label}: {len(specs)} requests, "
                 f"{'all at t=0' if all_at_once else 'open loop'}, window {window:.0f} s")
        off0 = server.log_size()
        t_run = time.monotonic()
        run = cl.run_async(cl.replay(base, specs, all_at_once=all_at_once,
                                     max_duration_s=window, seed=self.a.seed,
                                     max_inflight=self.max_inflight))
        off1 = server.log_size()
        aborted = cl.run_async(cl.abort_all(base)) if run.time_limited else None
        # never wait past the budget: the server is stopped next anyway
        drain_cap = max(5.0, min(self.a.drain_timeout_s,
                                 self.budget.left() + self.budget.reserve_s - STOP_EST_S))
        idle = cl.run_async(cl.wait_idle(base, drain_cap))
        drain = time.monotonic() - t_run - run.window_s
        self.drain_est = max(self.drain_est * 0.5, drain + 5)
        name = f"{cfg.name}__{label}"
        summary = summarize_run(run, name)
        stats = slice_stats(server.log_path, off0, off1)
        with gzip.open(self.logs / f"requests__{name}.jsonl.gz", "wt") as f:
            for r in run.records:
                f.write(json.dumps(r.compact()) + "\n")
        rec = {
            "config": cfg.name, "workload": label.split("@")[0], "label": label,
            "trace_file": trace_file, "client": summary, "server_log": stats,
            "pool_tokens": self.configs[cfg.name].get("max_total_num_tokens"),
            "ignore_eos": cl.SENDS_IGNORE_EOS,
            "admission_rule": self.configs[cfg.name].get("admission_rule"),
            "abort_all": aborted, "idle_after_s": idle, "drain_s": drain,
            "wall_start_unix": run.wall_start, **(extra or {}),
        }
        self.runs.append(rec)
        self.say(f"{cfg.name}/{label}: {summary['output_throughput']:.0f} out tok/s "
                 f"(steady {summary['steady_output_throughput']:.0f}), "
                 f"{summary['completed']} completed, {summary['failed']} failed, "
                 f"batch mean {stats.get('mean_running', 0):.1f} peak "
                 f"{stats.get('peak_running', 0)}; idle again after "
                 f"{'-' if idle is None else f'{idle:.1f}'} s")
        if summary["failed"]:
            self.say(f"{cfg.name}/{label}: errors {summary['error_kinds']}: "
                     f"{summary['first_errors'][:1]}")
        if idle is None:
            self.say(f"{cfg.name}/{label}: server still busy {drain_cap:.0f} s "
                     "after the window; later workloads on it overlap")
        return rec

    def windowed(self, what: str, want: float) -> float | None:
        w = self.budget.window(want, self.drain_est + STOP_EST_S, self.a.min_window_s)
        if w is None:
            self.say(f"SKIP {what}: {self.budget.left():.0f} s left, needs "
                     f">= {self.a.min_window_s + self.drain_est + STOP_EST_S:.0f} s")
        elif w < want:
            self.say(f"SHORTEN {what}: window {w:.0f} s instead of {want:.0f} s (budget)")
        return w

    def run_config(self, cfg: ServerConfig) -> None:
        plan = self.plan
        argv = launch_command(cfg, plan.launch)
        env = launch_env(cfg)
        info: dict[str, Any] = {"command": shell_line(argv, cfg.env_dict),
                                "env": cfg.env_dict, "attention_backend": cfg.attention_backend,
                                "kv_cache_dtype": cfg.kv_cache_dtype}
        self.configs[cfg.name] = info
        need = (self.start_est + WARMUP_EST_S + self.a.min_window_s + self.drain_est
                + STOP_EST_S)
        if not self.budget.fits(need):
            info["skipped"] = f"budget: {self.budget.left():.0f} s left, needs ~{need:.0f} s"
            self.say(f"SKIP config {cfg.name}: {info['skipped']}")
            return
        log_path = self.logs / f"server__{cfg.name}.log"
        server = ServerProcess(argv, env, log_path)
        self.say(f"{cfg.name}: starting: {info['command']}")
        try:
            server.start(plan.launch.host, plan.launch.port)
            timeout = min(self.a.start_timeout_s, self.budget.left() - STOP_EST_S)
            ready = server.wait_ready(timeout)
        except ServerStartError as e:
            info["error"] = str(e)
            self.say(f"{cfg.name}: START FAILED: {e}")
            return
        try:
            info["startup_s"] = ready
            self.start_est = ready + 15
            info.update(startup_info(log_path, server.log_size()))
            self._admission(cfg, argv)
            self.say(f"{cfg.name}: ready after {ready:.0f} s; pool "
                     f"{info.get('max_total_num_tokens')} tokens, max running "
                     f"{info.get('max_running_requests')}")
            for ln in info.get("diffkv_report", []):
                self.say(f"{cfg.name}:   {ln}")
            self._warmup(cfg)
            self._freeze_gc(cfg)
            self._workloads(server, cfg)
        finally:
            info["stop_s"] = server.stop()
            self.say(f"{cfg.name}: stopped in {info['stop_s']:.0f} s")

    def _admission(self, cfg: ServerConfig, argv: list[str]) -> None:
        """Record the server's resolved radix setting (its start-up log's, which
        ``startup_info`` read into the config's info, else the launch command's) and the
        admission rule it gives the bench's (ignore_eos) requests
        (sglang_diffkv.bench.admission)."""
        info = self.configs[cfg.name]
        off, where = adm.radix_disabled(argv, cfg.attention_backend,
                                        info.get("disable_radix_cache"))
        rule = adm.admission_rule(cl.SENDS_IGNORE_EOS, off)
        info.update({"disable_radix_cache": off, "disable_radix_cache_from": where,
                     "admission_rule": rule})
        self.say(f"{cfg.name}: radix cache {'off' if off else 'on'} ({where}): SGLang admits "
                 f"the ignore_eos requests under {rule}")

    def _warmup(self, cfg: ServerConfig) -> None:
        if self.a.warmup <= 0:
            return
        t = time.monotonic()
        bad: list[str] = []
        # one prompt at a time, then all together: single- and multi-prompt prefill batches
        # of several lengths compile their kernels here, not in the first measured window
        for specs, at_once in warmup_phases(self.a.warmup):
            run = cl.run_async(cl.replay(self.plan.launch.base_url, specs, all_at_once=at_once,
                                         max_duration_s=60.0, seed=self.a.seed + 999))
            bad += [r.error for r in run.records if not r.completed]
        self.configs[cfg.name]["warmup_s"] = time.monotonic() - t
        if bad:
            self.say(f"{cfg.name}: warm-up: {len(bad)} requests failed: {bad[0]}")

    def _freeze_gc(self, cfg: ServerConfig) -> None:
        if not self.a.freeze_gc:
            return
        frozen = cl.run_async(cl.freeze_gc(self.plan.launch.base_url))
        self.configs[cfg.name]["gc_frozen"] = frozen
        self.say(f"{cfg.name}: /freeze_gc after the warm-up: "
                 f"{'done' if frozen else 'FAILED (the runs go on unfrozen)'}")

    def _workloads(self, server: ServerProcess, cfg: ServerConfig) -> None:
        plan = self.plan
        saturation: float | None = None
        for wl in plan.workloads:
            if not server.alive():
                self.say(f"{cfg.name}: SERVER DIED; skipping {wl} and later workloads")
                self.configs[cfg.name]["died"] = True
                return
            if wl in ("longgen", "sharegpt"):
                w = self.windowed(f"{cfg.name}/{wl}", plan.windows[wl])
                if w is None:
                    continue
                extra = None
                if wl == "longgen" and plan.longgen_auto:
                    extra = self._auto_n(cfg)
                    if extra is None:
                        continue
                trace = self.trace(wl, None if extra is None else extra["longgen_n"])
                tf = self.write_trace(trace, trace.name)
                rec = self.run_workload(server, cfg, wl, trace, True, w, tf, extra)
                if wl == "longgen" and rec is not None:
                    self._check_longgen_bound(cfg, rec, len(trace))
                if wl == "sharegpt" and rec is not None:
                    saturation = saturation_rate(rec["client"])
                    rec["saturation_req_s"] = saturation
                continue
            if wl == "prefix":
                self._prefix(server, cfg)
                continue
            # ladder
            basis = None if plan.ladder_absolute else self._pacing_rate(cfg, "ladder",
                                                                          saturation)
            if not plan.ladder_absolute and not basis:
                self.say(f"SKIP {cfg.name}/ladder: no saturation rate measured on this server "
                         "(sharegpt skipped or completed nothing)")
                continue
            base = self.trace("sharegpt") if plan.sharegpt_n else None
            assert base is not None
            for x in plan.ladder_rates:
                rate = x if plan.ladder_absolute else x * float(basis or 0)
                label = f"ladder@{x:g}" + ("rps" if plan.ladder_absolute else "x")
                w = self.windowed(f"{cfg.name}/{label}", plan.windows["ladder"])
                if w is None:
                    break
                trace = ladder_trace(base, rate, w, seed=self.a.seed)
                tf = self.write_trace(trace, f"{cfg.name}__{label}")
                self.run_workload(server, cfg, label, trace, False, w, tf,
                                  {"rate_req_s": rate,
                                   "rate_fraction": None if plan.ladder_absolute else x,
                                   "saturation_req_s": saturation,
                                   "paced_basis_req_s": basis})
                if not server.alive():
                    break

    def _prefix(self, server: ServerProcess, cfg: ServerConfig) -> None:
        """The prefix-reuse trace all at t = 0, then paced at fractions of the request rate
        that run completed (steady rate when the window cut it; under ``--paced-basis
        first`` the first configuration's). Each run starts from an
        empty prefix cache (``/flush_cache``): the paced runs replay the same first requests,
        which the run before would otherwise have cached."""
        plan = self.plan
        w = self.windowed(f"{cfg.name}/prefix", plan.windows["prefix"])
        if w is None:
            return
        trace = self.trace("prefix")
        ceiling = hit_ceiling(trace)
        tf = self.write_trace(trace, trace.name)
        rec = self.run_workload(server, cfg, "prefix", trace, True, w, tf,
                                {"hit_ceiling": ceiling, "cache_flushed": self._flush(cfg)})
        if rec is None:
            return
        rec["saturation_req_s"] = saturation_rate(rec["client"])
        basis = self._pacing_rate(cfg, "prefix", rec["saturation_req_s"])
        if not basis:
            self.say(f"SKIP {cfg.name}/prefix paced runs: the saturation run completed nothing")
            return
        for x in plan.prefix_rates:
            label = f"prefix@{x:g}x"
            w = self.windowed(f"{cfg.name}/{label}", plan.windows["ladder"])
            if w is None or not server.alive():
                break
            paced = paced_trace(trace, x * basis, w)
            tf = self.write_trace(paced, f"{cfg.name}__{label}")
            self.run_workload(server, cfg, label, paced, False, w, tf,
                              {"rate_req_s": x * basis, "rate_fraction": x,
                               "saturation_req_s": rec["saturation_req_s"],
                               "paced_basis_req_s": basis,
                               "hit_ceiling": hit_ceiling(paced),
                               "cache_flushed": self._flush(cfg)})

    def _pacing_rate(self, cfg: ServerConfig, workload: str, own: float | None) -> float | None:
        """The req/s that ``workload``'s paced fractions multiply on ``cfg``'s server: its own
        saturation, or under ``--paced-basis first`` the first one measured for the workload
        (said when it differs, so a run's rates are never a surprise)."""
        if self.a.paced_basis == "own":
            return own
        if workload not in self.paced_basis:
            if not own:
                return own
            self.paced_basis[workload] = (cfg.name, own)
        first, rate = self.paced_basis[workload]
        if first != cfg.name:
            self.say(f"{cfg.name}/{workload}: paced at fractions of {first}'s saturation "
                     f"{rate:.3g} req/s (this server's own: "
                     f"{'none' if not own else f'{own:.3g}'}; --paced-basis own to use it)")
        return rate

    def _flush(self, cfg: ServerConfig) -> bool:
        ok = bool(cl.run_async(cl.flush_cache(self.plan.launch.base_url)))
        if not ok:
            self.say(f"{cfg.name}: /flush_cache refused (server not idle?): this run starts "
                     "with the prefix cache the run before left")
        return ok

    def _auto_n(self, cfg: ServerConfig) -> dict[str, Any] | None:
        """``--longgen-n auto``: N from this server's start-up capacity (printed, recorded)."""
        info = self.configs[cfg.name]
        try:
            auto = auto_longgen_n(self.plan.longgen, info.get("max_total_num_tokens"),
                                  reported_all_high(info.get("diffkv_report", [])),
                                  info.get("max_running_requests"), self.plan.longgen_factor,
                                  self.longgen_n_max)
        except BenchInputError as e:
            self.say(f"SKIP {cfg.name}/longgen: {e}")
            return None
        self.longgen_n_max = auto.n
        self.say(f"{cfg.name}/longgen: {auto.why}")
        if auto.warning:
            self.say(f"{cfg.name}/longgen: WARNING {auto.warning}")
        return {"longgen_n": auto.n, "longgen_n_why": auto.why,
                "longgen_capacity_requests": auto.capacity_requests,
                "longgen_n_warning": auto.warning}

    def _check_longgen_bound(self, cfg: ServerConfig, rec: dict[str, Any], n: int) -> None:
        """Say so when the batch reached the request count (the run was request-bound)."""
        peak = rec["server_log"].get("peak_running")
        rec["longgen_request_bound"] = peak is not None and peak >= n
        if rec["longgen_request_bound"]:
            self.say(f"{cfg.name}/longgen: WARNING the batch reached all {n} requests (peak "
                     f"{peak}): the request count, not memory, capped it; use a larger "
                     "--longgen-n or --longgen-n auto")

    # ---- whole run -------------------------------------------------------------------------

    def run(self) -> int:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results["environment"] = environment_info(self.a.git_commit)
        self.say(f"fd limit {self.fd_limit}, max in-flight streams {self.max_inflight}; "
                 f"gpu {self.results['environment'].get('gpu')}; "
                 f"cpu {self.results['environment'].get('cpu')} "
                 f"x {self.results['environment'].get('cpus')}")
        try:
            for cfg in self.plan.configs:
                self.run_config(cfg)
        finally:
            self.finish()
        return 0 if self.runs else 1

    def finish(self) -> None:
        table = format_table(self.runs)
        print(table, flush=True)
        self.results.update({"configs": self.configs, "runs": self.runs,
                             "admission_warnings": adm.mixed_rule_warnings(self.runs),
                             "notes": self.budget.notes, "table": table,
                             "elapsed_s": self.budget.elapsed()})
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1,
                                                          default=str))
        write_bench_jsonl([{**r["client"], "config": r["config"], "workload": r["label"]}
                           for r in self.runs], self.out / "bench_serving.jsonl")
        (self.out / "summary.txt").write_text("\n".join(self.budget.notes) + "\n\n" + table
                                              + "\n")
        tar = self.out / "logs.tar.gz"
        self._tar(tar, with_requests=True)
        if tar.stat().st_size > TAR_LIMIT:
            self._tar(tar, with_requests=False)
            print(f"logs.tar.gz over {TAR_LIMIT >> 20} MiB: per-request records left out",
                  flush=True)

    def _tar(self, path: Path, with_requests: bool) -> None:
        with tarfile.open(path, "w:gz") as t:
            for f in sorted(self.logs.rglob("*")):
                if f.is_file() and (with_requests or not f.name.startswith("requests__")):
                    t.add(f, arcname=str(f.relative_to(self.out)))


def dry_run(plan: Plan, a: argparse.Namespace) -> int:
    out = Path(a.out)
    (out / "logs" / "traces").mkdir(parents=True, exist_ok=True)
    for cfg in plan.configs:
        argv = launch_command(cfg, plan.launch)
        rule = adm.admission_rule(cl.SENDS_IGNORE_EOS,
                                  adm.argv_disable_radix(argv, cfg.attention_backend))
        print(f"{cfg.name}: {shell_line(argv, cfg.env_dict)}")
        print(f"{cfg.name}: admission {rule} (from the launch command; the server log's "
              "resolved disable_radix_cache decides in a real run)")
    for wl in plan.workloads:
        if wl == "ladder":
            basis = "each server's" if a.paced_basis == "own" else "the first server's"
            print(f"ladder: rates {plan.ladder_rates} "
                  f"{'req/s' if plan.ladder_absolute else f'x saturation ({basis})'}, window "
                  f"{plan.windows['ladder']:g} s each")
            continue
        if wl == "longgen" and plan.longgen_auto:
            print(f"longgen: N auto ({plan.longgen_factor:g} x the requests of mean length "
                  "each server's reported KV capacity holds, at its start), window "
                  f"{plan.windows['longgen']:g} s")
            continue
        if wl == "prefix":
            trace = plan.prefix.trace()
            p = write_mooncake_jsonl(trace, out / "logs" / "traces" / f"{trace.name}.jsonl")
            print(f"prefix: {len(trace)} requests all at t=0, window {plan.windows[wl]:g} s, "
                  f"then paced at {plan.prefix_rates} x saturation "
                  f"({'each server' if a.paced_basis == 'own' else 'the first server'}'s), "
                  f"{plan.windows['ladder']:g} s each; an unbounded prefix cache could serve "
                  f"{100 * hit_ceiling(trace):.1f}% of its prompt tokens; trace {p}")
            continue
        trace = plan.longgen.trace() if wl == "longgen" else sharegpt_trace(
            plan.sharegpt_n, plan.sharegpt_source, plan.sharegpt_skip)
        p = write_mooncake_jsonl(trace, out / "logs" / "traces" / f"{trace.name}.jsonl")
        print(f"{wl}: {len(trace)} requests, window {plan.windows[wl]:g} s, trace {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    try:
        plan = make_plan(a)
        if a.dry_run:
            return dry_run(plan, a)
        return Harness(plan, a, argv).run()
    except InputError as e:
        print(f"bench_e2e: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
