"""Refine a backend's fitted step costs on what the planner predicts: the fitting runs'
metrics (throughput, mean batch, TPOT, TTFT), not their log intervals.

Why: the interval fit (``step_fit.py``) fits each Decode interval's wall time. On a backend
whose prefill steps are host-bound and long (DiffKV: 25-45 ms a step), a prefill lands in
the wrong interval of the log as often as not (the overlap scheduler logs a step late), the
fit drops those rows as outliers, and its in-sample metric errors stay large: on the DiffKV
12 req/s fitting ladder, TPOT -11.8%, TTFT -19.4% and batch -10.7%, although the interval
MAPE is 5.5%. What a capacity plan needs is the metrics, so this step moves the fitted terms
until the fitting runs' simulated metrics match their measured ones.

How: starting from the interval fit, Nelder-Mead over the terms the interval fit determined
(non-negative), minimising ``sum rho(error / target)`` over the fitting runs' metric rows,
each simulated whole (``evaluate``). ``rho`` is the Cauchy loss ``log(1 + z^2)``: quadratic
near zero, and for a row many target widths off its pull fades (``2 z / (1 + z^2)``) without
vanishing, so one fitting row that no setting of the terms can reach (a server that ran slow
throughout) cannot drag the rest, yet a row far off at the start is still brought in.
Only fitting runs are simulated: validated runs stay held out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from simulator.errors import SimulatorInputError
from simulator.specs.calibration import Calibration

DEFAULT_MAX_EVALS = 300  # simulations of the fitting runs (a few seconds each)
INITIAL_STEP = 0.3       # the simplex's first step: 30% of a term, at least one unit

# the terms that can be refined, with the unit a simplex step is measured in
UNITS: dict[str, float] = {
    "step_overhead_s": 1e-3,
    "seq_overhead_s": 1e-6,
    "prefill_step_overhead_s": 1e-3,
    "prefill_seq_overhead_s": 1e-3,
    "prefill_token_overhead_s": 1e-6,
    "release_overhead_s": 1e-3,
    "eager_decode_layer_overhead_s": 1e-5,
    "decode_attention_scale": 0.1,
    "first_token_latency_s": 1e-3,
}
TTFT_METRIC = "TTFT mean (ms)"


def first_token_latency_guess(rows: Sequence[dict[str, Any]]) -> float:
    """A start for ``first_token_latency_s`` (seconds): the median of measured - predicted
    TTFT over the open-loop rows (those with a TTFT target; a burst's TTFT is queueing),
    at least 0. The interval fit cannot see it: no server log line times a first token."""
    gaps = [r["measured"] - r["predicted"] for r in rows
            if r["metric"] == TTFT_METRIC and r.get("target") is not None
            and r.get("measured") is not None and r.get("predicted") is not None]
    return max(0.0, float(np.median(gaps))) / 1e3 if gaps else 0.0


def metric_loss(rows: Sequence[dict[str, Any]]) -> tuple[float, int]:
    """(loss, rows counted) over the rows with a target and an error, the KV pool left out
    (start-up arithmetic: no step cost moves it). A row's ``fit_target``, where it has one,
    stands in for a missing target: a metric no plan is validated on but a fit may read."""
    total, n = 0.0, 0
    for r in rows:
        target = r.get("target") or r.get("fit_target")
        if target is None or r.get("error") is None or r["metric"] == "KV pool tokens":
            continue
        z = r["error"] / target
        total += math.log1p(z * z)
        n += 1
    return total, n


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, steps: np.ndarray,
                max_evals: int, ftol: float = 1e-4) -> tuple[np.ndarray, float, int]:
    """Minimise ``f`` from ``x0`` (simplex edges ``steps``): (x, f(x), evaluations). Standard
    coefficients (reflection 1, expansion 2, contraction 1/2, shrink 1/2); stops after
    ``max_evals`` evaluations or when the simplex's values agree within ``ftol``."""
    n = len(x0)
    simplex = [np.asarray(x0, float)] + [x0 + np.eye(n)[i] * steps[i] for i in range(n)]
    values = [f(x) for x in simplex]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] <= ftol * (abs(values[0]) + ftol):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        evals += 1
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * ((xr if fr < values[-1] else simplex[-1]) - centroid)
            fc = f(xc)
            evals += 1
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = xc, fc
            else:
                for i in range(1, n + 1):
                    simplex[i] = simplex[0] + 0.5 * (simplex[i] - simplex[0])
                    values[i] = f(simplex[i])
                evals += n
    best = int(np.argmin(values))
    return simplex[best], values[best], evals


@dataclass(frozen=True)
class Refinement:
    """What the refinement did: the terms before and after, the loss, the effort."""

    names: tuple[str, ...]
    before: dict[str, float]
    after: dict[str, float]
    loss_before: float
    loss_after: float
    rows: int
    evaluations: int

    def note(self) -> str:
        def show(name: str, v: float) -> str:
            if name == "decode_attention_scale":
                return f"x{v:.3f}"
            unit, label = ((1e-3, "ms") if UNITS[name] >= 1e-3 else (1e-6, "us"))
            return f"{v / unit:.3g} {label}"
        moved = "; ".join(f"{n} {show(n, self.before[n])} -> {show(n, self.after[n])}"
                          for n in self.names)
        return (f"refined on the fitting runs' {self.rows} metric rows (loss "
                f"{self.loss_before:.2f} -> {self.loss_after:.2f}, {self.evaluations} "
                f"simulations): {moved}")


def with_terms(calib: Calibration, terms: dict[str, float]) -> Calibration:
    """``calib`` with the given step-cost terms; a new ``decode_attention_scale`` moves the
    per-format factors by the same ratio (the fit's ratios between formats are kept)."""
    changes: dict[str, Any] = {k: v for k, v in terms.items() if k != "decode_attention_scale"}
    if "decode_attention_scale" in terms:
        new = terms["decode_attention_scale"]
        ratio = new / calib.decode_attention_scale if calib.decode_attention_scale else 1.0
        changes["decode_attention_scale"] = new
        changes["decode_attention_scale_by_format"] = {
            k: v * ratio for k, v in calib.decode_attention_scale_by_format.items()}
    return replace(calib, **changes)


def refine_costs(calib: Calibration, names: Sequence[str],
                 evaluate: Callable[[Calibration], list[dict[str, Any]]],
                 max_evals: int = DEFAULT_MAX_EVALS) -> tuple[Calibration, Refinement]:
    """Move the terms ``names`` of ``calib`` to minimise ``metric_loss(evaluate(c))``, where
    ``evaluate`` simulates the fitting runs with calibration ``c`` and returns their rows
    (with targets). Terms stay >= 0; the result is never worse than ``calib``."""
    unknown = [n for n in names if n not in UNITS]
    if unknown:
        raise SimulatorInputError(f"cannot refine {', '.join(unknown)}: the refinable terms "
                                  f"are {', '.join(UNITS)}")
    if max_evals < len(names) + 2:
        raise SimulatorInputError(f"max_evals {max_evals} must be at least "
                                  f"{len(names) + 2} for {len(names)} terms")
    names = tuple(names)
    if not names:
        return calib, Refinement((), {}, {}, 0.0, 0.0, 0, 0)
    before = {n: float(getattr(calib, n) if n != "eager_decode_layer_overhead_s"
                       else calib.eager_decode_layer_s) for n in names}
    units = np.array([UNITS[n] for n in names])
    x0 = np.array([before[n] for n in names]) / units
    loss0, rows = metric_loss(evaluate(calib))
    if not rows:
        raise SimulatorInputError("the fitting runs have no metric row with a target to "
                                  "refine the step costs on")

    def terms(x: np.ndarray) -> dict[str, float]:
        return {n: float(max(v, 0.0) * u) for n, v, u in zip(names, x, units, strict=True)}

    def key(x: np.ndarray) -> tuple[float, ...]:
        return tuple(np.round(np.maximum(x, 0.0), 9))

    cache: dict[tuple[float, ...], float] = {key(x0): loss0}

    def loss(x: np.ndarray) -> float:
        if key(x) not in cache:
            cache[key(x)] = metric_loss(evaluate(with_terms(calib, terms(x))))[0]
        return cache[key(x)]

    steps = np.maximum(INITIAL_STEP * np.abs(x0), 1.0)
    x, fx, evals = nelder_mead(loss, x0, steps, max_evals)
    if fx >= loss0:
        x, fx = x0, loss0
    after = terms(x)
    return with_terms(calib, after), Refinement(names, before, after, loss0, fx, rows, evals)
