"""Arrival processes (seeded): Poisson, Gamma with a given coefficient of variation, all at once;
``resample_arrivals`` re-times a trace's requests with one.

Gamma inter-arrivals use shape k = 1/CV^2 and scale CV^2/rate (mean 1/rate, CV as given), as in
DistServe and Vidur; CV = 1 is Poisson. The first request arrives at t = 0.
"""

from __future__ import annotations

import math

import numpy as np

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace


def _check(rate: float, n: int) -> None:
    if n < 1:
        raise InputError(f"number of requests n={n} must be >= 1")
    if not (rate > 0):
        raise InputError(f"rate={rate!r} must be > 0 requests/s (use inf for all at once)")


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    return gamma_arrivals(rate, 1.0, n, rng)


def gamma_arrivals(rate: float, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    _check(rate, n)
    if not (cv > 0 and math.isfinite(cv)):
        raise InputError(f"cv={cv!r} must be a positive number")
    if math.isinf(rate):
        return np.zeros(n)
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, (cv**2) / rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def resample_arrivals(trace: Trace, rate: float, seed: int, cv: float = 1.0) -> Trace:
    """The trace's lengths (in order) with new Gamma(cv) arrivals at ``rate``."""
    rng = np.random.default_rng(seed)
    arr = gamma_arrivals(rate, cv, len(trace), rng)
    tag = "inf" if math.isinf(rate) else f"{rate:g}"
    return trace.with_arrivals(arr.tolist(), name=f"{trace.name}@{tag}rps")
