"""End-to-end runs: analytic cases, determinism, completeness, metric definitions, replicas
and the capacity searches."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import scenario

from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.engine.cluster import simulate
from simulator.kv.mix import TierMix
from simulator.metrics.slo import SLO
from simulator.metrics.summary import per_request_arrays, summarize
from simulator.report import table
from simulator.serving.cost import StepShape
from simulator.studies.search import max_rate, replicas_for, steady_max_rate
from simulator.workload.generate import ClosedLoop, synthetic_trace
from simulator.workload.lengths import length_model


def _decode_time(srv, bs: int, kv: int) -> float:
    kvs = np.full(bs, kv)
    return srv.cost.step_time(StepShape(decode_reqs=bs, decode_kv_tokens=bs * kv,
                                        decode_read_bytes=srv.pool.read_bytes_per_layer(kvs,
                                                                                        None)))


def _prefill_time(srv, chunks: list[int]) -> float:
    return srv.cost.step_time(StepShape(prefill_tokens=sum(chunks),
                                        prefill_pairs=sum(c * c / 2 for c in chunks),
                                        prefill_seqs=len(chunks)))


@pytest.mark.parametrize("fmt", ["bf16", "diffkv"])
def test_single_request_ttft_is_its_prefill_time(fmt):
    sc = scenario()
    srv = sc.server(fmt)
    res = simulate(Trace((TraceRequest(0.0, 1000, 10),)), srv)
    r = res.requests[0]
    # DiffKV also scores the prompt with its last 64 queries before compressing it
    extra = srv.pool.compression_pairs(1000)
    prefill = srv.cost.step_time(StepShape(prefill_tokens=1000, prefill_pairs=1000**2 / 2 + extra,
                                           prefill_seqs=1))
    assert r.first_token == pytest.approx(prefill, rel=1e-12)
    # decode steps: KV holds 1000 + j tokens at step j (the step writes token j's KV)
    e2e = r.first_token + sum(_decode_time(srv, 1, 1000 + j) for j in range(1, 10))
    assert r.finish == pytest.approx(e2e, rel=1e-12)
    s = summarize(res)
    assert s["ttft_ms"]["mean"] == pytest.approx(1e3 * r.first_token)
    assert s["tpot_ms"]["mean"] == pytest.approx(1e3 * (r.finish - r.first_token) / 9)


def test_client_latency_adds_to_ttft_and_e2e_and_to_a_closed_loops_gaps():
    lat = 0.012
    base, slow = scenario(), scenario()
    slow = replace(slow, calibration=replace(slow.calibration, first_token_latency_s=lat))
    trace = Trace((TraceRequest(0.0, 300, 20), TraceRequest(0.5, 200, 30)))
    a, b = summarize(base.run(trace, "bf16")), summarize(slow.run(trace, "bf16"))
    assert b["ttft_ms"]["mean"] == pytest.approx(a["ttft_ms"]["mean"] + 1e3 * lat)
    assert b["e2e_ms"]["mean"] == pytest.approx(a["e2e_ms"]["mean"] + 1e3 * lat)
    assert b["tpot_ms"]["mean"] == pytest.approx(a["tpot_ms"]["mean"])
    # one user, two requests: the second reaches the server one latency after the first ends
    loop = ClosedLoop(tuple(TraceRequest(0.0, 100, 10) for _ in range(2)), 1)
    ra, rb = base.run(loop, "bf16").requests, slow.run(loop, "bf16").requests
    assert rb[1].arrival - rb[0].finish == pytest.approx(lat)
    assert ra[1].arrival == pytest.approx(ra[0].finish)


def test_closed_loop_throughput_is_batch_over_step_time():
    sc = scenario()
    srv = sc.server("bf16")
    users, waves, inp, out = 8, 4, 64, 33
    reqs = tuple(TraceRequest(0.0, inp, out) for _ in range(users * waves))
    res = simulate(ClosedLoop(reqs, users), srv)
    # each wave: one prefill of 8 x 64 tokens, then 32 decode steps of batch 8
    wave = _prefill_time(srv, [inp] * users) + sum(
        _decode_time(srv, users, inp + j) for j in range(1, out))
    assert res.end_time == pytest.approx(waves * wave, rel=1e-9)
    s = summarize(res)
    assert s["mean_batch"] == users and s["peak_batch"] == users
    assert s["output_throughput"] == pytest.approx(users * waves * out / (waves * wave), rel=1e-9)
    # in the decode phase tokens arrive at B / step time
    itl = np.concatenate(res.replicas[0].itl)
    assert itl.min() == pytest.approx(_decode_time(srv, users, inp + 1), rel=1e-9)


def test_fixed_seed_gives_identical_results():
    base = scenario()
    sc = replace(base, mix=TierMix(0.3, 0.5, head_spread=0.3, request_spread=0.2), seed=7)
    trace = synthetic_trace(length_model("sharegpt"), 300, 40.0, seed=11, cv=2.0)
    a = summarize(sc.run(trace, "diffkv"))
    b = summarize(sc.run(trace, "diffkv"))
    assert a == b
    trace2 = synthetic_trace(length_model("sharegpt"), 300, 40.0, seed=12, cv=2.0)
    assert summarize(sc.run(trace2, "diffkv")) != a


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "k4v2", "diffkv"])
def test_every_request_completes_or_is_rejected_under_memory_pressure(fmt):
    sc = scenario(max_total_tokens=40_000)
    trace = resample_arrivals(load_named_trace("azure-conv").head(400), 200.0, seed=1)
    trace = Trace(trace.requests + (TraceRequest(trace.requests[-1].arrival_s, 39_990, 5),),
                  name="pressure")
    res = sc.run(trace, fmt)
    s = summarize(res)
    assert s["completed"] + s["rejected"] == s["requests"] == 401
    assert s["rejected"] >= 1 and s["unfinished"] == 0
    assert sum(s["rejection_reasons"].values()) == s["rejected"]
    assert all("N" in reason for reason in s["rejection_reasons"])
    assert s["retractions"] > 0
    sched = res.replicas[0].scheduler
    assert sched.used == 0 and sched.idle            # every unit returned to the pool
    assert s["peak_kv_usage"] <= 1.0
    arrs = per_request_arrays(res)
    # bench_serving: one ITL per token after the first, pooled over requests
    itl_count = sum(a.size for a in res.replicas[0].itl) + sum(
        len(r.itl) for r in res.requests if r.itl)
    assert itl_count == int((arrs["output"] - 1).sum())
    done = [r for r in res.requests if r.rejected is None]
    assert all(r.gen == r.output_len for r in done)


def test_ignore_eos_admission_never_retracts():
    sc = scenario(max_total_tokens=40_000, disable_radix_cache=True)
    trace = resample_arrivals(load_named_trace("azure-conv").head(300), 200.0, seed=1)
    s = summarize(sc.run(trace, "bf16"))
    assert s["completed"] == 300 and s["retractions"] == 0
    assert summarize(scenario(max_total_tokens=40_000).run(trace, "bf16"))["retractions"] > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.floats(0, 2), st.integers(1, 3000), st.integers(1, 400),
                          st.integers(0, 300), st.integers(0, 2)),
                min_size=1, max_size=25),
       st.sampled_from(["bf16", "k8v4", "diffkv"]), st.sampled_from([3000, 6000, 20000]),
       st.booleans(), st.booleans(), st.sampled_from([256, 1024, -1]))
def test_property_every_request_ends_and_pool_accounting_never_leaks(
        rows, fmt, pool_tokens, no_radix, mixed, chunk):
    # 64 request rows: DiffKV's page tables for SGLang's default (pool // 2 = 1,500 rows of
    # an 8k context) would take more than these small pools
    sc = scenario(max_total_tokens=pool_tokens, chunked_prefill_size=chunk,
                  disable_radix_cache=no_radix, enable_mixed_chunk=mixed,
                  max_running_requests=64)
    # extra max_new_tokens beyond the output, and prompts sharing 512-token prefix blocks
    trace = Trace(tuple(TraceRequest(t, i, o, o + extra,
                                     tuple(group * 1000 + k for k in range(i // 512)))
                        for t, i, o, extra, group in rows))
    res = sc.run(trace, fmt)
    s = summarize(res)
    sched = res.replicas[0].scheduler
    assert s["completed"] + s["rejected"] == len(rows) and s["unfinished"] == 0
    assert sched.used == sched.cache_units               # only unlocked cache remains
    assert max(res.replicas[0].log.usage, default=0) <= 1.0


def test_replicas_share_the_load():
    sc = scenario()
    trace = resample_arrivals(load_named_trace("sharegpt").head(400), 20.0, seed=3)
    rr = sc.with_replicas(2).run(trace, "bf16")
    counts = [sum(r.replica == k for r in rr.requests) for k in range(2)]
    assert counts == [200, 200]
    lo = replace(sc, router="least_outstanding", replicas=3).run(trace, "bf16")
    assert {r.replica for r in lo.requests} == {0, 1, 2}
    one = summarize(sc.run(trace, "bf16"))
    two = summarize(sc.with_replicas(2).run(resample_arrivals(trace, 40.0, seed=3), "bf16"))
    # twice the rate on twice the replicas: the same work in about half the time
    assert two["duration_s"] < 0.75 * one["duration_s"]
    assert two["ttft_ms"]["p50"] < 2 * one["ttft_ms"]["p50"]


def test_capacity_searches_bracket_the_slo():
    sc = scenario()
    trace = load_named_trace("sharegpt").head(300)
    slo = SLO(ttft_s=0.3, tpot_s=0.03, attainment=0.9)
    found = max_rate(sc, trace, "bf16", slo, lo=1.0, hi=1024.0, rel_tol=0.2)
    assert found["max_rate"] > 1.0
    probes = found["probes"]
    assert all(p["met"] for p in probes if p["rate"] <= found["max_rate"])
    failing = [p["rate"] for p in probes if not p["met"]]
    assert failing and min(failing) <= found["max_rate"] * 1.2 + 1e-9
    at = found["at_max"]
    assert at["rate"] == found["max_rate"] and at["attainment"] >= 0.9
    assert at["ttft_p99_ms"] > 0 and at["output_throughput"] > 0
    # a bracket that misses the answer is widened to reach it
    top = found["max_rate"]
    low = max_rate(sc, trace, "bf16", slo, lo=top / 4, hi=top / 2, rel_tol=0.2,
                   ceiling=1024.0)
    assert low["max_rate"] > top / 2


def test_gpus_follow_the_per_replica_maximum():
    assert replicas_for(400.0, 59.3, 1, 64) == {"replicas": 7, "gpus": 7, "note": ""}
    assert replicas_for(118.6, 59.3, 2, 64)["gpus"] == 4
    assert replicas_for(400.0, 59.3, 1, 4)["replicas"] is None
    assert replicas_for(1.0, 0.0, 1, 64)["replicas"] is None


def test_all_rejected_run_reports_zero_rates():
    sc = scenario(context_len=64)
    res = sc.run(Trace((TraceRequest(0.0, 100, 10), TraceRequest(1.0, 80, 5))), "fp8")
    s = summarize(res, SLO(ttft_s=1.0))
    assert (s["completed"], s["rejected"], s["duration_s"]) == (0, 2, 0.0)
    assert s["output_throughput"] == 0.0 and s["goodput"] == 0.0
    assert s["rejection_reasons"] == {"input N + max_new_tokens N >= context length N": 2}


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_scheduler_admits_an_arrival_one_step_late(overlap):
    """A request that arrives while a step runs joins the batch after the next one under the
    overlap scheduler (that batch was formed when the step started), the next one without
    it; the server was busy with request 0's decode steps."""
    sc = scenario(disable_overlap_schedule=not overlap)
    srv = sc.server("bf16")
    t0 = _prefill_time(srv, [1000])
    d1 = _decode_time(srv, 1, 1001)
    arrival = t0 + 0.5 * d1                   # in the middle of request 0's first decode step
    res = simulate(Trace((TraceRequest(0.0, 1000, 50), TraceRequest(arrival, 200, 5))), srv)
    late = res.requests[1]
    starts = t0 + d1 + (_decode_time(srv, 1, 1002) if overlap else 0.0)
    assert late.first_token == pytest.approx(starts + _prefill_time(srv, [200]), rel=1e-9)
    # an idle server forms its batch at once, overlap or not
    assert res.requests[0].first_token == pytest.approx(t0, rel=1e-12)


def test_eager_decode_share_counts_decode_time_above_the_largest_graph():
    # 4 requests stop after 11 tokens, 4 after 33: batch 8, then batch 4
    reqs = Trace(tuple(TraceRequest(0.0, 64, out) for out in (11,) * 4 + (33,) * 4))
    runs = {name: simulate(reqs, scenario(**kw).server("bf16")) for name, kw in (
        ("max4", {"cuda_graph_max_bs": 4}), ("max8", {"cuda_graph_max_bs": 8}),
        ("off", {"disable_cuda_graph": True}))}
    s = {name: summarize(res) for name, res in runs.items()}
    lg = runs["max4"].replicas[0].log.arrays()
    dec = lg["kind"] == 1
    eager = dec & (lg["running"] > 4)
    assert 0 < eager.sum() < dec.sum()
    assert s["max4"]["cuda_graph_max_bs"] == 4
    assert s["max4"]["eager_decode_share"] == pytest.approx(
        lg["dt"][eager].sum() / lg["dt"][dec].sum(), rel=1e-12)
    note = table.eager_note(s["max4"])
    assert "above the largest CUDA graph (batch 4)" in note and "--cuda-graph-max-bs 8" in note
    assert s["max8"]["eager_decode_share"] == 0.0 and table.eager_note(s["max8"]) is None
    assert s["off"]["eager_decode_share"] == 1.0 and s["off"]["cuda_graph_max_bs"] == 0
    assert "with CUDA graphs off" in table.eager_note(s["off"])


def test_steady_search_doubles_the_trace_until_the_answer_settles():
    sc = scenario()
    trace = load_named_trace("sharegpt").head(200)
    slo = SLO(ttft_s=0.3, tpot_s=0.03, attainment=0.9)
    found = steady_max_rate(sc, trace, "bf16", slo, 1.0, 1024.0, start_requests=100,
                            tol=0.25, max_requests=800)
    lengths = [lv["requests"] for lv in found["levels"]]
    assert lengths == [100 * 2**i for i in range(len(lengths))] and len(lengths) >= 2
    assert found["max_rate"] == found["levels"][-1]["max_rate"] > 1.0
    assert found["converged"] == (found["last_change"] <= 0.25)
    assert {p["requests"] for p in found["probes"]} == set(lengths)
