"""Where a serving scheduler's loop spends its time (``SGLANG_DIFFKV_LOOP_TRACE=DIR``).

SGLang's overlap event loop calls, once per iteration: ``recv_requests``,
``process_input_requests``, ``get_next_batch_to_run``, ``run_batch`` (launch the batch),
``process_batch_result`` (of the previous batch: wait for its tokens on the host, then stream
them) and ``launch_batch_sample_if_needed``. ``install`` wraps those methods on a scheduler
class so that each call appends one record (phase, host start and end, the batch's mode,
size and new tokens, the wait for the previous batch's tokens, the request ids a prefill
launched or finished). Records stay in memory and are written, as JSON lines to
``DIR/loop-<pid>.jsonl``, only when the loop goes idle (``on_idle``; sglang 0.5.10:
``self_check_during_idle``), so writing never lands inside a measured step. Since sglang
0.5.17 the loop receives through its ``request_receiver`` (``install``'s ``receiver_cls``)
and ``get_next_batch_to_run`` returns a plan holding the batch. Off (no wrapper installed)
unless the variable is set. A wrapped call costs about two microseconds.

``time_method`` adds named spans inside a step: the host time of a method (the model runner's
eager forward, the attention backend's extend, the KV store) summed since the launch began,
attached to the launch's record. Every launch's record also carries ``cpu``, the scheduler
thread's CPU time inside it (a launch whose wall time exceeds it waited: on the GPU, the
GIL, or a host that did not run the thread), and ``gc``, the time Python's garbage
collector ran inside it.

``read_loop_trace`` and ``summarize`` turn a file back into busy segments (runs of the loop
between idle gaps) with per-phase host times per iteration mode and per-request scheduler
times (queue: received to launched; step: launched to first token streamed);
``poll_wait_s`` is how long an arriving request waits for the loop's next poll.
"""

from __future__ import annotations

import functools
import gc
import gzip
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

TRACE_ENV = "SGLANG_DIFFKV_LOOP_TRACE"
FLUSH_RECORDS = 200_000  # written at the next result even if the loop never idles


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


WRAPPED = ("recv_requests", "process_input_requests", "get_next_batch_to_run", "run_batch",
           "process_batch_result", "launch_batch_sample_if_needed")
_MARK = "_sglang_diffkv_loop_traced"
# host seconds per timed method (``time_method``) since the current run_batch began: the
# scheduler loop is one thread, and only a traced process (SGLANG_DIFFKV_LOOP_TRACE) writes it
SPANS: dict[str, float] = {}
CPU_SPAN = "cpu"
GC_SPAN = "gc"


def batch_mode(batch: Any) -> Mode:
    if batch is None:
        return Mode.NONE
    fm = batch.forward_mode
    if fm.is_decode():
        return Mode.DECODE
    if fm.is_extend():
        return Mode.EXTEND
    return Mode.OTHER


@dataclass
class LoopRecorder:
    """One process's records; ``flush`` appends them to ``path`` and empties the list."""

    path: Path
    records: list[tuple] = field(default_factory=list)
    _header_written: bool = False

    def add(self, phase: Phase, t0: float, t1: float, mode: Mode = Mode.NONE, size: int = 0,
            tokens: int = 0, wait: float = 0.0, rids: list[str] | None = None,
            spans: dict[str, float] | None = None) -> None:
        self.records.append((int(phase), t0, t1, int(mode), size, tokens, wait, rids, spans))

    def flush(self) -> None:
        if not self.records:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            if not self._header_written:
                # perf_counter has no epoch: the offset puts records on the clients' clock
                f.write(json.dumps({"pid": os.getpid(),
                                    "wall_minus_perf": time.time() - time.perf_counter()})
                        + "\n")
                self._header_written = True
            for p, t0, t1, m, n, tok, w, rids, spans in self.records:
                row: dict[str, Any] = {"p": p, "t0": t0, "t1": t1, "m": m, "n": n, "tok": tok}
                if w:
                    row["w"] = w
                if rids:
                    row["rids"] = rids
                if spans:
                    row["x"] = spans
                f.write(json.dumps(row) + "\n")
        self.records.clear()


def _rids(batch: Any) -> list[str]:
    return [str(getattr(r, "rid", "")) for r in getattr(batch, "reqs", ())]


def _batch_fields(batch: Any) -> tuple[Mode, int, int]:
    mode = batch_mode(batch)
    if batch is None:
        return mode, 0, 0
    return mode, batch.batch_size(), int(getattr(batch, "extend_num_tokens", 0) or 0)


def install(cls: Any, trace_dir: str | os.PathLike,
            clock: Callable[[], float] = time.perf_counter,
            cpu_clock: Callable[[], float] = time.thread_time,
            receiver_cls: Any = None) -> bool:
    """Wrap ``cls``'s loop methods (idempotent). ``receiver_cls``: the class whose
    ``recv_requests`` the loop calls when ``cls`` has none (sglang 0.5.17: the scheduler's
    ``request_receiver``). Returns whether it wrapped them now."""
    if getattr(cls, _MARK, False):
        return False
    _time_gc()
    recorders: dict[int, LoopRecorder] = {}

    def recorder() -> LoopRecorder:
        pid = os.getpid()  # a forked or spawned scheduler gets its own file
        rec = recorders.get(pid)
        if rec is None:
            rec = recorders[pid] = LoopRecorder(Path(trace_dir) / f"loop-{pid}.jsonl")
        return rec

    recv_owner = cls if hasattr(cls, "recv_requests") else receiver_cls
    orig = {name: getattr(recv_owner if name == "recv_requests" else cls, name)
            for name in WRAPPED}
    idle_name = "on_idle" if hasattr(cls, "on_idle") else "self_check_during_idle"
    orig_idle = getattr(cls, idle_name, None)
    # a receiver's last call (t0, t1, requests): it cannot tell an idle spin, so the loop's
    # next process_input_requests keeps or drops it
    pending_recv: list[tuple[float, float, int]] = []

    def keep_recv(loop: Any, t0: float, t1: float, n: int) -> None:
        if n or getattr(loop, "last_batch", None) is not None:  # idle spins are not kept
            recorder().add(Phase.RECV, t0, t1, size=n)

    def recv_requests(self: Any, *a: Any, **k: Any) -> Any:
        t0 = clock()
        out = orig["recv_requests"](self, *a, **k)
        n = len(out) if out is not None else 0
        if recv_owner is cls:
            keep_recv(self, t0, clock(), n)
        else:
            pending_recv[:] = [(t0, clock(), n)]
        return out

    def process_input_requests(self: Any, recv_reqs: Any, *a: Any, **k: Any) -> Any:
        if pending_recv:
            keep_recv(self, *pending_recv.pop())
        t0 = clock()
        out = orig["process_input_requests"](self, recv_reqs, *a, **k)
        if recv_reqs:
            rids = [str(r.rid) for r in recv_reqs if hasattr(r, "rid")]
            recorder().add(Phase.INPUT, t0, clock(), size=len(recv_reqs), rids=rids or None)
        return out

    def get_next_batch_to_run(self: Any, *a: Any, **k: Any) -> Any:
        t0 = clock()
        out = orig["get_next_batch_to_run"](self, *a, **k)
        batch = getattr(out, "batch_to_run", out)  # (sglang 0.5.17: a NextBatchPlan)
        if batch is not None:
            mode, n, tok = _batch_fields(batch)
            recorder().add(Phase.NEXT, t0, clock(), mode, n, tok)
        return out

    def run_batch(self: Any, batch: Any, *a: Any, **k: Any) -> Any:
        mode, n, tok = _batch_fields(batch)
        rids = _rids(batch) if mode == Mode.EXTEND else None
        SPANS.clear()
        c0 = cpu_clock()
        t0 = clock()
        out = orig["run_batch"](self, batch, *a, **k)
        t1 = clock()
        SPANS[CPU_SPAN] = cpu_clock() - c0
        recorder().add(Phase.RUN, t0, t1, mode, n, tok, rids=rids, spans=dict(SPANS))
        return out

    def process_batch_result(self: Any, batch: Any, result: Any, *a: Any, **k: Any) -> Any:
        mode, n, tok = _batch_fields(batch)
        t0 = clock()
        done = getattr(result, "copy_done", None)
        if done is not None:  # the wait for the tokens, apart from the host work after it
            done.synchronize()
        wait = clock() - t0
        out = orig["process_batch_result"](self, batch, result, *a, **k)
        rec = recorder()
        rec.add(Phase.RESULT, t0, clock(), mode, n, tok, wait,
                _rids(batch) if mode == Mode.EXTEND else None)
        if len(rec.records) >= FLUSH_RECORDS:
            rec.flush()
        return out

    def launch_batch_sample_if_needed(self: Any, batch_result: Any, *a: Any, **k: Any) -> Any:
        if batch_result is None:
            return orig["launch_batch_sample_if_needed"](self, batch_result, *a, **k)
        t0 = clock()
        out = orig["launch_batch_sample_if_needed"](self, batch_result, *a, **k)
        recorder().add(Phase.SAMPLE, t0, clock())
        return out

    def on_idle(self: Any, *a: Any, **k: Any) -> Any:
        recorder().flush()
        return orig_idle(self, *a, **k) if orig_idle is not None else None

    recv_owner.recv_requests = recv_requests
    for fn in (process_input_requests, get_next_batch_to_run, run_batch,
               process_batch_result, launch_batch_sample_if_needed):
        setattr(cls, fn.__name__, fn)
    setattr(cls, idle_name, on_idle)
    setattr(cls, _MARK, True)
    return True


_gc_timer: list[Callable[[str, dict], None]] = []  # the one installed gc callback, if any


def _time_gc() -> None:
    """Add the garbage collector's run time to ``SPANS[GC_SPAN]`` (one callback per process;
    ``run_batch`` clears SPANS, so its record holds only what ran inside it)."""
    if _gc_timer:
        return
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            SPANS[GC_SPAN] = SPANS.get(GC_SPAN, 0.0) + time.perf_counter() - started.pop()

    gc.callbacks.append(on_gc)
    _gc_timer.append(on_gc)


def time_method(cls: Any, name: str, span: str,
                clock: Callable[[], float] = time.perf_counter) -> bool:
    """Add the host time of every ``cls.name`` call to ``SPANS[span]`` (idempotent). Returns
    whether it wrapped the method now."""
    fn = getattr(cls, name)
    if getattr(fn, _MARK, False):
        return False

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            SPANS[span] = SPANS.get(span, 0.0) + clock() - t0

    setattr(timed, _MARK, True)
    setattr(cls, name, timed)
    return True


# ---- reading ------------------------------------------------------------------------------
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

