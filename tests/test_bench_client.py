"""The streaming client against the in-process fake SGLang server (aiohttp), incl. windows,
cancellation, server-side abort, errors and open-loop timing."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from sglang_diffkv.bench import client as cl
from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.fakeserver import ERROR_HOOK_TOKENS, FakeState, make_app
from sglang_diffkv.bench.metrics import summarize_run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_server(state: FakeState, body: Callable[[str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        runner = web.AppRunner(make_app(state))
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await body(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def specs(n: int, out: int, inp: int = 8, gap: float = 0.0) -> list[cl.RequestSpec]:
    return [cl.RequestSpec(i * gap, inp, out) for i in range(n)]


def test_all_requests_complete_with_exact_token_counts() -> None:
    state = FakeState(step_s=0.002)
    run = with_server(state, lambda url: cl.replay(url, specs(5, 8), all_at_once=True))
    assert not run.time_limited and run.mode == "all-at-once"
    for r in run.records:
        assert r.completed and r.error is None and not r.cancelled
        assert r.tokens == 8 and sum(r.chunk_tokens) == 8
        assert r.send_s <= r.first_token_s <= r.chunk_s[-1] <= r.end_s
        assert r.chunk_s == sorted(r.chunk_s)
    s = summarize_run(run)
    assert s["completed"] == 5 and s["failed"] == 0
    assert s["total_output_tokens"] == 40 == s["total_output_tokens_window"]
    # untruncated: the window is the last completion, and both throughput definitions agree
    assert run.window_s == pytest.approx(max(r.end_s for r in run.records))
    assert s["output_throughput"] == pytest.approx(s["output_throughput_completed"])


def test_stream_interval_chunks_are_counted_by_completion_tokens() -> None:
    # SGLang sends tokens 1, k+1, 2k+1, ... and the last; deltas of completion_tokens
    state = FakeState(step_s=0.002, stream_interval=4)
    run = with_server(state, lambda url: cl.replay(url, specs(1, 10)))
    assert run.records[0].chunk_tokens == [1, 4, 4, 1]
    assert run.records[0].completed


def test_window_cancels_streams_and_the_server_goes_idle() -> None:
    state = FakeState(step_s=0.005, max_running=2)

    async def body(url: str) -> tuple[cl.ClientRun, bool, float | None, int | None]:
        run = await cl.replay(url, specs(6, 100_000), all_at_once=True, max_duration_s=0.5)
        aborted = await cl.abort_all(url)
        idle = await cl.wait_idle(url, timeout_s=5.0, poll_s=0.05)
        return run, aborted, idle, await cl.server_load(url)

    run, aborted, idle, load = with_server(state, body)
    assert run.time_limited and run.window_s == pytest.approx(0.5, abs=0.1)
    assert all(r.cancelled and not r.completed for r in run.records)
    streamed = [r for r in run.records if r.tokens > 0]
    assert len(streamed) == 2  # only max_running=2 ran; the rest waited in the server queue
    assert aborted and idle is not None and load == 0
    s = summarize_run(run)
    assert s["completed"] == 0 and s["cancelled"] == 6 and s["failed"] == 0
    assert s["mean_ttft_ms"] is None and s["mean_ttft_all_ms"] is not None
    assert s["output_throughput"] == pytest.approx(sum(r.tokens for r in run.records)
                                                   / run.window_s)
    json.dumps(s, allow_nan=False)  # no NaN in the results


def test_server_side_abort_is_an_error_not_a_completion() -> None:
    state = FakeState(step_s=0.005)

    async def body(url: str) -> cl.ClientRun:
        task = asyncio.create_task(cl.replay(url, specs(2, 100_000)))
        await asyncio.sleep(0.3)
        assert await cl.abort_all(url)
        return await task

    run = with_server(state, body)
    for r in run.records:
        assert not r.completed and not r.cancelled
        assert r.error is not None and r.error.startswith("aborted by the server")


def test_error_chunk_and_http_errors_are_recorded() -> None:
    state = FakeState(step_s=0.002)
    run = with_server(state, lambda url: cl.replay(url, specs(1, ERROR_HOOK_TOKENS)))
    rec = run.records[0]
    assert not rec.completed and rec.error == "server error: boom"
    run = with_server(state, lambda url: cl.replay(url + "/nope", specs(1, 4)))
    assert run.records[0].error.startswith("HTTP 404")
    assert summarize_run(run)["error_kinds"] == {"HTTP 404": 1}


def test_connection_refused_is_recorded() -> None:
    run = asyncio.run(cl.replay(f"http://127.0.0.1:{_free_port()}", specs(2, 4),
                                connect_timeout_s=2.0))
    assert all(not r.completed and r.error for r in run.records)


def test_open_loop_sends_at_trace_times() -> None:
    state = FakeState(step_s=0.002)
    run = with_server(state, lambda url: cl.replay(url, specs(3, 4, gap=0.2)))
    for r in run.records:
        assert r.arrival_s <= r.send_s < r.arrival_s + 0.1
        assert r.completed


def test_max_inflight_serialises_requests() -> None:
    state = FakeState(step_s=0.002)
    run = with_server(state, lambda url: cl.replay(url, specs(3, 5), all_at_once=True,
                                                   max_inflight=1))
    recs = run.records
    assert all(r.completed for r in recs)
    assert recs[1].send_s >= recs[0].end_s and recs[2].send_s >= recs[1].end_s


def test_unsent_requests_after_the_window() -> None:
    state = FakeState(step_s=0.002)
    reqs = [cl.RequestSpec(0.0, 8, 4), cl.RequestSpec(5.0, 8, 4)]
    run = with_server(state, lambda url: cl.replay(url, reqs, max_duration_s=0.4))
    assert run.records[0].completed and run.records[1].send_s is None
    assert run.not_sent == 1 and summarize_run(run)["not_sent"] == 1


def test_prompt_ids_are_seeded_and_in_the_vocabulary() -> None:
    a = cl.prompt_ids(0, 3, 500)
    assert a == cl.prompt_ids(0, 3, 500) and len(a) == 500
    assert a != cl.prompt_ids(0, 4, 500) and a != cl.prompt_ids(1, 3, 500)
    assert 0 <= min(a) and max(a) < cl.VOCAB_IDS
    p = cl.generate_payload(cl.RequestSpec(0.0, 5, 7), seed=0, index=0)
    assert p["stream"] is True and len(p["input_ids"]) == 5
    assert p["sampling_params"] == {"max_new_tokens": 7, "temperature": 0.0,
                                    "ignore_eos": True}


def test_chunk_parser_on_sglang_shaped_lines() -> None:
    # SGLang's orjson output (no spaces), an aborted final chunk, an error, and garbage
    line = (b'{"output_ids":[5,6],"meta_info":{"id":"a","finish_reason":{"type":"abort",'
            b'"message":"Abort"},"prompt_tokens":9,"completion_tokens":12,"cached_tokens":0}}')
    assert cl._chunk_tokens(line) == (12, True, None)
    ok = b'{"output_ids":[5],"meta_info":{"finish_reason":{"type":"length","length":3},' \
         b'"completion_tokens":3}}'
    assert cl._chunk_tokens(ok) == (3, False, None)
    assert cl._chunk_tokens(b'{"error": {"message": "bad"}}') == (None, False,
                                                                  "server error: bad")
    assert "unparsable" in cl._chunk_tokens(b"{nope")[2]
    assert "without meta_info" in cl._chunk_tokens(b'{"output_ids": [1]}')[2]


def test_bad_requests_and_options_are_refused() -> None:
    with pytest.raises(BenchInputError, match="arrival_s"):
        cl.RequestSpec(-1.0, 5, 5)
    with pytest.raises(BenchInputError, match="output_len"):
        cl.RequestSpec(0.0, 5, 0)
    with pytest.raises(BenchInputError, match="max_duration_s"):
        asyncio.run(cl.replay("http://127.0.0.1:1", specs(1, 1), max_duration_s=0))
    with pytest.raises(BenchInputError, match="at least one request"):
        asyncio.run(cl.replay("http://127.0.0.1:1", []))
    assert cl.default_max_inflight(1024) == 768 and cl.default_max_inflight(100) == 1
    assert cl.default_max_inflight(1 << 20) == 4096


def test_freeze_gc_posts_once_and_reports_a_dead_server() -> None:
    state = FakeState(step_s=0.005)
    assert with_server(state, lambda url: cl.freeze_gc(url)) is True
    assert state.gc_freezes == 1
    # nothing listens on a fresh free port: False, not an exception
    assert asyncio.run(cl.freeze_gc(f"http://127.0.0.1:{_free_port()}", timeout_s=2.0)) is False
