"""The engine's fast path for runs of decode steps (``Replica.fast_forward``) changes nothing:
every request's times, every step's log row, every inter-token gap and the end of the run
are the same to the last bit as forming, completing and logging each step in turn, for
colocated and disaggregated replicas, every kind of KV pool, retractions, the radix cache,
closed loops and the overlap scheduler on and off. And the cost model's per-batch timers
(``CostModel.decode_step_timer``) give ``step_time``'s numbers exactly."""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.engine.cluster import RunResult, simulate
from simulator.engine.disagg import simulate_disagg
from simulator.engine.replica import Replica
from simulator.kv.mix import TierMix
from simulator.serving.cost import StepShape
from simulator.serving.prealloc import PreallocQueue
from simulator.serving.scheduler import Scheduler
from simulator.specs.calibration_set import load_calibration_set
from simulator.specs.link import LinkSpec, load_link
from simulator.studies.scenario import Scenario
from simulator.workload.generate import ClosedLoop

SLOW = LinkSpec("slow", "slow", 2e9, 1.0, 1e-4, "test: a slow link")


def measured(**settings: object) -> Scenario:
    """The CLI's default scenario: the H100 calibrations fitted to measured runs, with their
    grids (``sim_helpers.scenario`` has the flat calibration)."""
    return replace(scenario(**settings), calibration=load_calibration_set("h100"))


def _snapshot(res: RunResult) -> dict[str, Any]:
    """Everything a run leaves behind that a summary or a test reads."""
    reqs = [(r.rid, r.arrival, r.first_token, r.finish, r.last_token, r.gen, r.retractions,
             r.rejected, r.replica, r.cached, None if r.itl is None else tuple(r.itl))
            for r in res.requests]
    reps = []
    for rep in res.replicas:
        itl = np.concatenate(rep.itl) if rep.itl else np.zeros(0)
        reps.append(({k: v.tolist() for k, v in rep.log.arrays().items()}, itl.tolist(),
                     rep.scheduler.used, rep.scheduler.retractions, rep.outstanding,
                     rep.scheduler.new_token_ratio))
    meta = {}
    if "kv" in res.meta:
        meta = {"kv": {k: vars(v) for k, v in res.meta["kv"].items()},
                "ports": [(p.busy_s, p.bytes, p.transfers) for p in res.meta["ports"]]}
    return {"requests": reqs, "replicas": reps, "end": res.end_time, "meta": meta}


def _same_both_ways(monkeypatch: pytest.MonkeyPatch, run: Any) -> RunResult:
    """``run()`` step by step and fast-forwarded: identical (NaN equal to NaN)."""
    monkeypatch.setattr(Replica, "fast_forward", False)
    slow = run()
    monkeypatch.setattr(Replica, "fast_forward", True)
    fast = run()
    assert _first_difference(_snapshot(slow), _snapshot(fast)) is None
    return fast


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (floats bit for bit, NaN equal to NaN), or None;
    a short answer where pytest's own diff of two large structures would take minutes."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a)} != {sorted(b)}"
        pairs = [(a[k], b[k], f"{where}.{k}") for k in a]
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{where}: {len(a)} != {len(b)} items"
        pairs = [(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True))]
    else:
        same = (a == b and (not isinstance(a, float) or math.copysign(1, a)
                            == math.copysign(1, b))) or (
            isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
        return None if same and type(a) is type(b) else f"{where}: {a!r} != {b!r}"
    return next((d for x, y, w in pairs if (d := _first_difference(x, y, w))), None)


def _trace(name: str, n: int, rate: float, seed: int = 0) -> Trace:
    return resample_arrivals(load_named_trace(name).head(n), rate, seed)


@pytest.mark.parametrize("fmt, settings", [
    ("bf16", {}),                                          # radix cache, page-size-1 pool
    ("fp8", {"disable_overlap_schedule": True}),
    ("k8v4", {}),                                          # a paged token pool
    ("diffkv", {}),
    ("bf16", {"max_total_tokens": 15_000}),                # retractions
    ("diffkv", {"max_total_tokens": 30_000, "max_running_requests": 64}),
    ("bf16", {"enable_mixed_chunk": True, "chunked_prefill_size": 1024}),
    ("bf16", {"cuda_graph_max_bs": 8}),                    # eager decode steps above 8
])
def test_colocated_runs_are_identical_with_and_without_the_fast_path(monkeypatch, fmt,
                                                                     settings):
    sc = measured(**settings)
    trace = _trace("azure-conv", 300, 12.0)
    res = _same_both_ways(monkeypatch, lambda: simulate(trace, sc.server(fmt), 2))
    assert sum(len(rep.log.dt) for rep in res.replicas) > 1000
    if settings.get("max_total_tokens"):
        assert sum(rep.scheduler.retractions for rep in res.replicas) > 0


def test_the_fast_path_covers_most_decode_steps_of_a_quiet_replica(monkeypatch):
    # two long generations alone: every step but the few around arrivals and finishes is
    # in a run, and a run never spans the step where a request finishes
    runs: list[int] = []
    commit = Replica._commit_run

    def spy(self, run, batch):
        runs.append(len(run.ends))
        return commit(self, run, batch)
    monkeypatch.setattr(Replica, "_commit_run", spy)
    trace = Trace((TraceRequest(0.0, 500, 700), TraceRequest(0.3, 200, 400)))
    res = _same_both_ways(monkeypatch, lambda: simulate(trace, measured().server("bf16")))
    steps = len(res.replicas[0].log.dt)
    assert sum(runs) > 0.9 * steps and max(runs) <= 256


def test_prefix_cache_closed_loop_and_request_spread_are_identical(monkeypatch):
    sc = replace(measured(max_total_tokens=60_000),
                 mix=TierMix(0.3, 0.5, head_spread=0.3, request_spread=0.2), seed=3)
    moon = load_named_trace("mooncake-conversation").head(200)
    _same_both_ways(monkeypatch, lambda: simulate(moon, sc.server("bf16"), 1))
    _same_both_ways(monkeypatch, lambda: simulate(_trace("azure-conv", 200, 15.0),
                                                  sc.server("diffkv"), 2,
                                                  "least_outstanding"))
    loop = ClosedLoop(tuple(TraceRequest(0.0, 300 + 7 * i, 40 + i % 13) for i in range(120)),
                      6, think_s=0.01)
    _same_both_ways(monkeypatch, lambda: simulate(loop, sc.server("fp8"), 2))


@pytest.mark.parametrize("fmt, scope, p, d, rate", [
    ("bf16", "pair", 3, 1, 20.0), ("diffkv", "pair", 2, 2, 15.0), ("fp8", "gpu", 2, 3, 25.0),
])
def test_disaggregated_runs_are_identical_with_and_without_the_fast_path(monkeypatch, fmt,
                                                                         scope, p, d, rate):
    sc = measured()
    link = SLOW if scope == "gpu" else load_link("rdma-100")
    trace = _trace("azure-code", 200, rate)
    res = _same_both_ways(monkeypatch,
                          lambda: simulate_disagg(trace, sc.server(fmt), p, d, link, scope))
    assert all(r.finish >= 0 for r in res.requests)


def test_a_small_decode_pool_stays_identical(monkeypatch):
    # reservations wait for running requests to finish: the decode replica's queue
    sc = measured(max_total_tokens=30_000, max_running_requests=64)
    trace = _trace("azure-conv", 150, 40.0)
    _same_both_ways(monkeypatch, lambda: simulate_disagg(trace, sc.server("diffkv"), 3, 1,
                                                         SLOW))


@pytest.mark.parametrize("fmt", ["bf16", "diffkv"])
@pytest.mark.parametrize("make", [scenario, measured])
def test_decode_timers_give_step_times_to_the_last_bit(fmt, make):
    cost = make(cuda_graph_max_bs=64).server(fmt).cost
    rng = np.random.default_rng(0)
    for reqs in (0, 1, 3, 17, 64, 65, 200):
        for _ in range(20):
            kv = int(rng.integers(reqs, 40_000 * max(reqs, 1) + 1))
            read = float(rng.uniform(0, 1e9))
            released = int(rng.integers(0, 3))
            shape = StepShape(decode_reqs=reqs, decode_kv_tokens=kv, decode_read_bytes=read,
                              released_reqs=released)
            # the reference: the operations step_time performed on any step before the
            # timers, for a decode-only shape
            c = cost.calib
            graphed = cost.graphed(shape)
            lin = cost.padded_batch(reqs) if graphed else reqs
            per_layer = cost._dense_layer(lin)
            if reqs:
                if cost._decode_grid is not None:
                    att = (cost.decode_attention_sol(reqs, kv, read)
                           / cost._decode_grid(reqs, kv / max(reqs, 1)))
                else:
                    nbytes, fl = cost.decode_attention_work(reqs, kv, read)
                    att = max(nbytes / cost.attn_mem_rate, fl / cost.attn_comp_rate)
                per_layer += att * cost.attention_scale
                assert cost.decode_attention_time(reqs, kv, read) == att * cost.attention_scale
            t = cost.layers * per_layer + cost._gemm(lin, cost.lm_head, cost._lm_grid)
            t += cost.layers * cost.layer_overhead(shape)
            t += (c.step_overhead_s + c.seq_overhead_s * reqs
                  + c.release_overhead_s * released)
            want = max(t, cost.host_bound_floor(shape))
            assert cost.step_time(shape) == want
            assert cost.decode_step_time(reqs, kv, read, released) == want


def test_a_grid_along_one_axis_is_the_grid():
    grid = measured().server("bf16").cost._decode_grid
    assert grid is not None
    rng = np.random.default_rng(1)
    for x in (0.5, 1, 2, 3, 100, 1e6):
        f = grid.at_x(x)
        for y in [0.0, 1e-3, 1.0, *rng.uniform(0, 3e5, 50).tolist(), math.inf]:
            assert f(y) == grid(x, y)


@pytest.mark.parametrize("fmt", ["bf16", "k8v4", "diffkv"])
def test_the_batch_totals_the_scheduler_keeps_match_its_arrays(monkeypatch, fmt):
    checked = [0]
    next_batch = Scheduler.next_batch

    def check(self, *args):
        assert self._kv_total == int(self.kv.sum())
        assert self._held_total == int(self.held.sum())
        if self.run_reqs:
            assert self._left == int((self.out - self.gen).min()) >= 1
            checked[0] += 1
        return next_batch(self, *args)
    monkeypatch.setattr(Scheduler, "next_batch", check)
    sc = measured(max_total_tokens=30_000, max_running_requests=64)
    simulate(_trace("azure-conv", 200, 12.0), sc.server(fmt), 1)
    simulate_disagg(_trace("azure-code", 100, 20.0), measured().server(fmt), 2, 1, SLOW)
    assert checked[0] > 500


def test_reservations_made_between_a_runs_steps_are_the_loops(monkeypatch):
    # without SGLang's 512-token reserve per request a reservation can leave too little for
    # the next decode step: the run then ends with the step whose end made the reservation,
    # whose log row still shows the pool before it (as the loop logs a step before its
    # next formation reserves)
    init = PreallocQueue.__init__
    monkeypatch.setattr(PreallocQueue, "__init__",
                        lambda self, sched, reserved_tokens=0: init(self, sched, 0))
    ended_by_one: list[int] = []
    commit = Replica._commit_run

    def spy(self, run, batch):
        out = commit(self, run, batch)
        ended_by_one.append(out[2])
        return out
    monkeypatch.setattr(Replica, "_commit_run", spy)
    sc = measured(max_total_tokens=16_000, max_running_requests=64)
    trace = _trace("azure-conv", 300, 20.0)
    res = _same_both_ways(monkeypatch, lambda: simulate_disagg(trace, sc.server("diffkv"), 3,
                                                               1, SLOW))
    assert any(ended_by_one)
    assert sum(rep.scheduler.retractions for rep in res.replicas) > 0


def test_a_started_shape_is_the_shape_with_its_timing_replaced():
    # StepShape.started builds the shape positionally: every field must land in place
    given = {f.name: ((i, i + 1),) if f.name == "prefill_chunks" else
             (float(i) if f.type == "float" else i) for i, f in enumerate(fields(StepShape), 1)}
    shape = StepShape(**given)
    assert shape.started(0.5, 0.25) == replace(shape, prefill_gap_s=0.5,
                                               launch_head_start_s=0.25)
