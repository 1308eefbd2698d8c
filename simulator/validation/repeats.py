"""Validation against the mean of repeated runs.

The same command on the same trace, started again on another server of the same kind, does
not measure the same numbers: on the lent H100s, bf16's ladder at 23 req/s gave TPOT from
13.5 to 17.2 ms over eight server starts. One run is then a noisy reference for a ±5% target,
so rows whose runs repeat one command on one request list are also scored against the
mean of their measurements, next to that measured spread.

A row joins a group through its ``group`` key (``repeat_key``): configuration, workload, rate
and the trace's request lengths (not its arrival times, which a ladder rescales by a fraction
of a per-server saturation rate), and on a server with a radix cache the workloads it ran
before (they decide which prompts it serves from the cache: a bf16 ladder at 23 req/s runs
cold first on a server and two thirds cached after the 7.68 and 15.35 req/s ladders). Fitting
runs stay out: their measurements fitted the costs.
"""

from __future__ import annotations

import hashlib
from statistics import fmean
from typing import Any

from sglang_diffkv.serving_io.trace import Trace
from simulator.validation.harness import row
from simulator.validation.held_out import band


def request_lengths_digest(trace: Trace) -> str:
    """Digest of the trace's (input, output) token counts in order, arrival times left out."""
    h = hashlib.sha256()
    for r in trace.requests:
        h.update(f"{r.input_tokens},{r.output_tokens};".encode())
    return h.hexdigest()[:16]


def repeat_key(config: str, workload: str, rate_req_s: float | None, trace: Trace,
               after: str = "") -> str:
    """The group a run's rows belong to: the same key means the same command on the same
    requests (a ladder's rate to 0.01 req/s) after the same ``after`` (what ran before it
    on its server, where that matters)."""
    rate = f"@{rate_req_s:.2f}rps" if rate_req_s else ""
    history = f" after {after}" if after else ""
    return f"{config}/{workload}{rate}{history} [{request_lengths_digest(trace)}]"


def group_label(key: str) -> str:
    """A group key without its digest, for the report."""
    return key.split(" [", 1)[0]


def repeat_rows(rows: list[dict[str, Any]], min_runs: int = 2) -> list[dict[str, Any]]:
    """One row per (metric, group) with at least ``min_runs`` validated runs that carry a
    target: the measured mean, min and max, the mean prediction, the error against the
    measured mean (relative, or absolute for an ``absolute`` row), the target and verdict,
    and whether the prediction lies inside the measured range."""
    if min_runs < 2:
        raise ValueError(f"min_runs={min_runs}: a repeat needs at least 2 runs")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if (r.get("group") and not r.get("in_sample") and r["target"] is not None
                and r["measured"] is not None and r["predicted"] is not None):
            groups.setdefault((r["metric"], r["group"]), []).append(r)
    out = []
    for (metric, group), members in groups.items():
        if len(members) < min_runs:
            continue
        measured = [m["measured"] for m in members]
        mean, lo, hi = fmean(measured), min(measured), max(measured)
        predicted = fmean(m["predicted"] for m in members)
        absolute = members[0]["absolute"]
        r = row(metric, group, mean, predicted, members[0]["target"], absolute=absolute)
        loads = [m.get("load") for m in members]
        r.update({
            "group": group, "runs": [m["run"] for m in members], "measured_mean": mean,
            "measured_min": lo, "measured_max": hi,
            "spread": (hi - lo) / 2 if absolute else (hi - lo) / 2 / mean if mean else None,
            "within_range": lo <= predicted <= hi,
            # held out when every run is (their kind), at the band of the runs' mean load
            "held_out": (members[0].get("held_out")
                         if all(m.get("held_out") for m in members) else None),
            "load": fmean(loads) if None not in loads else None,
            "band": (band(fmean(loads), "ladder") if None not in loads
                     else members[0].get("band")),
        })
        out.append(r)
    return out
