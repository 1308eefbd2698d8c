"""The served fuzz run (sglang_diffkv.bench.fuzz_serve) against the fake SGLang server: a
healthy server passes; one that accepts invalid custom_params, drops a token of valid
requests or dies fails the verdict, by the right check. Plus the generator's own contract."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from sglang_diffkv.bench import fuzz_serve as fz
from sglang_diffkv.bench.fakeserver import FakeState, make_app
from sglang_diffkv.config import PRESETS, DiffKVConfig

N = 40
SMALL = {"max_input": 16, "max_output": 24}
CFG = PRESETS["default"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fuzz_fake(state: FakeState, seed: int = 0, **kw: Any) -> dict[str, Any]:
    cases = fz.make_cases(N, seed, CFG, **SMALL)

    async def main() -> dict[str, Any]:
        runner = web.AppRunner(make_app(state))
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            args = {"seed": seed, "concurrency": 12, "idle_s": 0.05, "drain_timeout_s": 5.0,
                    "abort_timeout_s": 5.0, "server_pid": os.getpid(), "progress_s": 60.0,
                    "deadline_s": 30.0, "log": lambda m: None, **kw}
            return await fz.fuzz(f"http://127.0.0.1:{port}", cases, **args)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def healthy() -> FakeState:
    return FakeState(step_s=0.002, max_running=16, diffkv_config=CFG)


def failed_checks(v: dict[str, Any]) -> set[str]:
    return {name for name, c in v["checks"].items() if not c["ok"]}


def test_a_healthy_server_passes_with_every_kind_exercised() -> None:
    state = healthy()
    v = fuzz_fake(state)
    assert v["passed"], fz.summary_text(v)
    recs = v["records"]
    assert len(recs) == N and all(r["ok"] for r in recs)
    outcomes = Counter((r["kind"], r["outcome"]) for r in recs)
    assert {k for k, _ in outcomes} == set(fz.KINDS), outcomes
    for r in recs:
        if r["kind"] == "invalid":
            assert r["outcome"] == "rejected" and r["tokens"] == 0
            assert r["expect_key"] in r["error"] and "\n" not in r["error"]
        elif r["kind"] == "valid":
            assert r["outcome"] == "completed" and r["tokens"] == r["output_len"]
    # the abandoned ones were cut mid-stream at least once each way
    assert outcomes[("disconnect", "disconnected")] >= 1
    assert outcomes[("abort", "aborted")] >= 1
    assert state.disconnects >= 1 and not state.by_rid
    assert v["checks"]["drained_to_idle"]["after_s"] is not None


def test_accepting_invalid_params_fails_the_verdict() -> None:
    state = healthy()
    state.faults = frozenset({"accept_invalid"})
    v = fuzz_fake(state)
    assert not v["passed"]
    assert failed_checks(v) == {"invalid_refused_by_key"}
    bad = [r for r in v["records"] if not r["ok"]]
    assert bad and all(r["kind"] == "invalid" for r in bad)
    assert all("not refused" in r["why"] for r in bad)


@pytest.mark.parametrize(("raw", "strict"), [
    (None, True), ('{"diffkv_alpha_h": 1.0}', True), ('{"diffkv_alpha_h": 1e38}', True),
    ('{"diffkv_alpha_h": NaN}', False), ('{"diffkv_alpha_h": -Infinity}', False),
    ('{"diffkv_alpha_h": 1e999}', False), ('{"diffkv_alpha_h": ' + str(10 ** 400) + "}", False),
])
def test_strict_json_is_what_a_strict_parser_reads(raw: str | None, strict: bool) -> None:
    assert fz.is_strict_json(raw) is strict


def test_a_json_layer_refusal_passes_only_for_bodies_that_are_not_strict_json() -> None:
    """SGLang's HTTP layer (orjson) refuses NaN / Infinity / 1e999 bodies with its own
    multi-line "JSON decode error": a client error before DiffKV, accepted for those bodies
    only; the same refusal of a strict-JSON body stays a failure (it must name its key)."""
    msg = "1 validation error:\n  {'type': 'json_invalid', 'msg': 'JSON decode error'}"

    def judged(raw: str) -> tuple[bool, str]:
        case = fz.Case(index=0, rid="r", kind="invalid", sub="nan", raw=raw, input_len=4,
                       output_len=4, expect_key=fz.H)
        rec = fz.Record(index=0, rid="r", kind="invalid", sub="nan", params=raw,
                        expect_key=fz.H, input_len=4, output_len=4, cut_after=None,
                        status=400, error=msg)
        rec.outcome = "rejected"
        return fz.judge(case, rec)

    assert judged('{"diffkv_alpha_h": NaN}') == (True, "")
    ok, why = judged('{"diffkv_alpha_h": "NaN"}')
    assert not ok and "not one line" in why


def test_a_short_valid_request_fails_the_verdict() -> None:
    state = healthy()
    state.faults = frozenset({"short"})
    v = fuzz_fake(state)
    assert not v["passed"]
    assert "valid_completed" in failed_checks(v)
    assert "invalid_refused_by_key" not in failed_checks(v)
    short = [r for r in v["records"] if r["kind"] == "valid" and not r["ok"]]
    assert short and all(r["tokens"] == r["output_len"] - 1 for r in short)


def test_a_dead_server_process_and_a_deadline_fail_the_verdict() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    v = fuzz_fake(healthy(), server_pid=dead.pid)
    assert failed_checks(v) == {"server_alive_after_idle"}
    # a server too slow for the deadline: the open requests count as failures
    slow = FakeState(step_s=0.05, max_running=2, diffkv_config=CFG)
    v = fuzz_fake(slow, deadline_s=0.3)
    assert {"finished_before_deadline", "valid_completed"} <= failed_checks(v)
    assert any(r["outcome"] in ("timeout", "not sent") for r in v["records"])


def test_cases_are_seeded_cover_every_sub_kind_and_agree_with_the_rule() -> None:
    cfg = DiffKVConfig.from_spec('{"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]}')
    a = fz.make_cases(600, 3, cfg)
    b = fz.make_cases(600, 3, cfg)
    assert [(c.kind, c.sub, c.raw, c.input_len, c.output_len) for c in a] == \
        [(c.kind, c.sub, c.raw, c.input_len, c.output_len) for c in b]
    subs = {(c.kind, c.sub) for c in a}
    for sub in ["absent", "null", "empty", "alpha", "alpha_bigint", "foreign"]:
        assert ("valid", sub) in subs
    for sub in [*fz.BAD_VALUES, "non_object", "unknown_key", "order", "order_config"]:
        assert ("invalid", sub) in subs, sub
    for c in a:
        body = fz.request_body(c, 3)
        json.loads(body)  # Python's JSON reads NaN / Infinity like the server's
        msg = fz.oracle(c.raw, cfg)
        assert (msg is not None) == (c.kind == "invalid")
        if c.kind in ("disconnect", "abort"):
            assert 1 <= c.cut_after <= c.output_len
    assert not {c.sub for c in fz.make_cases(200, 3, cfg, skip=("alpha_bigint",))} & \
        {"alpha_bigint"}


def _wait_ready(srv: subprocess.Popen, port: int) -> None:
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            assert srv.poll() is None and time.monotonic() - t0 < 20
            time.sleep(0.1)


def _fake_server(port: int, step_s: str, config: str) -> subprocess.Popen:
    """The fake SGLang server as its own process, serving diffkv with ``config``."""
    env = {**os.environ, "FAKE_STEP_S": step_s, "SGLANG_DIFFKV_CONFIG": config}
    return subprocess.Popen([sys.executable, "-m", "sglang_diffkv.bench.fakeserver",
                             "--attention-backend", "diffkv", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_cli_against_the_fake_server_process(tmp_path: Path) -> None:
    port = _free_port()
    srv = _fake_server(port, "0.002", "qwen2.5-7b")
    try:
        _wait_ready(srv, port)
        out = tmp_path / "fuzz"
        rc = subprocess.run(
            [sys.executable, "-m", "sglang_diffkv.bench.fuzz_serve", "--url",
             f"http://127.0.0.1:{port}", "--out", str(out), "--n", "30", "--max-input", "8",
             "--max-output", "16", "--idle-s", "0.1", "--server-pid", str(srv.pid),
             "--diffkv-config", "qwen2.5-7b", "--progress-s", "1"],
            capture_output=True, text=True, timeout=60)
        assert rc.returncode == 0, rc.stdout + rc.stderr
        assert "served fuzz run: PASS" in (out / "summary.txt").read_text()
        res = json.loads((out / "results.json").read_text())
        assert res["passed"] and len(res["records"]) == 30
        assert res["args"]["config"]["alpha_h"] == PRESETS["qwen2.5-7b"].alpha_h
    finally:
        srv.terminate()
        srv.wait(timeout=10)


def test_a_server_killed_mid_run_fails_without_hanging(tmp_path: Path) -> None:
    port = _free_port()
    srv = _fake_server(port, "0.01", "default")
    try:
        _wait_ready(srv, port)
        client = subprocess.Popen(
            [sys.executable, "-m", "sglang_diffkv.bench.fuzz_serve", "--url",
             f"http://127.0.0.1:{port}", "--out", str(tmp_path), "--n", "60", "--max-input",
             "8", "--max-output", "400", "--idle-s", "0.1", "--server-pid", str(srv.pid),
             "--drain-timeout-s", "1", "--abort-timeout-s", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        srv.kill()
        srv.wait(timeout=10)
        assert client.wait(timeout=30) == 1
    finally:
        srv.kill()
    res = json.loads((tmp_path / "results.json").read_text())
    failed = {name for name, c in res["checks"].items() if not c["ok"]}
    assert {"valid_completed", "drained_to_idle", "health_after_idle",
            "server_alive_after_idle"} <= failed


@pytest.mark.parametrize("url", ["http://127.0.0.1:9"])
def test_an_unreachable_server_exits_2(tmp_path: Path, url: str) -> None:
    rc = fz.main(["--url", url, "--out", str(tmp_path), "--n", "3", "--idle-s", "0"])
    assert rc == 2
    assert "FAIL" in (tmp_path / "summary.txt").read_text()
