"""Summary metrics of a client run, with sglang.bench_serving's names and definitions.

bench_serving (``calculate_metrics``, sglang 0.5.10), over the *completed* requests:
  duration            benchmark start to the last completion (here: to the end of the window
                      when the run was stopped by its window)
  completed           requests that finished
  request_throughput  completed / duration
  input_throughput    prompt tokens of completed requests / duration
  TTFT                first chunk - send;  E2E (latency) = the [DONE] line - send
  TPOT                (E2E - TTFT) / (output tokens - 1), requests with more than one token
  ITL                 each chunk's gap to the previous one, divided evenly over its new tokens
                      (a 4-token chunk 40 ms after the last gives four 10 ms ITLs), pooled
  concurrency         sum of E2E / duration
One deliberate difference: ``output_throughput`` counts *every token received inside the
window* (completed or not) / duration. A window-limited run of 4096-token outputs may complete
few or no requests, and bench_serving's completed-only count would then say ~0 tok/s while the
server generated thousands per second. Without a window cut (all requests finished) both
definitions agree; ``output_throughput_completed`` is bench_serving's exact one.

Added: ``steady_output_throughput`` / ``steady_request_throughput``, the same rates over the
window's second half (after the all-at-once prefill burst), ``*_all_ms`` TTFT/TPOT/ITL over
every request that streamed tokens (for windows where few complete), ``mean_inflight`` (the
time-average of open requests) and ``output_tokens_per_s`` (1-second buckets).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.bench.client import ClientRun, RequestRecord


def _stat(values: list[float], name: str, stats: tuple[str, ...]) -> dict[str, float | None]:
    """bench_serving's keys (``mean_ttft_ms`` ...) in ms; None where there is no value (JSON
    has no NaN, and simulator.validation.compare skips None)."""
    out: dict[str, float | None] = {}
    v = np.asarray(values, dtype=float) * 1e3
    for s in stats:
        key = f"{s}_{name}_ms"
        if v.size == 0:
            out[key] = None
        elif s == "mean":
            out[key] = float(v.mean())
        elif s == "median":
            out[key] = float(np.median(v))
        elif s == "std":
            out[key] = float(v.std())
        elif s == "max":
            out[key] = float(v.max())
        else:
            out[key] = float(np.percentile(v, float(s[1:])))
    return out


def _itls(rec: RequestRecord) -> list[float]:
    out: list[float] = []
    for k in range(1, len(rec.chunk_s)):
        gap = rec.chunk_s[k] - rec.chunk_s[k - 1]
        n = rec.chunk_tokens[k]
        out.extend([gap / n] * n)
    return out


def summarize_run(run: ClientRun, name: str = "") -> dict[str, Any]:
    recs = run.records
    dur = run.window_s
    done = [r for r in recs if r.completed]
    per_s = (lambda x: x / dur if dur > 0 else 0.0)  # noqa: E731
    ttft = [r.first_token_s - r.send_s for r in done]
    e2e = [r.end_s - r.send_s for r in done]
    tpot = [(e - t) / (r.tokens - 1) for r, t, e in zip(done, ttft, e2e, strict=True)
            if r.tokens > 1]
    itl = [x for r in done for x in _itls(r)]
    streamed = [r for r in recs if r.first_token_s is not None]
    ttft_all = [r.first_token_s - r.send_s for r in streamed]
    tpot_all = [(r.chunk_s[-1] - r.first_token_s) / (r.tokens - 1) for r in streamed
                if r.tokens > 1]
    itl_all = [x for r in streamed for x in _itls(r)]

    # tokens by arrival time of their chunk, inside the window
    times = np.array([t for r in recs for t in r.chunk_s], dtype=float)
    counts = np.array([n for r in recs for n in r.chunk_tokens], dtype=float)
    inside = times <= dur + 1e-9
    tokens_window = float(counts[inside].sum())
    half = dur / 2
    second = inside & (times > half)
    ends = [r.end_s for r in done]
    steady_done = sum(e > half for e in ends)
    nbuckets = max(1, int(math.ceil(dur))) if dur > 0 else 1
    buckets = np.zeros(nbuckets)
    if inside.any():
        idx = np.minimum((times[inside]).astype(int), nbuckets - 1)
        np.add.at(buckets, idx, counts[inside])
    # time-average of open streams over [0, window]
    open_s = sum(min(r.end_s if r.end_s is not None else dur, dur) - r.send_s
                 for r in recs if r.send_s is not None)
    errors = Counter((r.error or "").split(":")[0] for r in recs
                     if r.error is not None and not r.cancelled)
    first_errors = [r.error for r in recs if r.error is not None and not r.cancelled][:3]

    # prefix-cache hits as the server reported them (meta_info.cached_tokens), over the
    # requests that streamed (a hit is decided at admission, before the first token)
    hit = [r for r in streamed if r.cached_tokens is not None]
    hit_in = sum(r.input_len for r in hit)
    out: dict[str, Any] = {
        "tag": name,
        "backend": "sglang-diffkv-bench",
        "mode": run.mode,
        "time_limited": run.time_limited,
        "window_s": dur,
        "duration": dur,
        "requests": len(recs),
        "sent": sum(r.send_s is not None for r in recs),
        "not_sent": run.not_sent,
        "completed": len(done),
        "cancelled": sum(r.cancelled for r in recs),
        "failed": sum(errors.values()),
        "error_kinds": dict(errors),
        "first_errors": first_errors,
        "max_inflight": run.max_inflight,
        "total_input_tokens": int(sum(r.input_len for r in done)),
        "total_output_tokens": int(sum(r.tokens for r in done)),
        "total_output_tokens_window": int(tokens_window),
        "request_throughput": per_s(len(done)),
        "input_throughput": per_s(sum(r.input_len for r in done)),
        "output_throughput": per_s(tokens_window),
        "output_throughput_completed": per_s(sum(r.tokens for r in done)),
        "total_throughput": per_s(sum(r.input_len for r in done) + tokens_window),
        "steady_output_throughput": (float(counts[second].sum()) / half) if half > 0 else 0.0,
        "steady_request_throughput": steady_done / half if half > 0 else 0.0,
        **_stat(e2e, "e2e_latency", ("mean", "median", "std", "p90", "p99")),
        **_stat(ttft, "ttft", ("mean", "median", "std", "p99")),
        **_stat(tpot, "tpot", ("mean", "median", "std", "p99")),
        **_stat(itl, "itl", ("mean", "median", "std", "p95", "p99", "max")),
        **_stat(ttft_all, "ttft_all", ("mean", "median", "p99")),
        **_stat(tpot_all, "tpot_all", ("mean", "median", "p99")),
        **_stat(itl_all, "itl_all", ("mean", "median", "p99")),
        "cached_tokens": int(sum(r.cached_tokens or 0 for r in hit)),
        "cache_hit_rate": (sum(r.cached_tokens or 0 for r in hit) / hit_in) if hit_in else None,
        "concurrency": per_s(sum(e2e)),
        "mean_inflight": per_s(open_s),
        "max_output_tokens_per_s": float(buckets.max()) if buckets.size else 0.0,
        "output_tokens_per_s": buckets.tolist(),
    }
    return out


def write_bench_jsonl(results: list[dict[str, Any]], path: str | Path) -> Path:
    """One JSON line per run (``simulator.validation.bench_result.read_bench_result`` reads it;
    its ``index`` picks the run). The per-second series stays in results.json only."""
    p = Path(path)
    lines = [json.dumps({k: v for k, v in r.items() if k != "output_tokens_per_s"})
             for r in results]
    p.write_text("\n".join(lines) + ("\n" if lines else ""))
    return p
