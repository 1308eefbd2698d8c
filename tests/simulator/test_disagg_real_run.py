"""The P/D model against the committed real run: SGLang 0.5.17 serving bf16 with
``--disaggregation-mode`` over Mooncake's TCP transport, both servers on one H200, and its
colocated control on the same machine (docs/disaggregation.md, "Measured: a real P/D run on
one H200"). These pin what docs/disaggregation.md states about it: a model change that moves
these numbers must update that page too."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.validation import disagg_real as dr

RUN = Path(__file__).resolve().parents[2] / "docs/data/h200-2026-11-28-session44/pd-one-gpu"
CALLS = [RUN / "call-pd", RUN / "call-coloc"]


@pytest.fixture(scope="module")
def idle_link() -> dict:
    return dr.validate(CALLS)


def _rows(result: dict, deployment: str) -> dict[tuple[float, str], dr.Row]:
    return {(r.rate, r.metric): r for r in dr.rows_of(result) if r.deployment == deployment}


def test_the_kv_bytes_sglang_sent_are_the_models_to_the_byte(idle_link):
    rows = _rows(idle_link, "pd")
    assert idle_link["shared_gpu"] is True and idle_link["gpu"] == "h200"
    for rate in (2.0, 4.0):
        assert abs(rows[(rate, "kv_mb")].error) < 1e-3


def test_the_colocated_control_is_within_the_stated_error(idle_link):
    # docs: colocated TTFT p50/p90 and TPOT p50/p90 within 11% at 2 and 4 req/s
    rows = _rows(idle_link, "colocated")
    for rate in (2.0, 4.0):
        for metric in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"):
            assert abs(rows[(rate, metric)].error) < 0.11, (rate, metric)


def test_the_idle_probe_link_underestimates_the_served_transfer(idle_link):
    # the gap the docs record: SGLang's transfers while serving run slower than the idle probe
    rows = _rows(idle_link, "pd")
    assert -0.35 < rows[(2.0, "kv_ms")].error < -0.15
    assert -0.50 < rows[(4.0, "kv_ms")].error < -0.30


def test_sglangs_own_speed_at_2_rps_predicts_the_held_out_4_rps_ttft():
    rows = _rows(dr.validate(CALLS, link_spec="sglang"), "pd")
    assert rows[(2.0, "kv_mb")].error == pytest.approx(0.0, abs=1e-3)
    for metric in ("ttft_p50_ms", "ttft_p90_ms"):
        assert abs(rows[(4.0, metric)].error) < 0.10, metric
