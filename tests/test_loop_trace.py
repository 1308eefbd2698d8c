"""The scheduler loop trace: what the wrappers record, when they write, how it reads back."""

from __future__ import annotations

import gc
import json
from collections import deque
from pathlib import Path
from typing import NamedTuple

import pytest

from sglang_diffkv.bench import loop_records as lr
from sglang_diffkv.sglang import loop_trace as lt


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


class _Mode:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def is_decode(self) -> bool:
        return self.kind == "decode"

    def is_extend(self) -> bool:
        return self.kind == "extend"


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


class _Batch:
    def __init__(self, kind: str, rids: list[str], tokens: int | None = None) -> None:
        self.forward_mode = _Mode(kind)
        self.reqs = [_Req(r) for r in rids]
        self.extend_num_tokens = tokens

    def batch_size(self) -> int:
        return len(self.reqs)


class _Done:
    def __init__(self, clock: FakeClock, wait_ms: float) -> None:
        self.clock, self.wait_ms, self.waited = clock, wait_ms, False

    def synchronize(self) -> None:
        if not self.waited:  # the second synchronize (SGLang's own) returns at once
            self.clock.advance(self.wait_ms)
            self.waited = True


class _Result:
    def __init__(self, done: _Done | None) -> None:
        self.copy_done = done


def make_scheduler(clock: FakeClock, receiver: bool = False) -> type:
    """A class with the loop methods SGLang's overlap loop calls, each costing known time.
    ``receiver``: sglang 0.5.17's shape (the loop receives through ``request_receiver``,
    ``get_next_batch_to_run`` returns a plan, idle housekeeping is ``on_idle``)."""

    class Scheduler:
        def __init__(self) -> None:
            self.inbox: deque = deque()
            self.plan: deque = deque()
            self.last_batch = None
            self.idle_checks = 0

        def recv_requests(self) -> list:
            clock.advance(0.1)
            out = list(self.inbox)
            self.inbox.clear()
            return out

        def process_input_requests(self, recv_reqs: list) -> None:
            clock.advance(0.2 * len(recv_reqs))

        def get_next_batch_to_run(self):
            clock.advance(0.3)
            return self.plan.popleft() if self.plan else None

        def run_batch(self, batch):
            clock.advance(8.0 if batch.forward_mode.is_extend() else 1.0)
            return _Result(_Done(clock, 2.0 if batch.forward_mode.is_extend() else 4.0))

        def process_batch_result(self, batch, result) -> None:
            result.copy_done.synchronize()
            clock.advance(0.5)

        def launch_batch_sample_if_needed(self, batch_result) -> None:
            clock.advance(0.05)

        def self_check_during_idle(self) -> None:
            self.idle_checks += 1

        def loop_once(self) -> None:
            """One iteration of SGLang's event_loop_overlap, as far as the trace sees it."""
            self.process_input_requests(self.recv_requests())
            batch = self.get_next_batch_to_run()
            result = self.run_batch(batch) if batch else None
            if self.last_batch is not None:
                self.process_batch_result(*self.pending)
            elif batch is None:
                self.self_check_during_idle()
            self.launch_batch_sample_if_needed(result)
            self.pending = (batch, result)
            self.last_batch = batch

    if not receiver:
        return Scheduler

    # the receiver owns recv_requests; the scheduler has none
    base = {k: v for k, v in vars(Scheduler).items()
            if k not in ("recv_requests", "__dict__", "__weakref__")}

    class RequestReceiver:
        def __init__(self, scheduler) -> None:
            self.scheduler = scheduler

        def recv_requests(self) -> list:
            return Scheduler.recv_requests(self.scheduler)

    class Plan(NamedTuple):
        batch_to_run: object

    def init(self) -> None:
        Scheduler.__init__(self)
        self.request_receiver = RequestReceiver(self)

    def get_next_batch_to_run(self):
        return Plan(Scheduler.get_next_batch_to_run(self))

    def on_idle(self) -> None:
        self.idle_checks += 1

    def loop_once(self) -> None:
        self.process_input_requests(self.request_receiver.recv_requests())
        batch = self.get_next_batch_to_run().batch_to_run
        result = self.run_batch(batch) if batch else None
        if self.last_batch is not None:
            self.process_batch_result(*self.pending)
        elif batch is None:
            self.on_idle()
        self.launch_batch_sample_if_needed(result)
        self.pending = (batch, result)
        self.last_batch = batch

    return type("Scheduler", (), {
        **base, "__init__": init, "get_next_batch_to_run": get_next_batch_to_run,
        "on_idle": on_idle, "loop_once": loop_once, "receiver_cls": RequestReceiver})


@pytest.fixture(params=[False, True], ids=["sglang-0.5.10", "sglang-0.5.17"])
def traced(tmp_path: Path, request):
    clock = FakeClock()
    cls = make_scheduler(clock, receiver=request.param)
    receiver_cls = getattr(cls, "receiver_cls", None)
    assert lt.install(cls, tmp_path, clock=clock, receiver_cls=receiver_cls)
    assert not lt.install(cls, tmp_path, clock=clock)  # idempotent
    return cls(), clock, tmp_path


def _serve(s, clock: FakeClock) -> None:
    """Two requests arrive, one prefill of both, three decode steps, then idle."""
    s.inbox.extend([_Req("a"), _Req("b")])
    s.plan.extend([_Batch("extend", ["a", "b"], 300), *[_Batch("decode", ["a", "b"])] * 3])
    for _ in range(6):
        s.loop_once()
    clock.advance(1000)  # idle for a second
    s.loop_once()


def test_records_each_phase_with_the_batch_and_writes_only_when_idle(traced):
    s, clock, d = traced
    s.inbox.append(_Req("x"))
    s.plan.append(_Batch("extend", ["x"], 7))
    s.loop_once()
    assert lr.trace_files(d) == []  # busy: nothing written yet
    s.loop_once()  # processes the prefill's result; no batch and last_batch set: not idle yet
    s.loop_once()  # idle: flush
    assert s.idle_checks == 1
    (path,) = lr.trace_files(d)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert "wall_minus_perf" in rows[0]
    phases = [lr.Phase(r["p"]).name for r in rows[1:]]
    # empty inputs, no batch and a sample with no result are not recorded
    assert phases == ["RECV", "INPUT", "NEXT", "RUN", "SAMPLE", "RECV", "RESULT"]
    run = next(r for r in rows[1:] if r["p"] == lr.Phase.RUN)
    assert (run["m"], run["n"], run["tok"], run["rids"]) == (lr.Mode.EXTEND, 1, 7, ["x"])
    assert run["t1"] - run["t0"] == pytest.approx(8e-3)
    res = next(r for r in rows[1:] if r["p"] == lr.Phase.RESULT)
    assert res["w"] == pytest.approx(2e-3)  # the wait, apart from the 0.5 ms host work
    assert res["t1"] - res["t0"] == pytest.approx(2.5e-3)


def test_idle_spins_are_not_recorded(traced):
    s, clock, d = traced
    for _ in range(50):
        s.loop_once()
    assert lr.trace_files(d) == []


def test_summary_splits_segments_and_times_requests(traced):
    s, clock, d = traced
    _serve(s, clock)
    _serve(s, clock)
    (path,) = lr.trace_files(d)
    recs = lr.read_loop_trace(path)
    segs = lr.segments(recs, gap_s=0.3)
    assert len(segs) == 2
    summ = lr.summarize(segs[0])
    assert summ.requests == 2
    ext, dec = summ.modes[lr.Mode.EXTEND], summ.modes[lr.Mode.DECODE]
    assert (ext.iterations, dec.iterations) == (1, 3)
    ms = {"abs": 1e-3}  # records sit on the wall clock (~1.7e9 s): sub-microsecond rounding
    assert ext.tokens == 300 and ext.mean_ms("run") == pytest.approx(8.0, **ms)
    assert dec.mean_ms("run") == pytest.approx(1.0, **ms)
    # the iteration after the prefill waits for the prefill's tokens (2 ms), decode ones 4 ms
    assert dec.mean_ms("wait") == pytest.approx((2.0 + 4.0 + 4.0) / 3, **ms)
    # received at the end of process_input_requests, launched at run_batch's start
    assert summ.queue_ms == pytest.approx([0.3, 0.3], **ms)
    # launched -> its result processed: run 8 + sample 0.05 + next iteration up to the result
    expected_step = 8.0 + 0.05 + 0.1 + 0.3 + 1.0 + 2.0 + 0.5
    assert summ.step_ms == pytest.approx([expected_step] * 2, **ms)


def test_a_bad_line_is_reported_by_number(tmp_path: Path):
    p = tmp_path / "loop-1.jsonl"
    p.write_text(json.dumps({"pid": 1, "wall_minus_perf": 5.0}) + "\n"
                 + json.dumps({"p": 3, "t0": 1.0, "t1": 2.0, "m": 1, "n": 1, "tok": 3}) + "\n"
                 + json.dumps({"p": 99, "t0": 1.0, "t1": 2.0, "m": 1, "n": 1, "tok": 3}) + "\n")
    with pytest.raises(ValueError, match=r"loop-1.jsonl:3: bad loop-trace line"):
        lr.read_loop_trace(p)
    p.write_text(json.dumps({"p": 3, "t0": 1.0, "t1": 2.0, "m": 1, "n": 1, "tok": 3}) + "\n")
    with pytest.raises(ValueError, match=r":1: .*before the header"):
        lr.read_loop_trace(p)


def test_timed_methods_inside_a_launch_ride_on_its_record(tmp_path: Path):
    clock = FakeClock()
    cls = make_scheduler(clock)

    class Pool:
        def set_kv_buffer(self, n: int) -> int:
            clock.advance(0.25 * n)
            return n

    pool = Pool()
    original_run = cls.run_batch

    def run_batch(self, batch):
        for _ in range(4):  # four layers store their K/V
            pool.set_kv_buffer(len(batch.reqs))
        return original_run(self, batch)

    cls.run_batch = run_batch
    assert lt.install(cls, tmp_path, clock=clock)
    assert lt.time_method(Pool, "set_kv_buffer", "kv_store", clock=clock)
    assert not lt.time_method(Pool, "set_kv_buffer", "kv_store", clock=clock)
    s = cls()
    s.inbox.append(_Req("x"))
    s.plan.extend([_Batch("extend", ["x", "y"], 9), _Batch("decode", ["x"])])
    for _ in range(4):
        s.loop_once()
    (path,) = lr.trace_files(tmp_path)
    runs = [r for r in lr.read_loop_trace(path) if r.phase == lr.Phase.RUN]
    assert [r.mode for r in runs] == [lr.Mode.EXTEND, lr.Mode.DECODE]
    # the extend stored 2 requests x 4 layers, the decode 1 x 4; each launch starts at zero
    assert runs[0].spans["kv_store"] == pytest.approx(4 * 0.5e-3)
    assert runs[1].spans["kv_store"] == pytest.approx(4 * 0.25e-3)
    assert runs[0].t1 - runs[0].t0 == pytest.approx(2e-3 + 8e-3, abs=1e-6)
    assert pool.set_kv_buffer(3) == 3  # the wrapper returns what the method returns


def test_each_launch_carries_its_thread_cpu_time_and_garbage_collection(tmp_path: Path):
    clock, cpu = FakeClock(), FakeClock()
    cls = make_scheduler(clock)
    original_run = cls.run_batch

    def run_batch(self, batch):
        cpu.advance(3.0)  # of the 8 ms launch, the thread ran 3 ms
        if batch.forward_mode.is_extend():
            gc.collect()
        return original_run(self, batch)

    cls.run_batch = run_batch
    assert lt.install(cls, tmp_path, clock=clock, cpu_clock=cpu)
    s = cls()
    s.inbox.append(_Req("x"))
    s.plan.extend([_Batch("extend", ["x"], 9), _Batch("decode", ["x"])])
    gc.collect()  # outside a launch: on no record
    gc.disable()  # no automatic collection may land in the decode's launch
    try:
        for _ in range(4):
            s.loop_once()
    finally:
        gc.enable()
    (path,) = lr.trace_files(tmp_path)
    runs = [r for r in lr.read_loop_trace(path) if r.phase == lr.Phase.RUN]
    assert [r.spans[lt.CPU_SPAN] for r in runs] == pytest.approx([3e-3, 3e-3])
    assert runs[0].spans[lt.GC_SPAN] > 0  # the collector's real run time
    assert lt.GC_SPAN not in runs[1].spans


def test_a_gzipped_trace_reads_the_same(traced):
    import gzip

    s, clock, d = traced
    _serve(s, clock)
    (path,) = lr.trace_files(d)
    plain = lr.read_loop_trace(path)
    packed = d / (path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    assert lr.trace_files(d) == [packed]
    assert lr.read_loop_trace(packed) == plain
