"""A served fuzz run against a running SGLang server with ``--attention-backend diffkv``
(issue 50 item 4): many streaming ``/generate`` requests of random lengths, with random valid
and invalid ``custom_params``, some abandoned mid-stream (the client closes the connection)
and some aborted (``POST /abort_request {"rid": ...}``), at a concurrency that forces
retractions; then the server must be idle, healthy and alive.

    python -m sglang_diffkv.bench.fuzz_serve --url http://127.0.0.1:30000 --out /tmp/fuzz \\
        [--n 1000] [--seed 0] [--concurrency 384] [--server-pid PID] [--deadline-s 400]

Every request is one of four kinds (seeded, ``--invalid-frac`` / ``--disconnect-frac`` /
``--abort-frac``, the rest valid), with a sub-kind naming what its ``custom_params`` hold:

- valid: absent, null, {}, diffkv_alpha_h and/or diffkv_alpha_l inside the bounds (floats,
  ints, edge values, integers above 2**64), foreign keys (``temperature``, ``DIFFKV_ALPHA_H``,
  ``diffkv`` ...) beside or without DiffKV keys. It must stream exactly max_new_tokens tokens
  (``ignore_eos``) and end with ``[DONE]``.
- invalid(key): a string, null, list, object or bool value; NaN / Infinity (the literals
  Python's JSON reads), 1e999 (strict JSON, read as inf), "NaN" / "inf" strings; huge or
  negative numbers; alpha_l > alpha_h (both given, or one against the config); an unknown
  ``diffkv_*`` key; a custom_params that is not an object. It must fail alone, with one error
  line that names the offending key (the server's tokenizer-manager check,
  ``sglang_diffkv.sglang.request_check``), and stream no token.
- disconnect: valid parameters; the client closes the connection once it has received k
  tokens (k up to half of max_new_tokens; SGLang aborts the request 2 s later). Nothing may
  fail before the cut.
- abort: valid parameters; once k tokens have arrived the client posts ``/abort_request`` with the
  request's rid and reads on: the stream must end (finish_reason abort, an abort error, or
  complete if it finished first) within ``--abort-timeout-s``.

Each generated ``custom_params`` is first checked against the project's own rule
(``sglang_diffkv.request_params.thresholds_for_request`` with ``--diffkv-config``, which must
be the server's SGLANG_DIFFKV_CONFIG): a disagreement is a bug of this generator and stops
the run before anything is sent.

Verdict (exit code 0 pass / 1 fail / 2 server not reachable at the start): ``/health`` is 200
before and after the run; every valid request (and every abandoned one up to its cut)
succeeded; every invalid one was refused naming its key; no abort hung; the server drained
to no running or waiting request (``/get_load``); after ``--idle-s`` idle (SGLang's strict idle
memory check runs) ``/health`` is still 200 and ``--server-pid``, when given, is alive; the
run finished before ``--deadline-s``. ``--out`` gets results.json (arguments, verdict, one
record per request) and summary.txt (the verdict in words and counts per kind / sub-kind /
outcome).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from sglang_diffkv.bench import client as cl
from sglang_diffkv.config import MAX_ALPHA, DiffKVConfig
from sglang_diffkv.request_params import (
    ALPHA_H_PARAM,
    ALPHA_L_PARAM,
    RequestParamError,
    thresholds_for_request,
)

KINDS = ("valid", "invalid", "disconnect", "abort")
H, L = ALPHA_H_PARAM, ALPHA_L_PARAM
_JSON = {"Content-Type": "application/json"}
_PLACEHOLDER = '"__FUZZ_CUSTOM_PARAMS__"'


class GeneratorError(AssertionError):
    """A generated case disagrees with thresholds_for_request: a bug of this module."""


@dataclass
class Case:
    """One request: its kind, what its custom_params hold (``raw``: the exact JSON text sent,
    None for no custom_params key) and for an invalid one the key its error must name."""

    index: int
    rid: str
    kind: str
    sub: str
    raw: str | None
    input_len: int
    output_len: int
    expect_key: str | None = None
    cut_after: int | None = None  # tokens received before a disconnect / abort


@dataclass
class Record:
    index: int
    rid: str
    kind: str
    sub: str
    params: str | None
    expect_key: str | None
    input_len: int
    output_len: int
    cut_after: int | None
    status: int | None = None
    outcome: str = "not sent"
    error: str | None = None
    tokens: int = 0
    chunks: int = 0
    done_marker: bool = False
    finish: str | None = None
    abort_status: int | None = None
    send_s: float | None = None
    end_s: float | None = None
    ok: bool = False
    why: str = ""


# ---------------------------------------------------------------- generation


def _num(x: float | int) -> str:
    """JSON text of a number (ints exactly, floats by repr: 5e-324, 3.4028234663852886e+38)."""
    return str(x) if isinstance(x, int) else repr(float(x))


def _obj(items: list[tuple[str, str]]) -> str:
    """A JSON object from (key, raw JSON value text) pairs."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in items) + "}"


FOREIGN_KEYS = ["temperature", "x", "DIFFKV_ALPHA_H", "diffkv", "alpha_h", "", "thinking_note",
                "diffkvalpha_h"]


def _foreign_value(rng: random.Random) -> str:
    # scalars only: SGLang's IPC types custom_params values as JSON scalars / flat containers
    return rng.choice(['"bar"', "3", "0.5", "true", "null", '""', "-7", '"diffkv_alpha_h"'])


def _valid_pair(rng: random.Random, cfg: DiffKVConfig) -> list[tuple[str, str]]:
    r = rng.random()
    if r < 0.25:  # only alpha_h, not below the config's alpha_l
        lo = cfg.alpha_l
        h = rng.choice([lo, lo + rng.random() * 64, MAX_ALPHA, max(lo, 64.0), lo * 2 + 1])
        return [(H, _num(min(h, MAX_ALPHA)))]
    if r < 0.45:  # only alpha_l, not above the config's alpha_h
        hi = cfg.alpha_h
        low = rng.choice([0.0, 0, rng.random() * min(hi, 0.5), hi, 5e-324])
        return [(L, _num(min(low, hi)))]
    # both, alpha_l <= alpha_h
    a, b = sorted([rng.random() * rng.choice([1, 8, 64, 1e6]), rng.random()])
    pair = rng.choice([(b, a), (0.0, 0.0), (MAX_ALPHA, 0.0), (5e-324, 0.0), (b, b), (3, 1),
                       (0, 0), (1.0, 0)])
    items = [(H, _num(pair[0])), (L, _num(pair[1]))]
    rng.shuffle(items)
    return items


def valid_params(rng: random.Random, cfg: DiffKVConfig) -> tuple[str, str | None]:
    """(sub-kind, raw JSON text or None) of a custom_params the server must accept."""
    r = rng.random()
    if r < 0.15:
        return "absent", None
    if r < 0.20:
        return "null", "null"
    if r < 0.25:
        return "empty", "{}"
    if r < 0.65:
        return "alpha", _obj(_valid_pair(rng, cfg))
    if r < 0.72:  # an integer alpha above 2**64 (inside [0, MAX_ALPHA]), beside alpha_l 0
        return "alpha_bigint", _obj([(H, str(10 ** rng.randint(20, 38))), (L, "0")])
    items = [(k, _foreign_value(rng)) for k in rng.sample(FOREIGN_KEYS, rng.randint(1, 3))]
    if rng.random() < 0.5:
        items += _valid_pair(rng, cfg)
    rng.shuffle(items)
    return "foreign", _obj(items)


BAD_VALUES = {  # sub-kind -> raw JSON texts of a value no alpha takes
    "string": ['"2.0"', '"0"', '""', '"1e3"'],
    "null_value": ["null"],
    "list": ["[1.0]", "[]", "[0, 1]"],
    "object": ['{"v": 1}', "{}"],
    "bool": ["true", "false"],
    "nan": ["NaN", '"NaN"', '"nan"'],
    "inf": ["Infinity", "-Infinity", "1e999", "-1e999", '"inf"', '"Infinity"'],
    "huge": ["1e39", "3.5e38", str(10 ** 40), str(10 ** 400), str(-(10 ** 30)),
             "1.7976931348623157e308"],
    "negative": ["-1e-9", "-1", "-0.5", "-5e-324"],
}
UNKNOWN_KEYS = ["diffkv_alpha_hh", "diffkv_", "diffkv_window", "diffkv_alpha", "diffkv_alpha_H",
                "diffkv_alpha_h ", "diffkv_ALPHA_L"]
NON_OBJECTS = ['"abc"', "[1, 2]", "3", "true", "0", '[{"diffkv_alpha_h": 1.0}]',
               '"{\\"diffkv_alpha_h\\": 1}"', "[]", '""']


def invalid_params(rng: random.Random, cfg: DiffKVConfig) -> tuple[str, str, str]:
    """(sub-kind, raw JSON text, the key the error must name) of a custom_params the server
    must refuse."""
    r = rng.random()
    if r < 0.10:
        return "non_object", rng.choice(NON_OBJECTS), "custom_params"
    if r < 0.25:
        key = rng.choice(UNKNOWN_KEYS)
        items = [(key, _num(rng.random()))]
        if rng.random() < 0.5:
            items += _valid_pair(rng, cfg)
        if rng.random() < 0.3:
            items.append((rng.choice(FOREIGN_KEYS), _foreign_value(rng)))
        rng.shuffle(items)
        return "unknown_key", _obj(items), key
    if r < 0.35:  # alpha_l > alpha_h, both given
        a = rng.choice([0.0, 0.1, 1.0, 5e-324, 7])
        b = rng.choice([a + 0.5, a * 2 + 1, MAX_ALPHA])
        items = [(H, _num(a)), (L, _num(b))]
        rng.shuffle(items)
        return "order", _obj(items), L
    if r < 0.40 and cfg.alpha_h < MAX_ALPHA:  # alpha_l above the config's alpha_h
        return "order_config", _obj([(L, _num(min(MAX_ALPHA, cfg.alpha_h * 2 + 1)))]), L
    sub = rng.choice(sorted(BAD_VALUES))
    key = rng.choice([H, L])
    items = [(key, rng.choice(BAD_VALUES[sub]))]
    other = L if key == H else H
    if rng.random() < 0.4:  # a good value for the other key, so the bad one alone is at fault
        items.append((other, "0" if other == L else _num(MAX_ALPHA)))
    if rng.random() < 0.3:
        items.append((rng.choice(FOREIGN_KEYS), _foreign_value(rng)))
    rng.shuffle(items)
    return sub, _obj(items), key


def oracle(raw: str | None, cfg: DiffKVConfig) -> str | None:
    """None when the server must accept ``raw``, else the project's own error message."""
    try:
        thresholds_for_request(None if raw is None else json.loads(raw), cfg)
    except RequestParamError as e:
        return str(e)
    return None


def _lengths(rng: random.Random, max_input: int, max_output: int, long: bool
             ) -> tuple[int, int]:
    r = rng.random()
    if r < 0.6:
        inp = rng.randint(1, max(1, max_input // 4))
    elif r < 0.9:
        inp = rng.randint(max(1, max_input // 4), max(1, (max_input * 2) // 3))
    else:
        inp = rng.randint(max(1, (max_input * 2) // 3), max_input)
    r = rng.random()
    if long or r < 0.15:
        out = rng.randint(max(1, max_output // 2), max_output)
    elif r < 0.5:
        out = rng.randint(1, max(1, max_output // 16))
    else:
        out = rng.randint(max(1, max_output // 16), max(1, max_output // 2))
    return inp, out


def make_cases(n: int, seed: int, cfg: DiffKVConfig, *, invalid_frac: float = 0.3,
               disconnect_frac: float = 0.1, abort_frac: float = 0.1, max_input: int = 3072,
               max_output: int = 2048, skip: tuple[str, ...] = ()) -> list[Case]:
    """``n`` seeded requests; each generated custom_params is checked against
    ``thresholds_for_request`` (GeneratorError when they disagree)."""
    rng = random.Random(seed)
    cases: list[Case] = []
    while len(cases) < n:
        i = len(cases)
        r = rng.random()
        kind = ("invalid" if r < invalid_frac else
                "disconnect" if r < invalid_frac + disconnect_frac else
                "abort" if r < invalid_frac + disconnect_frac + abort_frac else "valid")
        expect_key = None
        if kind == "invalid":
            sub, raw, expect_key = invalid_params(rng, cfg)
        else:
            sub, raw = valid_params(rng, cfg)
        if sub in skip:
            continue
        inp, out = _lengths(rng, max_input, max_output, long=kind in ("disconnect", "abort"))
        cut = rng.randint(1, max(1, out // 2)) if kind in ("disconnect", "abort") else None
        msg = oracle(raw, cfg)
        if kind == "invalid":
            if msg is None:
                raise GeneratorError(f"case {i} ({sub}) custom_params={raw} is accepted")
            if expect_key not in msg or "\n" in msg:
                raise GeneratorError(f"case {i} ({sub}): {msg!r} does not name {expect_key!r}")
        elif msg is not None:
            raise GeneratorError(f"case {i} ({sub}) custom_params={raw} is refused: {msg}")
        cases.append(Case(i, f"fuzz-{seed}-{i}-{os.getpid()}", kind, sub, raw, inp, out,
                          expect_key, cut))
    return cases


def request_body(case: Case, seed: int) -> bytes:
    sp: dict[str, Any] = {"max_new_tokens": case.output_len, "temperature": 0.0,
                          "ignore_eos": True}
    if case.raw is not None:
        sp["custom_params"] = "__FUZZ_CUSTOM_PARAMS__"
    body = {"input_ids": cl.prompt_ids(seed, case.index, case.input_len),
            "sampling_params": sp, "stream": True, "rid": case.rid}
    text = json.dumps(body)
    if case.raw is not None:
        text = text.replace(_PLACEHOLDER, case.raw, 1)
    return text.encode()


# ---------------------------------------------------------------- running


def _error_text(body: str) -> str:
    """The message of an HTTP error body (SGLang: {"error": {"message": ...}} or {"detail"})."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message", obj)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:1000]
    return str(obj)[:300]


_FINISH = ("length", "stop", "abort")


def _finish_type(line: bytes) -> str | None:
    if b'"finish_reason"' not in line:
        return None
    for t in _FINISH:
        if f'"type": "{t}"'.encode() in line or f'"type":"{t}"'.encode() in line:
            return t
    return None


async def _abort(session: aiohttp.ClientSession, base: str, rid: str) -> int | None:
    try:
        async with session.post(base + "/abort_request", json={"rid": rid}) as r:
            return r.status
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None


async def run_case(session: aiohttp.ClientSession, base: str, case: Case, rec: Record,
                   body: bytes, t0: float, abort_timeout_s: float) -> None:
    rec.send_s = time.perf_counter() - t0
    errors: list[str] = []
    disconnected = hung = False
    last = 0
    try:
        async with session.post(base + "/generate", data=body, headers=_JSON) as resp:
            rec.status = resp.status
            if resp.status != 200:
                errors.append(_error_text(await resp.text()))
            else:
                abort_at: float | None = None
                while True:
                    wait = None if abort_at is None else max(0.01, abort_at - time.monotonic())
                    try:
                        raw = await asyncio.wait_for(resp.content.readline(), wait)
                    except asyncio.TimeoutError:
                        hung = True
                        resp.close()
                        break
                    if not raw:
                        break
                    line = raw.strip()
                    if not line:
                        continue
                    if line.startswith(b"data:"):
                        line = line[5:].strip()
                    if line == b"[DONE]":
                        rec.done_marker = True
                        break
                    count, aborted, err = cl._chunk_tokens(line)
                    rec.finish = "abort" if aborted else (_finish_type(line) or rec.finish)
                    if err is not None:
                        errors.append(err.removeprefix("server error: "))
                        continue
                    if count is not None and count > last:
                        last = count
                        rec.tokens = count
                        rec.chunks += 1
                    if case.cut_after is not None and rec.tokens >= case.cut_after:
                        if case.kind == "disconnect":
                            disconnected = True
                            resp.close()  # the TCP connection, not just this response
                            break
                        if case.kind == "abort" and abort_at is None:
                            abort_at = time.monotonic() + abort_timeout_s
                            rec.abort_status = await _abort(session, base, case.rid)
    except asyncio.CancelledError:
        rec.outcome = "timeout"
        rec.end_s = time.perf_counter() - t0
        raise
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        # ValueError: aiohttp's line-length limit on a chunk
        errors.append(f"{type(e).__name__}: {e}")
    rec.end_s = time.perf_counter() - t0
    rec.error = errors[0] if errors else None
    aborted_err = rec.error is not None and "abort" in rec.error.lower()
    if hung:
        rec.outcome = "hung"
    elif disconnected:
        rec.outcome = "disconnected" if not errors else "error"
    elif errors:
        rec.outcome = ("aborted" if case.kind == "abort" and aborted_err
                       else "rejected" if rec.tokens == 0 else "error")
    elif rec.finish == "abort":
        rec.outcome = "aborted"
    elif not rec.done_marker:
        rec.outcome = "truncated"
    elif rec.tokens >= case.output_len:
        rec.outcome = "completed"
    else:
        rec.outcome = "short"


def _finite_number(text: str) -> float:
    value = float(text)  # an integer beyond a double's range raises OverflowError
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(text)
    return value


def is_strict_json(raw: str | None) -> bool:
    """Whether ``raw`` is JSON a strict parser reads: no NaN / Infinity literals and every
    number representable as a finite double. SGLang's HTTP layer (orjson) refuses the whole
    request body otherwise, before any DiffKV code runs."""
    if raw is None:
        return True

    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(raw, parse_constant=refuse, parse_float=_finite_number,
                   parse_int=_finite_number)
    except (ValueError, OverflowError):
        return False
    return True


def judge(case: Case, rec: Record) -> tuple[bool, str]:
    """(ok, why not) of one request's record."""
    if rec.outcome in ("not sent", "timeout"):
        return False, f"{rec.outcome} (deadline)"
    if case.kind == "invalid":
        if rec.outcome != "rejected":
            return False, f"invalid params not refused: {rec.outcome}, {rec.tokens} tokens"
        msg = rec.error or ""
        if (not is_strict_json(case.raw) and rec.status is not None
                and 400 <= rec.status < 500 and "JSON decode error" in msg):
            # a body that is not strict JSON never reaches DiffKV behind a strict parser:
            # SGLang's HTTP layer (orjson) refuses it, HTTP 400 with its own multi-line
            # pydantic message naming the byte offset; what must hold is that it fails
            # alone, as a client error (a lenient parser hands it on to the key check below)
            return True, ""
        if "\n" in msg.strip():
            return False, f"error is not one line: {msg[:200]!r}"
        if case.expect_key not in msg:
            return False, f"error does not name {case.expect_key!r}: {msg[:200]!r}"
        if rec.status is not None and rec.status >= 500:
            return False, f"HTTP {rec.status} (a server error) for invalid params"
        return True, ""
    if case.kind == "valid" or (case.kind in ("disconnect", "abort")
                                and rec.outcome == "completed"):
        if rec.outcome == "completed" and rec.tokens == case.output_len:
            return True, ""
        return False, (f"{rec.outcome}: {rec.tokens} of {case.output_len} tokens"
                       + (f"; {rec.error[:200]}" if rec.error else ""))
    if case.kind == "disconnect":
        if rec.outcome == "disconnected":
            return True, ""
        return False, (f"{rec.outcome} before the cut after {case.cut_after} tokens "
                       f"({rec.tokens} tokens)" + (f"; {rec.error[:200]}" if rec.error else ""))
    # abort
    if rec.outcome == "aborted":
        return True, ""
    if rec.outcome == "hung":
        return False, f"stream did not end after the abort (abort HTTP {rec.abort_status})"
    return False, (f"{rec.outcome} ({rec.tokens} tokens, abort HTTP {rec.abort_status})"
                   + (f"; {rec.error[:200]}" if rec.error else ""))


async def http_status(base: str, path: str, timeout_s: float = 40.0) -> int | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
                s.get(base + path) as r:
            return r.status
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _progress(t0: float, recs: list[Record], n: int) -> str:
    sent = sum(r.send_s is not None for r in recs)
    ended = [r for r in recs if r.end_s is not None]
    by = Counter(r.kind for r in ended)
    bad = sum(not r.ok for r in ended)
    return (f"[fuzz {time.perf_counter() - t0:6.1f} s] sent {sent}/{n}, ended {len(ended)} "
            f"({', '.join(f'{k} {by[k]}' for k in KINDS)}), in flight {sent - len(ended)}, "
            f"failed so far {bad}")


async def fuzz(base: str, cases: list[Case], *, seed: int = 0, concurrency: int = 384,
               deadline_s: float | None = None, abort_timeout_s: float = 60.0,
               idle_s: float = 10.0, drain_timeout_s: float = 120.0,
               server_pid: int | None = None, progress_s: float = 10.0,
               log: Any = print) -> dict[str, Any]:
    """Send ``cases`` to the server at ``base`` and judge; returns the verdict dict with the
    records (``records``)."""
    base = base.rstrip("/")
    health_before = await http_status(base, "/health")
    recs = [Record(c.index, c.rid, c.kind, c.sub, c.raw if c.raw is None or len(c.raw) < 300
                   else c.raw[:300] + "...", c.expect_key, c.input_len, c.output_len,
                   c.cut_after) for c in cases]
    verdict: dict[str, Any] = {"health_before": health_before}
    if health_before != 200:
        verdict.update(passed=False, checks={"health_before": {
            "ok": False, "why": f"/health answered {health_before} before the run"}},
            records=[asdict(r) for r in recs])
        return verdict
    bodies = [request_body(c, seed) for c in cases]
    slots = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=None)
    t0 = time.perf_counter()

    async def task(case: Case, rec: Record, body: bytes) -> None:
        async with slots:
            await run_case(session, base, case, rec, body, t0, abort_timeout_s)
            rec.ok, rec.why = judge(case, rec)

    async def reporter() -> None:
        while True:
            await asyncio.sleep(progress_s)
            log(_progress(t0, recs, len(cases)))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        tasks = [asyncio.create_task(task(c, r, b))
                 for c, r, b in zip(cases, recs, bodies, strict=True)]
        rep = asyncio.create_task(reporter())
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        rep.cancel()
        await asyncio.gather(rep, return_exceptions=True)
        for t in done:
            if (exc := t.exception()) is not None:
                raise exc
    run_s = time.perf_counter() - t0
    for c, r in zip(cases, recs, strict=True):
        if r.end_s is None or r.outcome in ("timeout", "not sent"):
            r.ok, r.why = judge(c, r)
    log(_progress(t0, recs, len(cases)))
    if pending:
        log(f"[fuzz] deadline of {deadline_s} s reached: {len(pending)} requests cancelled")
        await cl.abort_all(base)
    drained = await cl.wait_idle(base, timeout_s=drain_timeout_s, poll_s=0.5)
    drain_text = f"after {drained:.1f} s" if drained is not None else "NO"
    log(f"[fuzz] run {run_s:.1f} s; drained to idle: {drain_text}; idling {idle_s} s")
    await asyncio.sleep(idle_s)
    health_after = await http_status(base, "/health")
    load_after = await cl.server_load(base)
    alive = pid_alive(server_pid) if server_pid is not None else None
    verdict.update(summarize(cases, recs, health_after=health_after, drained_s=drained,
                             load_after=load_after, alive=alive, server_pid=server_pid,
                             deadline_hit=bool(pending), run_s=run_s))
    verdict["records"] = [asdict(r) for r in recs]
    return verdict


def summarize(cases: list[Case], recs: list[Record], *, health_after: int | None,
              drained_s: float | None, load_after: int | None, alive: bool | None,
              server_pid: int | None, deadline_hit: bool, run_s: float) -> dict[str, Any]:
    def group(kinds: tuple[str, ...]) -> dict[str, Any]:
        rs = [r for r in recs if r.kind in kinds]
        bad = [r for r in rs if not r.ok]
        return {"ok": not bad, "n": len(rs), "failed": len(bad),
                "first_failures": [f"#{r.index} {r.kind}/{r.sub}: {r.why}" for r in bad[:5]]}

    checks: dict[str, dict[str, Any]] = {
        "health_before": {"ok": True},
        "valid_completed": group(("valid",)),
        "invalid_refused_by_key": {
            **group(("invalid",)),
            "of_which_not_strict_json": sum(
                1 for c, r in zip(cases, recs, strict=True)
                if r.kind == "invalid" and not is_strict_json(c.raw)),
        },
        "abandoned_ok": group(("disconnect", "abort")),
        "finished_before_deadline": {"ok": not deadline_hit, "run_s": round(run_s, 1)},
        "drained_to_idle": {"ok": drained_s is not None, "after_s": drained_s,
                            "load_after_idle": load_after},
        "health_after_idle": {"ok": health_after == 200, "status": health_after},
        "server_alive_after_idle": {"ok": alive is not False, "pid": server_pid,
                                    "alive": alive},
    }
    outcomes = Counter(f"{r.kind}/{r.outcome}" for r in recs)
    subs = Counter(f"{r.kind}/{r.sub}" for r in recs)
    failed_subs = Counter(f"{r.kind}/{r.sub}" for r in recs if not r.ok)
    return {
        "passed": all(c["ok"] for c in checks.values()),
        "checks": checks,
        "n": len(recs),
        "outcomes": dict(sorted(outcomes.items())),
        "sub_kinds": dict(sorted(subs.items())),
        "failed_by_sub_kind": dict(sorted(failed_subs.items())),
        "tokens_received": sum(r.tokens for r in recs),
    }


def summary_text(verdict: dict[str, Any]) -> str:
    lines = [f"served fuzz run: {'PASS' if verdict.get('passed') else 'FAIL'} "
             f"({verdict.get('n', 0)} requests, {verdict.get('tokens_received', 0)} tokens "
             "received)"]
    for name, c in verdict.get("checks", {}).items():
        extra = {k: v for k, v in c.items() if k not in ("ok", "first_failures")}
        lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'} {name} {json.dumps(extra)}")
        for f in c.get("first_failures", []):
            lines.append(f"         {f}")
    for key in ("outcomes", "failed_by_sub_kind", "sub_kinds"):
        if verdict.get(key):
            lines.append(f"{key}: " + ", ".join(f"{k} {v}" for k, v in verdict[key].items()))
    return "\n".join(lines) + "\n"


def write_results(out: Path, args: dict[str, Any], verdict: dict[str, Any]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = summary_text(verdict)
    (out / "summary.txt").write_text(text)
    (out / "results.json").write_text(json.dumps({"args": args, **verdict}, indent=1))
    return text


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sglang_diffkv.bench.fuzz_serve",
        description=__doc__, epilog="See also docs/e2e.md, 'Served fuzz run'.",
        formatter_class=_HelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the running server")
    p.add_argument("--out", required=True, help="folder for results.json and summary.txt")
    p.add_argument("--n", type=int, default=1000, help="requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=384,
                   help="streams open at once (closed loop); high enough to force retractions")
    p.add_argument("--invalid-frac", type=float, default=0.3)
    p.add_argument("--disconnect-frac", type=float, default=0.1,
                   help="valid requests whose connection the client closes after k tokens")
    p.add_argument("--abort-frac", type=float, default=0.1,
                   help="valid requests aborted with POST /abort_request {rid} after k tokens")
    p.add_argument("--max-input", type=int, default=3072, help="longest prompt (token ids)")
    p.add_argument("--max-output", type=int, default=2048, help="largest max_new_tokens")
    p.add_argument("--diffkv-config", default=os.environ.get("SGLANG_DIFFKV_CONFIG") or "default",
                   help="the server's SGLANG_DIFFKV_CONFIG (what is valid depends on its "
                        "thresholds); default: this process's SGLANG_DIFFKV_CONFIG or 'default'")
    p.add_argument("--skip", default="",
                   help="comma-separated sub-kinds not to generate (e.g. alpha_bigint)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="cancel what is still open after this long (then the run fails)")
    p.add_argument("--abort-timeout-s", type=float, default=60.0,
                   help="how long an aborted stream may take to end")
    p.add_argument("--drain-timeout-s", type=float, default=120.0,
                   help="how long the server may take to reach no running / waiting request")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="idle wait before the final checks (SGLang's idle leak check runs)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid: must be alive after the idle wait")
    p.add_argument("--progress-s", type=float, default=10.0, help="progress line interval")
    a = p.parse_args(argv)
    if a.n < 1 or a.concurrency < 1 or a.max_input < 1 or a.max_output < 1:
        p.error("--n, --concurrency, --max-input and --max-output must be >= 1")
    if not 0 <= a.invalid_frac + a.disconnect_frac + a.abort_frac <= 1:
        p.error("the three fractions must sum to at most 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = DiffKVConfig.from_spec(a.diffkv_config)
    skip = tuple(s for s in a.skip.split(",") if s)
    cases = make_cases(a.n, a.seed, cfg, invalid_frac=a.invalid_frac,
                       disconnect_frac=a.disconnect_frac, abort_frac=a.abort_frac,
                       max_input=a.max_input, max_output=a.max_output, skip=skip)
    kinds = Counter(c.kind for c in cases)
    print(f"[fuzz] {len(cases)} requests against {a.url} (config {cfg.name!r}, seed {a.seed}, "
          f"concurrency {a.concurrency}): " + ", ".join(f"{k} {kinds[k]}" for k in KINDS),
          flush=True)
    cl.raise_fd_limit()
    verdict = cl.run_async(fuzz(
        a.url, cases, seed=a.seed, concurrency=a.concurrency, deadline_s=a.deadline_s,
        abort_timeout_s=a.abort_timeout_s, idle_s=a.idle_s, drain_timeout_s=a.drain_timeout_s,
        server_pid=a.server_pid, progress_s=a.progress_s,
        log=lambda m: print(m, flush=True)))
    text = write_results(Path(a.out), {**vars(a), "config": cfg.to_dict()}, verdict)
    print(text, end="")
    print(json.dumps({k: v for k, v in verdict.items() if k != "records"}))
    if verdict.get("health_before") != 200:
        return 2
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
