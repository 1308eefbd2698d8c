"""DiffKV tier mixes: which fraction of tokens each KV head keeps at the high tier, the low
tier, or prunes, and how that varies across heads and across requests.

Tokens inside the recent window (DiffKVConfig.window) are always high; the fractions apply to
the tokens outside it. A mix is either fixed (every head, every request) or a distribution:
``head_spread`` splits the heads into HEAD_CLASSES equal-share classes whose kept fraction is
the mean scaled by (1 + head_spread * z) at the class's normal quantile z (classes clipped at
1 give their excess to the others, so the mean kept fraction stays the mix's); ``request_spread``
scales each request's kept fraction by a draw from N(1, request_spread) clipped to [0.2, 1.8].
Kept fractions are clipped to [0, 1]; the high:low ratio of a class is the mean's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sglang_diffkv.serving_io.json_file import read_json
from simulator.errors import SimulatorInputError

HEAD_CLASSES = 4
# normal quantiles at (i + 0.5) / 4: equal-share classes of a standard normal
_CLASS_Z = (-1.1503493803760079, -0.31863936396437514, 0.31863936396437514, 1.1503493803760079)


def _clip_keep_mean(kept: np.ndarray, mean: float) -> np.ndarray:
    """Clip kept fractions to [0, 1] and scale the unclipped classes so the mean stays
    ``mean`` (the mix's kept fraction is what the user asked for)."""
    k = np.clip(kept, 0.0, 1.0)
    for _ in range(len(k)):
        free = k < 1.0
        gap = mean * len(k) - k.sum()
        if abs(gap) < 1e-12 or not free.any() or k[free].sum() == 0:
            break
        k[free] *= 1 + gap / k[free].sum()
        k = np.clip(k, 0.0, 1.0)
    return k


@dataclass(frozen=True)
class TierMix:
    high: float
    low: float
    head_spread: float = 0.0
    request_spread: float = 0.0
    # measured per-head (high, low) fractions, one entry per KV head (equal weights); when
    # given they replace the parametric head classes and high/low are their means
    heads: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for i, hl in enumerate(self.heads):
            if len(hl) != 2 or any(not (isinstance(x, (int, float)) and 0 <= x <= 1)
                                   for x in hl) or hl[0] + hl[1] > 1 + 1e-9:
                raise SimulatorInputError(
                    f"head {i}: fractions {hl!r} must be [high, low] in [0, 1] with high + low "
                    "<= 1")
        for name in ("high", "low", "head_spread", "request_spread"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise SimulatorInputError(f"mix {name}={v!r} must be a finite number >= 0")
        if self.high + self.low > 1 + 1e-9:
            raise SimulatorInputError(
                f"mix high={self.high} + low={self.low} = {self.high + self.low:g} exceeds 1; "
                "the rest (1 - high - low) is the pruned fraction"
            )
        if self.high + self.low <= 0:
            raise SimulatorInputError("mix keeps no token (high = low = 0); keep some tokens")
        if self.heads and self.head_spread:
            raise SimulatorInputError("give measured heads or head_spread, not both")

    @property
    def pruned(self) -> float:
        return max(0.0, 1.0 - self.high - self.low)

    @property
    def kept(self) -> float:
        return self.high + self.low

    @classmethod
    def parse(cls, text: str, head_spread: float = 0.0, request_spread: float = 0.0) -> TierMix:
        """'H,L' or 'H,L,P' as fractions (0.3,0.5,0.2) or percentages (30,50,20)."""
        try:
            parts = [float(x) for x in text.split(",")]
        except ValueError as e:
            raise SimulatorInputError(
                f"mix {text!r} must be 'high,low[,pruned]' numbers, e.g. 0.3,0.5,0.2"
            ) from e
        if len(parts) not in (2, 3):
            raise SimulatorInputError(f"mix {text!r} must have 2 or 3 numbers: high,low[,pruned]")
        if any(p > 1 for p in parts):  # percentages
            parts = [p / 100 for p in parts]
        if len(parts) == 3 and abs(sum(parts) - 1) > 1e-6:
            raise SimulatorInputError(f"mix {text!r}: high + low + pruned must be 1 (or 100)")
        return cls(parts[0], parts[1], head_spread, request_spread)

    @classmethod
    def from_heads(cls, heads: list[tuple[float, float]], request_spread: float = 0.0) -> TierMix:
        if not heads:
            raise SimulatorInputError("a measured mix needs at least one head")
        arr = np.asarray(heads, dtype=float)
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise SimulatorInputError("measured heads must be a list of [high, low] pairs")
        return cls(float(arr[:, 0].mean()), float(arr[:, 1].mean()), 0.0, request_spread,
                   tuple((float(h), float(lo)) for h, lo in arr))

    @classmethod
    def from_file(cls, path: str, request_spread: float = 0.0) -> TierMix:
        """JSON ``{"heads": [[high, low], ...]}`` (any number of heads, e.g. layers x KV heads
        flattened) or ``{"layers": [[[high, low] per head] per layer]}``."""
        from pathlib import Path

        p = Path(path)
        data = read_json(p, "mix file", SimulatorInputError)
        if isinstance(data, dict) and "heads" in data:
            heads = data["heads"]
        elif isinstance(data, dict) and "layers" in data:
            heads = [h for layer in data["layers"] for h in layer]
        else:
            raise SimulatorInputError(f"{p}: expected {{\"heads\": [[high, low], ...]}} or "
                                      "{\"layers\": [[[high, low], ...], ...]}")
        try:
            return cls.from_heads([tuple(h) for h in heads], request_spread)
        except (TypeError, ValueError) as e:
            raise SimulatorInputError(f"{p}: {e}") from e

    def class_fractions(self) -> np.ndarray:
        """(2, K) array: high and low fraction of each head class (equal shares)."""
        if self.heads:
            return np.asarray(self.heads, dtype=float).T.copy()
        if self.head_spread == 0:
            return np.array([[self.high], [self.low]], dtype=float)
        scale = np.clip(1 + self.head_spread * np.array(_CLASS_Z), 0.0, None)
        kept = _clip_keep_mean(self.kept * scale, self.kept)
        share_high = self.high / self.kept
        return np.stack([kept * share_high, kept * (1 - share_high)])

    def request_fractions(self, rng: np.random.Generator) -> np.ndarray:
        """One request's (2, K) fractions."""
        base = self.class_fractions()
        if self.request_spread == 0:
            return base
        s = float(np.clip(rng.normal(1.0, self.request_spread), 0.2, 1.8))
        kept = np.clip(base.sum(axis=0) * s, 0.0, 1.0)
        frac_high = np.divide(base[0], base.sum(axis=0), out=np.zeros_like(base[0]),
                              where=base.sum(axis=0) > 0)
        return np.stack([kept * frac_high, kept * (1 - frac_high)])

    def describe(self) -> str:
        s = f"{self.high:.0%}/{self.low:.0%}/{self.pruned:.0%} high/low/pruned"
        if self.heads:
            s += f" (mean of {len(self.heads)} measured heads)"
        if self.head_spread:
            s += f", head spread {self.head_spread:g}"
        if self.request_spread:
            s += f", request spread {self.request_spread:g}"
        return s
