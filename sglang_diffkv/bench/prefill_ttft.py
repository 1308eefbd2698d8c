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
churned). The phases and their requests are ``sglang_diffkv.serving_io.prefill_probe``'s
``ProbePlan``. The table gives each (start, configuration, phase, L) the
median and the 10th / 90th percentile of the time to the first token, with a host-speed
reading (``host_probe.python_loop_ms``) taken before the start. Writes
OUT/prefill_ttft.json (every request, the plan and each configuration's backend:
``sglang_diffkv.serving_io.prefill_probe``) and OUT/logs/ (the servers' logs).

    python -m sglang_diffkv.bench.prefill_ttft --model /tmp/dummy-llama3-8b --configs bf16,fp8 \
        --starts 2 --out "$OUT"
    python -m sglang_diffkv.bench.prefill_ttft --url http://127.0.0.1:30000 --out /tmp/p
                                           # a server already running (no start, no stop)

The simulator's TTFT for the same phases, beside the measured medians, and the eager prefill
launch they imply (CPU): ``diffkv-sim prefill-probes OUT --gpu h200``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sglang_diffkv.bench import client as cl
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.host_probe import python_loop_ms
from sglang_diffkv.bench.server import (
    LaunchOptions,
    ServerProcess,
    ServerStartError,
    launch_command,
    launch_env,
    parse_config_list,
)
from sglang_diffkv.serving_io import prefill_probe as pp
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.prefill_probe import PHASES, ProbePlan, summarize

__all__ = ["PHASES", "ProbePlan", "main", "run_phases", "summarize"]

PROBE_TIMEOUT_S = 5.0  # a probe not answered by then counts as failed
PRIME_WINDOW_S = 120.0
PRIME_SEED_OFFSET = 1   # the burst's prompts must share no prefix with the probes'


def client_specs(reqs: list[pp.ProbeRequest]) -> list[cl.RequestSpec]:
    return [cl.RequestSpec(*r) for r in reqs]


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
    for phase in plan.phases():
        reqs = client_specs(plan.phase_requests(phase))
        window = reqs[n_probes - 1].arrival_s + PROBE_TIMEOUT_S
        run = cl.run_async(cl.replay(url, reqs, seed=seed, max_duration_s=window))
        if run.time_limited:
            cl.run_async(cl.abort_all(url))
        cl.run_async(cl.wait_idle(url, 60.0))
        for rec in run.records[:n_probes]:
            rows.append({"phase": phase, "input_len": rec.input_len,
                         "ttft_ms": ttft_ms(rec), "error": rec.error})
    return rows


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
                 "time; host ms: host_probe.python_loop_ms, lower is faster")
    return "\n".join(lines)


def plan_from_args(a: argparse.Namespace) -> ProbePlan:
    return ProbePlan(pp.parse_lengths(a.lengths), a.per_length, a.gap_s, a.load_batch,
                     a.load_input)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="results folder (required)")
    ap.add_argument("--url", help="probe this running server instead of starting any")
    ap.add_argument("--model", help="model path for the servers this starts")
    ap.add_argument("--configs", default="bf16,fp8",
                    help="configurations to start, as bench_e2e.py names them (bf16, fp8, "
                         "diffkv, diffkv-mix, ...); default: bf16,fp8")
    ap.add_argument("--starts", type=int, default=1,
                    help="server starts per configuration, alternating (default 1)")
    ap.add_argument("--lengths", default=pp.DEFAULT_LENGTHS,
                    help="prompt lengths in tokens, comma-separated (default %(default)s)")
    ap.add_argument("--per-length", type=int, default=pp.DEFAULT_PER_LENGTH,
                    help="probe requests per length and phase (default %(default)s)")
    ap.add_argument("--gap-s", type=float, default=pp.DEFAULT_GAP_S,
                    help="seconds between probe requests (default %(default)s)")
    ap.add_argument("--load-batch", type=int, default=pp.DEFAULT_LOAD_BATCH,
                    help="decode requests streaming during the loaded phase (0: no such "
                         "phase; default %(default)s)")
    ap.add_argument("--load-input", type=int, default=pp.DEFAULT_LOAD_INPUT,
                    help="prompt tokens of each load request (default %(default)s)")
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
    if a.out is None:
        ap.error("--out is required (the simulator's side: diffkv-sim prefill-probes OUT)")
    try:
        plan = plan_from_args(a)
    except InputError as e:
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
        except InputError as e:
            ap.error(f"--prime {a.prime} --prime-trace {a.prime_trace}: {e}")
    primes: dict[int, dict[str, Any]] = {}
    if a.url is None and a.model is None:
        ap.error("give --model (servers to start) or --url (a running server)")
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    hosts: dict[int, float] = {}
    configs: dict[str, dict[str, Any]] = {}
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
            configs[cfg.name] = {"attention_backend": cfg.attention_backend,
                                 "kv_cache_dtype": cfg.kv_cache_dtype, "env": cfg.env_dict}
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
        {"argv": sys.argv[1:] if argv is None else argv, "plan": plan.to_record(),
         "configs": configs, "host_ms": hosts, "primes": primes, "summary": summary,
         "requests": rows}, indent=1))
    print(format_table(summary, hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
