"""Synthetic traces: fitted lengths + an arrival process, and the closed-loop workload."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sglang_diffkv.serving_io.arrivals import gamma_arrivals
from sglang_diffkv.serving_io.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest
from simulator.errors import SimulatorInputError
from simulator.workload.lengths import LengthModel


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


def resized(trace: Trace, n: int, seed: int) -> Trace:
    """``n`` requests with the trace's lengths: its first ``n`` in order, or all of them and
    then draws with replacement (seeded) up to ``n``. A drawn copy keeps its lengths but not
    its prefix ids, so that copies do not hit the radix cache as repeats of one prompt.
    Arrival times are left for ``resample_arrivals`` to set."""
    if n < 1:
        raise SimulatorInputError(f"n={n} must be >= 1")
    if n <= len(trace):
        return trace.head(n)
    rng = np.random.default_rng(seed)
    extra = rng.integers(0, len(trace), n - len(trace))
    last = trace.requests[-1].arrival_s
    copies = [replace(trace.requests[i], arrival_s=last, prefix_hash_ids=(), session_id=None)
              for i in extra]
    return Trace.from_requests((*trace.requests, *copies), name=f"{trace.name}-n{n}",
                               source=trace.source)


def scale_lengths(trace: Trace, input_scale: float = 1.0, output_scale: float = 1.0) -> Trace:
    """The trace with every prompt ``input_scale`` times and every output (and client
    max_tokens) ``output_scale`` times as long, rounded, at least 1 token. Prefix ids name
    blocks of the original prompts, so a scaled prompt keeps none."""
    for name, v in (("input scale", input_scale), ("output scale", output_scale)):
        if not (v > 0 and math.isfinite(v)):
            raise SimulatorInputError(f"{name}={v!r} must be a number > 0")
    if input_scale == 1.0 and output_scale == 1.0:
        return trace

    def scaled(n: int, f: float) -> int:
        return max(1, round(n * f))
    reqs = [replace(r, input_tokens=scaled(r.input_tokens, input_scale),
                    output_tokens=scaled(r.output_tokens, output_scale),
                    max_new_tokens=(None if r.max_new_tokens is None
                                    else scaled(r.max_new_tokens, output_scale)),
                    prefix_hash_ids=r.prefix_hash_ids if input_scale == 1.0 else ())
            for r in trace.requests]
    return replace(trace, requests=tuple(reqs),
                   name=f"{trace.name}-in{input_scale:g}x-out{output_scale:g}x")
