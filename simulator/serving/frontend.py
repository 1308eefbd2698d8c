"""SGLang's tokenizer manager as the requests and their tokens pass it, with its garbage
collector's pauses.

One Python process (the HTTP server's) takes every request in and hands every streamed token
out. Python's full (generation-2) collection stops it: requests that arrive then reach the
scheduler, and tokens the scheduler streams then reach the client, only once it ends. On the
H200 runs (simulator-validation-h200.md, session 38) SGLang's own GC warning logged one
such collection of 0.39 s over ~740,000 objects; clients saw the tokenizer manager stall
0.37-0.49 s once per server start, at its 824th to 1,060th request. ``POST /freeze_gc``
after the warm-up moves the start-up heap out of the collector's reach, and the stall went
away.

Python starts a full collection once the objects promoted to its oldest generation since the
last one exceed a quarter of those that survived it. The start-up heap sets the first
threshold, the serving heap the later ones, so the model has two counts: a pause of
``pause_s`` when the requests received since the server started reach ``first_reqs``, then
each further ``every_reqs`` (H200, bf16: the first at 834-1,060 requests over eleven probe
starts, the second 1,588 requests later; 0: no pauses). The pause starts when that request
arrives (its allocations trigger the collection). The scheduler is not paused; only the
requests' way in and the tokens' way out.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from simulator.errors import SimulatorInputError
from simulator.serving.request import SimRequest


@dataclass
class FrontEnd:
    first_reqs: int = 0
    every_reqs: int = 0
    pause_s: float = 0.0
    received: int = 0          # requests since the server started (warm-up and earlier runs)
    # invariant: pauses are disjoint and in time order (each starts at or after the last end)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("first_reqs", "every_reqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SimulatorInputError(
                    f"front-end GC {name}={v!r} must be an integer >= 0 (0: no pauses)")
        if not (isinstance(self.pause_s, (int, float)) and math.isfinite(self.pause_s)
                and self.pause_s >= 0):
            raise SimulatorInputError(
                f"front-end GC pause_s={self.pause_s!r} must be a number of seconds >= 0")
        if isinstance(self.received, bool) or not isinstance(self.received, int) \
                or self.received < 0:
            raise SimulatorInputError(
                f"requests received before the run ({self.received!r}) must be an integer >= 0")

    @property
    def pauses(self) -> bool:
        return self.first_reqs > 0 and self.pause_s > 0

    def describe(self) -> str:
        if not self.pauses:
            return "no pauses"
        then = f", then every {self.every_reqs}" if self.every_reqs else ""
        return f"{1e3 * self.pause_s:.0f} ms at request {self.first_reqs}{then}"

    def admit(self, now: float) -> float:
        """Count a request arriving at ``now``; the time it reaches the scheduler."""
        self.received += 1
        if self.pauses and self._collects(self.received):
            start = max(now, self.ends[-1]) if self.ends else now
            self.starts.append(start)
            self.ends.append(start + self.pause_s)
        return self.seen_at(now)

    def _collects(self, n: int) -> bool:
        """Whether the ``n``-th request since the start triggers a full collection."""
        if n == self.first_reqs:
            return True
        return bool(self.every_reqs) and n > self.first_reqs \
            and (n - self.first_reqs) % self.every_reqs == 0

    def seen_at(self, t: float) -> float:
        """When something the tokenizer manager gets at ``t`` gets through: the end of the
        pause ``t`` falls in (and of any pause that starts right at its end), else ``t``."""
        while True:
            i = bisect.bisect_right(self.starts, t) - 1
            if i < 0 or t >= self.ends[i]:
                return t
            t = self.ends[i]

    def hold_tokens(self, reqs: Iterable[SimRequest], since: float) -> None:
        """Move the first and last tokens that ``reqs`` streamed at or after ``since`` to when
        the tokenizer manager hands them on (nothing to do before the first pause: the
        replica calls this every step)."""
        if not self.starts:
            return
        for r in reqs:
            if r.first_token >= since:
                r.first_token = self.seen_at(r.first_token)
            if r.finish >= since:
                r.finish = self.seen_at(r.finish)
            if r.last_token >= since:
                r.last_token = self.seen_at(r.last_token)
