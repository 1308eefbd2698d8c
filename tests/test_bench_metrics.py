"""Summary metrics against hand-computed values (bench_serving's definitions + the window)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_diffkv.bench.client import ClientRun, RequestRecord
from sglang_diffkv.bench.metrics import summarize_run, write_bench_jsonl
from simulator.validation.bench_result import read_bench_result


def _run() -> ClientRun:
    # A: completed, 4 tokens in chunks of 1, 2, 1
    a = RequestRecord(0, 0.0, 100, 4, send_s=0.0, first_token_s=1.0, chunk_s=[1.0, 1.5, 2.0],
                      chunk_tokens=[1, 2, 1], end_s=2.1, tokens=4, completed=True)
    # B: still streaming when the 4 s window closed
    b = RequestRecord(1, 0.5, 50, 10, send_s=0.5, first_token_s=1.2, chunk_s=[1.2, 3.5],
                      chunk_tokens=[1, 1], end_s=4.0, tokens=2, cancelled=True)
    # C: its arrival was after the window
    c = RequestRecord(2, 9.0, 70, 10)
    return ClientRun([a, b, c], wall_start=0.0, window_s=4.0, time_limited=True,
                     max_inflight=10, mode="trace")


def test_bench_serving_definitions_by_hand() -> None:
    s = summarize_run(_run(), "x")
    assert s["duration"] == 4.0 and s["completed"] == 1 and s["cancelled"] == 1
    assert s["not_sent"] == 1 and s["sent"] == 2 and s["failed"] == 0
    assert s["request_throughput"] == pytest.approx(0.25)
    assert s["input_throughput"] == pytest.approx(100 / 4)
    # every token inside the window (A's 4 + B's 2) / 4 s; completed-only: A's 4 / 4 s
    assert s["output_throughput"] == pytest.approx(1.5)
    assert s["output_throughput_completed"] == pytest.approx(1.0)
    assert s["total_throughput"] == pytest.approx((100 + 6) / 4)
    # second half (2, 4]: only B's chunk at 3.5 (A's at 2.0 is not after 2.0); A ended at 2.1
    assert s["steady_output_throughput"] == pytest.approx(0.5)
    assert s["steady_request_throughput"] == pytest.approx(0.5)
    assert s["mean_ttft_ms"] == pytest.approx(1000.0)
    assert s["mean_e2e_latency_ms"] == pytest.approx(2100.0)
    assert s["mean_tpot_ms"] == pytest.approx((2.1 - 1.0) / 3 * 1000)
    # ITL: the 2-token chunk's 0.5 s gap is split evenly, then one 0.5 s gap
    itl = [250.0, 250.0, 500.0]
    assert s["mean_itl_ms"] == pytest.approx(np.mean(itl))
    assert s["median_itl_ms"] == pytest.approx(250.0)
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99))
    assert s["max_itl_ms"] == pytest.approx(500.0)
    assert s["concurrency"] == pytest.approx(2.1 / 4)
    # the *_all figures include B (TTFT 0.7 s, TPOT (3.5 - 1.2) / 1)
    assert s["mean_ttft_all_ms"] == pytest.approx(850.0)
    assert s["mean_tpot_all_ms"] == pytest.approx(((2.0 - 1.0) / 3 + 2.3) / 2 * 1000)
    assert s["mean_itl_all_ms"] == pytest.approx(np.mean(itl + [2300.0]))
    # open streams: A 0..2.1, B 0.5..4.0
    assert s["mean_inflight"] == pytest.approx((2.1 + 3.5) / 4)
    # 1-second buckets: [0,1): 0, [1,2): 1+2+1, [2,3): 1, [3,4): 1
    assert s["output_tokens_per_s"] == [0.0, 4.0, 1.0, 1.0]
    assert s["max_output_tokens_per_s"] == 4.0


def test_no_completion_gives_none_not_nan() -> None:
    run = _run()
    run.records[0].completed = False
    run.records[0].error = "HTTP 500: x"
    s = summarize_run(run)
    assert s["completed"] == 0 and s["failed"] == 1 and s["error_kinds"] == {"HTTP 500": 1}
    for k in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2e_latency_ms"):
        assert s[k] is None
    assert s["request_throughput"] == 0.0 and s["concurrency"] == 0.0
    json.dumps(s, allow_nan=False)


def test_jsonl_is_read_by_the_simulator(tmp_path) -> None:
    s1 = summarize_run(_run(), "first")
    s2 = {**s1, "tag": "second", "output_throughput": 7.0}
    p = write_bench_jsonl([s1, s2], tmp_path / "b.jsonl")
    assert read_bench_result(p)["tag"] == "second"
    first = read_bench_result(p, 0)
    assert first["output_throughput"] == pytest.approx(1.5)
    assert "output_tokens_per_s" not in first
