"""KV formats take their bytes from sglang_diffkv.layout; the DiffKV pool's page accounting
matches hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_diffkv.config import K4V2, K8V4, preset
from sglang_diffkv.layout import PageGeometry, TierLayout, fp16_bytes_per_token, search_page_bytes
from simulator.errors import SimulatorInputError
from simulator.kv.formats import DiffKVFormat, make_format
from simulator.kv.mix import TierMix
from simulator.kv.pool import DiffKVPool
from simulator.specs.model import load_model

GIB = 2**30


def test_uniform_formats_use_layout_bytes():
    m = load_model("llama-3-8b")
    bf16 = make_format("bf16", 128)
    assert bf16.bytes_per_token_head == fp16_bytes_per_token(128)
    assert make_format("fp8", 128).bytes_per_token_head == fp16_bytes_per_token(128) / 2
    for name, tier in (("k8v4", K8V4), ("k4v2", K4V2)):
        f = make_format(name, 128)
        page = search_page_bytes(128, (tier,))
        lay = TierLayout.build(tier, 128, page)
        assert f.page_size == lay.tokens_per_page
        assert f.bytes_per_token_head == lay.bytes_per_token
        pool = f.build_pool(m, 1, f.max_total_num_tokens(m, 1, 10 * GIB), 2048, 8192)
        # whole pages per (layer, head): tokens = pages * tokens_per_page
        pages = int(10 * GIB // (page * m.num_layers * m.num_kv_heads))
        assert pool.capacity == pages * lay.tokens_per_page
    tokens = bf16.max_total_num_tokens(m, 1, 10 * GIB)
    assert tokens == 10 * GIB // (32 * 8 * 512)
    pool = bf16.build_pool(m, 1, tokens, 2048, 8192)
    assert pool.capacity == tokens
    assert pool.read_bytes_per_layer(np.array([100, 50]), None) == 150 * 8 * 512


def test_unknown_format_and_bad_head_dim():
    with pytest.raises(SimulatorInputError, match="unknown KV format 'int3'"):
        make_format("int3", 128)
    with pytest.raises(SimulatorInputError, match="head_dim=96"):
        make_format("diffkv", 96)


def _pool(mix: TierMix, heads: int = 2, layers: int = 1, pages: int = 10_000) -> DiffKVPool:
    cfg = preset("llama-3-8b")
    geo = PageGeometry.for_config(cfg, 128)
    return DiffKVPool(pages, geo, cfg.window, mix, layers, heads)


def test_diffkv_pages_hand_computed():
    cfg = preset("llama-3-8b")
    geo = PageGeometry.for_config(cfg, 128)
    nh, nl = geo.high.tokens_per_page, geo.low.tokens_per_page
    w = cfg.window
    pool = _pool(TierMix(0.3, 0.5), heads=2, layers=3)           # 6 (layer, head) pairs
    kv = 1000
    high = w + math.floor(0.3 * (kv - w))
    low = math.floor(0.5 * (kv - w))
    per_head = math.ceil(high / nh) + math.ceil(low / nl)
    assert pool.decode_units(np.array([kv]), None)[0] == 6 * per_head
    # a short context is all window: high only
    assert pool.decode_units(np.array([10]), None)[0] == 6 * 1
    # prompt admission: all-high worst case, chunk after chunk
    assert pool.prompt_units(0, 1000) == 6 * math.ceil(1000 / nh)
    assert pool.prompt_units(1000, 24) == 6 * (math.ceil(1024 / nh) - math.ceil(1000 / nh))
    # decode reserve: one page per (layer, head) per tier
    assert pool.decode_step_need(np.array([5, 7, 9])) == 3 * 6 * 2
    assert _pool(TierMix(0.8, 0.0)).decode_step_need(np.array([5])) == 2  # no low tier
    # expected pages per future token: sum over heads of high/N_high + low/N_low
    assert pool.future_units(100) == pytest.approx(100 * 6 * (0.3 / nh + 0.5 / nl))
    # bytes read follow the physical per-token sizes of each tier
    read = pool.read_bytes_per_layer(np.array([kv]), None)
    assert read == pytest.approx(2 * (high * geo.high.bytes_per_token
                                      + low * geo.low.bytes_per_token))


def _diffkv_pool_for(f: DiffKVFormat, rest_bytes: float, max_reqs: int = 2048) -> DiffKVPool:
    m = load_model("llama-3-8b")
    pool = f.build_pool(m, 1, f.max_total_num_tokens(m, 1, rest_bytes), max_reqs, 8192)
    assert isinstance(pool, DiffKVPool)
    return pool


def test_logged_tokens_count_pages_and_reserve_and_invert():
    """SGLang's ``#token`` for DiffKV is the pages held plus the decode reserve at the
    planning density, so it overstates a short context; ``context_from_logged`` undoes it."""
    pool = _pool(TierMix(0.3, 0.5), heads=2, layers=3)
    kv = np.array([40, 700, 3000])
    pages = pool.decode_units(kv, None).sum() + pool.decode_step_need(kv)
    assert pool.logged_tokens(kv) == pytest.approx(pages / pool.pages_per_token)
    short = pool.logged_tokens(np.full(8, 60)) / 8
    assert short > 2 * 60                     # rounding and reserve dominate a short one
    rng = np.random.default_rng(11)
    for reqs, length in zip(rng.integers(1, 200, 6), rng.integers(1, 6000, 6), strict=True):
        logged = pool.logged_tokens(np.full(reqs, length))
        got = pool.context_from_logged(int(reqs), logged)
        # pages are whole: the longest context that logs no more than the value
        assert got >= length
        assert pool.logged_tokens(np.full(reqs, got)) == logged
        assert pool.logged_tokens(np.full(reqs, got + 1)) > logged
    with pytest.raises(SimulatorInputError, match="reqs=0"):
        pool.context_from_logged(0, 100.0)


def test_token_pool_logs_its_slots():
    pool = make_format("bf16", 128).build_pool(load_model("llama-3-8b"), 1, 100_000, 64, 8192)
    assert pool.logged_tokens(np.array([100, 50])) == 150
    assert pool.context_from_logged(4, 1003) == 250


def test_diffkv_pool_capacity_in_pages_and_tokens():
    m = load_model("llama-3-8b")
    f = make_format("diffkv", 128)
    assert isinstance(f, DiffKVFormat)
    plan = f.capacity_plan(m, 1)
    pool = _diffkv_pool_for(f, 10 * GIB)
    # the backend's sizing: SGLang's token budget back to bytes, minus the page tables of
    # 2048 + 1 request rows (each row ceil(8196 / 32) + 2 int32 entries, counters and shared-
    # page counts), and 8 bytes per page (free-list entry and reference count)
    tokens = int(10 * GIB // plan.cell_bytes)
    rows = 2049 * 32 * 8
    state = rows * ((math.ceil(8196 / f.geometry.min_tokens_per_page) + 2) * 4 + 40) + 2049 * 9
    assert pool.capacity == (tokens * plan.cell_bytes - state) // plan.pool_bytes_per_page
    # fewer request rows leave more pages
    assert _diffkv_pool_for(f, 10 * GIB, max_reqs=64).capacity > pool.capacity
    # tokens at the mean mix: fewer bytes per token than bf16 by the mix and the tiers' sizes
    bytes_per_token = (m.num_layers * m.num_kv_heads
                       * f.geometry.bytes_per_token(0.3, 0.5))
    assert pool.token_capacity == pytest.approx(
        pool.capacity * f.geometry.page_bytes / bytes_per_token, rel=1e-4)
    # and equal to the slots the SGLang backend logs for those pages at that planning mix
    assert pool.token_capacity == plan.logical_slots(pool.capacity)


def test_diffkv_pool_matches_the_h100_server_log():
    # session 3-11 H100 runs (docs/data/h100-2026-11-22/*/results.json): bf16 profiled
    # 423,862 tokens of 131,072 B; the diffkv-mix server built 8,173,613 pages and logged
    # 1,774,212 logical slots with max_running_requests 4096 and context 8192. It charged a
    # page 6,656 + 4 B (the free list); the pool now also counts each page's reference count
    # (+4 B) and each of the 4,097 x 256 request rows' shared-page counts (+8 B), so the same
    # budget holds those pages' bytes less the new state
    m = load_model("llama-3-8b")
    f = make_format("diffkv", 128)
    pool = f.build_pool(m, 1, f.max_total_num_tokens(m, 1, 423_862 * 131_072), 4096, 8192)
    logged, rows = 8_173_613, 4097 * 256
    assert abs(pool.capacity - (logged * 6660 - rows * 8) // 6664) <= 8
    assert abs(pool.token_capacity - round(1_774_212 * pool.capacity / logged)) <= 2


def test_diffkv_pool_too_small_for_its_page_tables():
    m = load_model("llama-3-8b")
    f = make_format("diffkv", 128)
    with pytest.raises(SimulatorInputError, match="page tables of 4096 requests"):
        f.build_pool(m, 1, f.max_total_num_tokens(m, 1, 0.5 * GIB), 4096, 8192)


def test_page_granularity_rounds_each_tier_up():
    pool = _pool(TierMix(1.0, 0.0), heads=1)
    nh = pool.n_high
    held = pool.decode_units(np.arange(1, 3 * nh + 1), None)
    assert held.tolist() == [math.ceil(k / nh) for k in range(1, 3 * nh + 1)]


def test_mix_parsing_and_distributions():
    assert TierMix.parse("30,50,20") == TierMix(0.3, 0.5)
    assert TierMix.parse("0.3,0.5").pruned == pytest.approx(0.2)
    for bad, msg in (("0.7,0.6", "exceeds 1"), ("a,b", "numbers"), ("0.3", "2 or 3"),
                     ("0.3,0.3,0.3", "must be 1"), ("0,0", "keeps no token")):
        with pytest.raises(SimulatorInputError, match=msg):
            TierMix.parse(bad)
    spread = TierMix(0.3, 0.5, head_spread=0.4)
    fr = spread.class_fractions()
    assert fr.shape == (2, 4)
    assert fr.sum(axis=0).mean() == pytest.approx(0.8, abs=1e-9)   # mean kept fraction kept
    assert np.allclose(fr[0] / fr.sum(axis=0), 0.3 / 0.8)           # high:low ratio kept
    per_req = TierMix(0.3, 0.5, request_spread=0.2)
    a = per_req.request_fractions(np.random.default_rng(5))
    b = per_req.request_fractions(np.random.default_rng(5))
    assert np.array_equal(a, b)
    draws = [per_req.request_fractions(np.random.default_rng(s)).sum() for s in range(300)]
    assert np.mean(draws) == pytest.approx(0.8, rel=0.05) and np.std(draws) > 0.05


def test_diffkv_prompt_scoring_pairs():
    pool = _diffkv_pool_for(make_format("diffkv", 128), 10 * GIB)
    assert pool.compression_pairs(1000) == 64 * 1000      # 64 scoring queries x 1000 keys
    assert pool.compression_pairs(10) == 10 * 10
    assert make_format("bf16", 128).build_pool(load_model("llama-3-8b"), 1, 10_000, 2048,
                                               8192).compression_pairs(1000) == 0


def test_measured_per_head_mix(tmp_path):
    import json

    heads = [[0.5, 0.3], [0.1, 0.7], [0.2, 0.2], [0.4, 0.4]] * 64     # 256 = 32 layers x 8
    p = tmp_path / "mix.json"
    p.write_text(json.dumps({"heads": heads}))
    mix = TierMix.from_file(str(p))
    assert mix.high == pytest.approx(0.3) and mix.low == pytest.approx(0.4)
    assert "256 measured heads" in mix.describe()
    pool = _pool(mix, heads=8, layers=32)
    # every (layer, head) pair holds its own measured mix: pages add up head by head
    kv = 2000
    w = pool.window
    expect = 0
    for h, lo in heads:
        n_hi = w + math.floor(h * (kv - w))
        n_lo = math.floor(lo * (kv - w))
        expect += math.ceil(n_hi / pool.n_high) + math.ceil(n_lo / pool.n_low)
    assert pool.decode_units(np.array([kv]), None)[0] == expect
    p.write_text(json.dumps({"layers": [[[0.5, 0.6]]]}))
    with pytest.raises(SimulatorInputError, match=r"head 0: fractions \(0.5, 0.6\)"):
        TierMix.from_file(str(p))
    p.write_text(json.dumps({"other": 1}))
    with pytest.raises(SimulatorInputError, match="expected"):
        TierMix.from_file(str(p))
