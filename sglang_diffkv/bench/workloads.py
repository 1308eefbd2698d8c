"""The three workloads, as simulator traces (``simulator.workload``), so the exact requests can
be written out (Mooncake JSONL, ``write_mooncake_jsonl``) and replayed by ``diffkv-sim``.

  longgen   DiffKV's long-generation benchmark shape: prompts uniform in [256, 768] tokens
            (seeded), 4096 output tokens each (ignore_eos), N requests all at t = 0. The
            default N = 512 saturates even the DiffKV pool (at a 30/50/20 tier mix it holds ~4x
            bf16's 423,862 tokens, i.e. ~370 requests of 4608 tokens; bf16 holds ~92).
  sharegpt  the first N requests of the bundled ShareGPT-shaped trace (mean 352 in / 240 out,
            at most 4096 / 2048), all at t = 0: offline saturation.
  ladder    the same ShareGPT-shaped lengths re-timed as Poisson arrivals at given rates
            (fractions of the saturation request rate measured on the same server just before,
            or absolute req/s), one window-limited run per rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sglang_diffkv.bench.client import RequestSpec
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest

WORKLOADS = ("longgen", "sharegpt", "ladder")


def parse_workloads(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchInputError(f"--workloads {text!r} names no workload")
    for n in names:
        if n not in WORKLOADS:
            raise BenchInputError(f"unknown workload {n!r}; allowed: {', '.join(WORKLOADS)}")
    if len(set(names)) != len(names):
        raise BenchInputError(f"--workloads {text!r} names a workload twice")
    return names


def parse_rates(text: str, what: str = "--ladder-rates") -> list[float]:
    """Comma-separated positive finite numbers, e.g. '0.25,0.5,0.75'."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            r = float(part)
        except ValueError as e:
            raise BenchInputError(f"{what}: {part!r} is not a number (expected e.g. "
                                  "'0.25,0.5,0.75')") from e
        if not (r > 0 and math.isfinite(r)):
            raise BenchInputError(f"{what}: rate {part!r} must be a positive finite number")
        rates.append(r)
    if not rates:
        raise BenchInputError(f"{what} {text!r} names no rate")
    return rates


@dataclass(frozen=True)
class LongGen:
    n: int = 512
    input_min: int = 256
    input_max: int = 768
    output_len: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1 or self.output_len < 1:
            raise BenchInputError(f"longgen needs n >= 1 and output_len >= 1, got n={self.n}, "
                                  f"output_len={self.output_len}")
        if not 1 <= self.input_min <= self.input_max:
            raise BenchInputError(f"longgen input range [{self.input_min}, {self.input_max}] "
                                  "must have 1 <= min <= max")

    def trace(self) -> Trace:
        rng = np.random.default_rng(self.seed)
        inp = rng.integers(self.input_min, self.input_max + 1, size=self.n)
        reqs = [TraceRequest(0.0, int(i), self.output_len) for i in inp]
        return Trace.from_requests(
            reqs, name=f"longgen-n{self.n}-o{self.output_len}",
            source=f"uniform input [{self.input_min}, {self.input_max}], seed {self.seed}")


def sharegpt_trace(n: int, source: str = "sharegpt", skip: int = 0) -> Trace:
    """``n`` requests of a trace (bundled name or file) after its first ``skip``, all arriving
    at t = 0. ``skip`` reaches requests that the default runs (the first 1,500) never replay."""
    base = load_named_trace(source)
    if n < 1:
        raise BenchInputError(f"sharegpt n={n} must be >= 1")
    if skip < 0:
        raise BenchInputError(f"sharegpt skip={skip} must be >= 0")
    if skip + n > len(base):
        raise BenchInputError(f"sharegpt n={n} after skip={skip}: trace {source!r} has only "
                              f"{len(base)} requests")
    part = Trace(base.requests[skip:skip + n], name=base.name, source=base.source)
    return part.with_arrivals([0.0] * n,
                              name=f"sharegpt-n{n}" + (f"-skip{skip}" if skip else ""))


def ladder_trace(base: Trace, rate: float, window_s: float, seed: int = 0) -> Trace:
    """``base``'s lengths (in order) with Poisson arrivals at ``rate`` req/s, cut to the
    requests arriving inside ``window_s``; the lengths wrap around if the window needs more
    requests than ``base`` has."""
    if not (rate > 0 and math.isfinite(rate)):
        raise BenchInputError(f"ladder rate {rate!r} must be a positive finite number of req/s")
    if not (window_s > 0 and math.isfinite(window_s)):
        raise BenchInputError(f"ladder window {window_s!r} must be a positive number of s")
    # enough requests to cover the window with margin (Poisson count sd ~ sqrt(mean))
    need = int(rate * window_s + 5 * math.sqrt(rate * window_s) + 10)
    reqs = [base.requests[i % len(base)] for i in range(need)]
    timed = resample_arrivals(Trace(tuple(reqs), name=base.name), rate, seed)
    keep = tuple(r for r in timed.requests if r.arrival_s < window_s)
    return Trace(keep, name=f"ladder-{rate:.3g}rps", source=f"{base.name} at Poisson {rate:g}")


def to_specs(trace: Trace) -> list[RequestSpec]:
    """Client requests: output = ``max_new_tokens`` (what SGLang reserves for, generated in
    full with ignore_eos)."""
    return [RequestSpec(r.arrival_s, r.input_tokens, r.requested_new_tokens)
            for r in trace.requests]
