"""SGLANG_DIFFKV_PROFILE: the step profiler's accounting and its log line format."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from sglang_diffkv.bench.logstats import _diffkv_stats
from sglang_diffkv.serving_io.profile_lines import (
    HOST_LINE_RE,
    PART_BUCKETS,
    PROFILE_LINE_RE,
    parse_parts_line,
    parse_profile_line,
    profile_line,
)
from sglang_diffkv.sglang.step_profile import StepProfiler, profiling_enabled


def test_enabled_only_when_asked():
    assert not profiling_enabled({})
    assert not profiling_enabled({"SGLANG_DIFFKV_PROFILE": "0"})
    assert profiling_enabled({"SGLANG_DIFFKV_PROFILE": "1"})
    assert StepProfiler.from_env("cpu", {}) is None
    with pytest.raises(ValueError, match="SGLANG_DIFFKV_PROFILE='maybe': use 1"):
        profiling_enabled({"SGLANG_DIFFKV_PROFILE": "maybe"})


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _sleep_span(p: StepProfiler, bucket: str, seconds: float) -> None:
    start = p.mark()
    p._clock.sleep(seconds)
    p.add(bucket, start)


def test_buckets_steps_and_free_between_steps():
    p = StepProfiler("cpu", clock=FakeClock())
    for _ in range(2):  # two decode steps: alloc 4 ms + policy 2 x 3 ms inside ~20 ms
        p.begin_step()
        _sleep_span(p, "alloc", 0.004)
        for _ in range(2):
            _sleep_span(p, "policy", 0.003)
        p._clock.sleep(0.006)
        p.end_step("decode")
    _sleep_span(p, "free", 0.005)  # a request finishes between steps
    p.begin_step()
    _sleep_span(p, "alloc", 0.002)
    _sleep_span(p, "reclaim", 0.003)
    p.end_step("prefill")
    gc.collect()  # one gen-2 collection inside the interval
    lines = p.lines()
    assert len(lines) == 3
    assert lines[2] == "DiffKV host: 0 device allocations, 1 gen-2 collections"
    assert HOST_LINE_RE.search("[2026-01-01 00:00:00] " + lines[2])["gen2_collections"] == "1"
    pre, dec = (parse_profile_line(x) for x in lines[:2])  # MODES order: prefill, decode
    assert dec["mode"] == "decode" and dec["steps"] == 2 and dec["total_steps"] == 2
    assert dec["alloc_ms"] == pytest.approx(4) and dec["free_ms"] == 0
    assert dec["policy_ms"] == pytest.approx(6)
    assert dec["step_ms"] == pytest.approx(4 + 6 + 6)
    assert dec["host_ms"] == pytest.approx(dec["step_ms"])  # the fake clock is the host's
    assert dec["mm_pct"] == pytest.approx(100 * dec["mm_ms"] / dec["step_ms"], abs=0.01)
    # the free ran before the prefill step began: its mm, and its step time
    assert pre["mode"] == "prefill" and pre["steps"] == 1
    assert pre["free_ms"] == pytest.approx(5)
    assert pre["step_ms"] == pytest.approx(5 + 2 + 3)
    assert pre["mm_ms"] == pytest.approx(pre["alloc_ms"] + pre["reclaim_ms"] + pre["free_ms"],
                                         abs=0.002)
    assert pre["step_ms"] >= pre["mm_ms"] and pre["policy_ms"] == 0
    # a new interval: only decode ran; totals keep counting
    p.begin_step()
    _sleep_span(p, "alloc", 0.001)
    p.end_step("decode")
    again, host = p.lines()
    assert host == "DiffKV host: 0 device allocations, 0 gen-2 collections"
    d2 = parse_profile_line(again)
    assert d2["steps"] == 1 and d2["total_steps"] == 3
    assert d2["total_mm_ms"] == pytest.approx(2 * dec["mm_ms"] + d2["mm_ms"], abs=0.01)
    assert p.lines() == []


def test_prefill_parts_get_their_own_line():
    """Where a prefill step's time goes (attention, compress, chunk stores, ends, export):
    a second line, only when a part was timed; the bench reads it back per step."""
    p = StepProfiler("cpu", clock=FakeClock())
    for _ in range(2):
        p.begin_step()
        _sleep_span(p, "alloc", 0.001)
        _sleep_span(p, "attend", 0.010)
        _sleep_span(p, "chunk", 0.030)
        _sleep_span(p, "end", 0.005)
        p._clock.sleep(0.002)
        p.end_step("prefill")
    lines = p.lines()
    assert len(lines) == 3  # profile, parts, host
    assert parse_profile_line(lines[1]) is None  # the main line's reader skips it
    parts = parse_parts_line(lines[1])
    assert parts["mode"] == "prefill" and parts["steps"] == 2
    assert parts["attend_ms"] == pytest.approx(10) and parts["chunk_ms"] == pytest.approx(30)
    assert parts["end_ms"] == pytest.approx(5) and parts["compress_ms"] == 0
    assert parts["step_ms"] == pytest.approx(48)
    assert sum(parts[f"{b}_ms"] for b in PART_BUCKETS) <= parts["step_ms"]
    stats = _diffkv_stats(["[2026-01-01 00:00:00] " + ln for ln in lines])
    assert stats["diffkv_parts"]["prefill"]["chunk_ms"] == pytest.approx(30)
    assert "diffkv_other_lines" not in stats
    # decode steps time no part: no parts line for them
    p.begin_step()
    _sleep_span(p, "policy", 0.001)
    p.end_step("decode")
    assert not any(parse_parts_line(x) for x in p.lines())


def test_line_format_is_the_documented_one():
    window = {"step": 312.0, "alloc": 1.0, "reclaim": 0.0, "free": 0.2, "policy": 3.0}
    total = {"step": 31200.0, "alloc": 100.0, "reclaim": 0.0, "free": 18.0, "policy": 300.0}
    line = profile_line("decode", 10, window, 1000, total, host_ms=290.0)
    assert line == (
        "DiffKV profile decode: 10 steps: mm 0.120 ms/step (0.38% of step 31.200 ms) = "
        "alloc 0.100 + reclaim 0.000 + free 0.020, policy 0.300 ms/step (0.96%), "
        "host 29.000 ms/step; "
        "total 1000 steps: mm 118.000 ms (0.38% of 31200.000 ms), policy 300.000 ms (0.96%)"
    )
    assert PROFILE_LINE_RE.search("[2026-01-01 00:00:00] " + line)
    assert parse_profile_line(line)["total_policy_pct"] == 0.96
    assert parse_profile_line(line)["host_ms"] == 29.0
    # a line written before the host field existed still parses, without it
    old = line.replace(", host 29.000 ms/step", "")
    assert parse_profile_line(old)["host_ms"] is None
    assert parse_profile_line(old)["step_ms"] == 31.2
    assert parse_profile_line("DiffKV decode: batch 3, tokens high 30.0%") is None


def test_docs_show_the_regex_the_code_uses():
    doc = (Path(__file__).parent.parent / "docs" / "backend.md").read_text()
    block = doc.split("    DiffKV profile (?P<mode>", 1)[1].split("\n\n", 1)[0]
    shown = "DiffKV profile (?P<mode>" + "".join(
        ln.strip() if i == 0 else " " + ln.strip() for i, ln in enumerate(block.splitlines()))
    assert shown.replace("F", r"\d+(?:\.\d+)?") == PROFILE_LINE_RE.pattern


def test_span_times_a_block_and_is_a_no_op_without_a_profiler():
    from sglang_diffkv.sglang.step_profile import span

    with span(None, "alloc"):  # profiling off: nothing to record, nothing raised
        pass
    p = StepProfiler("cpu", clock=FakeClock())
    p.begin_step()
    with span(p, "alloc"):
        p._clock.sleep(0.004)
    with pytest.raises(ValueError, match="profile bucket 'nope'"):
        with span(p, "nope"):
            pass
    p.end_step("decode")
    line, _ = p.lines()
    dec = parse_profile_line(line)
    assert dec["alloc_ms"] == pytest.approx(4) and dec["step_ms"] == pytest.approx(4)
