"""Workloads, budget, CLI validation, and the whole harness against the CPU fake server."""

from __future__ import annotations

import json
import math
import socket
import sys
import tarfile

import pytest

from sglang_diffkv.bench.budget import Budget
from sglang_diffkv.bench.client import request_ids
from sglang_diffkv.bench.e2e import main
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.server import parse_config_list
from sglang_diffkv.bench.workloads import (
    LongGen,
    PrefixReuse,
    auto_longgen_n,
    hit_ceiling,
    ladder_trace,
    paced_trace,
    parse_rates,
    parse_workloads,
    sharegpt_trace,
    to_specs,
)
from sglang_diffkv.serving_io.loaders import load_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl
from simulator.validation.bench_result import read_bench_result

# ---- workloads ---------------------------------------------------------------------------


def test_longgen_shape_and_seed() -> None:
    t = LongGen(n=64, seed=3).trace()
    assert len(t) == 64 and all(r.arrival_s == 0.0 for r in t.requests)
    assert all(256 <= r.input_tokens <= 768 and r.output_tokens == 4096 for r in t.requests)
    assert t == LongGen(n=64, seed=3).trace() and t != LongGen(n=64, seed=4).trace()
    with pytest.raises(BenchInputError, match="input range"):
        LongGen(input_min=800, input_max=700)


def test_auto_longgen_n_from_the_reported_capacity() -> None:
    lg = LongGen(input_min=256, input_max=768, output_len=4096)  # mean request 4608 tokens
    # DiffKV on an H100 at 30/50/20: 1,774,212 logical slots, all-high capacity smaller
    a = auto_longgen_n(lg, 1_774_212, 1_100_000, 1024)
    assert a.capacity_tokens == 1_774_212 and a.n == math.ceil(2 * 1_774_212 / 4608) == 771
    assert a.n > 512 and "max_total_num_tokens 1774212" in a.why and a.warning is None
    # the all-high capacity counts where it is the larger
    b = auto_longgen_n(lg, 400_000, 900_000, None, factor=1.5)
    assert b.n == math.ceil(1.5 * 900_000 / 4608) and "all-high capacity 900000" in b.why
    # an earlier configuration's N is never undercut; a low request limit is named
    c = auto_longgen_n(lg, 423_862, None, 48, at_least=771)
    assert c.n == 771 and "raised to 771" in c.why
    assert c.warning is not None and "max_running_requests 48" in c.warning
    with pytest.raises(BenchInputError, match="must be > 1"):
        auto_longgen_n(lg, 1000, None, None, factor=1.0)
    with pytest.raises(BenchInputError, match="no KV capacity"):
        auto_longgen_n(lg, None, None, None)


def test_measured_mix_and_variant_env_configs() -> None:
    cfgs = parse_config_list("diffkv-mix,diffkv-measured,diffkv-fused",
                             {"diffkv-fused": "bench-30-50-20"}, {"SGLANG_DIFFKV_PROFILE": "1"},
                             {"diffkv-fused": {"SGLANG_DIFFKV_FUSED_ARGMIN": "1"}})
    env = [c.env_dict for c in cfgs]
    assert json.loads(env[1]["SGLANG_DIFFKV_CONFIG"]) == {"preset": "bench-measured"}
    assert env[2]["SGLANG_DIFFKV_FUSED_ARGMIN"] == "1" and "SGLANG_DIFFKV_FUSED_ARGMIN" \
        not in env[0] and env[2]["SGLANG_DIFFKV_CONFIG"] == "bench-30-50-20"
    assert all(e["SGLANG_DIFFKV_PROFILE"] == "1" for e in env)
    with pytest.raises(BenchInputError, match="variant environment .* not in --configs"):
        parse_config_list("diffkv-mix", None, None, {"diffkv-x": {"A": "1"}})
    with pytest.raises(BenchInputError, match="only configurations named 'diffkv'"):
        parse_config_list("bf16", None, None, {"bf16": {"A": "1"}})


def test_sharegpt_is_the_bundled_trace_at_t0() -> None:
    t = sharegpt_trace(100)
    assert len(t) == 100 and {r.arrival_s for r in t.requests} == {0.0}
    assert max(r.input_tokens + r.output_tokens for r in t.requests) <= 8192
    with pytest.raises(BenchInputError, match="only 2000"):
        sharegpt_trace(5000)


def test_sharegpt_skip_takes_the_requests_after_the_first_skip() -> None:
    whole = sharegpt_trace(2000)
    tail = sharegpt_trace(500, skip=1500)
    assert tail.name == "sharegpt-n500-skip1500" and {r.arrival_s for r in tail.requests} == {0.0}
    assert [(r.input_tokens, r.output_tokens) for r in tail.requests] == [
        (r.input_tokens, r.output_tokens) for r in whole.requests[1500:]]
    with pytest.raises(BenchInputError, match="n=501 after skip=1500: .* only 2000"):
        sharegpt_trace(501, skip=1500)
    with pytest.raises(BenchInputError, match="skip=-1 must be >= 0"):
        sharegpt_trace(10, skip=-1)


def test_ladder_trace_rate_window_and_roundtrip(tmp_path) -> None:
    base = sharegpt_trace(2000)
    t = ladder_trace(base, rate=20.0, window_s=50.0, seed=1)
    arr = [r.arrival_s for r in t.requests]
    assert arr[0] == 0.0 and max(arr) < 50.0
    assert abs(len(t) - 1000) < 5 * math.sqrt(1000)  # Poisson count around rate * window
    assert [r.input_tokens for r in t.requests[:50]] == [r.input_tokens for r in
                                                         base.requests[:50]]
    # the written file replays the same requests in the simulator
    p = write_mooncake_jsonl(t, tmp_path / "ladder.jsonl")
    back = load_trace(p)
    assert [(r.input_tokens, r.output_tokens) for r in back.requests] == [
        (r.input_tokens, r.output_tokens) for r in t.requests]
    assert [r.arrival_s for r in back.requests] == pytest.approx(arr, abs=1e-3)
    specs = to_specs(t)
    assert specs[3].output_len == t.requests[3].output_tokens
    # more requests than the base trace: lengths wrap around
    assert len(ladder_trace(sharegpt_trace(10), 50.0, 2.0)) > 10
    with pytest.raises(BenchInputError, match="positive finite"):
        ladder_trace(base, float("inf"), 10.0)


def test_prefix_workload_shares_token_blocks_by_hash_id() -> None:
    wl = PrefixReuse(n=200, max_input=2000, max_output=64)
    trace = wl.trace()
    assert len(trace) == 200 and trace.requests[0].arrival_s == 0
    assert max(r.input_tokens for r in trace.requests) == 2000
    assert max(r.requested_new_tokens for r in trace.requests) == 64
    # a cut prompt keeps its leading ids: ceil(2000 / 512) = 4 blocks at most
    assert all(len(r.prefix_hash_ids) == -(-r.input_tokens // 512) for r in trace.requests)
    specs = to_specs(trace)
    # two requests whose leading ids agree share exactly those blocks' tokens
    pairs = [(i, j) for i in range(len(specs)) for j in range(i + 1, min(i + 40, len(specs)))
             if specs[i].prefix_blocks[:1] == specs[j].prefix_blocks[:1]]
    assert pairs, "the trace has no shared leading block"
    for i, j in pairs[:20]:
        a, b = request_ids(specs[i], 0, i), request_ids(specs[j], 0, j)
        assert len(a) == specs[i].input_len and len(b) == specs[j].input_len
        k = 0
        while (k < len(specs[i].prefix_blocks) and k < len(specs[j].prefix_blocks)
               and specs[i].prefix_blocks[k] == specs[j].prefix_blocks[k]):
            k += 1
        shared = min(k * 512, len(a), len(b))
        assert a[:shared] == b[:shared]
        if shared < min(len(a), len(b)):
            assert a[shared:shared + 8] != b[shared:shared + 8]
    # the same request is the same prompt in every run, another seed another prompt
    assert request_ids(specs[5], 0, 5) == request_ids(specs[5], 0, 5)
    assert request_ids(specs[5], 1, 5) != request_ids(specs[5], 0, 5)


def test_paced_trace_keeps_order_and_scales_to_the_rate() -> None:
    trace = PrefixReuse(n=300).trace()
    paced = paced_trace(trace, 2.0, 60.0)
    n = len(paced)
    assert 0 < n < len(trace) and paced.requests[-1].arrival_s < 60
    assert [r.prefix_hash_ids for r in paced.requests] == \
        [r.prefix_hash_ids for r in trace.requests[:n]]
    full = paced_trace(trace, 2.0, 1e9)
    assert full.mean_rate == pytest.approx(2.0)
    with pytest.raises(BenchInputError, match="rate"):
        paced_trace(trace, 0.0, 10)


def test_hit_ceiling_counts_leading_blocks_seen_before() -> None:
    reqs = [TraceRequest(0.0, 1024, 4, prefix_hash_ids=(1, 2)),
            TraceRequest(1.0, 1500, 4, prefix_hash_ids=(1, 2, 3)),   # 1024 hit
            TraceRequest(2.0, 600, 4, prefix_hash_ids=(1, 9)),       # 512 hit
            TraceRequest(3.0, 1024, 4, prefix_hash_ids=(1, 2)),      # all but one token
            TraceRequest(4.0, 512, 4, prefix_hash_ids=(7,))]         # none
    t = Trace(tuple(reqs), prefix_block_tokens=512)
    assert hit_ceiling(t) == pytest.approx((1024 + 512 + 1023) / (1024 + 1500 + 600 + 1024 + 512))


@pytest.mark.parametrize(("text", "match"), [
    ("0.5,abc", "'abc' is not a number"), ("0.5,-1", "'-1' must be a positive"),
    ("0", "'0' must be a positive"), ("inf", "'inf' must be a positive"),
    ("nan", "'nan' must be a positive"), (" , ", "names no rate"),
])
def test_bad_rates(text, match) -> None:
    with pytest.raises(BenchInputError, match=match):
        parse_rates(text)


def test_rates_and_workload_names() -> None:
    assert parse_rates("0.25, 0.5,0.75") == [0.25, 0.5, 0.75]
    assert parse_workloads("sharegpt,longgen") == ["sharegpt", "longgen"]
    with pytest.raises(BenchInputError, match="unknown workload 'long'; allowed: longgen"):
        parse_workloads("long")


def test_budget_shortens_then_skips() -> None:
    now = [0.0]
    b = Budget(100.0, reserve_s=10.0, clock=lambda: now[0])
    assert b.left() == 90.0 and b.window(60.0, 20.0, 15.0) == 60.0
    now[0] = 40.0
    assert b.window(60.0, 20.0, 15.0) == pytest.approx(30.0)  # shortened
    now[0] = 60.0
    assert b.window(60.0, 20.0, 15.0) is None  # 10 s of room < 15 s minimum
    assert not b.fits(31.0) and b.fits(30.0)
    assert b.note("x").endswith("x") and len(b.notes) == 1
    with pytest.raises(BenchInputError, match="budget"):
        Budget(0.0)


# ---- CLI -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "match"), [
    (["--configs", "bf16,int4"], "unknown configuration 'int4'"),
    (["--ladder-rates", "0.5,x"], "'x' is not a number"),
    (["--ladder-abs-rates", "-2"], "'-2' must be a positive"),
    (["--workloads", "ladder"], "needs sharegpt"),
    (["--workloads", "longgen", "--window-s", "3"], "sharegpt window 3.0 s must be >="),
    (["--diffkv-config", "diffkv-mix"], "expected NAME=VALUE"),
    (["--diffkv-config", "diffkv-x={}"], "'diffkv-x', which is not in --configs"),
    (["--longgen-in", "300"], "expected MIN,MAX"),
    (["--sharegpt-n", "600", "--sharegpt-skip", "1500"], "n=600 after skip=1500"),
    (["--longgen-n", "many"], "a number or 'auto'"),
    (["--longgen-n-factor", "1"], "must be > 1"),
    (["--diffkv-variant-env", "diffkv-mix=X"], "expected NAME:VALUE"),
])
def test_cli_bad_input_exits_2_with_the_reason(args, match, capsys, tmp_path) -> None:
    assert main(["--dry-run", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert "bench_e2e: error:" in err
    import re
    assert re.search(match, err), err


def test_dry_run_prints_commands_and_writes_traces(capsys, tmp_path) -> None:
    rc = main(["--dry-run", "--out", str(tmp_path), "--configs", "bf16,fp8,diffkv-mix",
               "--longgen-n", "16", "--sharegpt-n", "30"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--kv-cache-dtype fp8_e4m3" in out and "SGLANG_DIFFKV_PROFILE=1" in out
    assert "bf16: admission new_token_ratio" in out
    assert len(load_trace(tmp_path / "logs/traces/longgen-n16-o4096.jsonl")) == 16
    assert len(load_trace(tmp_path / "logs/traces/sharegpt-n30.jsonl")) == 30
    assert main(["--dry-run", "--out", str(tmp_path), "--configs", "bf16", "--workloads",
                 "sharegpt", "--sharegpt-n", "20", "--sharegpt-skip", "1500"]) == 0
    skipped = load_trace(tmp_path / "logs/traces/sharegpt-n20-skip1500.jsonl")
    assert [r.input_tokens for r in skipped.requests] == [
        r.input_tokens for r in sharegpt_trace(20, skip=1500).requests]


# ---- the whole harness against the fake server -----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def fake_python(tmp_path):
    """An interpreter stand-in: drops '-m sglang.launch_server' and runs the fake server."""
    p = tmp_path / "fakepy"
    p.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} -m "
                 "sglang_diffkv.bench.fakeserver \"$@\"\n")
    p.chmod(0o755)
    return str(p)


@pytest.mark.slow
def test_harness_end_to_end_on_the_fake_server(fake_python, tmp_path, monkeypatch,
                                               capsys) -> None:
    monkeypatch.setenv("FAKE_MAX_RUNNING", "8")
    monkeypatch.setenv("FAKE_STEP_S", "0.005")
    out = tmp_path / "out"
    rc = main(["--python", fake_python, "--out", str(out), "--port", str(_free_port()),
               "--configs", "bf16,diffkv-mix", "--longgen-n", "16", "--longgen-out", "400",
               "--sharegpt-n", "40", "--window-s", "1.5", "--longgen-window-s", "1",
               "--ladder-window-s", "1", "--ladder-rates", "0.5,1", "--min-window-s", "0.5",
               "--budget-s", "900", "--start-estimate-s", "5", "--warmup", "2",
               "--git-commit", "abc123"])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    # the budget is a ceiling (the run takes ~15 s); a step it skipped shows in its notes
    assert not [n for n in res["notes"] if "SKIP" in n or "SHORTEN" in n], res["notes"]
    assert res["environment"]["git_commit"] == "abc123"
    assert set(res["configs"]) == {"bf16", "diffkv-mix"}
    for c in res["configs"].values():
        assert c["startup_s"] > 0 and c["max_total_num_tokens"] == 100_000
        assert c["max_running_requests"] == 8 and "stop_s" in c
    assert res["configs"]["diffkv-mix"]["diffkv_report"]
    labels = [(r["config"], r["label"]) for r in res["runs"]]
    assert labels == [(c, w) for c in ("bf16", "diffkv-mix")
                      for w in ("longgen", "sharegpt", "ladder@0.5x", "ladder@1x")]
    for r in res["runs"]:
        assert r["client"]["output_throughput"] > 0 and r["idle_after_s"] is not None
        assert r["server_log"]["decode_lines"] > 0
        assert r["server_log"]["peak_running"] <= 8
        assert r["client"]["failed"] == 0
    lg = res["runs"][0]
    assert lg["client"]["time_limited"] and lg["client"]["completed"] == 0  # 400 tokens take 2 s
    sg, lad = res["runs"][1], res["runs"][2]
    assert lad["rate_req_s"] == pytest.approx(0.5 * sg["saturation_req_s"])
    assert lad["trace_file"] == "logs/traces/bf16__ladder@0.5x.jsonl"
    # --paced-basis first (default): diffkv's ladder runs at bf16's rates, its own recorded
    dsg, dlad = res["runs"][5], res["runs"][6]
    assert dlad["rate_req_s"] == pytest.approx(0.5 * sg["saturation_req_s"])
    assert dlad["paced_basis_req_s"] == pytest.approx(sg["saturation_req_s"])
    assert dlad["saturation_req_s"] == pytest.approx(dsg["saturation_req_s"])
    assert "diffkv-mix/ladder: paced at fractions of bf16's saturation" in printed
    dk = res["runs"][4]["server_log"]
    # the fake writes profile_lines.profile_line: mm = alloc 1.0 + reclaim 0.25 + free 0.25
    assert dk["diffkv_profile"]["decode"]["mm_ms"] == pytest.approx(1.5)
    assert dk["diffkv_profile"]["decode"]["step_ms"] == pytest.approx(12.5)
    assert "diffkv_profile" not in res["runs"][0]["server_log"]
    # bench_serving-style lines, one per run, readable by the simulator
    assert read_bench_result(out / "bench_serving.jsonl", 2)["workload"] == "ladder@0.5x"
    with tarfile.open(out / "logs.tar.gz") as t:
        names = set(t.getnames())
    assert {"logs/server__bf16.log", "logs/server__diffkv-mix.log",
            "logs/requests__bf16__sharegpt.jsonl.gz",
            "logs/traces/diffkv-mix__ladder@1x.jsonl"} <= names
    assert "diffkv-mix" in printed and "ladder@1x" in printed
    # the fake logs SGLang's resolved server_args line: radix on, so new_token_ratio
    for c in res["configs"].values():
        assert c["disable_radix_cache"] is False
        assert c["disable_radix_cache_from"] == "server log"
        assert c["admission_rule"] == "new_token_ratio"
    assert {r["admission_rule"] for r in res["runs"]} == {"new_token_ratio"}
    assert res["admission_warnings"] == [] and "WARNING" not in res["table"]
    assert "1.50" in printed  # the mm ms/step column


@pytest.mark.slow
def test_prefix_workload_on_the_fake_servers_prefix_cache(fake_python, tmp_path,
                                                          monkeypatch) -> None:
    """The fake caches every prompt when it arrives (16-token pages), so the hit rate the
    client reads from meta_info.cached_tokens is what the trace's shared blocks allow."""
    monkeypatch.setenv("FAKE_MAX_RUNNING", "64")
    monkeypatch.setenv("FAKE_STEP_S", "0.002")
    out = tmp_path / "out"
    rc = main(["--python", fake_python, "--out", str(out), "--port", str(_free_port()),
               "--configs", "bf16", "--workloads", "prefix", "--prefix-n", "120",
               "--prefix-max-input", "1536", "--prefix-max-output", "4",
               "--prefix-window-s", "20", "--ladder-window-s", "1", "--prefix-rates", "0.5",
               "--min-window-s", "0.5", "--budget-s", "600", "--start-estimate-s", "5",
               "--decode-log-interval", "1", "--warmup", "0"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    sat, paced = res["runs"]
    assert (sat["label"], paced["label"]) == ("prefix", "prefix@0.5x")
    c = sat["client"]
    assert c["completed"] == 120 and not c["time_limited"]
    assert c["cache_hit_rate"] > 0.05
    # every prompt arrives before any later one (all at t=0, in order), so the fake's hits
    # are the ceiling's up to partial last blocks (a shorter earlier one caches less)
    assert c["cache_hit_rate"] <= sat["hit_ceiling"] + 1e-9
    assert c["cache_hit_rate"] >= sat["hit_ceiling"] - 0.02
    # the server log's Prefill lines say the same
    assert sat["server_log"]["prefix_hit_rate_log"] == pytest.approx(c["cache_hit_rate"])
    assert paced["rate_req_s"] == pytest.approx(0.5 * sat["saturation_req_s"])
    # each run starts from an empty cache: the paced one hits what its own requests share
    assert sat["cache_flushed"] and paced["cache_flushed"]
    pc = paced["client"]
    assert paced["hit_ceiling"] > 0.05
    assert paced["hit_ceiling"] - 0.02 <= pc["cache_hit_rate"] <= paced["hit_ceiling"] + 1e-9
    assert "hit %" in res["table"]


@pytest.mark.slow
def test_longgen_auto_sizes_n_from_each_servers_capacity(fake_python, tmp_path, monkeypatch,
                                                         capsys) -> None:
    """bf16 then DiffKV on the fake server (pool 20,000 tokens; DiffKV reports 30,000 all-high):
    each longgen run gets 2x the requests of mean length its server holds, the later one
    never fewer, with the reason printed and recorded; the request limit (8) is named."""
    monkeypatch.setenv("FAKE_MAX_RUNNING", "8")
    monkeypatch.setenv("FAKE_STEP_S", "0.005")
    monkeypatch.setenv("FAKE_POOL_TOKENS", "20000")
    monkeypatch.setenv("FAKE_ALL_HIGH", "30000")
    out = tmp_path / "out"
    rc = main(["--python", fake_python, "--out", str(out), "--port", str(_free_port()),
               "--configs", "bf16,diffkv-measured", "--workloads", "longgen",
               "--longgen-out", "400", "--longgen-window-s", "1", "--min-window-s", "0.5",
               "--budget-s", "300", "--start-estimate-s", "5", "--warmup", "0"])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["plan"]["longgen_n_auto"] is True
    bf, dk = res["runs"]
    mean = (256 + 768) / 2 + 400
    assert bf["longgen_n"] == math.ceil(2 * 20000 / mean) == 44
    assert dk["longgen_n"] == math.ceil(2 * 30000 / mean) == 66
    assert "all-high capacity 30000" in dk["longgen_n_why"]
    assert "max_running_requests 8" in bf["longgen_n_warning"]
    assert not bf["longgen_request_bound"] and not dk["longgen_request_bound"]
    assert bf["trace_file"].endswith("longgen-n44-o400.jsonl")
    assert "N = 66: capacity 30000 tokens" in printed
    assert json.loads(res["configs"]["diffkv-measured"]["env"]["SGLANG_DIFFKV_CONFIG"]) == {
        "preset": "bench-measured"}


@pytest.mark.slow
def test_harness_skips_what_does_not_fit_and_reports_start_failures(
        fake_python, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FAKE_EXIT_EARLY", "1")
    out = tmp_path / "out"
    rc = main(["--python", fake_python, "--out", str(out), "--port", str(_free_port()),
               "--configs", "bf16,fp8", "--workloads", "longgen", "--longgen-window-s", "1",
               "--window-s", "1", "--ladder-window-s", "1", "--min-window-s", "0.5",
               "--budget-s", "100", "--start-estimate-s", "5"])
    assert rc == 1  # no run succeeded
    res = json.loads((out / "results.json").read_text())
    assert "exited with code 3" in res["configs"]["bf16"]["error"]
    monkeypatch.delenv("FAKE_EXIT_EARLY")
    rc = main(["--python", fake_python, "--out", str(out), "--port", str(_free_port()),
               "--configs", "bf16", "--budget-s", "60"])
    res = json.loads((out / "results.json").read_text())
    assert rc == 1 and res["configs"]["bf16"]["skipped"].startswith("budget")
    assert any("SKIP config bf16" in n for n in res["notes"])


@pytest.mark.slow
def test_freeze_gc_follows_the_warmup_and_is_recorded(fake_python, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.005")
    out = tmp_path / "out"
    rc = main(["--python", fake_python, "--out", str(out), "--port", str(_free_port()),
               "--configs", "bf16", "--workloads", "ladder", "--ladder-abs-rates", "5",
               "--ladder-window-s", "1", "--sharegpt-n", "20", "--min-window-s", "0.5",
               "--budget-s", "300", "--start-estimate-s", "5", "--warmup", "2",
               "--freeze-gc"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["configs"]["bf16"]["gc_frozen"] is True
    assert any("/freeze_gc after the warm-up: done" in n for n in res["notes"])
    with tarfile.open(out / "logs.tar.gz") as t:
        log = t.extractfile("logs/server__bf16.log").read().decode()
    assert log.count("Freezing GC") == 1


def test_warmup_sends_every_length_alone_then_all_together() -> None:
    from sglang_diffkv.bench.e2e import WARMUP_PROMPT_LENS, warmup_phases

    (singles, at_once_1), (together, at_once_2) = warmup_phases(6)
    assert not at_once_1 and at_once_2
    assert [s.input_len for s in singles] == list(WARMUP_PROMPT_LENS)
    assert [s.arrival_s for s in singles] == [0.0, 1.0, 2.0, 3.0]  # one prefill each
    assert [s.input_len for s in together] == [*WARMUP_PROMPT_LENS, *WARMUP_PROMPT_LENS[:2]]
    (few, _), (both, _) = warmup_phases(2)
    assert [s.input_len for s in few] == [s.input_len for s in both] == [17, 128]


def test_cpu_model_reads_the_first_model_name(tmp_path) -> None:
    from sglang_diffkv.bench.e2e import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\n"
                    "processor\t: 1\nmodel name\t: something else\n")
    assert cpu_model(str(info)) == "AMD EPYC 9654 96-Core Processor"
    info.write_text("processor\t: 0\n")
    assert cpu_model(str(info)) is None
    assert cpu_model(str(tmp_path / "missing")) is None
