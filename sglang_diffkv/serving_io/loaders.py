"""Loaders for the public trace formats; each returns a Trace in the internal schema.

Every bad row raises InputError naming the file, the 1-based line number and what was
wrong; so does a file that cannot be read to the end (a truncated or corrupt ``.gz``, bytes that
are not UTF-8, a CSV field past the csv module's limit, JSON nested too deeply). Files may be
gzip-compressed (``.gz``). Arrival times are rebased so the first request arrives at t = 0.

Formats:
  mooncake   JSONL {"timestamp": ms, "input_length", "output_length", "hash_ids"?, "session_id"?}
             (also what ``write_mooncake_jsonl`` writes, and what sglang.bench_serving reads)
  azure      CSV TIMESTAMP,ContextTokens,GeneratedTokens (Azure LLM inference 2023/2024)
  burstgpt   CSV Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
  sglang     SGLang bench_serving ``custom`` JSONL: {"conversations": [{role/from, content/value}]}
             (token counts estimated from text, see CHARS_PER_TOKEN) or explicit counts
             {"input_len"/"prompt_len", "output_len", "timestamp"?}
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import json
import math
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from sglang_diffkv.value_text import short_repr

FORMATS = ("mooncake", "azure", "burstgpt", "sglang")

# Text without a tokenizer: ~4 characters per token is the usual English BPE average
# (OpenAI's tokenizer guide); only used for the conversations variant of the sglang format.
CHARS_PER_TOKEN = 4.0


# Arrival times: a double resolves 1 us up to 2**52 us (about 142 years); later times would
# lose the step resolution the simulator adds to them (t + 5 ms == t at 1e300 s).
MAX_TIME_S = 2.0**52 * 1e-6


class _RowError(Exception):
    """Raised inside a row parser; the loader adds file and line."""


def _open_bytes(path: Path) -> IO[bytes]:
    try:
        if path.suffix == ".gz":
            return gzip.open(path, "rb")
        return open(path, "rb")  # noqa: SIM115 - closed by the caller's with
    except OSError as e:
        raise InputError(f"cannot read trace file {str(path)!r}: {e.strerror}") from e


def _read_error(e: BaseException) -> str:
    if isinstance(e, EOFError):
        return "the compressed stream ends early (truncated .gz file?)"
    if isinstance(e, gzip.BadGzipFile):
        return "not a gzip file"
    if isinstance(e, zlib.error):
        return f"corrupt compressed data ({e})"
    return f"cannot read ({e})"


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text with its line ending) of every line of a (gzip) UTF-8 file.
    Lines are decoded one by one, so a bad byte or a broken stream is reported at its line."""
    with _open_bytes(path) as f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, zlib.error) as e:
                raise InputError(f"{path}: line {lineno + 1}: {_read_error(e)}") from None
            if not raw:
                return
            lineno += 1
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise InputError(
                    f"{path}: line {lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                    f"column {e.start + 1})") from None
            yield lineno, text


def _json_object(text: str) -> Any:
    """json.loads of one line; every failure a _RowError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _RowError(f"invalid JSON ({e.msg})") from None
    except RecursionError:
        raise _RowError("invalid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise _RowError(f"invalid JSON ({e})") from None


def detect_format(path: Path) -> str:
    """Guess the format from the first non-empty line."""
    for _, line in _lines(path):
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                obj = _json_object(s)
            except _RowError:
                break
            if isinstance(obj, dict) and "input_length" in obj:
                return "mooncake"
            return "sglang"
        low = s.lower()
        if "contexttokens" in low:
            return "azure"
        if "request tokens" in low:
            return "burstgpt"
        break
    raise InputError(
        f"{path}: cannot tell the trace format from its first line; pass the format "
        f"explicitly (one of {', '.join(FORMATS)})"
    )


def _int_field(obj: dict[str, Any], key: str, minimum: int) -> int:
    if key not in obj:
        raise _RowError(f"missing field {key!r}")
    v = obj[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _RowError(f"{key}={v!r} must be an integer >= {minimum}")
    return v


def _float(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError as e:
        raise _RowError(f"{what}={text!r} is not a number") from e
    if not math.isfinite(v):
        raise _RowError(f"{what}={text!r} must be finite")
    return v


def _timestamp_ms(obj: dict[str, Any]) -> float:
    """A JSON row's optional ``timestamp`` (ms, default 0) in seconds."""
    ts = obj.get("timestamp", 0)
    ok = (not isinstance(ts, bool) and isinstance(ts, (int, float))
          and 0 <= ts <= MAX_TIME_S * 1000.0)
    if not ok:  # (NaN fails the comparison too)
        raise _RowError(f"timestamp={short_repr(ts)} must be a number of milliseconds in "
                        f"[0, {MAX_TIME_S * 1000.0:.4g}]")
    return float(ts) / 1000.0


def _int(text: str, what: str, minimum: int) -> int:
    try:
        v = int(text.strip())
    except ValueError as e:
        raise _RowError(f"{what}={text!r} is not an integer") from e
    if v < minimum:
        raise _RowError(f"{what}={v} must be >= {minimum}")
    return v


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in _lines(path):
        s = line.strip()
        if not s:
            continue
        try:
            obj = _json_object(s)
        except _RowError as e:
            raise InputError(f"{path}: line {lineno}: {e}") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}: line {lineno}: expected a JSON object")
        yield lineno, obj


def _mooncake_row(obj: dict[str, Any]) -> TraceRequest:
    arrival = _timestamp_ms(obj)
    hashes = obj.get("hash_ids", [])
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise _RowError("hash_ids must be a list of integers")
    max_new = obj.get("max_new_tokens")
    if max_new is not None:
        max_new = _int_field(obj, "max_new_tokens", 1)
    session = obj.get("session_id")
    if session is not None and (isinstance(session, bool)
                                or not isinstance(session, (str, int))):
        raise _RowError(f"session_id={short_repr(session)} must be a string or an integer")
    return TraceRequest(
        arrival_s=arrival,
        input_tokens=_int_field(obj, "input_length", 1),
        output_tokens=_int_field(obj, "output_length", 1),
        max_new_tokens=max_new,
        prefix_hash_ids=tuple(hashes),
        session_id=None if session is None else str(session),
    )


def _text_tokens(text: Any, turn: int) -> int:
    if not isinstance(text, str):
        raise _RowError(f"conversations[{turn}] content={short_repr(text)} must be a string")
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _sglang_row(obj: dict[str, Any]) -> TraceRequest:
    arrival = _timestamp_ms(obj)
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or len(turns) < 2 or not all(
            isinstance(t, dict) for t in turns
        ):
            raise _RowError("conversations must be a list of at least 2 turns (prompt, answer)")
        content = [t.get("content", t.get("value")) for t in turns[:2]]
        return TraceRequest(arrival, _text_tokens(content[0], 0), _text_tokens(content[1], 1))
    in_key = next((k for k in ("input_len", "prompt_len", "input_tokens") if k in obj), None)
    if in_key is None or "output_len" not in obj:
        raise _RowError("expected 'conversations', or 'input_len' (or 'prompt_len') and "
                        "'output_len'")
    return TraceRequest(arrival, _int_field(obj, in_key, 1), _int_field(obj, "output_len", 1))


def _load_jsonl(path: Path, row: Callable[[dict[str, Any]], TraceRequest]) -> list[TraceRequest]:
    out = []
    for lineno, obj in _jsonl_rows(path):
        try:
            out.append(row(obj))
        except (_RowError, InputError) as e:
            raise InputError(f"{path}: line {lineno}: {e}") from e
    return out


def _csv_rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.reader(line for _, line in _lines(path))
    header: list[str] | None = None
    while True:
        lineno = reader.line_num + 1  # where the record starts (a quoted field may span lines)
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # e.g. a field past csv.field_size_limit()
            raise InputError(f"{path}: line {lineno}: CSV error: {e}") from None
        if not row or all(not c.strip() for c in row):
            continue
        if header is None:
            header = [c.strip() for c in row]
            missing = [c for c in required if c not in header]
            if missing:
                raise InputError(f"{path}: line {lineno}: header "
                                          f"{short_repr(header)} lacks column(s) {missing}")
            continue
        if len(row) != len(header):
            raise InputError(
                f"{path}: line {lineno}: expected {len(header)} columns, got {len(row)}"
            )
        yield lineno, dict(zip(header, row, strict=True))


def _azure_day_seconds(text: str) -> tuple[int, float]:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> (day ordinal, second of day);
    kept apart so differences keep sub-microsecond precision."""
    s = text.strip()
    try:
        day, clock = s.split(" ")
        h, m, sec = clock.split(":")
        hours, minutes, seconds = int(h), int(m), float(sec)
        ordinal = dt.date.fromisoformat(day).toordinal()
    except ValueError as e:
        raise _RowError(f"TIMESTAMP={short_repr(text)} is not 'YYYY-MM-DD HH:MM:SS.fffffff'"
                        ) from e
    # hours 0-23, minutes 0-59, seconds in [0, 61) (a leap second); NaN fails too
    if not (0 <= hours < 24 and 0 <= minutes < 60 and 0 <= seconds < 61):
        raise _RowError(f"TIMESTAMP={short_repr(text)} has no such time of day; expected "
                        "HH 00-23, MM 00-59, SS.fffffff in [0, 61)")
    return ordinal, hours * 3600 + minutes * 60 + seconds


def _azure_time(text: str, ref_day: int = 0) -> float:
    """Seconds since midnight of day ``ref_day`` (an ordinal)."""
    day, sec = _azure_day_seconds(text)
    return (day - ref_day) * 86400.0 + sec


def _load_azure(path: Path) -> list[TraceRequest]:
    out, times = [], []
    ref_day: int | None = None
    for lineno, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        try:
            if ref_day is None:
                ref_day = _azure_day_seconds(row["TIMESTAMP"])[0]
            t = _azure_time(row["TIMESTAMP"], ref_day)
            if abs(t) > MAX_TIME_S:
                raise _RowError(f"TIMESTAMP={short_repr(row['TIMESTAMP'])} is more than "
                                f"{MAX_TIME_S:.4g} s from the first row's day")
            times.append(t)
            inp = _int(row["ContextTokens"], "ContextTokens", 1)
            outp = _int(row["GeneratedTokens"], "GeneratedTokens", 1)
        except _RowError as e:
            raise InputError(f"{path}: line {lineno}: {e}") from e
        out.append((inp, outp))
    t0 = min(times) if times else 0.0
    return [TraceRequest(t - t0, i, o) for t, (i, o) in zip(times, out, strict=True)]


def _load_burstgpt(path: Path) -> tuple[list[TraceRequest], int]:
    """Rows with 0 response tokens are failed requests in BurstGPT; they are skipped and
    counted (the count goes into the trace's source string)."""
    out, skipped = [], 0
    cols = ("Timestamp", "Request tokens", "Response tokens")
    for lineno, row in _csv_rows(path, cols):
        try:
            t = _float(row["Timestamp"], "Timestamp")
            if not 0 <= t <= MAX_TIME_S:
                raise _RowError(f"Timestamp={t} must be seconds in [0, {MAX_TIME_S:.4g}]")
            inp = _int(row["Request tokens"], "Request tokens", 0)
            outp = _int(row["Response tokens"], "Response tokens", 0)
        except _RowError as e:
            raise InputError(f"{path}: line {lineno}: {e}") from e
        if outp == 0 or inp == 0:
            skipped += 1
            continue
        out.append(TraceRequest(t, inp, outp))
    if out:
        t0 = min(r.arrival_s for r in out)
        out = [TraceRequest(r.arrival_s - t0, r.input_tokens, r.output_tokens) for r in out]
    return out, skipped


def load_trace(path: str | Path, fmt: str | None = None, name: str | None = None) -> Trace:
    """Load a trace file in one of FORMATS (guessed from the first line when ``fmt`` is None)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"trace file {str(p)!r} does not exist")
    fmt = detect_format(p) if fmt is None else fmt
    note = ""
    if fmt == "mooncake":
        reqs = _load_jsonl(p, _mooncake_row)
    elif fmt == "sglang":
        reqs = _load_jsonl(p, _sglang_row)
    elif fmt == "azure":
        reqs = _load_azure(p)
    elif fmt == "burstgpt":
        reqs, skipped = _load_burstgpt(p)
        note = f" ({skipped} failed rows with 0 tokens skipped)" if skipped else ""
    else:
        raise InputError(f"trace format {fmt!r} is unknown; choose one of {FORMATS}")
    if not reqs:
        raise InputError(f"{p}: no requests in the file")
    stem = p.name.split(".")[0]
    return Trace.from_requests(reqs, name=name or stem, source=f"{p} [{fmt}]{note}").rebased()
