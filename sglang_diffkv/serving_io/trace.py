"""The one internal trace schema every loader and generator produces.

Invariants (checked in ``TraceRequest.__post_init__``): arrival >= 0, input_tokens >= 1,
output_tokens >= 1, and max_new_tokens (when given) >= output_tokens. A Trace is sorted by
arrival time; ties keep file order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_diffkv.serving_io.errors import InputError

# Mooncake traces name 512-token prompt blocks
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives and how many tokens go in and come out.

    ``output_tokens`` is how many tokens the request really generates (EOS or length);
    ``max_new_tokens`` is what the client asked for (SGLang reserves memory by it); None means
    the client asked for exactly ``output_tokens`` (bench_serving with ignore_eos).
    ``prefix_hash_ids`` name the prompt's full blocks of ``Trace.prefix_block_tokens`` tokens
    (Mooncake's 512 by default); an id depends on every block before it, so two prompts share
    the prefix of their leading equal ids (kept, written back out).
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    max_new_tokens: int | None = None
    prefix_hash_ids: tuple[int, ...] = ()
    session_id: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s)):
            raise InputError(f"arrival_s={self.arrival_s!r} must be a finite number")
        if self.arrival_s < 0:
            raise InputError(f"arrival_s={self.arrival_s!r} must be >= 0")
        for name in ("input_tokens", "output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name}={v!r} must be an integer >= 1")
        m = self.max_new_tokens
        bad = isinstance(m, bool) or not isinstance(m, int) or m < self.output_tokens
        if m is not None and bad:
            raise InputError(
                f"max_new_tokens={m!r} must be an integer >= output_tokens={self.output_tokens}"
            )

    @property
    def requested_new_tokens(self) -> int:
        return self.output_tokens if self.max_new_tokens is None else self.max_new_tokens


@dataclass(frozen=True)
class Trace:
    """An arrival-ordered list of requests with a name saying where it came from;
    ``prefix_block_tokens`` is the block size its requests' ``prefix_hash_ids`` name."""

    requests: tuple[TraceRequest, ...]
    name: str = "trace"
    source: str = field(default="", compare=False)
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not self.requests:
            raise InputError(f"trace {self.name!r} has no requests")
        b = self.prefix_block_tokens
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InputError(f"prefix_block_tokens={b!r} must be an integer >= 1 "
                                      "(tokens per prefix hash id)")
        arrivals = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
            order = sorted(range(len(self.requests)), key=lambda i: self.requests[i].arrival_s)
            object.__setattr__(self, "requests", tuple(self.requests[i] for i in order))

    @classmethod
    def from_requests(cls, requests: Iterable[TraceRequest], name: str, source: str = "") -> Trace:
        return cls(tuple(requests), name=name, source=source)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate(self) -> float:
        """Requests per second over the arrival span; inf when all arrive at once."""
        d = self.duration_s
        return (len(self) - 1) / d if d > 0 else math.inf

    def head(self, n: int) -> Trace:
        if n < 1:
            raise InputError(f"n={n} must be >= 1")
        return replace(self, requests=self.requests[:n])

    def rebased(self) -> Trace:
        """Arrivals shifted so the first request arrives at t = 0."""
        t0 = self.requests[0].arrival_s
        if t0 == 0:
            return self
        return replace(self, requests=tuple(replace(r, arrival_s=r.arrival_s - t0)
                                            for r in self.requests))

    def time_scaled(self, factor: float) -> Trace:
        """Inter-arrival times multiplied by ``factor`` (< 1 replays faster)."""
        if not (factor > 0 and math.isfinite(factor)):
            raise InputError(f"time scale factor={factor!r} must be a positive number")
        t0 = self.requests[0].arrival_s
        return replace(
            self, requests=tuple(replace(r, arrival_s=(r.arrival_s - t0) * factor)
                                 for r in self.requests),
            name=f"{self.name}x{factor:g}",
        )

    def with_arrivals(self, arrivals: Sequence[float], name: str | None = None) -> Trace:
        """The same lengths with new arrival times (one per request)."""
        return self._per_request("arrival_s", [float(t) for t in arrivals], "arrival times",
                                 name=name or self.name)

    def with_prefix_ids(self, ids: Sequence[tuple[int, ...]], block_tokens: int) -> Trace:
        """The same requests with new prefix hash ids (one tuple per request, in order) that
        name blocks of ``block_tokens`` tokens."""
        return self._per_request("prefix_hash_ids", [tuple(h) for h in ids], "prefix ids",
                                 prefix_block_tokens=block_tokens)

    def _per_request(self, attr: str, values: Sequence[Any], what: str, **changes: Any
                     ) -> Trace:
        """The trace with request i's field ``attr`` set to ``values[i]`` (and ``changes``)."""
        if len(values) != len(self):
            raise InputError(
                f"got {what} for {len(values)} requests; the trace has {len(self)}"
            )
        return replace(self, requests=tuple(replace(r, **{attr: v}) for r, v in zip(
            self.requests, values, strict=True)), **changes)
