"""A service-level objective: per-request TTFT and TPOT limits and the fraction of requests
that must meet them (DistServe-style attainment)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.errors import SimulatorInputError


@dataclass(frozen=True)
class SLO:
    ttft_s: float = math.inf
    tpot_s: float = math.inf
    e2e_s: float = math.inf
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise SimulatorInputError(f"SLO {name}={v!r} must be > 0 seconds")
        if not 0 < self.attainment <= 1:
            raise SimulatorInputError(f"SLO attainment={self.attainment!r} must be in (0, 1]")
        if all(math.isinf(getattr(self, n)) for n in ("ttft_s", "tpot_s", "e2e_s")):
            raise SimulatorInputError("an SLO needs at least one of ttft, tpot or e2e limits")

    def describe(self) -> str:
        parts = []
        if math.isfinite(self.ttft_s):
            parts.append(f"TTFT<={self.ttft_s * 1e3:g}ms")
        if math.isfinite(self.tpot_s):
            parts.append(f"TPOT<={self.tpot_s * 1e3:g}ms")
        if math.isfinite(self.e2e_s):
            parts.append(f"E2E<={self.e2e_s:g}s")
        return " and ".join(parts) + f" for {self.attainment:.0%} of requests"
