"""Length distributions for synthetic traces: empirical quantile tables or lognormals, with an
optional correlation between log input and log output lengths.

Sampling draws correlated standard normals and maps each coordinate through its marginal's
inverse CDF by rank, so the marginals are exactly the fitted ones and the rank correlation is
close to ``log_corr``. Everything is seeded by the caller's numpy Generator.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from simulator.errors import SimulatorInputError

QUANTILE_POINTS = 101  # p0, p1, ..., p100


@dataclass(frozen=True)
class Marginal:
    """One length distribution: an increasing quantile table (p0..p100) or a lognormal
    (mu, sigma) clipped to [low, high]."""

    quantiles: tuple[float, ...] = ()
    mu: float = 0.0
    sigma: float = 0.0
    low: int = 1
    high: int = 1_000_000

    def __post_init__(self) -> None:
        if self.quantiles:
            q = self.quantiles
            if len(q) != QUANTILE_POINTS or any(b < a for a, b in zip(q, q[1:], strict=False)):
                raise SimulatorInputError(
                    f"a quantile table needs {QUANTILE_POINTS} non-decreasing values, got {len(q)}"
                )
            if q[0] < 1:
                raise SimulatorInputError(f"lengths must be >= 1; quantile table starts at {q[0]}")
        elif not (self.sigma >= 0 and math.isfinite(self.mu)):
            raise SimulatorInputError(f"lognormal needs finite mu and sigma >= 0, got "
                                      f"mu={self.mu}, sigma={self.sigma}")
        if not 1 <= self.low <= self.high:
            raise SimulatorInputError(
                f"clip range [{self.low}, {self.high}] must have 1 <= low <= high")

    def from_uniform(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF at probabilities ``u`` in (0, 1), as integers in [low, high]."""
        if self.quantiles:
            grid = np.linspace(0.0, 1.0, QUANTILE_POINTS)
            # interpolate in log space: lengths are heavy-tailed
            x = np.exp(np.interp(u, grid, np.log(np.asarray(self.quantiles, dtype=float))))
        else:
            x = np.exp(self.mu + self.sigma * _norm_ppf(u))
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        if self.quantiles:
            return {"quantiles": list(self.quantiles), "low": self.low, "high": self.high}
        return {"mu": self.mu, "sigma": self.sigma, "low": self.low, "high": self.high}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Marginal:
        if "quantiles" in d:
            return cls(quantiles=tuple(float(x) for x in d["quantiles"]),
                       low=int(d.get("low", 1)), high=int(d.get("high", 1_000_000)))
        return cls(mu=float(d["mu"]), sigma=float(d["sigma"]), low=int(d.get("low", 1)),
                   high=int(d.get("high", 1_000_000)))

    @classmethod
    def fit(cls, values: np.ndarray) -> Marginal:
        v = np.asarray(values, dtype=float)
        q = np.percentile(v, np.linspace(0, 100, QUANTILE_POINTS))
        return cls(quantiles=tuple(round(float(x), 2) for x in q), low=int(v.min()),
                   high=int(v.max()))


def _norm_ppf(u: np.ndarray) -> np.ndarray:
    """Standard normal inverse CDF (Acklam's rational approximation, |rel err| < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00)
    u = np.clip(np.asarray(u, dtype=float), 1e-12, 1 - 1e-12)
    out = np.empty_like(u)
    lo, hi = u < 0.02425, u > 1 - 0.02425
    mid = ~(lo | hi)
    q = np.sqrt(-2 * np.log(u[lo]))
    out[lo] = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
        (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = np.sqrt(-2 * np.log(1 - u[hi]))
    out[hi] = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
        (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = u[mid] - 0.5
    r = q * q
    out[mid] = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    return out


@dataclass(frozen=True)
class LengthModel:
    """Joint (input, output) length distribution of one workload."""

    name: str
    input: Marginal
    output: Marginal
    log_corr: float = 0.0
    source: str = ""
    rate_rps: float | None = None
    interarrival_cv: float | None = None

    def __post_init__(self) -> None:
        if not -1.0 < self.log_corr < 1.0:
            raise SimulatorInputError(f"log_corr={self.log_corr} must be in (-1, 1)")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if n < 1:
            raise SimulatorInputError(f"number of requests n={n} must be >= 1")
        z = rng.standard_normal((n, 2))
        z[:, 1] = self.log_corr * z[:, 0] + math.sqrt(1 - self.log_corr**2) * z[:, 1]
        # rank -> uniform keeps the marginals exact while keeping the rank correlation
        u = (np.argsort(np.argsort(z, axis=0), axis=0) + 0.5) / n
        if n < 50:  # ranks of a tiny sample are too coarse; use the normal CDF directly
            u = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
        return self.input.from_uniform(u[:, 0]), self.output.from_uniform(u[:, 1])

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "input": self.input.to_dict(),
                "output": self.output.to_dict(), "log_corr": self.log_corr,
                "rate_rps": self.rate_rps, "interarrival_cv": self.interarrival_cv}

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> LengthModel:
        return cls(name=name, input=Marginal.from_dict(d["input"]),
                   output=Marginal.from_dict(d["output"]), log_corr=float(d.get("log_corr", 0)),
                   source=str(d.get("source", "")), rate_rps=d.get("rate_rps"),
                   interarrival_cv=d.get("interarrival_cv"))


def _fits_json() -> dict[str, Any]:
    text = resources.files("simulator.workload").joinpath("length_fits.json").read_text()
    return json.loads(text)


def length_model_names() -> list[str]:
    return sorted(k for k in _fits_json() if not k.startswith("_"))


def length_model(name: str) -> LengthModel:
    fits = _fits_json()
    if name not in fits or name.startswith("_"):
        raise SimulatorInputError(
            f"unknown length model {name!r}; available: {', '.join(length_model_names())}"
        )
    return LengthModel.from_dict(name, fits[name])
