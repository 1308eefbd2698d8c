"""Capacity questions by search:

  max_rate     the highest Poisson request rate at which a replica set meets the SLO,
               by bisection in log space (SLO attainment is taken as monotone in the rate);
  gpus_needed  the fewest replicas (x tp GPUs each) meeting the SLO for a trace at its rate,
               by doubling then bisection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from simulator.errors import SimulatorInputError
from simulator.metrics.slo import SLO
from simulator.studies.scenario import Scenario
from simulator.workload.generate import resample_arrivals
from simulator.workload.schema import Trace


@dataclass(frozen=True)
class Probe:
    rate: float
    replicas: int
    attainment: float
    met: bool
    summary: dict[str, Any]


def _probe(sc: Scenario, trace: Trace, fmt: str, slo: SLO, rate: float | None,
           replicas: int, seed: int) -> Probe:
    sc = sc.with_replicas(replicas)
    load = trace if rate is None else resample_arrivals(trace, rate, seed)
    _, s = sc.run_summary(load, fmt, slo)
    return Probe(rate if rate is not None else trace.mean_rate, replicas,
                 s["slo_attainment"], s["slo_met"], s)


def max_rate(sc: Scenario, trace: Trace, fmt: str, slo: SLO, lo: float = 0.25,
             hi: float = 256.0, rel_tol: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """Bisection on the rate; ``trace`` supplies the request lengths (its arrivals are
    replaced by Poisson arrivals at each probed rate)."""
    if not 0 < lo < hi:
        raise SimulatorInputError(f"rate bracket [{lo}, {hi}] must satisfy 0 < lo < hi")
    probes: list[Probe] = []
    p = _probe(sc, trace, fmt, slo, lo, sc.replicas, seed)
    probes.append(p)
    if not p.met:
        return {"format": fmt, "max_rate": 0.0, "note": f"SLO missed even at {lo:g} req/s",
                "probes": [_row(x) for x in probes]}
    p = _probe(sc, trace, fmt, slo, hi, sc.replicas, seed)
    probes.append(p)
    if p.met:
        return {"format": fmt, "max_rate": hi, "note": f"SLO met at the bracket top {hi:g}",
                "probes": [_row(x) for x in probes]}
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        p = _probe(sc, trace, fmt, slo, mid, sc.replicas, seed)
        probes.append(p)
        lo, hi = (mid, hi) if p.met else (lo, mid)
    best = max((x for x in probes if x.met), key=lambda x: x.rate)
    return {"format": fmt, "max_rate": lo, "output_throughput": best.summary["output_throughput"],
            "goodput": best.summary["goodput"], "probes": [_row(x) for x in probes]}


def gpus_needed(sc: Scenario, trace: Trace, fmt: str, slo: SLO, max_replicas: int = 256,
                seed: int = 0) -> dict[str, Any]:
    probes: list[Probe] = []

    def test(n: int) -> bool:
        p = _probe(sc, trace, fmt, slo, None, n, seed)
        probes.append(p)
        return p.met

    n = 1
    while not test(n):
        if n >= max_replicas:
            return {"format": fmt, "replicas": None, "gpus": None,
                    "note": f"SLO missed even with {max_replicas} replicas",
                    "probes": [_row(x) for x in probes]}
        n = min(2 * n, max_replicas)
    lo, hi = n // 2, n                     # lo fails (or is 0), hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            hi = mid
        else:
            lo = mid
    best = next(x for x in probes if x.replicas == hi and x.met)
    return {"format": fmt, "replicas": hi, "gpus": hi * sc.settings.tp,
            "attainment": best.attainment, "summary": best.summary,
            "probes": [_row(x) for x in probes]}


def _row(p: Probe) -> dict[str, Any]:
    s = p.summary
    return {"rate": p.rate, "replicas": p.replicas, "attainment": p.attainment, "met": p.met,
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "output_throughput": s["output_throughput"]}
