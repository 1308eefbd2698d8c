"""Summaries of a run with SGLang bench_serving's definitions:

  duration   last completion - first arrival (bench_serving's benchmark_duration)
  TTFT       first token time - arrival, plus the calibration's first_token_latency_s
  TPOT       (E2E - TTFT) / (output tokens - 1), requests with more than one output token
  ITL        every gap between consecutive tokens of a request, pooled over requests
  E2E        completion - arrival, plus the same latency
  throughput input / output / total tokens of completed requests per second of duration
  concurrency  sum of E2E / duration
Plus: decode batch size and KV-pool usage (time-weighted over steps), retractions, rejected
requests with their reasons, goodput (completed requests meeting the SLO per second), and the
share of decode time in steps above the largest CUDA graph (``eager_decode_share``: SGLang
runs those eagerly, the regime whose speed varied most between server starts in validation).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import numpy as np

from simulator.engine.cluster import RunResult
from simulator.engine.replica import KIND_CODE
from simulator.metrics.slo import SLO

PERCENTILES = (50, 90, 95, 99)


def _stats(values: np.ndarray, scale: float = 1e3) -> dict[str, float]:
    if values.size == 0:
        return {"mean": math.nan, "std": math.nan,
                **{f"p{p}": math.nan for p in PERCENTILES}, "max": math.nan}
    v = values * scale
    out = {"mean": float(v.mean()), "std": float(v.std())}
    for p, q in zip(PERCENTILES, np.percentile(v, PERCENTILES), strict=True):
        out[f"p{p}"] = float(q)
    out["max"] = float(v.max())
    return out


def per_request_arrays(result: RunResult) -> dict[str, np.ndarray]:
    done = [r for r in result.requests if r.rejected is None and r.finish >= 0]
    arr = np.array([[r.arrival, r.first_token, r.finish, r.input_len, r.gen, r.retractions]
                    for r in done], dtype=float).reshape(-1, 6)
    arrival, first, finish, inp, out, retr = arr.T
    # what the client sees beyond the server's steps (its way in, the tokens' way out)
    lat = result.server.deployment.calibration.first_token_latency_s
    ttft = first - arrival + lat
    e2e = finish - arrival + lat
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), np.nan)
    return {"arrival": arrival, "ttft": ttft, "e2e": e2e, "tpot": tpot, "input": inp,
            "output": out, "retractions": retr}


def slo_met(arrs: dict[str, np.ndarray], slo: SLO) -> np.ndarray:
    tpot = np.nan_to_num(arrs["tpot"], nan=0.0)
    return (arrs["ttft"] <= slo.ttft_s) & (tpot <= slo.tpot_s) & (arrs["e2e"] <= slo.e2e_s)


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> float:
    w = weights.sum()
    return float((values * weights).sum() / w) if w > 0 else math.nan


def _hit_rate(result: RunResult) -> float | None:
    """Prompt tokens served by the prefix cache / prompt tokens admitted (None: no cache)."""
    caches = [rep.scheduler.cache for rep in result.replicas if rep.scheduler.cache is not None]
    looked = sum(c.lookups for c in caches)
    return sum(c.hits for c in caches) / looked if caches and looked else None


def _eager_decode_share(logs: list[dict[str, np.ndarray]], graph_max: int) -> float:
    """Share of decode-only step time in steps that no CUDA graph runs (batch above
    ``graph_max``; 0: no graphs, every step)."""
    total = eager = 0.0
    for lg in logs:
        dec = lg["kind"] == KIND_CODE["decode"]
        total += float(lg["dt"][dec].sum())
        eager += float(lg["dt"][dec & (lg["running"] > graph_max)].sum())
    return eager / total if total > 0 else 0.0


def summarize(result: RunResult, slo: SLO | None = None) -> dict[str, Any]:
    arrs = per_request_arrays(result)
    n_total = len(result.requests)
    n_done = int(arrs["ttft"].size)
    rejected = [r for r in result.requests if r.rejected is not None]
    unfinished = n_total - n_done - len(rejected)
    first_arrival = min((r.arrival for r in result.requests), default=0.0)
    last_finish = float(arrs["arrival"].size and (arrs["arrival"] + arrs["e2e"]).max())
    # no completed request: no duration, and every rate is 0 (not a division by ~0)
    duration = max(last_finish - first_arrival, 0.0) if n_done else 0.0
    per_s = (lambda x: x / duration if duration > 0 else 0.0)  # noqa: E731
    itl_parts = [a for rep in result.replicas for a in rep.itl]
    itl_parts += [np.asarray(r.itl) for r in result.requests if r.itl]
    itl = np.concatenate(itl_parts) if itl_parts else np.zeros(0)
    logs = [rep.log.arrays("dt", "running", "usage", "kind") for rep in result.replicas]
    dec_bs, dec_w, usage, usage_w, steps, peak_bs = [], [], [], [], 0, 0
    for lg in logs:
        steps += lg["dt"].size
        if lg["dt"].size == 0:
            continue
        m = lg["running"] > 0
        dec_bs.append(lg["running"][m])
        dec_w.append(lg["dt"][m])
        usage.append(lg["usage"])
        usage_w.append(lg["dt"])
        peak_bs = max(peak_bs, int(lg["running"].max()))
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0))  # noqa: E731
    out_tokens = float(arrs["output"].sum())
    in_tokens = float(arrs["input"].sum())
    srv = result.server
    graph_max = srv.cost.graph_max if srv.cost.graphs_enabled else 0
    summary: dict[str, Any] = {
        "workload": result.workload,
        "kv_format": srv.deployment.kv_format.name,
        "replicas": len(result.replicas),
        "requests": n_total,
        "completed": n_done,
        "rejected": len(rejected),
        "unfinished": unfinished,
        # reasons grouped with their numbers masked ("input N >= max request length N")
        "rejection_reasons": dict(Counter(re.sub(r"\d+", "N", r.rejected or "")
                                          for r in rejected).most_common(5)),
        "duration_s": duration,
        "request_throughput": per_s(n_done),
        "input_throughput": per_s(in_tokens),
        "output_throughput": per_s(out_tokens),
        "total_throughput": per_s(in_tokens + out_tokens),
        "concurrency": per_s(float(arrs["e2e"].sum())),
        "ttft_ms": _stats(arrs["ttft"]),
        "tpot_ms": _stats(arrs["tpot"][~np.isnan(arrs["tpot"])]),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats(arrs["e2e"]),
        "mean_batch": _weighted_mean(cat(dec_bs), cat(dec_w)),
        "peak_batch": peak_bs,
        "mean_kv_usage": _weighted_mean(cat(usage), cat(usage_w)),
        "peak_kv_usage": float(cat(usage).max()) if usage else 0.0,
        "retractions": int(sum(rep.scheduler.retractions for rep in result.replicas)),
        "retracted_requests": int((arrs["retractions"] > 0).sum()),
        "steps": steps,
        "kv_pool_tokens": srv.pool.token_capacity,
        "kv_pool_units": srv.pool.capacity,
        "kv_pool_unit": srv.pool.unit,
        "max_running_requests": srv.max_running_requests,
        "prefix_hit_rate": _hit_rate(result),
        "cuda_graph_max_bs": graph_max,
        "eager_decode_share": _eager_decode_share(logs, graph_max),
    }
    if slo is not None:
        met = slo_met(arrs, slo)
        summary["slo"] = slo.describe()
        summary["slo_attainment"] = float(met.sum() / max(n_total, 1))
        summary["goodput"] = per_s(float(met.sum()))
        summary["slo_met"] = bool(summary["slo_attainment"] >= slo.attainment)
    return summary


def timeseries(result: RunResult, max_points: int = 2000) -> dict[str, list[float]]:
    """Running-batch size and KV usage over time (one replica as logged; several: summed
    batch, averaged usage on a common grid),
    downsampled to at most ``max_points`` for JSON and plots."""
    logs = [rep.log.arrays() for rep in result.replicas]
    logs = [lg for lg in logs if lg["t_end"].size]
    if not logs:
        return {"t": [], "batch": [], "kv_usage": [], "waiting": []}
    lg = logs[0] if len(logs) == 1 else None
    if lg is None:
        t = np.sort(np.concatenate([x["t_end"] for x in logs]))
        grid = np.linspace(t[0], t[-1], min(max_points, t.size))
        batch = sum(np.interp(grid, x["t_end"], x["batch"]) for x in logs)
        usage = sum(np.interp(grid, x["t_end"], x["usage"]) for x in logs) / len(logs)
        waiting = sum(np.interp(grid, x["t_end"], x["waiting"]) for x in logs)
        return {"t": grid.tolist(), "batch": list(batch), "kv_usage": list(usage),
                "waiting": list(waiting)}
    idx = np.linspace(0, lg["t_end"].size - 1, min(max_points, lg["t_end"].size)).astype(int)
    return {"t": lg["t_end"][idx].tolist(), "batch": lg["batch"][idx].tolist(),
            "kv_usage": lg["usage"][idx].tolist(), "waiting": lg["waiting"][idx].tolist()}
