"""A wall-clock budget: each step asks before it starts and is skipped or shortened (with a
printed reason) instead of overrunning the GPU call's hard limit."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_diffkv.bench.errors import BenchInputError


@dataclass
class Budget:
    """``total_s`` from construction; ``reserve_s`` is kept back for writing the results."""

    total_s: float
    reserve_s: float = 15.0
    clock: Callable[[], float] = time.monotonic
    t0: float = field(default=0.0)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.total_s > 0 and math.isfinite(self.total_s)):
            raise BenchInputError(f"budget {self.total_s!r} s must be a positive number")
        if self.reserve_s < 0:
            raise BenchInputError(f"budget reserve {self.reserve_s!r} s must be >= 0")
        self.t0 = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return self.total_s - self.reserve_s - self.elapsed()

    def fits(self, need_s: float) -> bool:
        return need_s <= self.left()

    def window(self, want_s: float, overhead_s: float, min_s: float) -> float | None:
        """The window a step may use: ``want_s`` if it fits with its overhead, else what is
        left (if at least ``min_s``), else None (skip)."""
        room = self.left() - overhead_s
        if room >= want_s:
            return want_s
        return room if room >= min_s else None

    def note(self, text: str) -> str:
        line = f"[budget {self.elapsed():6.0f}s/{self.total_s:.0f}s] {text}"
        self.notes.append(line)
        return line
