"""Measured vs simulated, metric by metric, with the relative error (simulated / measured - 1)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.sglang_log import ServerLog

# (label, bench_serving key, function of the simulator summary)
BENCH_METRICS: tuple[tuple[str, str, Any], ...] = (
    ("duration (s)", "duration", lambda s: s["duration_s"]),
    ("completed requests", "completed", lambda s: s["completed"]),
    ("request throughput (req/s)", "request_throughput", lambda s: s["request_throughput"]),
    ("input throughput (tok/s)", "input_throughput", lambda s: s["input_throughput"]),
    ("output throughput (tok/s)", "output_throughput", lambda s: s["output_throughput"]),
    ("TTFT mean (ms)", "mean_ttft_ms", lambda s: s["ttft_ms"]["mean"]),
    ("TTFT median (ms)", "median_ttft_ms", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p99 (ms)", "p99_ttft_ms", lambda s: s["ttft_ms"]["p99"]),
    ("TPOT mean (ms)", "mean_tpot_ms", lambda s: s["tpot_ms"]["mean"]),
    ("TPOT median (ms)", "median_tpot_ms", lambda s: s["tpot_ms"]["p50"]),
    ("TPOT p99 (ms)", "p99_tpot_ms", lambda s: s["tpot_ms"]["p99"]),
    ("ITL mean (ms)", "mean_itl_ms", lambda s: s["itl_ms"]["mean"]),
    ("ITL p99 (ms)", "p99_itl_ms", lambda s: s["itl_ms"]["p99"]),
    ("E2E mean (ms)", "mean_e2e_latency_ms", lambda s: s["e2e_ms"]["mean"]),
    ("E2E p99 (ms)", "p99_e2e_latency_ms", lambda s: s["e2e_ms"]["p99"]),
    ("concurrency", "concurrency", lambda s: s["concurrency"]),
)


def rel_error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or measured is None:
        return None
    if not (math.isfinite(simulated) and math.isfinite(measured)) or measured == 0:
        return None
    return simulated / measured - 1.0


def _row(label: str, measured: float | None, simulated: float | None) -> dict[str, Any]:
    return {"metric": label, "measured": measured, "simulated": simulated,
            "error": rel_error(simulated, measured)}


def compare_runs(summary: dict[str, Any], bench: dict[str, Any] | None,
                 log: ServerLog | None, decode_batches: np.ndarray) -> list[dict[str, Any]]:
    """Rows for every metric both sides have. ``decode_batches`` are the simulator's decode-step
    batch sizes (compared with the sampled 'Decode batch' lines by mean)."""
    rows: list[dict[str, Any]] = []
    if log is not None:
        if log.max_total_num_tokens is not None:
            rows.append(_row("KV pool tokens (max_total_num_tokens)",
                             float(log.max_total_num_tokens), float(summary["kv_pool_tokens"])))
        if log.max_running_requests is not None:
            rows.append(_row("max_running_requests", float(log.max_running_requests),
                             float(summary["max_running_requests"])))
        if log.decode_running:
            sim_mean = float(decode_batches.mean()) if decode_batches.size else None
            rows.append(_row("decode batch mean (running-req)",
                             float(np.mean(log.decode_running)), sim_mean))
            rows.append(_row("decode batch peak", float(max(log.decode_running)),
                             float(summary["peak_batch"])))
            rows.append(_row("token usage mean", float(np.mean(log.decode_usage)),
                             summary["mean_kv_usage"]))
        rows.append(_row("retractions", float(log.retractions), float(summary["retractions"])))
        if log.prefix_hit_rate is not None and summary.get("prefix_hit_rate") is not None:
            rows.append(_row("prefix hit rate", log.prefix_hit_rate, summary["prefix_hit_rate"]))
    if bench is not None:
        for label, key, get in BENCH_METRICS:
            if key in bench and bench[key] is not None:
                rows.append(_row(label, float(bench[key]), float(get(summary))))
    return rows
