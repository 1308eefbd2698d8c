"""The scheduler loop trace's format and its reader (the files ``SGLANG_DIFFKV_LOOP_TRACE=DIR``
makes a server write; the writer is ``sglang_diffkv.sglang.loop_trace``, which takes
``Phase`` and ``Mode`` from here).

A file ``DIR/loop-<pid>.jsonl`` (``.jsonl.gz`` as kept in docs/data) holds JSON lines: a
header ``{"pid", "wall_minus_perf"}`` (the offset from the writer's ``perf_counter`` to the
wall clock), then one record per wrapped call of the scheduler loop: ``p`` its ``Phase``,
``t0`` / ``t1`` host start and end (``perf_counter`` seconds), ``m`` the batch's ``Mode``,
``n`` its size, ``tok`` its new tokens, and when present ``w`` (the wait for the previous
batch's tokens), ``rids`` (the request ids received, or a prefill launched or finished) and
``x`` (named host-time spans of a launch: ``time_method``'s sums, ``cpu``, ``gc``).

``read_loop_trace`` and ``summarize`` turn a file back into busy segments (runs of the loop
between idle gaps) with per-phase host times per iteration mode and per-request scheduler
times (queue: received to launched; step: launched to first token streamed);
``poll_wait_s`` is how long an arriving request waits for the loop's next poll. Bench layer:
no sglang, no torch (``loop_trace_report`` reads traces on any machine).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path


class Phase(IntEnum):
    RECV = 0
    INPUT = 1
    NEXT = 2
    RUN = 3
    RESULT = 4
    SAMPLE = 5


class Mode(IntEnum):
    NONE = 0
    EXTEND = 1
    DECODE = 2
    OTHER = 3


@dataclass(frozen=True)
class Record:
    phase: Phase
    t0: float  # seconds on the clients' wall clock
    t1: float
    mode: Mode
    size: int
    tokens: int
    wait: float
    rids: tuple[str, ...]
    spans: dict[str, float] = field(default_factory=dict)  # run_batch: time_method's sums


def read_loop_trace(path: str | os.PathLike) -> list[Record]:
    """A file's records (``.jsonl``, or ``.jsonl.gz`` as kept in docs/data) in time order, on
    the wall clock. A bad line is reported by number."""
    out: list[Record] = []
    offset: float | None = None
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "wall_minus_perf" in row:
                    offset = float(row["wall_minus_perf"])
                    continue
                if offset is None:
                    raise ValueError("a record before the header line")
                out.append(Record(Phase(row["p"]), row["t0"] + offset, row["t1"] + offset,
                                  Mode(row["m"]), int(row["n"]), int(row["tok"]),
                                  float(row.get("w", 0.0)), tuple(row.get("rids", ())),
                                  {str(k): float(v) for k, v in row.get("x", {}).items()}))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad loop-trace line: {e}") from e
    out.sort(key=lambda r: r.t0)
    return out


def segments(records: list[Record], gap_s: float = 0.3) -> list[list[Record]]:
    """Busy stretches of the loop: split where no record starts for ``gap_s`` seconds."""
    out: list[list[Record]] = []
    last_end = None
    for r in records:
        if last_end is None or r.t0 - last_end > gap_s:
            out.append([])
        out[-1].append(r)
        last_end = r.t1 if last_end is None else max(last_end, r.t1)
    return out


@dataclass
class ModeStats:
    """Per iteration of one mode (the mode of the batch it launched), host seconds."""

    iterations: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    wait_s: float = 0.0
    wall_s: float = 0.0  # iteration start to the next iteration's start
    tokens: int = 0
    size: int = 0

    def mean_ms(self, what: str) -> float:
        if not self.iterations:
            return float("nan")
        if what == "wait":
            total = self.wait_s
        elif what == "wall":
            total = self.wall_s
        else:
            total = self.phase_s.get(what, 0.0)
        return 1e3 * total / self.iterations


@dataclass
class SegmentSummary:
    start: float
    duration_s: float
    requests: int  # prefills finished
    modes: dict[Mode, ModeStats]
    queue_ms: list[float]  # per request: received -> its prefill launched
    step_ms: list[float]  # per request: its prefill launched -> its first token streamed


@dataclass(frozen=True)
class RequestTimes:
    """When the scheduler received a request (end of process_input_requests), launched its
    prefill (start of that extend's run_batch) and streamed its first token (end of that
    extend's process_batch_result); seconds on the wall clock."""

    received: float
    launched: float
    streamed: float


def request_times(seg: list[Record]) -> dict[str, RequestTimes]:
    """Per request id, in the order of receipt: the requests of ``seg`` that were received,
    launched and streamed in it. A prompt prefilled in chunks is launched with its first chunk
    and streams its first token with its last, so ``streamed`` is the last extend result
    that carried the request."""
    received: dict[str, float] = {}
    launched: dict[str, float] = {}
    streamed: dict[str, float] = {}
    for r in seg:
        if r.phase == Phase.INPUT:
            for rid in r.rids:
                received.setdefault(rid, r.t1)
        elif r.phase == Phase.RUN and r.mode == Mode.EXTEND:
            for rid in r.rids:
                launched.setdefault(rid, r.t0)
        elif r.phase == Phase.RESULT and r.mode == Mode.EXTEND:
            for rid in r.rids:
                streamed[rid] = r.t1
    return {rid: RequestTimes(t, launched[rid], streamed[rid]) for rid, t in received.items()
            if rid in launched and rid in streamed}


def iterations(seg: list[Record]) -> Iterable[list[Record]]:
    """The records of ``seg`` split into scheduler loop iterations, each from its
    ``recv_requests`` (the records before the first one form their own)."""
    cur: list[Record] = []
    for r in seg:
        if r.phase == Phase.RECV and cur:
            yield cur
            cur = []
        cur.append(r)
    if cur:
        yield cur


@dataclass(frozen=True)
class Iteration:
    """One scheduler loop iteration: its records, the batch it launched (None: it launched
    none) and its wall time, from its start to the next iteration's (the last: to its own
    last record's end)."""

    records: list[Record]
    run: Record | None
    wall_s: float


def timed_iterations(seg: list[Record]) -> list[Iteration]:
    """``iterations(seg)``, each with its launched batch and wall time."""
    iters = list(iterations(seg))
    out = []
    for i, it in enumerate(iters):
        run = next((r for r in it if r.phase == Phase.RUN), None)
        nxt = iters[i + 1][0].t0 if i + 1 < len(iters) else max(r.t1 for r in it)
        out.append(Iteration(it, run, nxt - it[0].t0))
    return out


def poll_wait_s(seg: list[Record]) -> float | None:
    """The mean wait of a request that reaches the scheduler's socket at a random moment for
    the loop's next ``recv_requests``: sum(w^2) / (2 sum(w)) over the iterations' wall times w
    (Poisson arrivals land in an iteration with a chance in proportion to its length, then
    wait half of it on average). An iteration whose records cover less than half its wall
    time is left out: the loop idled (and the tracer flushed its records), where an untraced
    server polls at once. None without two iterations to time."""
    walls = [it.wall_s for it in timed_iterations(seg)[:-1]
             if sum(r.t1 - r.t0 for r in it.records) >= 0.5 * it.wall_s]
    total = sum(walls)
    if total <= 0.0:
        return None
    return sum(w * w for w in walls) / (2.0 * total)


def summarize(seg: list[Record]) -> SegmentSummary:
    modes: dict[Mode, ModeStats] = {}
    for it in timed_iterations(seg):
        run = it.run
        mode = run.mode if run is not None else Mode.NONE
        st = modes.setdefault(mode, ModeStats())
        st.iterations += 1
        for r in it.records:
            name = r.phase.name.lower()
            st.phase_s[name] = st.phase_s.get(name, 0.0) + (r.t1 - r.t0)
            if r.phase == Phase.RESULT:
                st.wait_s += r.wait
        st.wall_s += it.wall_s
        if run is not None:
            st.tokens += run.tokens
            st.size += run.size
    times = request_times(seg)
    queue = [1e3 * (t.launched - t.received) for t in times.values()]
    step = [1e3 * (t.streamed - t.launched) for t in times.values()]
    return SegmentSummary(seg[0].t0, seg[-1].t1 - seg[0].t0, len(step), modes, queue, step)


def trace_files(trace_dir: str | os.PathLike) -> list[Path]:
    d = Path(trace_dir)
    return sorted([*d.glob("loop-*.jsonl"), *d.glob("loop-*.jsonl.gz")])

