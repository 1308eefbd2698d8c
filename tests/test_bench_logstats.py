# ruff: noqa: E501  -- the fixtures are verbatim SGLang log lines, which are long
"""Server-log slices: SGLang 0.5.10 scheduler lines, retractions, DiffKV step/profile lines."""

from __future__ import annotations

import pytest

from sglang_diffkv.bench.logstats import (
    mm_ms_per_step,
    ms_figures,
    slice_stats,
    startup_info,
)

STARTUP = """\
[2026-01-01 10:00:00] server_args=ServerArgs(...)
[2026-01-01 10:00:05 TP0] KV Cache is allocated. #tokens: 423862, K size: 25.87 GB, V size: 25.87 GB
[2026-01-01 10:00:05 TP0] DiffKV KV cache: config 'llama-3-8b' high=K8V4 low=K4V2
[2026-01-01 10:00:05 TP0] DiffKV KV cache: planning mix high 0.30 / low 0.50 -> 1700000 logical token slots
[2026-01-01 10:00:05 TP0] diffkv: disable_cuda_graph=True (forced): no graphs yet
[2026-01-01 10:00:06 TP0] max_total_num_tokens=1700000, chunked_prefill_size=-1, max_prefill_tokens=16384, max_running_requests=2048, context_len=8192
[2026-01-01 10:00:06] Ignore import error when loading sglang.srt.models.x: Can not import FA3
[2026-01-01 10:00:07] The server is fired up and ready to roll!
"""

WORKLOAD_A = """\
[2026-01-01 10:00:10 TP0] Prefill batch, #new-seq: 8, #new-token: 4096, #cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 4,
[2026-01-01 10:00:11 TP0] Decode batch, #running-req: 100, #token: 50000, token usage: 0.03, cuda graph: False, gen throughput (token/s): 4000.00, #queue-req: 12,
[2026-01-01 10:00:12 TP0] DiffKV decode: batch 100, tokens high 30.0% / low 50.0% / pruned 20.0%; pages in use 2000/10000 (20.0%; a bf16 cache would need 6000), active requests 100 holding 50000 tokens
[2026-01-01 10:00:12 TP0] DiffKV profile decode: 50 steps: mm 3.100 ms/step (7.52% of step 41.200 ms) = alloc 1.000 + reclaim 0.100 + free 2.000, policy 5.000 ms/step (12.14%); total 500 steps: mm 1550.000 ms (7.52% of 20600.000 ms), policy 2500.000 ms (12.14%)
[2026-01-01 10:00:12 TP0] DiffKV profile prefill: 2 steps: mm 8.000 ms/step (8.00% of step 100.000 ms) = alloc 5.000 + reclaim 3.000 + free 0.000, policy 0.000 ms/step (0.00%), host 97.500 ms/step; total 4 steps: mm 16.000 ms (8.00% of 200.000 ms), policy 0.000 ms (0.00%)
[2026-01-01 10:00:12 TP0] DiffKV host: 3 device allocations, 1 gen-2 collections
[2026-01-01 10:00:13 TP0] Decode batch, #running-req: 300, #token: 150000, token usage: 0.09, cuda graph: False, gen throughput (token/s): 6000.00, #queue-req: 3,
[2026-01-01 10:00:13 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 1234, #new_token_ratio: 0.4000 -> 0.5000
[2026-01-01 10:00:14 TP0] DiffKV decode: batch 300, tokens high 40.0% / low 40.0% / pruned 20.0%; pages in use 6000/10000 (60.0%; a bf16 cache would need 15000), active requests 300 holding 150000 tokens
[2026-01-01 10:00:14 TP0] DiffKV profile decode: 30 steps: mm 4.900 ms/step (10.04% of step 48.800 ms) = alloc 2.000 + reclaim 0.900 + free 2.000, policy 6.000 ms/step (12.30%); total 530 steps: mm 1470.000 ms (10.04% of 14640.000 ms), policy 1800.000 ms (12.30%)
[2026-01-01 10:00:14 TP0] DiffKV timing (reworded): compaction 0.75 ms
[2026-01-01 10:00:14 TP0] DiffKV something new: 17 widgets
"""

WORKLOAD_B = """\
[2026-01-01 10:01:10 TP0] Decode batch, #running-req: 7, #token: 700, token usage: 0.00, cuda graph: False, gen throughput (token/s): 100.00, #queue-req: 0,
[2026-01-01 10:01:11 TP0] Traceback (most recent call last):
"""


@pytest.fixture()
def log(tmp_path):
    p = tmp_path / "server.log"
    p.write_text(STARTUP + WORKLOAD_A + WORKLOAD_B)
    a0 = len(STARTUP.encode())
    a1 = a0 + len(WORKLOAD_A.encode())
    return p, a0, a1


def test_startup_info(log) -> None:
    p, a0, _ = log
    info = startup_info(p, a0)
    assert info["max_total_num_tokens"] == 1_700_000 and info["max_running_requests"] == 2048
    assert info["kv_alloc"].startswith("KV Cache is allocated. #tokens: 423862")
    assert [ln.split(":")[0] for ln in info["diffkv_report"]] == ["DiffKV KV cache"] * 2 + [
        "diffkv"]


def test_slice_keeps_only_its_lines(log) -> None:
    p, a0, a1 = log
    s = slice_stats(p, a0, a1)
    assert s["log_bytes"] == [a0, a1]
    assert s["decode_lines"] == 2
    assert s["mean_running"] == 200.0 and s["peak_running"] == 300
    assert s["mean_tokens_used"] == 100_000.0 and s["peak_tokens_used"] == 150_000
    assert s["peak_token_usage"] == pytest.approx(0.09)
    assert s["peak_queue"] == 12
    assert s["prefill_batches"] == 1 and s["prefill_new_tokens"] == 4096
    assert s["retractions"] == 3  # SGLang 0.5.10's '#retracted_reqs: 3'
    assert s["error_lines"] == 0
    # DiffKV step lines
    assert s["diffkv_step_lines"] == 2
    assert s["diffkv_mean_high_pct"] == pytest.approx(35.0)
    assert s["diffkv_peak_pages_used"] == 6000 and s["diffkv_pages_total"] == 10000
    assert s["diffkv_peak_page_usage"] == pytest.approx(0.6)
    assert s["diffkv_peak_active_tokens"] == 150_000
    assert s["diffkv_mean_compression_vs_bf16"] == pytest.approx((3.0 + 2.5) / 2)
    # profile lines per mode, weighted by their steps (50 at 3.1 ms, 30 at 4.9 ms)
    dec = s["diffkv_profile"]["decode"]
    assert dec["lines"] == 2 and dec["steps"] == 80
    assert dec["mm_ms"] == pytest.approx((50 * 3.1 + 30 * 4.9) / 80)
    assert dec["step_ms"] == pytest.approx((50 * 41.2 + 30 * 48.8) / 80)
    assert dec["policy_ms"] == pytest.approx((50 * 5.0 + 30 * 6.0) / 80)
    assert dec["mm_pct"] == pytest.approx(100 * dec["mm_ms"] / dec["step_ms"])
    assert s["diffkv_profile"]["prefill"]["mm_ms"] == pytest.approx(8.0)
    # the host field where the lines have it (these decode lines predate it)
    assert s["diffkv_profile"]["prefill"]["host_ms"] == pytest.approx(97.5)
    assert "host_ms" not in dec
    assert s["diffkv_device_allocs"] == 3 and s["diffkv_gen2_collections"] == 1
    assert mm_ms_per_step(s) == pytest.approx(dec["mm_ms"])
    assert mm_ms_per_step(s, "prefill") == pytest.approx(8.0)
    # a line in another wording still gives its figures; the unknown line is kept raw
    assert s["diffkv_ms"] == {"compaction": pytest.approx(0.75)}
    assert s["diffkv_other_lines"] == 1
    assert s["diffkv_other_raw"] == ["DiffKV something new: 17 widgets"]


def test_later_slice_and_errors(log) -> None:
    p, _, a1 = log
    s = slice_stats(p, a1, None)
    assert s["decode_lines"] == 1 and s["peak_running"] == 7 and s["retractions"] == 0
    assert "diffkv_step_lines" not in s and mm_ms_per_step(s) is None
    assert s["error_lines"] == 1 and s["first_error_lines"][0].startswith("Traceback")


def test_empty_slice(log) -> None:
    p, a0, _ = log
    s = slice_stats(p, a0, a0)
    assert s["decode_lines"] == 0 and s["retractions"] == 0 and s["error_lines"] == 0


def test_ms_figures_formats() -> None:
    assert ms_figures("DiffKV profile: step 41.2 ms, memory management 3.1 ms/step") == {
        "step": 41.2, "memory management": 3.1}
    assert ms_figures("DiffKV profile: mm_ms=2.5 step_ms=30") == {"mm": 2.5, "step": 30.0}
    assert ms_figures("DiffKV decode: batch 3, nothing timed") == {}
    assert mm_ms_per_step({"diffkv_ms": {"step": 9.0, "mm": 1.25}}) == 1.25
