"""``python -m sglang_diffkv.bench.pd_replay``: replay a bundled trace at several request rates
against a running deployment, for ``diffkv-sim validate-disagg`` (scripts/gpu_pd_run.sh runs
it on the GPU machine; docs/disaggregation.md, "Validating against a real P/D run").

The deployment is either a prefill/decode pair behind SGLang's router (``--deployment pd``,
``--url`` the router's) or one ordinary server (``--deployment colocated``, the control). Per
rate: the trace's lengths in order with seeded Poisson arrivals at that rate, cut to the
requests arriving inside ``--window-s`` (``workloads.ladder_trace``, the e2e harness's ladder),
prompts and outputs capped to fit ``--context-len``, sent open-loop by the e2e harness's
streaming client (``client.replay``: ``input_ids``, ``ignore_eos``, ``stream``) and each request
recorded (send, first token, end, tokens). With ``--metrics-url`` (the prefill server, started
with ``--enable-metrics``) the change of its ``sglang:kv_transfer_*`` series over the rate is
kept: SGLang's own measure of each request's KV transfer. Between rates the servers of
``--idle-url`` must drain (``/get_load``; the router has none).

``--shared-gpu`` (scripts/gpu_pd_run.sh on a one-GPU machine): the prefill and decode servers
share one GPU; recorded as ``"shared_gpu": true`` with a note (their TTFT/TPOT include each
other's contention; the KV transfer metrics are the measurement).

Writes ``OUT/pd_runs_<deployment>.json`` (``sglang_diffkv.serving_io.pd_run``) after every
rate, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from sglang_diffkv.bench import client as cl
from sglang_diffkv.bench.budget import Budget
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.workloads import ladder_trace, parse_rates, to_specs
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.pd_run import (
    DEPLOYMENTS,
    REQUEST_FIELDS,
    SCHEMA,
    SHARED_GPU_NOTE,
    PdRequest,
    PdRun,
    latency_stats,
    measured_arrays,
    replay_file,
    transfer_means,
)
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from sglang_diffkv.serving_io.trace import Trace

PROG = "python -m sglang_diffkv.bench.pd_replay"
# the series kept from the prefill server's /metrics (histogram sums, counts and buckets)
METRIC_PREFIX = "sglang:kv_transfer"
# first-use compiles and Mooncake's first connection happen in the warm-up, not in a rate:
# one request of each prompt length alone, then a burst
WARMUP_SINGLE = ((128, 8), (1024, 8), (4000, 8))
WARMUP_BURST = (16, 1024, 32)
COMMAND_PREFIX = "# command: "


def pd_trace(name: str, rate: float, window_s: float, seed: int, context_len: int) -> Trace:
    """The requests one rate replays: ``name``'s lengths in order, Poisson arrivals at ``rate``
    inside ``window_s`` (``ladder_trace``); outputs capped at a quarter of the context and
    prompts to what is left of it (SGLang rejects a prompt + max_new_tokens over the
    context), so long-prompt traces fit a dummy model of ``context_len``."""
    if context_len < 64:
        raise BenchInputError(f"--context-len {context_len} must be >= 64")
    t = ladder_trace(load_named_trace(name), rate, window_s, seed)
    out_cap = context_len // 4
    reqs = []
    for r in t.requests:
        out = min(r.requested_new_tokens, out_cap)
        inp = min(r.input_tokens, context_len - out - 16)
        reqs.append(replace(r, input_tokens=inp, output_tokens=out, max_new_tokens=out,
                            prefix_hash_ids=()))
    return replace(t, requests=tuple(reqs), name=f"{name}@{rate:g}rps")


# ---- the prefill server's /metrics -----------------------------------------------------------
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')
_LE = re.compile(r'le="([^"]*)"')


def parse_prometheus(text: str, prefix: str = METRIC_PREFIX) -> dict[str, float]:
    """The samples of series starting with ``prefix`` in Prometheus text format, summed over
    their labels except a histogram bucket's ``le`` (kept as ``name_bucket[le=X]``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if le := _LE.search(labels or ""):
            name = f"{name}[le={le.group(1)}]"
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def scrape(url: str | None, timeout_s: float = 10.0) -> dict[str, float] | None:
    """``GET url/metrics`` parsed (``parse_prometheus``); None without a url or an answer."""
    if not url:
        return None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
                s.get(url.rstrip("/") + "/metrics") as r:
            if r.status != 200:
                return None
            return parse_prometheus(await r.text())
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None


def metrics_delta(before: dict[str, float] | None,
                  after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


# ---- records -----------------------------------------------------------------------------------
def request_rows(run: cl.ClientRun) -> list[list[Any]]:
    """The client's records as ``REQUEST_FIELDS`` rows (times rounded to 0.1 ms)."""
    def t(x: float | None) -> float | None:
        return None if x is None else round(x, 5)
    return [[r.index, t(r.arrival_s), r.input_len, r.output_len, t(r.send_s),
             t(r.first_token_s), t(r.end_s), r.tokens, int(r.completed)] for r in run.records]


def server_info(role: str, log: str) -> dict[str, Any]:
    """A server's role, command line (the log's first line, ``# command: ...``, written by
    scripts/gpu_pd_run.sh) and what its start-up lines say."""
    info: dict[str, Any] = {"role": role, "log": Path(log).name, "command": "",
                            "max_total_num_tokens": None, "max_running_requests": None,
                            "server_args": {}}
    try:
        first = Path(log).read_text(errors="replace").split("\n", 1)[0]
    except OSError as e:
        info["error"] = f"cannot read {log}: {e.strerror}"
        return info
    if first.startswith(COMMAND_PREFIX):
        info["command"] = first[len(COMMAND_PREFIX):].strip()
    try:
        parsed = parse_server_log(log)
    except InputError as e:
        info["error"] = str(e)
        return info
    info.update(max_total_num_tokens=parsed.max_total_num_tokens,
                max_running_requests=parsed.max_running_requests,
                server_args=parsed.server_args)
    return info


def device_name() -> str:
    """GPU 0's name (nvidia-smi), '' without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0].strip() if out.strip() else ""


def summary_line(deployment: str, run: dict[str, Any]) -> str:
    """One printed line per rate, from the same statistics diffkv-sim validate-disagg uses."""
    reqs = tuple(PdRequest(*row[:-1], bool(row[-1])) for row in run["requests"])
    done = sum(r.completed for r in reqs)
    line = f"{deployment} @ {run['rate']:g} req/s: {done}/{len(reqs)} completed"
    if run["time_limited"]:
        line += " (cut at the run limit)"
    if done:
        pr = PdRun(run["rate"], reqs, run["time_limited"], run["wall_s"], run["transfer"])
        a = measured_arrays(pr)
        s = latency_stats(a["arrival"], a["ttft"], a["e2e"], a["tpot"], a["output"])
        line += (f"; TTFT p50/p90 {s['ttft_p50_ms']:.1f}/{s['ttft_p90_ms']:.1f} ms; TPOT "
                 f"p50/p90 {s['tpot_p50_ms']:.2f}/{s['tpot_p90_ms']:.2f} ms; "
                 f"{s['req_s']:.2f} req/s, {s['out_tok_s']:.0f} output tok/s")
    if (t := transfer_means(run["transfer"])) is not None:
        line += (f"; SGLang's KV transfer: {t['latency_ms']:.1f} ms, {t['mb']:.1f} MB per "
                 f"request ({t['count']:.0f})")
    if run.get("errors"):
        line += f"; errors: {run['errors']}"
    return line


# ---- the run -------------------------------------------------------------------------------------
async def warm_up(url: str, seed: int) -> str | None:
    """A few requests before the measured rates; the first failure's message, or None."""
    single = [cl.RequestSpec(0.0, i, o) for i, o in WARMUP_SINGLE]
    n, i, o = WARMUP_BURST
    burst = [cl.RequestSpec(0.0, i, o) for _ in range(n)]
    # another seed than the measured requests': no prompt of theirs is seen here
    for specs, inflight in ((single, 1), (burst, n)):
        run = await cl.replay(url, specs, all_at_once=True, max_inflight=inflight,
                              max_duration_s=300.0, seed=seed + 10_007)
        bad = [r for r in run.records if not r.completed]
        if bad:
            return bad[0].error or "did not complete"
    return None


async def run_rates(a: argparse.Namespace, doc: dict[str, Any], out: Path,
                    budget: Budget) -> None:
    rates = parse_rates(a.rates, "--rates")
    if a.warmup:
        t0 = time.monotonic()
        err = await warm_up(a.url, a.seed)
        doc["warmup"] = {"seconds": time.monotonic() - t0, "error": err}
        print(budget.note(f"warm-up {'failed: ' + err if err else 'done'} in "
                          f"{time.monotonic() - t0:.0f} s"), flush=True)
        if err:
            doc["notes"].append(f"warm-up failed: {err}")
            _write(doc, out)
            raise BenchInputError(f"the deployment at {a.url} failed its warm-up: {err}")
    for rate in rates:
        window = budget.window(a.window_s, a.drain_s, min_s=15.0)
        if window is None:
            doc["notes"].append(budget.note(f"rate {rate:g} skipped: no time left"))
            print(doc["notes"][-1], flush=True)
            continue
        trace = pd_trace(a.trace, rate, window, a.seed, a.context_len)
        specs = to_specs(trace)
        before = await scrape(a.metrics_url)
        t0 = time.monotonic()
        run = await cl.replay(a.url, specs, max_duration_s=window + a.drain_s, seed=a.seed)
        wall = time.monotonic() - t0
        if run.time_limited:
            for u in a.idle_url:
                await cl.abort_all(u)
        for u in a.idle_url:
            if await cl.wait_idle(u, timeout_s=60.0) is None:
                doc["notes"].append(f"rate {rate:g}: {u} still busy 60 s after the run")
        after = await scrape(a.metrics_url)
        errors: dict[str, int] = {}
        for r in run.records:
            if r.error and not r.cancelled:
                key = r.error.split(":")[0]
                errors[key] = errors.get(key, 0) + 1
        doc["runs"].append({"rate": rate, "window_s": window, "time_limited": run.time_limited,
                            "wall_s": round(wall, 3), "errors": errors,
                            "transfer": metrics_delta(before, after),
                            "fields": list(REQUEST_FIELDS), "requests": request_rows(run)})
        _write(doc, out)
        print(budget.note(summary_line(a.deployment, doc["runs"][-1])), flush=True)


def _write(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    tmp.replace(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="where requests go: the router (pd) or the "
                   "server (colocated), e.g. http://127.0.0.1:8000")
    p.add_argument("--deployment", required=True, choices=DEPLOYMENTS)
    p.add_argument("--out", required=True, type=Path, help="folder for pd_runs_*.json")
    p.add_argument("--trace", default="azure-conv", help="bundled trace whose lengths are "
                   "replayed (default: %(default)s)")
    p.add_argument("--rates", default="2,4,8", help="request rates in req/s (default: "
                   "%(default)s)")
    p.add_argument("--window-s", type=float, default=50.0,
                   help="arrivals per rate span this many seconds (default: %(default)s)")
    p.add_argument("--drain-s", type=float, default=60.0,
                   help="after the window, wait this long for the last requests before "
                        "cancelling them (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-len", type=int, default=8192,
                   help="the served model's context: prompts and outputs are capped to fit "
                        "(default: %(default)s, the dummy Llama-3-8B's)")
    p.add_argument("--metrics-url", default=None,
                   help="the prefill server, started with --enable-metrics: its KV transfer "
                        "series are kept per rate")
    p.add_argument("--idle-url", action="append", default=[],
                   help="a server that must be idle before the next rate (repeatable)")
    p.add_argument("--server", action="append", default=[], metavar="ROLE=LOG",
                   help="a server's role (prefill, decode, colocated) and log file "
                        "(repeatable): its command line and start-up settings are recorded")
    p.add_argument("--router-log", default=None, help="the router's log (its first line "
                   "'# command: ...' is recorded)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock budget: a rate that does not fit is shortened or skipped "
                        "(default: %(default)s)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--shared-gpu", action="store_true",
                   help="the P/D pair's servers share one GPU (recorded in the file)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if not (a.window_s > 0 and math.isfinite(a.window_s)) or a.drain_s < 0:
            raise BenchInputError("--window-s must be > 0 and --drain-s >= 0")
        parse_rates(a.rates, "--rates")
        pd_trace(a.trace, 1.0, 1.0, a.seed, a.context_len)   # a bad trace name fails now
        servers = []
        for s in a.server:
            role, eq, log = s.partition("=")
            if not eq or not role or not log:
                raise BenchInputError(f"--server {s!r}: expected ROLE=LOG")
            servers.append(server_info(role, log))
        router = None
        if a.router_log:
            first = Path(a.router_log).read_text(errors="replace").split("\n", 1)[0]
            router = first[len(COMMAND_PREFIX):].strip() if first.startswith(
                COMMAND_PREFIX) else None
        budget = Budget(a.budget_s, reserve_s=10.0)
        doc: dict[str, Any] = {
            "schema": SCHEMA, "kind": "replay", "deployment": a.deployment,
            "device": device_name(), "created": dt.datetime.now(dt.timezone.utc).isoformat(),
            "url": a.url,
            "trace": {"name": a.trace, "seed": a.seed, "window_s": a.window_s,
                      "context_len": a.context_len, "rates": a.rates},
            "servers": servers, "router": router, "runs": [], "notes": [],
            "shared_gpu": bool(a.shared_gpu),
            "client": {"python": sys.version.split()[0], "numpy": np.__version__}}
        if a.shared_gpu:
            doc["notes"].append(SHARED_GPU_NOTE)
            print(f"{PROG}: {SHARED_GPU_NOTE}", flush=True)
        out = a.out / replay_file(a.deployment)
        cl.raise_fd_limit()
        cl.run_async(run_rates(a, doc, out, budget))
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
