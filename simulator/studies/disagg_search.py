"""The cheapest disaggregated deployment for a trace under an SLO: how many prefill and how many
decode replicas, per KV format.

A probe replays the trace's requests at the target rate (Poisson arrivals, as the colocated
``capacity`` search probes) on P prefill + D decode replicas joined by the link
(``simulator.engine.disagg``); it meets the SLO when the whole run and its later half both
do (``search.tail_attainment``: a queue still growing at the end fails it).

The search takes attainment as monotone in P and in D (another replica of either kind never
makes things worse), so the feasible (P, D) form a staircase and a total of T GPUs is
feasible iff some split (P, T - P) is:

1. ascent: from (1, 1), add replicas where the misses come from until the SLO is met: a
   TPOT miss is the decode side's; a TTFT miss is charged to the part of its time that was
   largest: waiting for the decode side to preallocate or for a decode batch slot (decode),
   waiting for and running the prefill (prefill), or the transfer (the side with fewer
   replicas: in either link scope that adds the most capacity to the busiest links);
2. descent: from that total T, try every split of T - 1, then of T - 2, ... while one of them
   meets the SLO; the lowest total that does is the answer, and of its splits the one with
   the highest goodput per GPU (then the fewest prefill replicas);
3. steady state, as ``steady_max_rate``: the answer is searched again on a trace twice as
   long (the trace's lengths drawn again past its end), starting from the previous answer,
   until the GPU count stays the same or the trace would pass ``max_requests``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.trace import Trace
from simulator.engine.cluster import RunResult, simulate
from simulator.engine.disagg import simulate_disagg
from simulator.errors import SimulatorInputError
from simulator.metrics.slo import SLO
from simulator.metrics.summary import per_request_arrays, summarize
from simulator.serving.server import ResolvedServer
from simulator.specs.link import LinkSpec
from simulator.studies.search import tail_attainment
from simulator.workload.generate import resized

SIDES = ("prefill", "decode")


@dataclass(frozen=True)
class SplitProbe:
    prefill: int
    decode: int
    requests: int
    attainment: float            # min(whole run, later half)
    met: bool
    summary: dict[str, Any]
    kv: dict[str, float]          # transfer statistics (``transfer_stats``)
    blame: dict[str, float] = field(default_factory=dict)   # why requests missed

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode


OnSplitProbe = Callable[[SplitProbe], None]


def ttft_parts(res: RunResult) -> dict[str, np.ndarray]:
    """Per completed request, where its TTFT went (seconds): ``reserve_wait`` for the decode
    side to preallocate its KV, ``prefill_wait`` in the prefill replica's queue,
    ``prefill`` from its first to its last prefill step's end, ``link_wait`` for the link
    (its last piece's queueing), ``wire`` its last piece on the wire, ``join_wait`` for a
    decode batch slot. ``bytes``, ``wire_all``: all its pieces."""
    kv = res.meta["kv"]
    rows = [(kv[r.rid], r) for r in res.requests if r.rejected is None and r.finish >= 0]
    a = np.array([[x.reserved - r.arrival, x.prefill_start - x.reserved,
                   x.prefill_end - x.prefill_start,
                   x.arrived - x.prefill_end - x.last_wire_s, x.last_wire_s,
                   r.first_token - x.arrived, x.bytes, x.wire_s,
                   r.first_token - r.arrival] for x, r in rows]).reshape(-1, 9)
    names = ("reserve_wait", "prefill_wait", "prefill", "link_wait", "wire", "join_wait",
             "bytes", "wire_all", "ttft")
    return {n: a[:, i] for i, n in enumerate(names)}


def transfer_stats(res: RunResult, parts: dict[str, np.ndarray] | None = None
                   ) -> dict[str, float]:
    """Means over completed requests of ``ttft_parts`` (ms; ``bytes``: bytes on the wire,
    ``wire_ms``: all its pieces' time on the wire), and the busiest port's share of the
    run. ``parts``: ``ttft_parts(res)`` if already at hand."""
    parts = ttft_parts(res) if parts is None else parts
    out = {"bytes": float(parts["bytes"].mean()) if parts["bytes"].size else math.nan}
    for k in ("reserve_wait", "prefill_wait", "prefill", "link_wait", "wire", "join_wait"):
        out[f"{k}_ms"] = 1e3 * float(parts[k].mean()) if parts[k].size else math.nan
    out["wire_ms"] = 1e3 * float(parts["wire_all"].mean()) if parts["bytes"].size else math.nan
    out["busiest_port"] = (max(p.busy_s for p in res.meta["ports"])
                           / max(res.end_time, 1e-12))
    return out


def blame(res: RunResult, slo: SLO, parts: dict[str, np.ndarray] | None = None
          ) -> dict[str, float]:
    """Which side the SLO misses come from: the shares of requests missing TPOT and TTFT,
    and, summed over the requests missing TTFT, the seconds they waited that more replicas
    could shorten: ``decode`` (for the reservation and for a batch slot), ``prefill`` (in
    the prefill queue), ``link`` (queued for the link). A prompt's own prefill and wire
    time are nobody's: more replicas do not shorten them. ``parts``: ``ttft_parts(res)`` if
    already at hand."""
    arrs = per_request_arrays(res)
    lat = res.server.deployment.calibration.first_token_latency_s
    tpot = np.nan_to_num(arrs["tpot"], nan=0.0)
    n = max(len(res.requests), 1)
    parts = ttft_parts(res) if parts is None else parts
    late = parts["ttft"] + lat > slo.ttft_s
    return {"tpot_miss": float((tpot > slo.tpot_s).sum()) / n,
            "ttft_miss": float((arrs["ttft"] > slo.ttft_s).sum()) / n,
            "rejected": float(sum(r.rejected is not None for r in res.requests)) / n,
            "decode": float((parts["reserve_wait"] + parts["join_wait"])[late].sum()),
            "prefill": float(parts["prefill_wait"][late].sum()),
            "link": float(parts["link_wait"][late].sum())}


def probe_split(server: ResolvedServer, trace: Trace, slo: SLO, prefill: int, decode: int,
                link: LinkSpec, scope: str = "pair", router: str = "round_robin",
                seed: int = 0) -> SplitProbe:
    """Replay ``trace`` (arrivals as given) on ``prefill`` + ``decode`` replicas."""
    res = simulate_disagg(trace, server, prefill, decode, link, scope, router, seed)
    s = summarize(res, slo)
    tail = tail_attainment(res, slo)
    parts = ttft_parts(res)
    return SplitProbe(prefill, decode, len(trace), min(s["slo_attainment"], tail),
                      bool(s["slo_met"] and tail >= slo.attainment), s,
                      transfer_stats(res, parts), blame(res, slo, parts))


def _goodput_per_gpu(p: SplitProbe, tp: int) -> float:
    return p.summary["goodput"] / (p.replicas * tp)


class _Search:
    """The probes of one search on one trace, cached by split. ``known`` answers from the
    probes already run where monotonicity decides: a split with at least as many replicas
    of both kinds as one that met the SLO meets it; one with at most as many as one that
    missed it misses it."""

    def __init__(self, server: ResolvedServer, trace: Trace, slo: SLO, link: LinkSpec,
                 scope: str, router: str, seed: int, on_probe: OnSplitProbe | None):
        self.args = (server, trace, slo)
        self.link, self.scope, self.router, self.seed = link, scope, router, seed
        self.on_probe = on_probe
        self.probes: dict[tuple[int, int], SplitProbe] = {}

    def __call__(self, p: int, d: int) -> SplitProbe:
        key = (p, d)
        if key not in self.probes:
            server, trace, slo = self.args
            self.probes[key] = probe_split(server, trace, slo, p, d, self.link, self.scope,
                                           self.router, self.seed)
            if self.on_probe:
                self.on_probe(self.probes[key])
        return self.probes[key]

    def known(self, p: int, d: int) -> bool | None:
        for (q, e), x in self.probes.items():
            if x.met and q <= p and e <= d:
                return True
            if not x.met and q >= p and e >= d:
                return False
        return None

    def met(self, p: int, d: int) -> bool:
        k = self.known(p, d)
        return self(p, d).met if k is None else k


def _more(search: _Search, probe: SplitProbe, slo: SLO) -> tuple[int, int]:
    """(prefill, decode) replicas to add after a probe that missed the SLO (ascent)."""
    b = probe.blame
    target = 1 - slo.attainment           # the share of requests allowed to miss
    add_p = add_d = 0
    if b["tpot_miss"] > target:
        add_d = 1
    if b["ttft_miss"] > target or not add_d:
        if b["decode"] > 0.25 * b["prefill"] and b["decode"] >= b["link"]:
            # a decode replica's reservations wait both when its running requests fill it
            # and when requests whose prompts queue for a slow prefill side hold its
            # memory: ask the next probes which it is
            more_p = search(probe.prefill + 1, probe.decode)
            more_d = search(probe.prefill, probe.decode + 1)
            side = "prefill" if more_p.attainment >= more_d.attainment else "decode"
        elif b["link"] > b["prefill"]:
            # more replicas of the scarcer kind add the most link capacity in either scope
            side = "prefill" if probe.prefill < probe.decode else "decode"
        else:
            # queued for the prefill, or (nobody waiting) sharing prefill steps
            side = "prefill"
        if side == "prefill":
            add_p = 1
        else:
            add_d = 1
    # far off: grow geometrically, so a large answer takes few probes
    if probe.attainment < slo.attainment / 2:
        add_p *= max(1, probe.prefill // 2)
        add_d *= max(1, probe.decode // 2)
    return add_p, add_d


# the ascent gives up when STALL_PROBES more replicas raised the attainment by less than
# STALL_GAIN: what misses then is the prompts' own prefill and wire time
STALL_PROBES = 4
STALL_GAIN = 0.005


def _search_level(search: _Search, start: tuple[int, int], slo: SLO, max_replicas: int,
                  floor: int) -> tuple[tuple[int, int] | None, str]:
    """Ascent from ``start``, then descent to the lowest feasible total not below ``floor``;
    (None, why) when no split within ``max_replicas`` meets the SLO."""
    p, d = start
    seen: list[float] = []
    while True:
        probe = search(p, d)
        if probe.met:
            break
        rejected = probe.blame["rejected"]
        if rejected > 1 - slo.attainment:
            why = next(iter(probe.summary["rejection_reasons"]), "")
            return None, (f"{rejected:.0%} of the requests are rejected whatever the split "
                          f"({why})")
        seen.append(probe.attainment)
        if len(seen) > STALL_PROBES and seen[-1] - seen[-1 - STALL_PROBES] < STALL_GAIN:
            return None, (f"more replicas stopped helping at {p}:{d} ({probe.attainment:.0%} "
                          "met): the misses are the prompts' own prefill and transfer time")
        if p + d >= max_replicas:
            return None, f"no split of up to {max_replicas} replicas meets the SLO"
        add_p, add_d = _more(search, probe, slo)
        p, d = p + add_p, d + add_d
        if p + d > max_replicas:                 # trim the step to the cap
            over = p + d - max_replicas
            take_d = min(over, add_d)
            p, d = p - (over - take_d), d - take_d
    best = (p, d)
    total = p + d - 1
    while total >= max(2, floor):
        # nearest split first: the staircase's answer at the next level down is near the
        # point found
        order = sorted(range(1, total), key=lambda q: (abs(q - best[0]), q))
        hit = next(((q, total - q) for q in order if search.met(q, total - q)), None)
        if hit is None:
            break
        best = hit
        total -= 1
    return best, ""


def cheapest_split(server: ResolvedServer, trace: Trace, slo: SLO, link: LinkSpec,
                   rate: float, scope: str = "pair", router: str = "round_robin",
                   start_requests: int = 1000, max_requests: int = 4000,
                   max_replicas: int = 32, seed: int = 0,
                   on_probe: OnSplitProbe | None = None) -> dict[str, Any]:
    """The fewest replicas (prefill + decode) meeting ``slo`` on ``trace``'s lengths at
    ``rate`` req/s, in steady state (module docstring). ``best``: the answer's probe on the
    longest trace (None: no split within ``max_replicas``); ``levels``: the answer at each
    trace length; ``probes``: every probe, by trace length."""
    if not 1 <= start_requests <= max_requests:
        raise SimulatorInputError(f"trace lengths {start_requests}..{max_requests} must "
                                  "satisfy 1 <= start <= max")
    if not (rate > 0 and math.isfinite(rate)):
        raise SimulatorInputError(f"rate={rate!r} must be a finite number > 0 (req/s)")
    if max_replicas < 2:
        raise SimulatorInputError(f"max replicas={max_replicas} must be >= 2 (one prefill "
                                  "and one decode replica)")
    tp = server.deployment.settings.tp
    levels: list[dict[str, Any]] = []
    probes: list[SplitProbe] = []
    start, floor, n = (1, 1), 2, start_requests
    best_probe: SplitProbe | None = None
    converged, note = False, ""
    while True:
        load = resample_arrivals(resized(trace, n, seed), rate, seed)
        search = _Search(server, load, slo, link, scope, router, seed, on_probe)
        found, note = _search_level(search, start, slo, max_replicas, floor)
        if found is None:
            probes.extend(search.probes.values())
            best_probe = None
            levels.append({"requests": n, "prefill": None, "decode": None})
            break
        total = sum(found)
        # the splits of the answer's total that may meet the SLO: on a longer trace, only
        # those that met it on the shorter one (a longer trace only adds queueing)
        # of the answer's total, the split found and its neighbours (one replica moved to
        # the other side) that may meet the SLO too; the one with the best goodput wins
        near = [(found[0] + k, found[1] - k) for k in (-1, 1)]
        splits = [found] + [x for x in near
                            if min(x) >= 1 and search.known(*x) is not False]
        ties = [search(q, d) for q, d in splits]
        probes.extend(search.probes.values())
        best_probe = max((x for x in ties if x.met),
                         key=lambda x: (_goodput_per_gpu(x, tp), -x.prefill))
        levels.append({"requests": n, "prefill": best_probe.prefill,
                       "decode": best_probe.decode})
        if len(levels) >= 2 and levels[-2]["prefill"] is not None and (
                levels[-2]["prefill"] + levels[-2]["decode"] == total):
            converged = True
            break
        if 2 * n > max_requests:
            break
        n *= 2
        start, floor = (best_probe.prefill, best_probe.decode), total
    return {"best": best_probe, "levels": levels, "converged": converged, "note": note,
            "probes": probes, "tp": tp,
            "gpus": None if best_probe is None else best_probe.replicas * tp,
            "goodput_per_gpu": (None if best_probe is None
                                else _goodput_per_gpu(best_probe, tp))}


@dataclass(frozen=True)
class FleetProbe:
    """A colocated fleet of ``replicas`` replicas behind the router, replayed like a split."""

    replicas: int
    requests: int
    attainment: float
    met: bool
    summary: dict[str, Any]


def probe_fleet(server: ResolvedServer, trace: Trace, slo: SLO, replicas: int,
                router: str = "round_robin", seed: int = 0) -> FleetProbe:
    res = simulate(trace, server, replicas, router, seed)
    s = summarize(res, slo)
    tail = tail_attainment(res, slo)
    return FleetProbe(replicas, len(trace), min(s["slo_attainment"], tail),
                      bool(s["slo_met"] and tail >= slo.attainment), s)


def _fleet_prober(server: ResolvedServer, load: Trace, slo: SLO, router: str, seed: int,
                  sink: list[FleetProbe], on_probe: Callable[[FleetProbe], None] | None
                  ) -> Callable[[int], FleetProbe]:
    """probe(replicas) on ``load``, cached, each new probe appended to ``sink``."""
    seen: dict[int, FleetProbe] = {}

    def probe(k: int) -> FleetProbe:
        if k not in seen:
            seen[k] = probe_fleet(server, load, slo, k, router, seed)
            sink.append(seen[k])
            if on_probe:
                on_probe(seen[k])
        return seen[k]
    return probe


def cheapest_colocated(server: ResolvedServer, trace: Trace, slo: SLO, rate: float,
                       router: str = "round_robin", start_requests: int = 1000,
                       max_requests: int = 4000, max_replicas: int = 32, seed: int = 0,
                       on_probe: Callable[[FleetProbe], None] | None = None
                       ) -> dict[str, Any]:
    """The fewest colocated replicas meeting ``slo`` on the same loads as
    ``cheapest_split`` (the same requests and arrivals at each trace length, the same
    criterion): doubling from one replica (or the previous length's answer) until the SLO
    is met, then bisection; in steady state as there."""
    if not 1 <= start_requests <= max_requests:
        raise SimulatorInputError(f"trace lengths {start_requests}..{max_requests} must "
                                  "satisfy 1 <= start <= max")
    tp = server.deployment.settings.tp
    levels: list[dict[str, Any]] = []
    probes: list[FleetProbe] = []
    best: FleetProbe | None = None
    lo, n, converged = 0, start_requests, False     # lo: replicas known to miss
    while True:
        load = resample_arrivals(resized(trace, n, seed), rate, seed)
        probe = _fleet_prober(server, load, slo, router, seed, probes, on_probe)
        k = max(lo + 1, 1)
        while not probe(k).met and k < max_replicas:
            lo, k = k, min(max_replicas, 2 * k)
        if not probe(k).met:
            best = None
            levels.append({"requests": n, "replicas": None})
            break
        hi = k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if probe(mid).met else (mid, hi)
        best = probe(hi)
        levels.append({"requests": n, "replicas": hi})
        if len(levels) >= 2 and levels[-2]["replicas"] == hi:
            converged = True
            break
        if 2 * n > max_requests:
            break
        n *= 2
        lo = hi - 1                  # a longer trace needs at least as many replicas
    return {"best": best, "levels": levels, "converged": converged, "probes": probes,
            "tp": tp, "gpus": None if best is None else best.replicas * tp,
            "goodput_per_gpu": (None if best is None
                                else best.summary["goodput"] / (best.replicas * tp))}
