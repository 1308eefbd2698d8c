"""Benchmark mode and SGLANG_DIFFKV_PROFILE through SGLang's own scheduler objects.

A bench-mode run must report itself as such at start-up, size its logical slots with the
bench mix, keep the mix in what finished requests hold, and (with profiling on) write
profile lines that parse with ``profile_lines.PROFILE_LINE_RE``.
"""

from __future__ import annotations

import json
import logging
import os

import harness as H
import pytest
import torch

from sglang_diffkv.serving_io.profile_lines import parse_profile_line
from sglang_diffkv.sglang.pool import PoolStats

MIX = (0.3, 0.5, 0.2)
BENCH = {"preset": "llama-3-8b", "window": 8, "score_queries": 8, "bench_mix": list(MIX)}


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    H.cpu_sglang_helpers(monkeypatch)




def run_bench(monkeypatch, caplog, shape: H.ModelShape, kernels: str,
              requests: tuple[tuple[int, int], ...]) -> tuple[H.MiniScheduler, list[str]]:
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(BENCH))
    monkeypatch.setenv("SGLANG_DIFFKV_LOG_INTERVAL", "3")
    monkeypatch.setenv("SGLANG_DIFFKV_PROFILE", "1")
    monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", kernels)
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        s = H.MiniScheduler(shape, H.budget_for_pages(shape, 900, 8))
        for n, (prompt, new) in enumerate(requests):
            s.add_request(str(n), [(7 * i + n) % 997 + 1 for i in range(prompt)], new)
        s.run_until_idle()
    return s, [r.getMessage() for r in caplog.records]


def check_bench_run(s: H.MiniScheduler, lines: list[str], tol: float) -> None:
    text = "\n".join(lines)
    note = "BENCHMARK MODE: tier decisions follow mix high 0.3 / low 0.5 / pruned 0.2, not " \
           "attention scores"
    assert f"DiffKV KV cache: {note}" in text  # start-up report
    assert f"DiffKV attention backend: {note}" in text
    assert "planning mix high 0.30 / low 0.50 ->" in text
    assert s.kv_pool.plan.mix == MIX[:2]
    # what the finished requests held: the mix (prompt + generated tokens, every row)
    stats = s.kv_pool.stats
    assert stats.finished_reqs == 2
    held = (stats.finished_tokens / stats.finished_reqs).tolist()
    assert held == pytest.approx(list(MIX), abs=tol), held
    profiles = [p for p in map(parse_profile_line, lines) if p is not None]
    assert all("\n" not in x for x in lines)
    decode = [p for p in profiles if p["mode"] == "decode"]
    prefill = [p for p in profiles if p["mode"] == "prefill"]
    assert decode and prefill
    assert all(p["alloc_ms"] > 0 and p["policy_ms"] > 0 and p["step_ms"] > 0 for p in decode)
    assert all(p["mm_ms"] <= p["step_ms"] for p in profiles)
    assert prefill[0]["reclaim_ms"] > 0 and prefill[0]["alloc_ms"] > 0
    assert decode[-1]["total_steps"] == sum(p["steps"] for p in decode)
    # the frees of both requests were timed (and counted into a later step, or pending)
    prof = stats.profiler
    assert prof is not None
    prof.lines()
    freed = sum(p["free_ms"] * p["steps"] for p in profiles) + sum(
        prof.total[m]["free"] for m in ("prefill", "decode"))
    assert freed > 0


def test_bench_mode_run_follows_the_mix_and_profiles(monkeypatch, caplog):
    s, lines = run_bench(monkeypatch, caplog, H.ModelShape(), "0", ((150, 40), (110, 30)))
    check_bench_run(s, lines, tol=0.06)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
def test_bench_mode_kernel_path(monkeypatch, caplog):
    """The same run with the Triton kernels (in-kernel draw) behind the ops seam."""
    # short: the interpreter runs the decode attention kernel slowly
    s, lines = run_bench(monkeypatch, caplog, H.ModelShape(dtype=torch.bfloat16), "1",
                         ((90, 7), (70, 5)))
    assert s.runner.attn_backend.ops.use_kernels
    check_bench_run(s, lines, tol=0.08)


def test_profiling_is_off_by_default(monkeypatch):
    monkeypatch.delenv("SGLANG_DIFFKV_PROFILE", raising=False)
    assert PoolStats().profiler is None
