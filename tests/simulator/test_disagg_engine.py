"""The disaggregated deployment: the decode side's preallocation (SGLang's rule, by hand),
no request joins a decode batch before its KV has arrived or without a reservation that
fit, and conservation (every request finishes once; memory returns to empty; TTFT covers
the prefill and the transfer)."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import req, scenario, token_scheduler

from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.bundled import load_named_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.engine.disagg import simulate_disagg
from simulator.errors import SimulatorInputError
from simulator.metrics.summary import summarize
from simulator.serving.prealloc import NUM_RESERVED_DECODE_TOKENS, PreallocQueue
from simulator.serving.scheduler import Scheduler
from simulator.specs.link import LinkSpec, load_link

SLOW = LinkSpec("slow", "slow", 2e9, 1.0, 1e-4, "test: a slow link")


def test_prealloc_reserves_in_order_while_sglangs_rule_admits():
    s = token_scheduler(4000)
    q = PreallocQueue(s)
    a, b, c = req(0, 1000, 10), req(1, 1000, 10), req(2, 10, 10)
    for r in (a, b, c):
        assert q.admissible(r)
        q.add(r)
    # a: 1000 + 512 <= 4000. b: 4000 - 1000 - 512 x (1 active) = 2488 >= 1512. c: FIFO
    # behind b is fine too: 4000 - 2000 - 512 x 2 = 976 >= 522
    assert q.pop_preallocated(0) == [a, b, c]
    assert s.used == 2010 and (a.held, b.held, c.held) == (1000, 1000, 10)
    d = req(3, 500, 10)
    q.add(d)
    # 4000 - 2010 - 512 x 3 in flight = 454 < 500 + 512: waits, and blocks what follows
    e = req(4, 1, 1)
    q.add(e)
    assert q.pop_preallocated(3) == [] and list(q.queue) == [d, e]
    # a and b arrive and run; their outputs' room counts against the next reservation
    assert s.join_prebuilt([a, b], now=1.0) == []
    assert s.running == 2 and a.first_token == 1.0 and a.gen == 1
    s.cancel_reservation(c)
    assert s.used == 2000
    # running a, b: retractable 2000, need_single = 1000 + 10 - 2000 < 0; 2 active:
    # 4000 - 2000 - 1024 = 976 < 1012: still waits
    assert q.pop_preallocated(0) == []


def test_prealloc_never_reserves_more_than_is_free_even_with_diffkv_pages():
    srv = scenario(max_total_tokens=20_000, max_running_requests=64).server("diffkv")
    s = srv.new_scheduler(0)
    q = PreallocQueue(s)
    rs = [req(i, 3000, 100) for i in range(20)]
    for r in rs:
        assert q.admissible(r)
        q.add(r)
    taken = q.pop_preallocated(0)
    reserve = s.pool.future_units(NUM_RESERVED_DECODE_TOKENS)
    assert 0 < len(taken) < 20
    assert s.used == sum(r.held for r in taken) <= s.pool.capacity
    # each reservation is the prompt's compressed pages, not its all-high prefill pages
    kv = np.array([3000])
    assert taken[0].held == int(s.pool.decode_units(kv, None)[0]) < s.pool.prompt_units(0, 3000)
    # the next one would not have fit with the reserve of every active request kept free
    nxt = q.queue[0]
    free = s.pool.capacity - s.used
    assert nxt.held == 0 and free - reserve * len(taken) < taken[0].held + reserve


def test_a_prompt_that_cannot_fit_an_empty_decode_pool_is_rejected_up_front():
    s = token_scheduler(1000)
    r = req(0, 600, 10)
    assert not PreallocQueue(s).admissible(r) and "even in an empty pool" in r.rejected


def _run(fmt: str, n: int = 120, rate: float = 12.0, p: int = 2, d: int = 1,
         link: LinkSpec = SLOW, scope: str = "pair", **settings: object):
    sc = scenario(**settings)
    trace = resample_arrivals(load_named_trace("azure-conv").head(n), rate, 0)
    return sc.server(fmt), simulate_disagg(trace, sc.server(fmt), p, d, link, scope)


@pytest.mark.parametrize("fmt, scope", [("bf16", "pair"), ("diffkv", "pair"), ("fp8", "gpu")])
def test_conservation_and_ttft_covers_the_prefill_and_the_transfer(fmt, scope):
    srv, res = _run(fmt, scope=scope)
    kv = res.meta["kv"]
    assert len(res.requests) == 120
    for r in res.requests:
        assert (r.rejected is None) == (r.finish >= 0)      # finished or rejected, once
        if r.rejected is not None:
            continue
        x = kv[r.rid]
        assert r.arrival <= x.reserved <= x.prefill_start < x.prefill_end
        # the KV arrives after the prompt's last step and its last piece's wire time ...
        assert x.arrived >= x.prefill_end + x.last_wire_s - 1e-12
        # ... the request joins a decode batch (its first token) only then
        assert r.first_token >= x.arrived
        assert r.first_token - r.arrival >= (x.prefill_end - x.prefill_start) + x.last_wire_s
        assert r.finish >= r.first_token and r.gen == r.output_len
        assert x.bytes == pytest.approx(
            srv.pool.decode_units(np.array([r.input_len]), r.prof[None] if r.prof is not None
                                  else None)[0] * (srv.deployment.kv_format.geometry.page_bytes
                                                   if fmt == "diffkv" else 32 * 8 * 512
                                                   / (2 if fmt == "fp8" else 1)))
    s = summarize(res)
    assert s["completed"] + s["rejected"] == 120 and s["completed"] > 100
    for rep in res.replicas:                  # every unit freed, every request delivered
        assert rep.scheduler.used == 0 and rep.outstanding == 0
        assert rep.scheduler.holding == 0 and not rep.scheduler.run_reqs
    ports = res.meta["ports"]
    assert sum(p.bytes for p in ports) == pytest.approx(
        sum(kv[r.rid].bytes for r in res.requests if r.rejected is None)
        * (2 if scope == "gpu" else 1))


def test_no_reservation_exceeds_the_free_pages_and_none_joins_before_its_kv(monkeypatch):
    seen: list[tuple[int, int]] = []
    joins: list[tuple[float, list[int]]] = []
    reserve, join = Scheduler.reserve, Scheduler.join_prebuilt

    def spy_reserve(self, r, units):
        seen.append((self.free_units, units))
        reserve(self, r, units)

    def spy_join(self, reqs, now):
        joins.append((now, [r.rid for r in reqs]))
        return join(self, reqs, now)

    monkeypatch.setattr(Scheduler, "reserve", spy_reserve)
    monkeypatch.setattr(Scheduler, "join_prebuilt", spy_join)
    # a small decode pool: reservations must wait for running requests to finish
    _, res = _run("diffkv", n=150, rate=40.0, p=3, d=1, max_total_tokens=30_000,
                  max_running_requests=64)
    kv = res.meta["kv"]
    waited = [kv[r.rid].reserved - r.arrival for r in res.requests if r.rejected is None]
    assert max(waited) > 0.05                   # the pool was the bottleneck at times
    assert seen and all(units <= free for free, units in seen)
    for now, rids in joins:
        assert all(kv[i].arrived <= now for i in rids)


def test_a_finished_prompts_kv_stays_on_the_prefill_replica_until_its_transfer_ends():
    sc = scenario()
    link = LinkSpec("slow", "slow", 1e8, 1.0, 0.0, "test")   # 100 MB/s: seconds per prompt
    trace = Trace((TraceRequest(0.0, 2000, 3), TraceRequest(0.0, 2000, 3)))
    res = simulate_disagg(trace, sc.server("bf16"), 1, 2, link)
    kv = res.meta["kv"]
    a, b = (kv[i] for i in (0, 1))
    wire = 2000 * 131072 / 1e8
    # both prefilled in one step; separate decode replicas, separate links: no queueing
    assert a.prefill_end == b.prefill_end
    assert a.arrived == pytest.approx(a.prefill_end + wire)
    assert b.arrived == pytest.approx(a.arrived)
    prefill = res.replicas[0]
    usage = dict(zip(prefill.log.t_end, prefill.log.usage, strict=True))
    assert usage[a.prefill_end] > 0            # held through the transfer, freed after
    assert prefill.scheduler.used == 0


def test_one_output_token_finishes_at_its_arrival_on_the_decode_side():
    sc = scenario()
    res = simulate_disagg(Trace((TraceRequest(0.0, 500, 1),)), sc.server("fp8"), 1, 1,
                          load_link("nvlink4"))
    r = res.requests[0]
    assert r.finish == r.first_token == res.meta["kv"][0].arrived and r.gen == 1


def test_bad_deployments_are_clear_errors():
    sc = scenario()
    with pytest.raises(SimulatorInputError, match="decode replicas=0"):
        simulate_disagg(Trace((TraceRequest(0.0, 5, 2),)), sc.server("bf16"), 1, 0, SLOW)
