"""Capacity questions by search:

  max_rate         the highest Poisson request rate at which one replica set meets the SLO on
                   a given trace, by bisection in log space (SLO attainment is taken as
                   monotone in the rate), the bracket widened when the answer lies outside it;
  steady_max_rate  the same on ever longer traces (the trace's lengths, drawn again past its
                   end) until the answer moves by less than a tolerance: a short trace ends
                   before a queue builds, so a rate just above what the server sustains
                   still meets the SLO on it;
  replicas_for     the replicas (and GPUs) a rate needs, from the per-replica maximum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.trace import Trace
from simulator.engine.cluster import RunResult
from simulator.errors import SimulatorInputError
from simulator.metrics.slo import SLO
from simulator.metrics.summary import per_request_arrays, slo_met, summarize
from simulator.studies.scenario import Scenario
from simulator.workload.generate import resized

# every trace length's answer is bisected to within REL_TOL, finer than the convergence
# tolerance, so that two lengths agreeing within the tolerance is no artefact of the step
REL_TOL = 0.02
# a longer trace's search starts from the previous answer, this factor either side
REFINE_BRACKET = 1.3


@dataclass(frozen=True)
class Probe:
    rate: float
    requests: int
    attainment: float
    met: bool
    summary: dict[str, Any]


OnProbe = Callable[[Probe], None]


def tail_attainment(result: RunResult, slo: SLO) -> float:
    """SLO attainment of the later half of the requests (by arrival; rejected ones fail):
    where the rate exceeds what the server sustains the queue grows through the run, and the
    later requests miss first, while the whole run's attainment still counts the early ones
    that found an empty server."""
    reqs = sorted(result.requests, key=lambda r: r.arrival)
    later = reqs[len(reqs) // 2:]
    arrs = per_request_arrays(replace(result, requests=later))
    return float(slo_met(arrs, slo).sum() / max(len(later), 1))


def _probe(sc: Scenario, trace: Trace, fmt: str, slo: SLO, rate: float, seed: int,
           on_probe: OnProbe | None) -> Probe:
    res, s = sc.run_summary(resample_arrivals(trace, rate, seed), fmt, slo)
    tail = tail_attainment(res, slo)
    # met: on the whole run and on its later half (no queue building up to the end)
    p = Probe(rate, len(trace), min(s["slo_attainment"], tail),
              bool(s["slo_met"] and tail >= slo.attainment), s)
    if on_probe:
        on_probe(p)
    return p


def max_rate(sc: Scenario, trace: Trace, fmt: str, slo: SLO, lo: float = 0.25,
             hi: float = 256.0, rel_tol: float = 0.05, seed: int = 0,
             on_probe: OnProbe | None = None, floor: float | None = None,
             ceiling: float | None = None) -> dict[str, Any]:
    """Bisection on the rate between ``lo`` and ``hi``, widened (halving ``lo``, doubling
    ``hi``) down to ``floor`` and up to ``ceiling`` (default: the bracket itself) while the
    answer lies outside; ``trace`` supplies the request lengths, Poisson arrivals replace its
    own at each probed rate. ``at_max``: the metrics at the rate returned."""
    floor = lo if floor is None else floor
    ceiling = hi if ceiling is None else ceiling
    if not 0 < floor <= lo < hi <= ceiling:
        raise SimulatorInputError(f"rate bracket [{lo:g}, {hi:g}] must satisfy 0 < lo < hi")
    probes: list[Probe] = []

    def probe(rate: float) -> Probe:
        probes.append(_probe(sc, trace, fmt, slo, rate, seed, on_probe))
        return probes[-1]

    def result(rate: float, note: str = "") -> dict[str, Any]:
        met = [p for p in probes if p.met and p.rate == rate]
        return {"format": fmt, "requests": len(trace), "max_rate": rate, "note": note,
                "at_max": at_rate(met[0]) if met else None,
                "probes": [_row(p) for p in probes]}

    while not probe(lo).met:
        if lo <= floor:
            return result(0.0, f"SLO missed even at {lo:g} req/s")
        lo, hi = max(floor, lo / 2), lo
    if hi != lo and not any(p.rate == hi for p in probes):
        while probe(hi).met:
            if hi >= ceiling:
                return result(hi, f"SLO met at the bracket top {hi:g} req/s")
            lo, hi = hi, min(ceiling, hi * 2)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if probe(mid).met else (lo, mid)
    return result(lo)


def steady_max_rate(sc: Scenario, trace: Trace, fmt: str, slo: SLO, lo: float = 0.25,
                    hi: float = 256.0, start_requests: int = 1000, tol: float = 0.05,
                    max_requests: int = 16000, seed: int = 0,
                    on_probe: OnProbe | None = None) -> dict[str, Any]:
    """``max_rate`` on traces of ``start_requests``, twice that, ... requests until two
    successive answers differ by at most ``tol`` (relative) or the next trace would exceed
    ``max_requests``. ``levels``: each trace length's answer, the last one reported."""
    if not 0 < tol < 1:
        raise SimulatorInputError(f"steady-state tolerance={tol!r} must be in (0, 1)")
    if not 1 <= start_requests <= max_requests:
        raise SimulatorInputError(f"trace lengths {start_requests}..{max_requests} must "
                                  "satisfy 1 <= start <= max")
    levels: list[dict[str, Any]] = []
    n = start_requests
    bracket = _first_bracket(sc, resized(trace, n, seed), fmt, seed, lo, hi)
    while True:
        found = max_rate(sc, resized(trace, n, seed), fmt, slo, *bracket, rel_tol=REL_TOL,
                         seed=seed, on_probe=on_probe, floor=lo, ceiling=hi)
        levels.append(found)
        rate = found["max_rate"]
        if len(levels) >= 2:
            prev = levels[-2]["max_rate"]
            change = abs(rate - prev) / prev if prev > 0 else (0.0 if rate == 0 else math.inf)
            if change <= tol:
                return _steady(found, levels, True, change, tol)
        if rate == 0.0:
            # missed at the floor: a longer trace only lowers the answer (the top of the
            # range, by contrast, a longer trace can still move inside it)
            return _steady(found, levels, False, None, tol)
        if 2 * n > max_requests:
            change = (abs(rate - levels[-2]["max_rate"]) / levels[-2]["max_rate"]
                      if len(levels) > 1 and levels[-2]["max_rate"] > 0 else None)
            return _steady(found, levels, False, change, tol)
        n *= 2
        bracket = (max(lo, rate / REFINE_BRACKET), min(hi, rate * REFINE_BRACKET))


def _first_bracket(sc: Scenario, trace: Trace, fmt: str, seed: int, lo: float,
                   hi: float) -> tuple[float, float]:
    """Where to start the search within [lo, hi]: around the request rate the server
    completes when every request arrives at once, which no SLO lets it exceed for long. A
    probe far below it is the costly kind (a lone request per step), so the search starts
    at a quarter of it and widens downward only when the SLO needs that."""
    burst = summarize(sc.run(resample_arrivals(trace, math.inf, seed), fmt))
    sat = burst["request_throughput"]
    if not sat > 0:
        return lo, hi
    top = min(hi, 2 * sat)
    bottom = min(max(lo, sat / 4), top / 2)
    return (bottom, top) if bottom > lo or top < hi else (lo, hi)


def _steady(found: dict[str, Any], levels: list[dict[str, Any]], converged: bool,
            change: float | None, tol: float) -> dict[str, Any]:
    return {**found, "converged": converged, "last_change": change, "tolerance": tol,
            "levels": [{"requests": x["requests"], "max_rate": x["max_rate"]} for x in levels],
            "probes": [p for x in levels for p in x["probes"]]}


def replicas_for(rate: float, per_replica: float, tp: int,
                 max_replicas: int) -> dict[str, Any]:
    """Replicas for ``rate`` req/s at ``per_replica`` req/s each: ceil(rate / per_replica),
    since the router spreads arrivals evenly (``None`` past ``max_replicas`` or when one
    replica meets the SLO at no rate)."""
    if per_replica <= 0:
        return {"replicas": None, "gpus": None, "note": "no rate meets the SLO on one replica"}
    n = max(1, math.ceil(rate / per_replica - 1e-9))
    if n > max_replicas:
        return {"replicas": None, "gpus": None,
                "note": f"needs {n} replicas, more than --max-replicas {max_replicas}"}
    return {"replicas": n, "gpus": n * tp, "note": ""}


def at_rate(p: Probe) -> dict[str, Any]:
    """What a probe measured, for the table: throughput, latency, attainment, rejections."""
    s = p.summary
    return {"rate": p.rate, "requests": p.requests, "attainment": p.attainment,
            "request_throughput": s["request_throughput"],
            "output_throughput": s["output_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "mean_batch": s["mean_batch"], "rejected": s["rejected"],
            "rejection_reasons": s["rejection_reasons"]}


def _row(p: Probe) -> dict[str, Any]:
    s = p.summary
    return {"rate": p.rate, "requests": p.requests, "attainment": p.attainment, "met": p.met,
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "output_throughput": s["output_throughput"], "rejected": s["rejected"]}
