"""The radix-cache model: block matching, locking, LRU eviction, and its effect on runs."""

from __future__ import annotations

import pytest
from sim_helpers import req, scenario, token_scheduler

from sglang_diffkv.serving_io.bundled import load_named_trace
from simulator.metrics.summary import summarize
from simulator.serving.prefix_cache import PrefixCache

SINK: list = []


def test_cache_blocks_lock_and_evict_lru():
    c = PrefixCache(512)
    assert c.insert([1, 2, 3], max_new=3) == 3 and c.units == 1536
    assert c.match([1, 2, 7], 10_000) == [1, 2]
    assert c.match([1, 2, 3], 1535) == [1, 2]          # leaves at least one token to compute
    assert c.lock([1, 2]) == 1024 and c.evictable_units == 512
    c.insert([4], max_new=1)
    assert c.evict(600) == 1024                         # two unlocked blocks: 3, then 4
    assert list(c.refs) == [1, 2] and not c.unlocked
    c.unlock([1, 2])
    assert c.evictable_units == 1024
    assert c.insert([5, 6], max_new=1) == 1             # bounded by the finisher's units


def test_shared_prefix_shortens_the_prefill_and_stays_cached():
    s = token_scheduler(10_000)
    s.cache = PrefixCache(512)
    r0 = req(0, 1636, 2)
    r0.hash_ids = (1, 2, 3, 4)
    s.submit(r0)
    t = 0.0
    while not r0.done:
        t += 1
        s.complete(s.next_batch(), t, SINK)
    # r0 held 1636 + 1 tokens; its 3 full prompt blocks (1536 tokens) stay as cache
    assert s.used == 1536 == s.cache.units and s.usage == 0.0
    r1 = req(1, 1586, 2)
    r1.hash_ids = (1, 2, 9, 10)
    s.submit(r1)
    b = s.next_batch()
    # blocks 1 and 2 match: 1024 cached tokens, 562 to compute, attending to 1024 past ones
    assert b.chunks == [(r1, 562)] and b.shape.prefill_past_tokens == 1024
    assert r1.prefix_blocks == [1, 2] and s.cache.evictable_units == 512


def test_mooncake_trace_reuses_prefixes_and_frees_everything():
    trace = load_named_trace("mooncake-synthetic").head(200)
    sc = scenario("qwen2.5-7b", max_total_tokens=300_000)
    res = sc.run(trace, "bf16")
    s = summarize(res)
    sched = res.replicas[0].scheduler
    assert s["completed"] + s["rejected"] == 200 and s["unfinished"] == 0
    # at most the hit rate of an unbounded cache that sees every earlier prompt at once
    seen: set[int] = set()
    ideal = 0
    for r in trace.requests:
        k = 0
        while k < len(r.prefix_hash_ids) and r.prefix_hash_ids[k] in seen:
            k += 1
        ideal += min(k * 512, r.input_tokens - 1)
        seen.update(r.prefix_hash_ids)
    ideal /= sum(r.input_tokens for r in trace.requests)
    assert 0.01 < s["prefix_hit_rate"] <= ideal
    assert sched.used == sched.cache_units                # only unlocked cache remains
    assert sched.cache.evictable_blocks == len(sched.cache.refs)
    off = summarize(scenario("qwen2.5-7b", max_total_tokens=300_000,
                             disable_radix_cache=True).run(trace, "bf16"))
    assert off["prefix_hit_rate"] is None
    assert off["ttft_ms"]["mean"] > s["ttft_ms"]["mean"]
    assert summarize(sc.run(trace, "diffkv"))["prefix_hit_rate"] is None  # DiffKV: radix off


@pytest.mark.parametrize("pool_tokens", [40_000, 120_000])
def test_eviction_under_memory_pressure_keeps_accounting_exact(pool_tokens):
    trace = load_named_trace("mooncake-synthetic").head(120)
    res = scenario("qwen2.5-7b", max_total_tokens=pool_tokens).run(trace, "bf16")
    s = summarize(res)
    sched = res.replicas[0].scheduler
    assert s["completed"] + s["rejected"] == 120 and s["unfinished"] == 0
    assert sched.used == sched.cache_units <= sched.pool.capacity
    assert s["peak_kv_usage"] <= 1.0
