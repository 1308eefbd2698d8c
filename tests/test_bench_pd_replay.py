"""The real-P/D-run tools of the bench on the CPU: the replay driver against the in-process fake
SGLang server (what it writes is what ``diffkv-sim validate-disagg`` reads), the Prometheus
scrape of SGLang's KV transfer series, the trace a rate replays, and the link probe's socket
part."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from aiohttp import web

from sglang_diffkv.bench import link_probe as lp
from sglang_diffkv.bench import pd_replay as pr
from sglang_diffkv.bench.budget import Budget
from sglang_diffkv.bench.fakeserver import FakeState, make_app
from sglang_diffkv.bench.workloads import ladder_trace
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.pd_run import LinkProbe, PdReplay, read_pd_file

METRICS = """# HELP sglang:kv_transfer_latency_ms Histogram of KV cache transfer latency in ms.
# TYPE sglang:kv_transfer_latency_ms histogram
sglang:kv_transfer_latency_ms_bucket{le="10.0",model_name="m",engine_type="unified"} 3.0
sglang:kv_transfer_latency_ms_bucket{le="+Inf",model_name="m",engine_type="unified"} 5.0
sglang:kv_transfer_latency_ms_sum{model_name="m",engine_type="unified"} 61.5
sglang:kv_transfer_latency_ms_count{model_name="m",engine_type="unified"} 5.0
sglang:kv_transfer_latency_ms_count{model_name="m",engine_type="other"} 1.0
sglang:kv_transfer_total_mb_sum{model_name="m"} 500.0
sglang:num_running_reqs{model_name="m"} 7.0
"""


def test_prometheus_kv_transfer_series_are_summed_over_labels_but_buckets_kept_apart():
    m = pr.parse_prometheus(METRICS)
    assert m == {"sglang:kv_transfer_latency_ms_bucket[le=10.0]": 3.0,
                 "sglang:kv_transfer_latency_ms_bucket[le=+Inf]": 5.0,
                 "sglang:kv_transfer_latency_ms_sum": 61.5,
                 "sglang:kv_transfer_latency_ms_count": 6.0,
                 "sglang:kv_transfer_total_mb_sum": 500.0}
    later = dict(m, **{"sglang:kv_transfer_latency_ms_sum": 100.0})
    d = pr.metrics_delta(m, later)
    assert d is not None and d["sglang:kv_transfer_latency_ms_sum"] == 38.5
    assert d["sglang:kv_transfer_latency_ms_count"] == 0.0
    assert pr.metrics_delta(None, m) is None


def test_a_rate_replays_the_ladder_trace_capped_to_the_context():
    t = pr.pd_trace("azure-conv", 4.0, 30.0, 0, 2048)
    base = ladder_trace(load_named_trace("azure-conv"), 4.0, 30.0, 0)
    assert [r.arrival_s for r in t.requests] == [r.arrival_s for r in base.requests]
    assert all(r.input_tokens + r.requested_new_tokens <= 2048 - 16 for r in t.requests)
    assert all(r.requested_new_tokens <= 512 for r in t.requests)
    # uncapped requests keep their lengths
    same = [(a.input_tokens, a.output_tokens) == (b.input_tokens, b.output_tokens)
            for a, b in zip(t.requests, base.requests, strict=True)
            if b.input_tokens + b.output_tokens < 1500 and b.output_tokens <= 512]
    assert same and all(same)
    assert pr.pd_trace("azure-conv", 4.0, 30.0, 0, 2048) == t     # seeded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_driver_writes_what_validate_disagg_reads(tmp_path, capsys):
    log = tmp_path / "colocated.log"
    log.write_text("# command: python3 -m sglang.launch_server --model-path /tmp/m "
                   "--attention-backend triton --mem-fraction-static 0.85 "
                   "--disable-piecewise-cuda-graph --disable-radix-cache\n"
                   "[2026-11-28 00:00:00] max_total_num_tokens=100000, "
                   "chunked_prefill_size=8192, max_running_requests=64\n")

    async def main() -> None:
        runner = web.AppRunner(make_app(FakeState(step_s=0.002)))
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        a = pr.build_parser().parse_args([
            "--url", url, "--deployment", "colocated", "--out", str(tmp_path),
            "--rates", "20,40", "--window-s", "0.5", "--drain-s", "20", "--context-len", "256",
            "--idle-url", url, "--metrics-url", url,
            "--server", f"colocated={log}"])
        doc = {"schema": 1, "kind": "replay", "deployment": "colocated", "device": "test",
               "trace": {"name": a.trace}, "servers": [pr.server_info("colocated", str(log))],
               "router": None, "runs": [], "notes": []}
        try:
            await pr.run_rates(a, doc, tmp_path / "pd_runs_colocated.json", Budget(120.0))
        finally:
            await runner.cleanup()

    asyncio.run(main())
    printed = capsys.readouterr().out
    assert "warm-up done" in printed and "colocated @ 40 req/s" in printed
    rep = read_pd_file(tmp_path / "pd_runs_colocated.json")
    assert isinstance(rep, PdReplay) and [r.rate for r in rep.runs] == [20.0, 40.0]
    for run in rep.runs:
        assert all(r.completed for r in run.requests) and not run.time_limited
        assert all(r.input_len + r.output_len <= 256 for r in run.requests)
        assert run.transfer is None                 # the fake has no /metrics
        assert len(run.requests) == pytest.approx(run.rate * 0.5, abs=12)
    srv = rep.server("colocated")
    assert srv is not None and srv.max_total_num_tokens == 100000
    assert "--disable-radix-cache" in srv.command

    # the simulator reads it (the control alone, on the placeholder link)
    from simulator.validation import disagg_real as dr
    res = dr.validate([tmp_path], gpu="h100", link_spec="tcp-loopback")
    assert [r["compared"] for r in res["runs"]] == [len(r.requests) for r in rep.runs]


def test_the_socket_probe_moves_every_byte_and_a_failed_probe_is_recorded(tmp_path):
    s = lp.socket_probe(64 * lp.MIB, pings=20)
    assert s["bytes"] == 64 * lp.MIB and s["bandwidth"] > 0 and s["rtt_s"] > 0
    bad = lp._probe("x", lambda: 1 / 0)
    assert bad["error"].startswith("ZeroDivisionError")
    assert lp.main(["--out", str(tmp_path), "--socket-gib", "0.0625", "--memcpy-gib", "0"]) == 0
    got = read_pd_file(tmp_path / "pd_link.json")
    assert isinstance(got, LinkProbe) and set(got.probes) == {"socket_loopback"}
    assert json.loads(Path(tmp_path / "pd_link.json").read_text())["schema"] == 1


def test_the_one_gpu_flags_are_recorded(tmp_path):
    # link_probe --same-gpu: the file says so (the Mooncake far side is then GPU 0)
    assert lp.main(["--out", str(tmp_path), "--socket-gib", "0.0625", "--memcpy-gib", "0",
                    "--same-gpu"]) == 0
    doc = json.loads(Path(tmp_path / "pd_link.json").read_text())
    assert doc["same_gpu"] is True and "gpus" in doc
    got = read_pd_file(tmp_path / "pd_link.json")
    assert isinstance(got, LinkProbe) and got.same_gpu
    # pd_replay --shared-gpu
    a = pr.build_parser().parse_args(["--url", "http://x", "--deployment", "pd", "--out",
                                      str(tmp_path), "--shared-gpu"])
    assert a.shared_gpu
    assert not pr.build_parser().parse_args(["--url", "http://x", "--deployment", "pd",
                                             "--out", str(tmp_path)]).shared_gpu
