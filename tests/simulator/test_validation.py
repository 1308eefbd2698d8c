"""Parsing SGLang's server log and bench_serving's result, and the measured-vs-simulated table.
The log lines follow SGLang's documented formats (old and new field names)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from simulator.cli import main
from simulator.validation.bench_result import read_bench_result
from simulator.validation.compare import compare_runs, rel_error

LOG = """\
[2026-11-22 09:00:05] max_total_num_tokens=409000, chunked_prefill_size=8192, \
max_prefill_tokens=16384, max_running_requests=4096, context_len=8192, available_gpu_mem=13.2 GB
[2026-11-22 09:00:10] Prefill batch, #new-seq: 2, #new-token: 900, #cached-token: 100, \
token usage: 0.00, #running-req: 0, #queue-req: 1, input throughput (token/s): 1.81, \
cuda graph: False
[2026-11-22 09:00:10] Decode batch, #running-req: 2, #token: 84, token usage: 0.10, \
cuda graph: True, gen throughput (token/s): 3.62, #queue-req: 1
2026-11-22T09:00:11.500Z TP0] Decode batch, #running-req: 10, #full token: 685000, \
full token usage: 0.50, cuda graph: True, gen throughput (token/s): 8.44, #queue-req: 0
[2026-11-22 09:00:12] Decode batch, #running-req: 6, #token: 90, token usage: 0.30, \
pre-allocated usage: 0.00, #retracted-req: 3, cuda graph: True, gen throughput (token/s): 1.0
"""


def test_server_log_lines_are_parsed(tmp_path):
    p = tmp_path / "server.log"
    p.write_text(LOG)
    log = parse_server_log(p)
    assert log.max_total_num_tokens == 409000 and log.max_running_requests == 4096
    assert log.decode_running == [2, 10, 6]
    assert log.decode_usage == [0.10, 0.50, 0.30]
    assert log.decode_gen_throughput == [3.62, 8.44, 1.0]
    assert log.prefill_new_tokens == [900] and log.prefix_hit_rate == pytest.approx(0.1)
    p.write_text("hello\nworld\n")
    with pytest.raises(InputError, match="is this an SGLang server log"):
        parse_server_log(p)


def test_bench_result_file(tmp_path):
    p = tmp_path / "bench.jsonl"
    p.write_text(json.dumps({"output_throughput": 10.0, "duration": 2.0}) + "\n"
                 + json.dumps({"output_throughput": 20.0}) + "\n")
    assert read_bench_result(p)["output_throughput"] == 20.0
    assert read_bench_result(p, 0)["duration"] == 2.0
    with pytest.raises(InputError, match="index 5"):
        read_bench_result(p, 5)
    p.write_text('{"output_throughput": 1}\n{oops\n')
    with pytest.raises(InputError, match="line 2: invalid JSON"):
        read_bench_result(p)
    p.write_text('{"foo": 1}\n')
    with pytest.raises(InputError, match="not a bench_serving result"):
        read_bench_result(p)


def test_comparison_rows_and_errors(tmp_path):
    p = tmp_path / "server.log"
    p.write_text(LOG)
    summary = {"kv_pool_tokens": 409_907, "max_running_requests": 4096, "peak_batch": 12,
               "mean_kv_usage": 0.3, "retractions": 3, "prefix_hit_rate": None,
               "output_throughput": 1650.0, "ttft_ms": {"mean": 44.0}}
    rows = compare_runs(summary, {"output_throughput": 1500.0, "mean_ttft_ms": 40.0},
                        parse_server_log(p), np.array([4, 6, 8]))
    by = {r["metric"]: r for r in rows}
    assert by["KV pool tokens (max_total_num_tokens)"]["error"] == pytest.approx(
        409_907 / 409_000 - 1)
    assert by["decode batch mean (running-req)"]["measured"] == 6.0
    assert by["decode batch mean (running-req)"]["error"] == pytest.approx(0.0)
    assert by["token usage mean"]["error"] == pytest.approx(0.0)
    assert by["output throughput (tok/s)"]["error"] == pytest.approx(0.1)
    assert by["TTFT mean (ms)"]["error"] == pytest.approx(0.1)
    assert rel_error(1.0, 0.0) is None and rel_error(None, 1.0) is None


def test_validate_command(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(LOG)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"output_throughput": 1500.0, "completed": 60,
                                 "mean_tpot_ms": 12.0}) + "\n")
    out = io.StringIO()
    rc = main(["validate", "--trace", "sharegpt", "-n", "60", "--server-log", str(log),
               "--bench-json", str(bench), "--json", str(tmp_path / "v.json")], out=out)
    text = out.getvalue()
    assert rc == 0 and "KV pool tokens" in text and "TPOT mean" in text and "%" in text
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["summary"]["completed"] == 60
    assert any(r["metric"] == "completed requests" and r["error"] == 0.0 for r in data["rows"])
    assert main(["validate", "-n", "5"], out=io.StringIO()) == 2
