"""Scoring against the mean of repeated runs: who groups with whom, and the arithmetic."""

import pytest

from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.validation.harness import row
from simulator.validation.repeats import (
    group_label,
    repeat_key,
    repeat_rows,
    request_lengths_digest,
)


def _trace(lengths, spacing=0.1):
    return Trace(tuple(TraceRequest(arrival_s=i * spacing, input_tokens=a, output_tokens=b)
                       for i, (a, b) in enumerate(lengths)))


def test_the_key_ignores_arrival_times_but_not_lengths_rate_or_config():
    a = _trace([(100, 20), (7, 300)])
    assert request_lengths_digest(a) == request_lengths_digest(_trace([(100, 20), (7, 300)],
                                                                      spacing=0.1004))
    assert request_lengths_digest(a) != request_lengths_digest(_trace([(100, 21), (7, 300)]))
    assert request_lengths_digest(a) != request_lengths_digest(_trace([(7, 300), (100, 20)]))
    k = repeat_key("bf16", "ladder", 15.3504, a)
    assert k == repeat_key("bf16", "ladder", 15.349, a)
    assert k != repeat_key("bf16", "ladder", 15.36, a) != repeat_key("fp8", "ladder", 15.35, a)
    assert group_label(k) == "bf16/ladder@15.35rps"
    assert group_label(repeat_key("bf16", "sharegpt", None, a)) == "bf16/sharegpt"
    # what ran before on a radix-cache server is part of the key (it decides the cache)
    cold = repeat_key("bf16", "ladder", 23.03, a)
    warm = repeat_key("bf16", "ladder", 23.03, a, after="ladder@7.68rps, ladder@15.35rps")
    assert cold != warm
    assert group_label(warm) == "bf16/ladder@23.03rps after ladder@7.68rps, ladder@15.35rps"


def _rows(metric, measured, predicted, target=0.05, group="g", **kw):
    out = []
    for i, (m, p) in enumerate(zip(measured, predicted, strict=True)):
        r = row(metric, f"run{i}", m, p, target, **kw)
        r["group"], r["in_sample"] = group, False
        out.append(r)
    return out


def test_mean_range_error_and_verdict():
    rows = _rows("TPOT", [10.0, 12.0, 14.0], [12.5, 12.5, 12.6])
    (r,) = repeat_rows(rows)
    assert r["runs"] == ["run0", "run1", "run2"]
    assert (r["measured_mean"], r["measured_min"], r["measured_max"]) == (12.0, 10.0, 14.0)
    assert r["spread"] == pytest.approx(2.0 / 12.0)
    assert r["predicted"] == pytest.approx(12.5333333)
    assert r["error"] == pytest.approx(12.5333333 / 12 - 1)
    assert r["verdict"] == "PASS" and r["within_range"]
    # every single run would miss by 25% / 4% / 10%: the mean is what the prediction meets
    assert [x["verdict"] for x in rows] == ["MISS", "PASS", "MISS"]
    (far,) = repeat_rows(_rows("TPOT", [10.0, 11.0], [14.0, 14.0]))
    assert far["verdict"] == "MISS" and not far["within_range"]
    assert far["error"] == pytest.approx(14.0 / 10.5 - 1)


def test_absolute_rows_keep_points():
    (r,) = repeat_rows(_rows("ratio", [1.0, 1.2], [1.05, 1.05], absolute=True))
    assert r["absolute"] and r["error"] == pytest.approx(-0.05)
    assert r["spread"] == pytest.approx(0.1)


def test_who_stays_out():
    rows = _rows("TPOT", [10.0, 12.0], [11.0, 11.0])
    rows[1]["in_sample"] = True
    assert repeat_rows(rows) == []                           # one validated run is no repeat
    assert repeat_rows(_rows("TTFT", [10.0, 12.0], [11.0, 11.0], target=None)) == []
    other = _rows("TPOT", [10.0], [11.0], group="h") + _rows("TPOT", [12.0], [11.0])
    assert repeat_rows(other) == []                          # different groups
    ungrouped = _rows("TPOT", [10.0, 12.0], [11.0, 11.0], group=None)
    assert repeat_rows(ungrouped) == []
    two = _rows("TPOT", [10.0, 12.0], [11.0, 11.0]) + _rows("batch", [5.0, 6.0], [5.5, 5.5])
    assert [r["metric"] for r in repeat_rows(two)] == ["TPOT", "batch"]
    assert repeat_rows(two, min_runs=3) == []
    with pytest.raises(ValueError, match="min_runs=1"):
        repeat_rows(two, min_runs=1)
