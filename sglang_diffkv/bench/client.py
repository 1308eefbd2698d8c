"""An asyncio streaming client for SGLang's native ``/generate`` (``--skip-tokenizer-init``).

Each request sends ``input_ids`` (seeded random ids < 128000, the same for every configuration)
and ``sampling_params {max_new_tokens, temperature 0, ignore_eos true}`` with ``stream: true``.

What SGLang 0.5.10 streams (``tokenizer_manager._handle_batch_output``): Server-Sent-Events
lines ``data: {"output_ids": [...], "meta_info": {..., "completion_tokens": N, ...}}`` and a
final ``data: [DONE]``. ``meta_info.completion_tokens`` is always the cumulative count;
``output_ids`` are cumulative by default and only the new ids with
``--incremental-streaming-output``; with the default, a slow reader is sent only the latest
chunk (intermediate ones are dropped, not queued). So tokens per chunk are counted as the
difference of ``completion_tokens``, which is right in both modes. A request aborted on the
server ends with ``finish_reason {"type": "abort"}``; errors arrive as ``data: {"error": ...}``.

Stopping: after ``max_duration_s`` the client cancels every outstanding stream (closing the
connection; SGLang aborts a disconnected stream 2 s later, ``create_abort_task``), then the
caller calls ``abort_all`` (``POST /abort_request {"abort_all": true}``, immediate, also for
queued requests) and ``wait_idle`` (``GET /get_load`` until no request is running or waiting)
before the next workload starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from sglang_diffkv.bench.errors import BenchInputError

VOCAB_IDS = 128_000  # Llama-3's ordinary ids; 128000.. are special tokens
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_ABORT = re.compile(rb'"finish_reason"\s*:\s*\{[^}]*"type"\s*:\s*"abort"')


@dataclass(frozen=True)
class RequestSpec:
    """One request: when it is sent (s after the run starts) and its token counts."""

    arrival_s: float
    input_len: int
    output_len: int
    # the prompt's leading blocks, by id: equal ids are equal token blocks in every request
    # (``block_ids``), so requests whose ids agree share that token prefix
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 512

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise BenchInputError(f"arrival_s={self.arrival_s!r} must be a finite number >= 0")
        for name in ("input_len", "output_len", "block_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BenchInputError(f"{name}={v!r} must be an integer >= 1")
        if len(self.prefix_blocks) * self.block_tokens >= self.input_len + self.block_tokens:
            raise BenchInputError(
                f"{len(self.prefix_blocks)} prefix blocks of {self.block_tokens} tokens do not "
                f"fit a {self.input_len}-token prompt (its last block may be partial, no more)")


@dataclass
class RequestRecord:
    """What happened to one request; times are seconds after the run's start."""

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    send_s: float | None = None
    first_token_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    tokens: int = 0
    completed: bool = False
    cancelled: bool = False
    error: str | None = None
    # prompt tokens the server took from its prefix cache (SGLang's meta_info.cached_tokens)
    cached_tokens: int | None = None

    def compact(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunk_s"] = [round(t, 5) for t in self.chunk_s]
        # one token per chunk is the common case with --stream-interval 1: store only others
        if all(n == 1 for n in self.chunk_tokens):
            d["chunk_tokens"] = 1
        return d


@dataclass
class ClientRun:
    """A replay's records plus the window it ran in (``window_s``: seconds from the start to
    when the client stopped; ``time_limited``: stopped by ``max_duration_s``)."""

    records: list[RequestRecord]
    wall_start: float
    window_s: float
    time_limited: bool
    max_inflight: int
    mode: str

    @property
    def not_sent(self) -> int:
        return sum(r.send_s is None for r in self.records)


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to the hard limit (children inherit it: the
    server needs one descriptor per client connection) and return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return int(hard if soft == resource.RLIM_INFINITY else soft)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return int(hard)
    return int(soft)


def default_max_inflight(fd_limit: int, cap: int = 4096) -> int:
    """Open streams the client may hold: the fd limit less a margin for the server's own
    files (it shares the limit through inheritance), at most ``cap``."""
    return max(1, min(cap, fd_limit - 256))


def prompt_ids(seed: int, index: int, length: int) -> list[int]:
    """Request ``index``'s prompt: seeded, independent of the configuration and of order."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, VOCAB_IDS, size=length).tolist()


# a third seed word keeps block streams apart from the per-request streams [seed, index]
_BLOCK_STREAM = 0x51_0C


def block_ids(seed: int, block: int, length: int) -> list[int]:
    """Prefix block ``block``'s first ``length`` token ids (the same in every request)."""
    rng = np.random.default_rng([seed, _BLOCK_STREAM, block])
    return rng.integers(0, VOCAB_IDS, size=length).tolist()


def request_ids(spec: RequestSpec, seed: int, index: int) -> list[int]:
    """The prompt of request ``index``: its prefix blocks (the last one cut to the prompt's
    length), then its own seeded tokens for the rest."""
    ids: list[int] = []
    for b in spec.prefix_blocks:
        ids += block_ids(seed, b, min(spec.block_tokens, spec.input_len - len(ids)))
    if len(ids) < spec.input_len:
        ids += prompt_ids(seed, index, spec.input_len - len(ids))
    return ids


# every request asks for exactly max_new_tokens (ignore_eos); with the radix cache off SGLang
# then admits under its strict no-retraction rule (sglang_diffkv.bench.admission)
SENDS_IGNORE_EOS = True


def generate_payload(spec: RequestSpec, seed: int, index: int) -> dict[str, Any]:
    return {
        "input_ids": request_ids(spec, seed, index),
        "sampling_params": {"max_new_tokens": spec.output_len, "temperature": 0.0,
                            "ignore_eos": SENDS_IGNORE_EOS},
        "stream": True,
    }


def _chunk_tokens(line: bytes) -> tuple[int | None, bool, str | None]:
    """(cumulative completion tokens or None, aborted?, error message or None) of one SSE line.
    A regex reads the count (a chunk is ~100 bytes; json.loads of thousands per second would
    cost the client more than the server); JSON is parsed only when the regex finds nothing."""
    if m := _COMPLETION.search(line):
        return int(m.group(1)), bool(_ABORT.search(line)), None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None, False, f"unparsable chunk {line[:120]!r}"
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        return None, False, f"server error: {msg}"
    return None, False, f"chunk without meta_info.completion_tokens: {line[:120]!r}"


_JSON = {"Content-Type": "application/json"}


async def _one_request(session: aiohttp.ClientSession, url: str, spec: RequestSpec,
                       rec: RequestRecord, body: bytes, t0: float) -> None:
    rec.send_s = time.perf_counter() - t0
    last = 0
    aborted = False
    async with session.post(url, data=body, headers=_JSON) as resp:
        if resp.status != 200:
            body = (await resp.text())[:300]
            rec.error = f"HTTP {resp.status}: {body}"
            rec.end_s = time.perf_counter() - t0
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line:
                continue
            now = time.perf_counter() - t0
            if line.startswith(b"data:"):
                line = line[5:].strip()
            if line == b"[DONE]":
                rec.end_s = now
                break
            count, aborted_here, err = _chunk_tokens(line)
            if rec.cached_tokens is None and (m := _CACHED.search(line)):
                rec.cached_tokens = int(m.group(1))
            aborted = aborted or aborted_here
            if err is not None:
                rec.error = err
                continue
            assert count is not None
            new = count - last
            if new <= 0:
                continue
            if rec.first_token_s is None:
                rec.first_token_s = now
            rec.chunk_s.append(now)
            rec.chunk_tokens.append(new)
            last = count
            rec.tokens = count
    if rec.end_s is None:
        rec.end_s = time.perf_counter() - t0
        rec.error = rec.error or "stream ended without [DONE]"
    if aborted and rec.error is None:
        rec.error = f"aborted by the server after {rec.tokens} tokens"
    if rec.error is None and rec.tokens < spec.output_len:
        rec.error = f"finished with {rec.tokens} of {spec.output_len} tokens"
    rec.completed = rec.error is None


async def replay(base_url: str, specs: Sequence[RequestSpec], *, all_at_once: bool = False,
                 max_duration_s: float | None = None, seed: int = 0,
                 max_inflight: int = 4096, connect_timeout_s: float = 30.0) -> ClientRun:
    """Send ``specs`` (open loop at their ``arrival_s``, or all at t = 0) and record each
    stream. At most ``max_inflight`` streams are open at once (later requests wait for a slot;
    with all_at_once that is a closed loop of that many users). After ``max_duration_s`` every
    outstanding request is cancelled and unsent ones are never sent."""
    if not specs:
        raise BenchInputError("replay() needs at least one request")
    if max_duration_s is not None and not (max_duration_s > 0 and math.isfinite(max_duration_s)):
        raise BenchInputError(f"max_duration_s={max_duration_s!r} must be a positive number")
    if max_inflight < 1:
        raise BenchInputError(f"max_inflight={max_inflight} must be >= 1")
    url = base_url.rstrip("/") + "/generate"
    records = [RequestRecord(i, 0.0 if all_at_once else s.arrival_s, s.input_len, s.output_len)
               for i, s in enumerate(specs)]
    # serialised before the clock starts: 1,500 prompts of up to 4,096 ids take ~1 s of CPU,
    # which would otherwise delay the t = 0 burst
    bodies = [json.dumps(generate_payload(s, seed, i)).encode() for i, s in enumerate(specs)]
    slots = asyncio.Semaphore(max_inflight)
    # no total/read timeout: a 4096-token stream at batch 500 runs for minutes
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=None)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    t0 = time.perf_counter()
    wall_start = time.time()

    async def task(spec: RequestSpec, rec: RequestRecord, body: bytes) -> None:
        # asyncio may fire a timer up to its clock resolution early, and its clock is not
        # perf_counter: sleep again until the trace time has really come (never send early)
        while (delay := rec.arrival_s - (time.perf_counter() - t0)) > 0:
            await asyncio.sleep(delay)
        async with slots:
            try:
                await _one_request(session, url, spec, rec, body, t0)
            except asyncio.CancelledError:
                if rec.send_s is not None:
                    rec.cancelled = True
                    rec.end_s = time.perf_counter() - t0
                raise
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                rec.error = f"{type(e).__name__}: {e}"
                rec.end_s = time.perf_counter() - t0

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(task(s, r, b))
                 for s, r, b in zip(specs, records, bodies, strict=True)]
        done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
        stopped = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if (exc := t.exception()) is not None:
                raise exc
    time_limited = bool(pending)
    if not time_limited:
        stopped = max((r.end_s or 0.0) for r in records)
    mode = "all-at-once" if all_at_once else "trace"
    return ClientRun(records, wall_start, stopped, time_limited, max_inflight, mode)


async def _post_ok(base_url: str, path: str, timeout_s: float,
                   body: dict[str, Any] | None = None) -> bool:
    """``POST path`` (with a JSON ``body``); True when the server answered 200."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as s, \
                s.post(base_url.rstrip("/") + path, json=body) as r:
            return r.status == 200
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return False


async def abort_all(base_url: str, timeout_s: float = 10.0) -> bool:
    """``POST /abort_request {"abort_all": true}``; True when the server answered 200."""
    return await _post_ok(base_url, "/abort_request", timeout_s, {"abort_all": True})


async def freeze_gc(base_url: str, timeout_s: float = 30.0) -> bool:
    """``POST /freeze_gc``: SGLang moves every object its tokenizer manager, scheduler and
    detokenizer hold into the GC's permanent generation, so a later full collection does not
    walk them (SGLang's advice after warm-up: a full collection of the tokenizer manager's
    start-up heap pauses it for hundreds of ms). True when the server answered 200."""
    return await _post_ok(base_url, "/freeze_gc", timeout_s)


async def flush_cache(base_url: str, timeout_s: float = 30.0) -> bool:
    """``POST /flush_cache``: SGLang empties its prefix cache (only when idle). True when it
    answered 200."""
    return await _post_ok(base_url, "/flush_cache", timeout_s)


async def server_load(base_url: str, timeout_s: float = 5.0) -> int | None:
    """Requests running or waiting (``GET /get_load``, summed over DP ranks); None when the
    server did not answer."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as s, \
                s.get(base_url.rstrip("/") + "/get_load") as r:
            if r.status != 200:
                return None
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, json.JSONDecodeError):
        return None
    ranks = data if isinstance(data, list) else [data]
    try:
        return int(sum(int(d["num_reqs"]) for d in ranks))
    except (KeyError, TypeError, ValueError):
        return None


async def wait_idle(base_url: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> float | None:
    """Seconds until the server reports no running or waiting request; None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await server_load(base_url) == 0:
            return time.monotonic() - t0
        await asyncio.sleep(poll_s)
    return None


def run_async(coro: Any) -> Any:
    """asyncio.run with uvloop when it is installed (SGLang's machines have it): the client
    parses thousands of chunks per second."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro) if hasattr(uvloop, "run") else asyncio.run(coro)
