"""The CPU parts of the sustained-prefill probe (simulator/calibration/sustained_prefill.py):
the model column, nvidia-smi parsing and argument errors; and the cost model's extend time of a
burst's multi-sequence chunk against its H200 measurement (the extend-mix probe,
scripts/probe_extend_mix.py in commit 8dc2c27). Their GPU timings live in benchmarks.md."""

from __future__ import annotations

import importlib

import pytest
from sim_helpers import ROOT

sustained = importlib.import_module("simulator.calibration.sustained_prefill")
H200_CALIBRATION = ROOT / "docs" / "data" / "h200-2026-11-24" / "calibration" / "calibration.json"


def _extend_s(cost, chunk: list[tuple[int, int]]) -> float:
    """The cost model's time of one layer's extend over ``chunk`` ((new, past) per sequence)."""
    pairs = sum(e * p + e * e / 2 for e, p in chunk)
    return cost.prefill_attention_time(sum(e for e, _ in chunk), sum(p for _, p in chunk),
                                       pairs, len(chunk), tuple(chunk))


def test_a_bursts_multi_sequence_chunk_costs_what_the_h200_measured():
    cost = sustained.bf16_server("llama-3-8b", "h200", str(H200_CALIBRATION)).cost
    late = [(1, 7999), (8000, 0), (191, 0)]
    # the measured 8.77 ms of this chunk on an H200 (benchmarks.md, session 20)
    assert _extend_s(cost, late) == pytest.approx(8.77e-3, rel=0.05)
    assert _extend_s(cost, late) > 2.5 * _extend_s(cost, [(8000, 0)])


def test_smi_samples_parse_nvidia_smi_csv(tmp_path):
    f = tmp_path / "smi.csv"
    f.write_text("timestamp, clocks.sm [MHz], power.draw [W], temperature.gpu, "
                 "clocks_event_reasons.active\n"
                 "2026/11/24 17:02:56.125, 1980 MHz, 312.50 W, 41, 0x0000000000000000\n"
                 "2026/11/24 17:02:56.175, 1538 MHz, 692.80 W, 55, 0x0000000000000004\n"
                 "garbage line\n")
    rows = sustained.smi_samples(f)
    assert [r["sm_mhz"] for r in rows] == [1980.0, 1538.0]
    assert rows[1]["power_w"] == 692.8
    assert rows[1]["t"] - rows[0]["t"] == pytest.approx(0.05)
    assert sustained.during(rows, rows[1]["t"] - 0.01, rows[1]["t"] + 0.01, "sm_mhz") == 1538.0
    assert sustained.during(rows, 0.0, 1.0, "sm_mhz") is None


def test_sustained_probe_rejects_a_shape_that_does_not_split():
    with pytest.raises(SystemExit, match="8192x20"):
        sustained.main(["--out", "/nonexistent", "--shapes", "8192x20"])


def test_sustained_probe_models_the_dense_step():
    one = sustained.modelled_ms("llama-3-8b", "h200", None, 8000, 1)
    twenty = sustained.modelled_ms("llama-3-8b", "h200", None, 8000, 20)
    assert 0 < twenty < one         # the same GEMMs, a twentieth of the causal attention


def test_duty_patterns_parse_and_bad_ones_name_the_term():
    assert sustained.parse_duty("1x4,2x0,0x1") == [(1, 4), (2, 0), (0, 1)]
    assert sustained.parse_duty("") == []
    for bad in ("1x", "0x0", "-1x3", "ax2"):
        with pytest.raises(SystemExit, match="--duty"):
            sustained.parse_duty(bad)
    with pytest.raises(SystemExit, match="--duty-shape 2048x3"):
        sustained.main(["--out", "/nonexistent", "--duty", "1x4", "--duty-shape", "2048x3"])


def test_duty_summary_measures_the_second_half():
    # first half: prefill steps alone (slow clocks would show late); second half: one 40-ms
    # prefill then three 4-ms decode steps, back to back
    steps, t = [], 0.0
    for _ in range(10):
        steps.append(("prefill", t, 30.0))
        t += 0.030
    for _ in range(10):
        steps.append(("prefill", t, 40.0))
        t += 0.040
        for _ in range(3):
            steps.append(("decode", t, 4.0))
            t += 0.004
    sm = sustained.duty_summary(steps)
    assert sm["prefill_ms"] == 40.0
    assert sm["decode_ms"] == 4.0
    assert sm["prefill_share"] == pytest.approx(40 / 52, rel=0.05)
