"""A stand-in for ``python -m sglang.launch_server`` that runs on a CPU, for the tests and for
rehearsing the harness without a GPU (``bench_e2e.py --python <script>``, where the script
drops the ``-m sglang.launch_server`` words and runs this module: see docs/e2e.md).

It speaks the part of SGLang 0.5.10's HTTP API the harness uses, the same way: ``/generate``
streams ``data: {"output_ids": [new ids], "meta_info": {"completion_tokens": cumulative, ...}}``
lines (``--incremental-streaming-output``) every ``--stream-interval`` tokens (and the first),
then ``data: [DONE]``; ``/abort_request {"abort_all": true}`` ends every request with
``finish_reason {"type": "abort"}``; ``/get_load`` reports running + waiting requests;
``/freeze_gc`` counts its calls (``FakeState.gc_freezes``) and logs SGLang's line. One
decode step every ``FAKE_STEP_S`` seconds (default 0.01) adds a token to every running request
(at most ``FAKE_MAX_RUNNING``); every ``--decode-log-interval`` steps it logs a ``Decode
batch`` line (and for ``--attention-backend diffkv`` a DiffKV step line and a profile line).
``FAKE_EXIT_EARLY=1`` exits with code 3 before the ready line. ``FAKE_POOL_TOKENS`` (default
100000) is the reported ``max_total_num_tokens``; a diffkv start also reports a capacity line
with ``FAKE_ALL_HIGH`` (default half the pool) tokens all-high (``--longgen-n auto`` reads both).

For the served fuzz run (``sglang_diffkv.bench.fuzz_serve``): with ``--attention-backend
diffkv`` a request whose ``custom_params`` ``sglang_diffkv.request_params`` refuses gets what
SGLang 0.5.17 streams for a ValueError of its tokenizer manager (HTTP 200, ``data: {"error":
{"message": ...}}``, ``data: [DONE]``); ``/abort_request {"rid": ...}`` ends that request with
``finish_reason {"type": "abort"}``; ``GET /health`` answers 200. ``FakeState.faults`` breaks
it on purpose for the tests: ``accept_invalid`` skips the custom_params check, ``short``
streams one token less than asked.

Prefix cache: an unbounded radix cache that a prompt enters, in ``FAKE_PREFIX_PAGE``-token
(default 16) pages, when it arrives; every streamed chunk's ``meta_info.cached_tokens`` is the
prompt's longest cached run of whole pages (at most its length - 1, as SGLang always computes
one token), and each Prefill line reports ``#cached-token``; ``/flush_cache`` empties it
when nothing runs or waits (HTTP 400 otherwise, as SGLang).

For the served-path quality harness (``diffkv-eval served``): a ``/generate`` with ``text``
and no ``stream`` answers at once, as a "copy model": its ``text`` is the prompt it kept and
its ``output_ids`` the last ``max_new_tokens`` bytes of it, so an answer is found exactly when
the prompt still holds it. ``FAKE_FORGET="a,b"`` (``FakeState.forget``) drops the prompt's
characters between fractions a and b, as a cache that lost the middle of the context would.
Its tokenizer (``fake_token_count``) counts every digit as a token and the other characters
at ``FAKE_CHARS_PER_TOKEN`` (default 4) a token, so a numbered word list takes about twice the
tokens of prose per character, as in a real BPE tokenizer; ``meta_info.prompt_tokens`` and
``POST /tokenize`` (``{"prompt": text or [texts]}`` -> ``{"tokens", "count",
"max_model_len"}``, absent with ``FAKE_NO_TOKENIZE=1``) use it. ``--context-length`` (default
8192, ``GET /server_info`` reports it and ``max_req_input_len`` = context - 6) is enforced as
SGLang 0.5.17's tokenizer manager does: HTTP 400 ``{"error": {"message": "The input (N
tokens) is longer than the model's context length (C tokens)."}}``, or the "Requested token
count exceeds" one when the prompt fits but not with ``max_new_tokens``. With
``return_logprob`` and ``top_logprobs_num`` k, ``meta_info.output_top_logprobs`` gives, per
output position, the k most likely of the fake's distribution over the 256 byte ids,
``[logprob, id, null]``: softmax of -|id - output id| / ``FAKE_LOGIT_T`` (default 4), so
two fakes with different temperatures have a known KL (``fake_logprobs``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.request_params import RequestParamError, thresholds_for_request

# the real profile line's format, from the module the server's writer uses
from sglang_diffkv.serving_io.profile_lines import profile_line

READY = "The server is fired up and ready to roll!"
ERROR_HOOK_TOKENS = 99_991  # max_new_tokens that makes /generate stream an error chunk


FAKE_VOCAB = 256  # the copy model's token ids are bytes


def fake_token_count(text: str, chars_per_token: int = 4) -> int:
    """The fake tokenizer: one token a digit, ``chars_per_token`` other characters a token."""
    digits = sum(ch.isdigit() for ch in text)
    return digits + -(-(len(text) - digits) // chars_per_token)


def fake_logprobs(token: int, temperature: float) -> list[float]:
    """The copy model's next-token log-distribution over the byte ids when it emits
    ``token``: log-softmax of -|id - token| / temperature."""
    z = [-abs(i - token) / temperature for i in range(FAKE_VOCAB)]
    top = max(z)
    norm = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - norm for x in z]


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


@dataclass
class FakeReq:
    want: int
    cached: int = 0
    done: int = 0
    aborted: bool = False
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


@dataclass
class FakeState:
    step_s: float = 0.01
    stream_interval: int = 1
    decode_log_interval: int = 10
    max_running: int = 64
    pool_tokens: int = 100_000
    diffkv: bool = False
    running: list[FakeReq] = field(default_factory=list)
    waiting: list[FakeReq] = field(default_factory=list)
    steps: int = 0
    disconnects: int = 0
    gc_freezes: int = 0
    tokens_used: int = 0
    diffkv_config: DiffKVConfig | None = None  # set: custom_params are checked (diffkv)
    faults: frozenset[str] = frozenset()  # "accept_invalid", "short" (see the docstring)
    by_rid: dict[str, FakeReq] = field(default_factory=dict)
    forget: tuple[float, float] | None = None  # text prompts: the fraction range dropped
    context_length: int = 8192
    chars_per_token: int = 4
    logit_t: float = 4.0
    prefix_page: int = 16
    prefixes: set[int] = field(default_factory=set)  # hashes of cached page-aligned prefixes

    def cache_prompt(self, ids: list[int]) -> int:
        """Tokens of ``ids`` already cached (whole pages, at most len - 1); caches the rest."""
        p, hit, known = self.prefix_page, 0, True
        for end in range(p, len(ids) + 1, p):
            h = hash(tuple(ids[:end]))
            if known and h in self.prefixes:
                hit = min(end, len(ids) - 1)
            else:
                known = False
                self.prefixes.add(h)
        return hit

    def count(self, text: str) -> int:
        return fake_token_count(text, self.chars_per_token)

    def length_error(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """SGLang 0.5.17's tokenizer-manager checks of a prompt against the context."""
        ctx = self.context_length
        if prompt_tokens >= ctx:
            return (f"The input ({prompt_tokens} tokens) is longer than the model's context "
                    f"length ({ctx} tokens).")
        if prompt_tokens + max_new_tokens > ctx:
            return ("Requested token count exceeds the model's maximum context length of "
                    f"{ctx} tokens. You requested a total of {prompt_tokens + max_new_tokens} "
                    f"tokens: {prompt_tokens} tokens from the input messages and "
                    f"{max_new_tokens} tokens for the completion.")
        return None

    def copy_answer(self, prompt: str, max_new_tokens: int, top_logprobs_num: int = 0
                    ) -> dict[str, Any]:
        """The text-mode answer (see the module docstring)."""
        kept = prompt
        if self.forget is not None:
            a, b = (int(f * len(prompt)) for f in self.forget)
            kept = prompt[:a] + prompt[b:]
        ids = list(kept.encode()[-max_new_tokens:])
        meta: dict[str, Any] = {"prompt_tokens": self.count(prompt),
                                "completion_tokens": len(ids),
                                "finish_reason": {"type": "length"}}
        if top_logprobs_num > 0:
            dists = [fake_logprobs(t, self.logit_t) for t in ids]
            meta["output_token_logprobs"] = [[d[t], t, None] for d, t in zip(dists, ids,
                                                                             strict=True)]
            meta["output_top_logprobs"] = [
                [[d[i], i, None] for i in sorted(range(FAKE_VOCAB), key=lambda i: -d[i])
                 [:top_logprobs_num]] for d in dists]
        return {"text": kept, "output_ids": ids, "meta_info": meta}

    def finish(self, r: FakeReq, reason: str) -> None:
        meta = {"completion_tokens": r.done, "finish_reason": {"type": reason},
                "cached_tokens": r.cached}
        r.queue.put_nowait({"output_ids": [], "meta_info": meta})
        r.queue.put_nowait(None)

    def step(self) -> None:
        self.waiting = [r for r in self.waiting if not r.aborted]
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return
        self.steps += 1
        still = []
        for r in self.running:
            if r.aborted:
                continue
            r.done += 1
            if r.done >= r.want:
                # the last chunk carries the last ids and the finish reason
                meta = {"completion_tokens": r.done, "finish_reason": {"type": "length"},
                        "cached_tokens": r.cached}
                r.queue.put_nowait({"output_ids": [7], "meta_info": meta})
                r.queue.put_nowait(None)
                continue
            if r.done == 1 or r.done % self.stream_interval == 1 or self.stream_interval == 1:
                n = 1 if r.done == 1 else min(self.stream_interval, r.done)
                meta = {"completion_tokens": r.done, "finish_reason": None,
                        "cached_tokens": r.cached}
                r.queue.put_nowait({"output_ids": [7] * n, "meta_info": meta})
            still.append(r)
        self.running = still
        if self.steps % self.decode_log_interval == 0:
            used = sum(r.done for r in self.running)
            log(f"Decode batch, #running-req: {len(self.running)}, #token: {used}, "
                f"token usage: {used / self.pool_tokens:.2f}, cuda graph: False, "
                f"gen throughput (token/s): {len(self.running) / self.step_s:.2f}, "
                f"#queue-req: {len(self.waiting)}")
            if self.diffkv:
                log(f"DiffKV decode: batch {len(self.running)}, tokens high 30.0% / low 50.0% / "
                    f"pruned 20.0%; pages in use {used // 10}/1000 (1.0%; a bf16 cache would "
                    f"need {used // 4}), active requests {len(self.running)} holding {used} "
                    "tokens")
                n = self.decode_log_interval
                window = {"step": 12.5 * n, "alloc": 1.0 * n, "reclaim": 0.25 * n,
                          "free": 0.25 * n, "policy": 2.0 * n}
                log(profile_line("decode", n, window, self.steps,
                                 {k: v * self.steps / n for k, v in window.items()}))


def make_app(state: FakeState) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = body.get("input_ids")
        sp = body.get("sampling_params") or {}
        if isinstance(body.get("text"), str) and not body.get("stream"):
            new = int(sp.get("max_new_tokens", 16))
            err = state.length_error(state.count(body["text"]), new)
            if err is not None:
                log(f"[http_server] Error: {err}")
                return web.json_response({"error": {"message": err}}, status=400)
            k = int(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else 0
            return web.json_response(state.copy_answer(body["text"], new, k))
        if not isinstance(ids, list) or not ids or not body.get("stream"):
            return web.json_response({"error": {"message": "need input_ids and stream"}},
                                     status=400)
        want = int(sp.get("max_new_tokens", 16))
        if state.diffkv_config is not None and "accept_invalid" not in state.faults:
            try:
                thresholds_for_request(sp.get("custom_params"), state.diffkv_config)
            except RequestParamError as e:  # SGLang: ValueError in the tokenizer manager
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                err = {"message": str(e), "type": "invalid_request_error", "code": 400}
                await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                return resp
        if "short" in state.faults and want > 1:
            want -= 1
        if want == ERROR_HOOK_TOKENS:  # for the tests: the server reports an error mid-stream
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"error": {"message": "boom"}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        r = FakeReq(want, cached=state.cache_prompt(ids))
        log(f"Prefill batch, #new-seq: 1, #new-token: {len(ids) - r.cached}, "
            f"#cached-token: {r.cached}, token usage: 0.00, #running-req: "
            f"{len(state.running)}, #queue-req: {len(state.waiting)}")
        state.waiting.append(r)
        rid = body.get("rid")
        if isinstance(rid, str):
            state.by_rid[rid] = r
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while (item := await r.queue.get()) is not None:
                await resp.write(b"data: " + json.dumps(item).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            # SGLang aborts a disconnected stream (create_abort_task); so does the fake, and
            # like SGLang it logs no traceback for it
            state.disconnects += 1
            r.aborted = True
            return resp
        except asyncio.CancelledError:
            state.disconnects += 1
            r.aborted = True
            raise
        finally:
            if isinstance(rid, str):
                state.by_rid.pop(rid, None)
        return resp

    async def abort(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("abort_all"):
            for r in state.running + state.waiting:
                r.aborted = True
                state.finish(r, "abort")
            state.running, state.waiting = [], []
        elif isinstance(rid := body.get("rid"), str) and (r := state.by_rid.get(rid)) \
                and not r.aborted:
            r.aborted = True
            state.finish(r, "abort")
        return web.Response(status=200)

    async def flush_cache(request: web.Request) -> web.Response:
        if state.running or state.waiting:  # SGLang flushes only when idle
            return web.Response(status=400, text="not idle")
        state.prefixes.clear()
        log("Cache flushed successfully!")
        return web.Response(status=200, text="Cache flushed.")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return web.json_response({"object": "error", "message": "need prompt"}, status=400)
        counts = [state.count(t) for t in texts]
        tokens = [list(range(n)) for n in counts]
        return web.json_response({
            "tokens": tokens[0] if isinstance(prompt, str) else tokens,
            "count": counts[0] if isinstance(prompt, str) else counts,
            "max_model_len": state.context_length})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"context_length": state.context_length,
                                  "max_req_input_len": state.context_length - 6,
                                  "version": "fake"})

    async def get_load(request: web.Request) -> web.Response:
        live = [r for r in state.running if not r.aborted]
        queued = [r for r in state.waiting if not r.aborted]
        return web.json_response([{"dp_rank": 0, "num_reqs": len(live) + len(queued),
                                   "num_waiting_reqs": len(queued), "num_tokens": 0,
                                   "ts_tic": time.perf_counter()}])

    async def freeze_gc(request: web.Request) -> web.Response:
        state.gc_freezes += 1
        log("Freezing GC in Tokenizer Manager process.")
        return web.Response(status=200)

    async def ticker(app: web.Application) -> Any:
        async def loop() -> None:
            while True:
                state.step()
                await asyncio.sleep(state.step_s)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    app.router.add_get("/get_load", get_load)
    app.router.add_post("/freeze_gc", freeze_gc)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    if os.environ.get("FAKE_NO_TOKENIZE") != "1":
        app.router.add_post("/tokenize", tokenize)
    app.cleanup_ctx.append(ticker)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--tp-size", type=int, default=1)
    a, _ = p.parse_known_args(argv)
    state = FakeState(step_s=float(os.environ.get("FAKE_STEP_S", "0.01")),
                      stream_interval=a.stream_interval,
                      decode_log_interval=a.decode_log_interval,
                      max_running=int(os.environ.get("FAKE_MAX_RUNNING", "64")),
                      pool_tokens=int(os.environ.get("FAKE_POOL_TOKENS", "100000")),
                      diffkv=a.attention_backend == "diffkv")
    state.context_length = a.context_length
    state.chars_per_token = int(os.environ.get("FAKE_CHARS_PER_TOKEN", "4"))
    state.logit_t = float(os.environ.get("FAKE_LOGIT_T", "4"))
    state.prefix_page = int(os.environ.get("FAKE_PREFIX_PAGE", "16"))
    if forget := os.environ.get("FAKE_FORGET"):
        a_, b_ = (float(x) for x in forget.split(","))
        state.forget = (a_, b_)
    if state.diffkv:
        state.diffkv_config = DiffKVConfig.from_env()
    log(f"server_args: {' '.join(sys.argv[1:])}")
    # SGLang's resolved-arguments line (diffkv forces the radix cache off with --tp-size > 1)
    no_radix = a.disable_radix_cache or (state.diffkv and a.tp_size > 1)
    log(f"server_args=ServerArgs(attention_backend={a.attention_backend!r}, "
        f"tp_size={a.tp_size}, disable_radix_cache={no_radix})")
    if os.environ.get("FAKE_EXIT_EARLY") == "1":
        log("Traceback (most recent call last): fake start-up failure")
        return 3
    log(f"max_total_num_tokens={state.pool_tokens}, chunked_prefill_size=8192, "
        f"max_prefill_tokens=16384, max_running_requests={state.max_running}, "
        f"context_len={state.context_length}")
    if state.diffkv:
        log(f"DiffKV KV cache: config from SGLANG_DIFFKV_CONFIG="
            f"{os.environ.get('SGLANG_DIFFKV_CONFIG')}")
        # capacity_report's line (numbers made up: FAKE_ALL_HIGH tokens all-high)
        all_high = int(os.environ.get("FAKE_ALL_HIGH", str(state.pool_tokens // 2)))
        log(f"DiffKV KV cache: 1000 pages = 0.50 GiB; capacity {all_high} tokens all-high, "
            f"{2 * all_high} all-low; the same memory holds {state.pool_tokens // 4} "
            "fp16/bf16 tokens")
        log("diffkv: disable_cuda_graph=True (forced): fake")

    async def serve() -> None:
        runner = web.AppRunner(make_app(state))
        await runner.setup()
        await web.TCPSite(runner, a.host, a.port).start()
        log(READY)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        log("SIGTERM received; shutting down")
        await runner.cleanup()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
