"""Synthetic traces: fitted lengths + an arrival process, and the closed-loop workload."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simulator.errors import SimulatorInputError
from simulator.workload.arrivals import gamma_arrivals
from simulator.workload.lengths import LengthModel
from simulator.workload.schema import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest


def synthetic_trace(lengths: LengthModel, n: int, rate: float, seed: int, cv: float = 1.0,
                    name: str | None = None) -> Trace:
    """``n`` requests with lengths from ``lengths`` and Gamma(cv) arrivals at ``rate`` req/s
    (cv = 1: Poisson; rate = inf: all at t = 0)."""
    rng = np.random.default_rng(seed)
    inp, out = lengths.sample(n, rng)
    arrivals = gamma_arrivals(rate, cv, n, rng)
    reqs = [TraceRequest(float(t), int(i), int(o)) for t, i, o in zip(arrivals, inp, out,
                                                                      strict=True)]
    label = name or f"{lengths.name}-n{n}-r{rate:g}" + ("" if cv == 1 else f"-cv{cv:g}")
    source = f"synthetic from {lengths.name}, seed {seed}"
    return Trace.from_requests(reqs, name=label, source=source)


def resample_arrivals(trace: Trace, rate: float, seed: int, cv: float = 1.0) -> Trace:
    """The trace's lengths (in order) with new Gamma(cv) arrivals at ``rate``."""
    rng = np.random.default_rng(seed)
    arr = gamma_arrivals(rate, cv, len(trace), rng)
    tag = "inf" if math.isinf(rate) else f"{rate:g}"
    return trace.with_arrivals(arr.tolist(), name=f"{trace.name}@{tag}rps")


@dataclass(frozen=True)
class ClosedLoop:
    """``users`` clients, each sending its next request ``think_s`` after the previous one
    completes, drawing requests in order from ``requests`` (arrival times ignored) until all
    have been sent. With think_s = 0 this holds the concurrency at exactly ``users``.
    ``prefix_block_tokens``: as ``Trace``'s, the block size the prefix hash ids name."""

    requests: tuple[TraceRequest, ...]
    users: int
    think_s: float = 0.0
    name: str = "closed-loop"
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.users < 1:
            raise SimulatorInputError(f"users={self.users} must be >= 1")
        if not (self.think_s >= 0 and math.isfinite(self.think_s)):
            raise SimulatorInputError(f"think_s={self.think_s} must be a finite number >= 0")
        if not self.requests:
            raise SimulatorInputError("a closed loop needs at least one request")

    def __len__(self) -> int:
        return len(self.requests)
