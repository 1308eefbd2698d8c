"""The metric refinement of fitted step costs (simulator/validation/refine.py): its optimiser,
its capped loss, and a refinement that recovers a hidden cost from metric rows alone."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from simulator.errors import SimulatorInputError
from simulator.specs.calibration import load_calibration
from simulator.validation.harness import row
from simulator.validation.refine import (
    first_token_latency_guess,
    metric_loss,
    nelder_mead,
    refine_costs,
    with_terms,
)


def test_nelder_mead_finds_the_minimum_of_a_shifted_quadratic():
    rng = np.random.default_rng(3)
    centre = rng.uniform(-2.0, 5.0, size=3)
    weights = rng.uniform(0.5, 3.0, size=3)
    calls = []

    def f(x):
        calls.append(1)
        return float(np.sum(weights * (x - centre) ** 2)) + 0.7

    x, fx, evals = nelder_mead(f, np.zeros(3), np.ones(3), max_evals=600, ftol=1e-12)
    assert x == pytest.approx(centre, abs=1e-3)
    assert fx == pytest.approx(0.7, abs=1e-5)
    assert evals == len(calls) <= 600


def test_nelder_mead_stops_at_its_budget():
    x, _, evals = nelder_mead(lambda x: float(np.sum(x ** 2)), np.full(4, 9.0), np.ones(4),
                              max_evals=20)
    assert evals <= 20 + 4  # a shrink may finish its sweep
    assert np.sum(x ** 2) < 4 * 81.0


def test_metric_loss_counts_rows_with_targets_and_grows_slowly_far_off():
    rows = [row("TPOT mean (ms)", "a", 10.0, 10.5, 0.05),       # z = 1
            row("TTFT mean (ms)", "a", 100.0, 50.0, 0.10),       # z = -5
            row("TTFT mean (ms)", "b", 100.0, 90.0, None),       # no target: left out
            row("KV pool tokens", "c", 1000.0, 900.0, 0.01)]     # start-up arithmetic
    loss, n = metric_loss(rows)
    assert n == 2
    assert loss == pytest.approx(math.log(2.0) + math.log(26.0))
    # ten times further off costs less than three times as much: one unreachable row cannot
    # outweigh the rest, but it still has a slope
    near = metric_loss([row("TTFT mean (ms)", "a", 100.0, 150.0, 0.10)])[0]   # z = 5
    far = metric_loss([row("TTFT mean (ms)", "a", 100.0, 600.0, 0.10)])[0]    # z = 50
    assert near < far < 3 * near


def test_a_fit_target_counts_a_row_the_validation_gives_no_target():
    burst = row("TTFT mean (ms)", "b", 100.0, 90.0, None)   # saturation: no verdict
    assert metric_loss([burst]) == (0.0, 0)
    loss, n = metric_loss([{**burst, "fit_target": 0.10}])   # z = -1
    assert n == 1 and loss == pytest.approx(math.log(2.0))
    # a real target wins over the fit target
    both = {**row("TPOT mean (ms)", "a", 10.0, 10.5, 0.05), "fit_target": 0.5}
    assert metric_loss([both])[0] == pytest.approx(math.log(2.0))


def _calibration():
    return load_calibration("h100")


def test_with_terms_moves_per_format_attention_factors_by_the_same_ratio():
    base = replace(_calibration(), decode_attention_scale=0.8,
                   decode_attention_scale_by_format={"fp8": 0.9})
    c = with_terms(base, {"decode_attention_scale": 0.4, "step_overhead_s": 2e-3})
    assert c.decode_attention_scale == pytest.approx(0.4)
    assert c.decode_attention_scale_by_format["fp8"] == pytest.approx(0.45)
    assert c.step_overhead_s == pytest.approx(2e-3)


def test_refinement_recovers_hidden_costs_from_metric_rows():
    """A stand-in 'simulation': TPOT and TTFT follow two costs linearly; the measured rows
    come from hidden values, the start is off by 2-3x, and the refinement finds them."""
    rng = np.random.default_rng(11)
    hidden_step, hidden_prefill = rng.uniform(0.5e-3, 2e-3), rng.uniform(10e-3, 40e-3)

    def metrics(step, prefill):
        return (8e-3 + 3.0 * step + 0.05 * prefill, 20e-3 + 0.5 * step + 1.2 * prefill)

    measured = metrics(hidden_step, hidden_prefill)
    seen = []

    def evaluate(c):
        seen.append((c.step_overhead_s, c.prefill_step_overhead_s))
        tpot, ttft = metrics(c.step_overhead_s, c.prefill_step_overhead_s)
        return [row("TPOT mean (ms)", "fit", measured[0], tpot, 0.05),
                row("TTFT mean (ms)", "fit", measured[1], ttft, 0.10)]

    start = with_terms(_calibration(), {"step_overhead_s": 3 * hidden_step,
                                        "prefill_step_overhead_s": hidden_prefill / 2})
    names = ("step_overhead_s", "prefill_step_overhead_s")
    refined, how = refine_costs(start, names, evaluate, max_evals=200)
    assert refined.step_overhead_s == pytest.approx(hidden_step, rel=0.02)
    assert refined.prefill_step_overhead_s == pytest.approx(hidden_prefill, rel=0.02)
    assert how.loss_after < 1e-3 < how.loss_before
    assert how.rows == 2 and how.evaluations <= 200 + len(names)
    assert min(min(s) for s in seen) >= 0.0  # terms never go negative
    assert "step_overhead_s" in how.note() and "->" in how.note()


def test_refinement_never_returns_worse_than_its_start():
    start = _calibration()

    def evaluate(c):  # already optimal at the start; anything else is worse
        off = abs(c.step_overhead_s - start.step_overhead_s) * 1e4
        return [row("TPOT mean (ms)", "fit", 1.0, 1.0 + off, 0.05)]

    refined, how = refine_costs(start, ("step_overhead_s",), evaluate, max_evals=30)
    assert refined.step_overhead_s == pytest.approx(start.step_overhead_s)
    assert how.loss_after == how.loss_before == 0.0


def test_bad_refinement_requests_are_named():
    c = _calibration()
    ok = [row("TPOT mean (ms)", "fit", 1.0, 1.1, 0.05)]
    with pytest.raises(SimulatorInputError, match="eta_mem_gemm"):
        refine_costs(c, ("eta_mem_gemm",), lambda _: ok)
    with pytest.raises(SimulatorInputError, match="max_evals 2"):
        refine_costs(c, ("step_overhead_s", "seq_overhead_s"), lambda _: ok, max_evals=2)
    with pytest.raises(SimulatorInputError, match="no metric row"):
        refine_costs(c, ("step_overhead_s",), lambda _: [row("x", "fit", 1.0, 1.0, None)])


def test_first_token_latency_starts_at_the_open_loop_ttft_residual():
    rows = [row("TTFT mean (ms)", "a", 40.0, 28.0, 0.10),
            row("TTFT mean (ms)", "b", 50.0, 41.0, 0.10),
            row("TTFT mean (ms)", "c", 45.0, 30.0, 0.10),
            row("TTFT mean (ms)", "burst", 9000.0, 5000.0, None),   # no target: queueing
            row("TPOT mean (ms)", "a", 10.0, 2.0, 0.05)]
    assert first_token_latency_guess(rows) == pytest.approx(12e-3)
    assert first_token_latency_guess([row("TTFT mean (ms)", "a", 30.0, 35.0, 0.1)]) == 0.0
    assert first_token_latency_guess(rows[3:]) == 0.0
