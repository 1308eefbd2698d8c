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

The file format and its reader (``read_loop_trace``, ``summarize``, ...) are the bench's
``sglang_diffkv.bench.loop_records``; this module, the writer, takes ``Phase`` and ``Mode``
from there. SGLang layer: it wraps SGLang's classes by method name (``plugin`` hands it them).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_diffkv.bench.loop_records import Mode, Phase

TRACE_ENV = "SGLANG_DIFFKV_LOOP_TRACE"
FLUSH_RECORDS = 200_000  # written at the next result even if the loop never idles

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
