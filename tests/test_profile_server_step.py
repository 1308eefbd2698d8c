"""sglang_diffkv.bench.profile_server_step's trace reading on a synthetic torch-profiler trace."""

from __future__ import annotations

import gzip
import json

import pytest


@pytest.fixture(scope="module")
def prof():
    from sglang_diffkv.bench import profile_server_step
    return profile_server_step


def test_busy_time_is_the_union_of_kernel_intervals(prof, tmp_path):
    events = [  # ts / dur in microseconds; two overlap, one gap of 500 us
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
        {"cat": "kernel", "name": "attn", "ts": 800, "dur": 400},
        {"cat": "kernel", "name": "attn", "ts": 1700, "dur": 300},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # not a kernel
    ]
    path = tmp_path / "x.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = prof.summarize(path, steps=2)
    assert s["wall_ms"] == pytest.approx(2.0)
    assert s["busy_ms"] == pytest.approx(1.5)
    assert [(k["name"], k["count"]) for k in s["kernels"]] == [("gemm", 1), ("attn", 2)]
    assert s["kernels"][1]["ms"] == pytest.approx(0.7)
    text = prof.report(s)
    assert "0.75 ms/step" in text and "75.0%" in text and "| `attn` | 0.350 |" in text


def test_stage_arguments_and_the_last_decode_line(prof, tmp_path):
    assert prof.int_list("128,256,450", "--requests") == [128, 256, 450]
    with pytest.raises(SystemExit, match="--prompt-len '16': expected 2 positive integers"):
        prof.int_list("16", "--prompt-len", 2)
    with pytest.raises(SystemExit, match="--requests '1,x': expected comma-separated"):
        prof.int_list("1,x", "--requests")
    log = tmp_path / "server.log"
    log.write_text("[x] Decode batch, #running-req: 10, #token: 900\n"
                   "[y] Prefill batch, #new-seq: 3\n"
                   "[z] Decode batch, #running-req: 12, #token: 1100\n")
    assert prof.last_decode_line(log) == "[z] Decode batch, #running-req: 12, #token: 1100"
    log.write_text("nothing yet\n")
    assert prof.last_decode_line(log) == ""


def test_host_calls_list_the_longest_single_call_first(prof, tmp_path):
    events = [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 7},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 20, "dur": 3000},
        {"cat": "cpu_op", "name": "aten::item", "ts": 20, "dur": 3010},
    ]
    path = tmp_path / "y.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = prof.summarize(path, steps=1)
    assert [h["name"] for h in s["host_calls"]] == ["aten::item", "cudaStreamSynchronize",
                                                    "cudaLaunchKernel"]
    launch = s["host_calls"][2]
    assert launch["count"] == 2 and launch["max_ms"] == pytest.approx(0.007)
    assert "| `cudaStreamSynchronize` | cuda_runtime | 3.00 |" in prof.report(s)


def test_drain_targets_stage_names_and_waiting_for_a_batch(prof, tmp_path):
    assert prof.drain_targets("", [400]) == []
    assert prof.drain_targets("650,500,120", [750]) == [650, 500, 120]
    with pytest.raises(SystemExit, match="--at-batch '120,500': needs one --requests total"):
        prof.drain_targets("120,500", [750])
    with pytest.raises(SystemExit, match=r"\(got 128,256\)"):
        prof.drain_targets("100", [128, 256])
    with pytest.raises(SystemExit, match="strictly decreasing"):
        prof.drain_targets("500,500", [750])
    assert prof.stage_names([400]) == [""]
    assert prof.stage_names([128, 256]) == ["-128", "-256"]
    assert prof.stage_names([450, 450, 600]) == ["-450-1", "-450-2", "-600"]
    log = tmp_path / "server.log"
    log.write_text("[a] Decode batch, #running-req: 700, #token: 9\n"
                   "[b] Decode batch, #running-req: 480, #token: 8\n")
    assert prof.wait_for_batch(log, 500, 1.0) == "[b] Decode batch, #running-req: 480, #token: 8"
    assert prof.wait_for_batch(log, 400, 0.2) == ""


def test_attach_arguments_are_checked(prof, tmp_path):
    assert prof.attach_offsets("40,90", "server.log") == [40.0, 90.0]
    for bad in ("", "90,40", "x", "-1,5", "40,40"):
        with pytest.raises(SystemExit, match="--attach needs --at-seconds as increasing"):
            prof.attach_offsets(bad, "server.log")
    with pytest.raises(SystemExit, match="--attach needs --server-log"):
        prof.attach_offsets("40", "")
    assert prof.last_decode_line(tmp_path / "not-yet.log") == ""


def test_a_trace_is_read_once_it_is_whole(prof, tmp_path):
    events = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000}]
    whole = gzip.compress(json.dumps({"traceEvents": events}).encode())
    path = tmp_path / "z.trace.json.gz"
    path.write_bytes(whole[: len(whole) // 2])   # cut short: never whole
    assert prof.summarize_when_written(path, 1, 0.3, poll_s=0.05) is None
    path.write_bytes(whole)
    s = prof.summarize_when_written(path, 1, 2.0, poll_s=0.05)
    assert s is not None and s["busy_ms"] == pytest.approx(1.0)


def test_forward_steps_split_at_the_sampler_and_prefill_steps_apart(prof, tmp_path):
    argmax = "reduce_kernel<ArgMaxOps<float>>"
    events = [  # a decode step (2 kernels), an eager prefill step with a host gap, a cut step
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 4000},
        {"cat": "kernel", "name": argmax, "ts": 4000, "dur": 100},
        {"cat": "kernel", "name": "gemm", "ts": 5000, "dur": 2000},
        {"cat": "kernel", "name": "_fwd_kernel", "ts": 9000, "dur": 1000},
        {"cat": "kernel", "name": argmax, "ts": 14900, "dur": 100},
        {"cat": "kernel", "name": "gemm", "ts": 16000, "dur": 500},
    ]
    path = tmp_path / "z.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = prof.summarize(path, steps=2)
    dec, pre = s["forward_steps"]
    assert not dec["prefill"] and dec["span_ms"] == pytest.approx(4.1)
    assert dec["busy_ms"] == pytest.approx(4.1) and dec["kernels"] == 2
    assert pre["prefill"] and pre["span_ms"] == pytest.approx(10.0)
    assert pre["busy_ms"] == pytest.approx(3.1) and pre["extend_ms"] == pytest.approx(1.0)
    text = prof.report(s)
    assert ("prefill steps: 1, median span 10.00 ms, GPU busy 3.10 ms, extend kernel 1.00 ms,"
            " 3 kernels") in text
    assert "decode steps: 1, median span 4.10 ms" in text
    assert "decode after a" not in text      # the one decode step's predecessor was cut


def test_decode_steps_split_by_the_step_before_and_diffkv_prefills_count(prof, tmp_path):
    argmax = "reduce_kernel<ArgMaxOps<float>>"
    ev = []
    t = 0
    # decode, DiffKV prefill (its store kernel, no triton extend), decode with 3 ms of idle
    # at its head (the host's turnaround), decode
    for names, idle in ((["gemm"], 0), (["flash_fwd", "_store_prefill_kernel"], 0),
                        (["memcpy", "graph"], 3000), (["graph"], 0)):
        for i, n in enumerate(names):
            ev.append({"cat": "kernel", "name": n, "ts": t, "dur": 1000})
            t += 1000 + (idle if i == 0 else 0)
        ev.append({"cat": "kernel", "name": argmax, "ts": t, "dur": 100})
        t += 200
    path = tmp_path / "z.trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    steps = prof.summarize(path, steps=4)["forward_steps"]
    assert [f["prefill"] for f in steps] == [False, True, False, False]
    assert [f["after_prefill"] for f in steps] == [None, False, True, False]
    kinds = dict(prof.split_steps(steps))
    (after_p,), (after_d,) = kinds["decode after a prefill"], kinds["decode after a decode"]
    assert after_p["span_ms"] - after_p["busy_ms"] == pytest.approx(3.0)
    assert after_d["span_ms"] == pytest.approx(after_d["busy_ms"])
    assert len(kinds["decode"]) == 3 and len(kinds["prefill"]) == 1
