"""The lone-prefill probe's plan, record and summary: what ``python -m
sglang_diffkv.bench.prefill_ttft`` sends a live server and writes, and what ``diffkv-sim
prefill-probes`` replays through the simulator (one definition, so the two always mean the
same requests).

A plan times single requests of one output token, each ``gap_s`` after the last, for every
prompt length L of ``lengths`` (``per_length`` of each), in three phases:

  fresh L    a prompt of L tokens the server has not seen (an uncached prefill)
  cached L   the same prompts again: a one-token extend on an (L-1)-token cached prefix
  loaded L   the cached prompts once more while ``load_batch`` requests of ``load_input``
             prompt tokens stream tokens (a mid-ladder server's decode batch)

Position i of a phase's request list always makes the same prompt (the bench client's
``prompt_ids``), so a phase that repeats the list hits the radix cache.

The record, ``prefill_ttft.json``: {"argv", "plan": ProbePlan's fields, "configs": {NAME:
{"attention_backend", "kv_cache_dtype", "env"}}, "host_ms", "primes", "summary",
"requests": [{"start", "config", "phase", "input_len", "ttft_ms", "error"}]}; records
written before "plan" and "configs" were kept give the plan by their argv
(``plan_from_record``), and their servers' logs the backend.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from sglang_diffkv.serving_io.errors import InputError

PHASES = ("fresh", "cached", "loaded")
MAX_CONTEXT = 8192   # Llama-3-8B's

# the plan's command-line defaults (the bench's options and an older record's argv)
DEFAULT_LENGTHS = "128,1024,4096"
DEFAULT_PER_LENGTH = 20
DEFAULT_GAP_S = 0.15
DEFAULT_LOAD_BATCH = 16
DEFAULT_LOAD_INPUT = 512


class ProbeRequest(NamedTuple):
    """One request of a phase: sent ``arrival_s`` after the phase starts."""

    arrival_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class ProbePlan:
    lengths: tuple[int, ...]
    per_length: int
    gap_s: float
    load_batch: int
    load_input: int
    load_lead_s: float = 2.0   # the load's prefill and first decode steps finish first

    def __post_init__(self) -> None:
        if not self.lengths or any(not 2 <= n < MAX_CONTEXT for n in self.lengths):
            raise InputError(f"lengths {self.lengths}: give at least one, each in 2.."
                             f"{MAX_CONTEXT - 1} (a cached prompt extends by its last token)")
        if self.per_length < 1:
            raise InputError(f"per_length={self.per_length}: must be >= 1")
        if not self.gap_s > 0:
            raise InputError(f"gap_s={self.gap_s}: must be > 0")
        if self.load_batch < 0 or not 1 <= self.load_input <= MAX_CONTEXT - 64:
            raise InputError(f"load_batch={self.load_batch}, load_input={self.load_input}: "
                             f"need >= 0 and 1..{MAX_CONTEXT - 64}")

    def probes(self, start_s: float = 0.0) -> list[ProbeRequest]:
        """The probe requests, one every gap_s from start_s; list position i always makes the
        same prompt, so a phase that repeats the list hits the cache."""
        lens = [n for n in self.lengths for _ in range(self.per_length)]
        return [ProbeRequest(start_s + i * self.gap_s, n, 1) for i, n in enumerate(lens)]

    def phases(self) -> tuple[str, ...]:
        """The phases this plan runs (no loaded phase without a load)."""
        return PHASES if self.load_batch else PHASES[:2]

    def phase_requests(self, phase: str) -> list[ProbeRequest]:
        """A phase's requests: the probes first (list positions 0..len(probes) - 1), then,
        in the loaded phase, the load."""
        if phase != "loaded":
            return self.probes()
        probes = self.probes(self.load_lead_s)
        last = probes[-1].arrival_s + 1.0
        # enough tokens to outlast the probes at 4 ms a step (faster than any server's step at
        # this batch); the client cancels them once the probes are done
        out = max(16, min(int(last / 0.004), MAX_CONTEXT - self.load_input - 1))
        # after the probes in the list: their positions, hence prompts, stay the cached ones
        return probes + [ProbeRequest(0.0, self.load_input, out)
                         for _ in range(self.load_batch)]

    def to_record(self) -> dict[str, Any]:
        return {**asdict(self), "lengths": list(self.lengths)}


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--lengths {text!r}: want integers, e.g. {DEFAULT_LENGTHS}") from None


def _plan_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS)
    ap.add_argument("--per-length", type=int, default=DEFAULT_PER_LENGTH)
    ap.add_argument("--gap-s", type=float, default=DEFAULT_GAP_S)
    ap.add_argument("--load-batch", type=int, default=DEFAULT_LOAD_BATCH)
    ap.add_argument("--load-input", type=int, default=DEFAULT_LOAD_INPUT)


def plan_from_record(data: dict[str, Any]) -> ProbePlan:
    """The plan a record was measured with: its "plan", or (an older record) the plan options
    of its "argv" at these defaults."""
    plan = data.get("plan")
    if isinstance(plan, dict):
        try:
            return ProbePlan(**{**plan, "lengths": tuple(plan["lengths"])})
        except (KeyError, TypeError) as e:
            raise InputError(f"probe record: bad plan {plan!r}: {e}") from None
    argv = data.get("argv")
    if not isinstance(argv, list):
        raise InputError("probe record: neither a plan nor the argv it was run with")
    ap = argparse.ArgumentParser(add_help=False)
    _plan_options(ap)
    a, _ = ap.parse_known_args([str(x) for x in argv])
    return ProbePlan(parse_lengths(a.lengths), a.per_length, a.gap_s, a.load_batch,
                     a.load_input)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (start, config, phase, input_len): n, failed, median / p10 / p90 TTFT in ms."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("start", 0), r.get("config", "-"), r["phase"],
                           r["input_len"]), []).append(r)
    out = []
    for (start, config, phase, n), rs in groups.items():
        t = sorted(r["ttft_ms"] for r in rs if r["ttft_ms"] is not None)
        q = statistics.quantiles(t, n=10, method="inclusive") if len(t) >= 2 else t * 9
        out.append({"start": start, "config": config, "phase": phase, "input_len": n,
                    "n": len(t), "failed": len(rs) - len(t),
                    "median_ms": statistics.median(t) if t else None,
                    "p10_ms": q[0] if t else None, "p90_ms": q[-1] if t else None})
    return out
