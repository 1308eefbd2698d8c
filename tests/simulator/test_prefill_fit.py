"""Fitting the prefill-only costs from back-to-back SGLang Prefill lines (their rows in the
joint step fit, ``step_fit``) recovers a known per-step / per-request / per-token cost over the
model's own prefill step; too few or artefact samples give a clear error."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from simulator.specs.calibration import load_calibration
from simulator.validation.fit import calibration_file, prefill_samples, prefill_shape
from simulator.validation.step_fit import fit_step_costs, step_rows

TRUE = {"prefill_step_overhead_s": 0.02, "prefill_seq_overhead_s": 5e-4,
        "prefill_token_overhead_s": 3e-6}


def _server(**prefill):
    cal = replace(load_calibration("h100"), **prefill)
    return replace(scenario(), calibration=cal).server("bf16")


def _log(tmp_path, shapes, artefact_after=None, decode_between=False):
    """Prefill lines as SGLang writes them: line i's input throughput is line i-1's new tokens
    over line i-1's step time (true costs added to the model's step, back to back)."""
    srv = _server()
    lines = ["max_total_num_tokens=400000, chunked_prefill_size=-1"]
    prev = None
    for i, (n, t) in enumerate(shapes):
        thr = 0.0
        if prev is not None:
            pn, pt = prev
            dur = (srv.cost.step_time(replace(prefill_shape(srv, pn, pt, 0), prefill_gap_s=0.0))
                   + TRUE["prefill_step_overhead_s"] + TRUE["prefill_seq_overhead_s"] * pn
                   + TRUE["prefill_token_overhead_s"] * pt)
            thr = pt / dur
            if artefact_after is not None and i - 1 == artefact_after:
                thr *= 30          # an overlap-pipeline gap: far too short for the step
        lines.append(f"[2026-11-22 12:00:{i:02d}] Prefill batch, #new-seq: {n}, #new-token: "
                     f"{t}, #cached-token: 0, token usage: 0.01, #running-req: {8 * i}, "
                     f"#queue-req: 100, cuda graph: False, input throughput (token/s): "
                     f"{thr:.2f}")
        if decode_between:
            lines.append(f"[2026-11-22 12:00:{i:02d}] Decode batch, #running-req: 8, #token: "
                         "4000, token usage: 0.01, cuda graph: True, gen throughput "
                         "(token/s): 900.00, #queue-req: 0")
        prev = (n, t)
    p = tmp_path / "server.log"
    p.write_text("\n".join(lines) + "\n")
    return parse_server_log(p)


def _varied():
    rng = np.random.default_rng(0)
    return [(int(rng.integers(1, 48)), int(rng.integers(500, 16000))) for _ in range(14)]


def test_parser_keeps_prefill_timing(tmp_path):
    log = _log(tmp_path, [(2, 1000), (4, 3000), (1, 500)])
    assert log.prefill_new_seqs == [2, 4, 1]
    assert log.prefill_after_prefill == [False, True, True]
    assert np.isnan(log.prefill_input_throughput).sum() == 0
    s = prefill_samples(log)
    assert s.shape == (2, 5) and list(s[:, 0]) == [2, 4] and list(s[:, 1]) == [1000, 3000]


def _fit(tmp_path, shapes, server=None, **log_kw):
    srv = server or _server()
    return fit_step_costs(srv, step_rows(srv, _log(tmp_path, shapes, **log_kw), "burst", True))


def test_fit_recovers_known_costs(tmp_path):
    shapes = _varied()
    fit = _fit(tmp_path, shapes, artefact_after=5)
    assert len(fit["dropped"]) == 1 and fit["rows"] == len(shapes) - 2
    for k, v in TRUE.items():
        assert fit[k] == pytest.approx(v, rel=1e-3), k
    assert fit["mape"] < 1e-4 < fit["mape_before"]
    assert set(fit["fitted"]) == set(TRUE)
    # no decode rows: the decode costs and the attention scale keep the calibration's
    cal = _server().deployment.calibration
    assert fit["decode_attention_scale"] == cal.decode_attention_scale
    assert fit["step_overhead_s"] == cal.step_overhead_s


def test_burst_rows_run_back_to_back_at_the_grids_clocks(tmp_path):
    """A burst's steps follow each other: a calibration's isolated_prefill_scale (a step
    alone, below the power limit) leaves their fit unchanged."""
    fit = _fit(tmp_path, _varied(), server=_server(isolated_prefill_scale=0.9))
    for k, v in TRUE.items():
        assert fit[k] == pytest.approx(v, rel=1e-3), k


def test_fit_residual_is_over_existing_costs(tmp_path):
    """Costs already in the calibration are not charged twice: the fit starts from the model's
    step without them, and a calibration that already holds the truth fits it again."""
    fit = _fit(tmp_path, _varied(), server=_server(**TRUE))
    assert fit["mape_before"] < 1e-4
    for k, v in TRUE.items():
        assert fit[k] == pytest.approx(v, rel=1e-3), k


def test_one_shape_charges_the_residual_per_token_and_keeps_the_step_cost(tmp_path):
    given = {"prefill_step_overhead_s": TRUE["prefill_step_overhead_s"]}
    fit = _fit(tmp_path, [(32, 16400)] * 10, server=_server(**given))
    assert fit["fitted"] == ["prefill_token_overhead_s"]
    assert fit["prefill_step_overhead_s"] == TRUE["prefill_step_overhead_s"]
    per_token = TRUE["prefill_token_overhead_s"] + TRUE["prefill_seq_overhead_s"] * 32 / 16400
    assert fit["prefill_token_overhead_s"] == pytest.approx(per_token, rel=1e-3)
    srv = _server(**given)
    data = calibration_file(srv, {**fit, "how": "fitted from x.log"}, "x.log")
    entry = data["gpus"][srv.deployment.gpu.key]
    assert entry["prefill_token_overhead_s"] == fit["prefill_token_overhead_s"]
    assert entry["prefill_step_overhead_s"] == TRUE["prefill_step_overhead_s"]
    assert entry["provenance"]["fixed_costs"] == "fitted from x.log"


def test_too_few_samples_raise_and_interleaved_steps_are_timed_by_their_interval(tmp_path):
    with pytest.raises(InputError, match="need at least 8 timed intervals"):
        _fit(tmp_path, _varied()[:4])
    # a Decode line after each Prefill line: no back-to-back pair, so no burst rows; each
    # prefill step is timed inside its Decode interval instead
    srv = _server()
    rows = step_rows(srv, _log(tmp_path, _varied(), decode_between=True), "x", True)
    assert prefill_samples(_log(tmp_path, _varied(), decode_between=True)).shape[0] == 0
    assert set(rows.kind) == {"prefill-interval"} and len(rows) == len(_varied()) - 1
