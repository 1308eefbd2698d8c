"""The three workloads, as simulator traces (``simulator.workload``), so the exact requests can
be written out (Mooncake JSONL, ``write_mooncake_jsonl``) and replayed by ``diffkv-sim``.

  longgen   DiffKV's long-generation benchmark shape: prompts uniform in [256, 768] tokens
            (seeded), 4096 output tokens each (ignore_eos), N requests all at t = 0. N must
            exceed what the server can run at once, or the request count, not memory, caps
            the batch: 512 did on an H100 (DiffKV at 30/50/20 held ~370 requests of 4608
            tokens) but not on an H200 (all 512 ran at once). ``auto_longgen_n`` sizes N
            from the server's reported capacity instead (``--longgen-n auto``).
  sharegpt  the first N requests of the bundled ShareGPT-shaped trace (mean 352 in / 240 out,
            at most 4096 / 2048), all at t = 0: offline saturation.
  ladder    the same ShareGPT-shaped lengths re-timed as Poisson arrivals at given rates
            (fractions of the saturation request rate measured on the same server just before,
            or absolute req/s), one window-limited run per rate.
  prefix    prefix reuse: the bundled Mooncake conversation trace, whose ``hash_ids`` name
            512-token blocks, replayed with one deterministic token block per id
            (``client.block_ids``), so requests that share leading ids share that token
            prefix and a radix cache can hit. Prompts are cut to fit the served context (their
            leading blocks kept). First all at t = 0 (saturation), then at fractions of that
            rate with the trace's own arrival order and gaps scaled (a conversation's next turn
            still comes after the one before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sglang_diffkv.bench.client import RequestSpec
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest

WORKLOADS = ("longgen", "sharegpt", "ladder", "prefix")


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


# ``--longgen-n auto``: N = AUTO_FACTOR x the requests of mean length (mean prompt + output)
# the server's largest reported capacity holds. With 1x the batch could just equal N; 2x keeps
# a second wave queued for the slots the first frees inside the window.
AUTO_FACTOR = 2.0


@dataclass(frozen=True)
class AutoN:
    """``auto_longgen_n``'s choice and its reasons (printed and recorded per run)."""

    n: int
    capacity_tokens: int
    capacity_requests: float
    why: str
    warning: str | None = None


def auto_longgen_n(longgen: LongGen, pool_tokens: int | None, all_high_tokens: int | None,
                   max_running: int | None, factor: float = AUTO_FACTOR,
                   at_least: int = 1) -> AutoN:
    """N for ``longgen`` on a server whose start-up reported ``pool_tokens`` (SGLang's
    ``max_total_num_tokens``: bf16/fp8 tokens, or DiffKV's logical token slots at its
    planning mix) and, for DiffKV, ``all_high_tokens`` (its pages' capacity with every token
    in the high tier). The capacity is the larger of the two (what the scheduler may admit
    by, whichever it is), in requests of mean length; N = ceil(factor x that), at least
    ``at_least`` (the harness passes the N of earlier configurations, so a later one never
    runs fewer requests). ``warning``: when ``max_running`` (max running requests) is below
    that capacity, it and not memory caps the batch."""
    if not factor > 1:
        raise BenchInputError(f"--longgen-n-factor {factor!r} must be > 1 (at 1 the batch "
                              "could equal N)")
    tokens = max(pool_tokens or 0, all_high_tokens or 0)
    if tokens <= 0:
        raise BenchInputError("--longgen-n auto: the server reported no KV capacity "
                              "(max_total_num_tokens); give --longgen-n a number")
    mean_len = (longgen.input_min + longgen.input_max) / 2 + longgen.output_len
    reqs = tokens / mean_len
    n = max(math.ceil(factor * reqs), at_least, 1)
    src = (f"max_total_num_tokens {pool_tokens}" if (pool_tokens or 0) >= (all_high_tokens or 0)
           else f"DiffKV all-high capacity {all_high_tokens}")
    why = (f"N = {n}: capacity {tokens} tokens ({src}) / mean request {mean_len:.0f} tokens "
           f"= {reqs:.1f} requests at once; x{factor:g}"
           + (f", raised to {at_least} (an earlier configuration's N)"
              if at_least > math.ceil(factor * reqs) else ""))
    warning = None
    if max_running is not None and max_running < reqs:
        warning = (f"max_running_requests {max_running} < the {reqs:.0f} requests memory "
                   "holds: the request limit, not memory, caps the batch (raise "
                   "--max-running-requests in --server-args)")
    return AutoN(n, tokens, reqs, why, warning)


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


@dataclass(frozen=True)
class PrefixReuse:
    """The prefix-reuse workload: the first ``n`` requests of ``source`` (a trace with prefix
    hash ids), outputs cut to ``max_output`` and prompts to ``max_input`` tokens (the leading
    hash ids kept, the rest dropped)."""

    n: int = 1000
    max_input: int = 6144
    max_output: int = 1024
    source: str = "mooncake-conversation"

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_input < 1 or self.max_output < 1:
            raise BenchInputError(f"prefix workload needs n, max_input, max_output >= 1; got "
                                  f"{self.n}, {self.max_input}, {self.max_output}")

    def trace(self) -> Trace:
        base = load_named_trace(self.source)
        if not any(r.prefix_hash_ids for r in base.requests):
            raise BenchInputError(f"prefix workload: trace {self.source!r} has no hash_ids "
                                  "(prefix block ids); use a Mooncake trace that has them")
        block = base.prefix_block_tokens
        reqs = []
        for r in base.requests[:self.n]:
            inp = min(r.input_tokens, self.max_input)
            out = min(r.requested_new_tokens, self.max_output)
            ids = r.prefix_hash_ids[:-(-inp // block)]
            reqs.append(TraceRequest(r.arrival_s, inp, out, prefix_hash_ids=ids))
        return Trace(tuple(reqs), name=f"prefix-n{len(reqs)}",
                     source=f"{self.source}, prompts <= {self.max_input}, outputs <= "
                            f"{self.max_output}", prefix_block_tokens=block).rebased()


def paced_trace(trace: Trace, rate: float, window_s: float) -> Trace:
    """``trace`` in its own order and relative gaps, time-scaled to a mean of ``rate`` req/s,
    cut to the requests arriving inside ``window_s``."""
    if not (rate > 0 and math.isfinite(rate)):
        raise BenchInputError(f"rate {rate!r} must be a positive finite number of req/s")
    if len(trace) < 2 or trace.duration_s <= 0:
        raise BenchInputError(f"trace {trace.name!r} has no arrival span to scale")
    scaled = trace.rebased().time_scaled(1.0 / (rate * trace.duration_s / (len(trace) - 1)))
    keep = tuple(r for r in scaled.requests if r.arrival_s < window_s)
    return replace(scaled, requests=keep, name=f"{trace.name}-{rate:.3g}rps",
                   source=f"{trace.source}, paced to {rate:g} req/s")


def hit_ceiling(trace: Trace) -> float:
    """The share of prompt tokens an unbounded prefix cache could serve if every request
    arrived after the ones before it had been prefilled: the tokens of its leading hash ids
    seen in earlier requests, over all prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    block = trace.prefix_block_tokens
    for r in trace.requests:
        ids = r.prefix_hash_ids
        k = 0
        while k < len(ids) and ids[:k + 1] in seen:
            k += 1
        hit += min(k * block, r.input_tokens - 1) if k else 0
        total += r.input_tokens
        seen.update(ids[:j] for j in range(1, len(ids) + 1))
    return hit / total


def to_specs(trace: Trace) -> list[RequestSpec]:
    """Client requests: output = ``max_new_tokens`` (what SGLang reserves for, generated in
    full with ignore_eos); a request with prefix hash ids starts with their token blocks."""
    return [RequestSpec(r.arrival_s, r.input_tokens, r.requested_new_tokens,
                        r.prefix_hash_ids, trace.prefix_block_tokens)
            for r in trace.requests]
