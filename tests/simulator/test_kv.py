"""KV formats take their bytes from sglang_diffkv.layout; the DiffKV pool's page accounting
matches hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_diffkv.config import K4V2, K8V4, preset
from sglang_diffkv.layout import PageGeometry, TierLayout, fp16_bytes_per_token, search_page_bytes
from simulator.errors import SimulatorInputError
from simulator.kv.formats import make_format
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
        pool = f.build_pool(m, 1, 10 * GIB)
        # whole pages per (layer, head): tokens = pages * tokens_per_page
        pages = int(10 * GIB // (page * m.num_layers * m.num_kv_heads))
        assert pool.capacity == pages * lay.tokens_per_page
    pool = bf16.build_pool(m, 1, 10 * GIB)
    assert pool.capacity == 10 * GIB // (32 * 8 * 512)
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


def test_diffkv_pool_capacity_in_pages_and_tokens():
    m = load_model("llama-3-8b")
    f = make_format("diffkv", 128)
    pool = f.build_pool(m, 1, 10 * GIB)
    assert pool.capacity == 10 * GIB // f.geometry.page_bytes
    # tokens at the mean mix: fewer bytes per token than bf16 by the mix and the tiers' sizes
    bytes_per_token = (m.num_layers * m.num_kv_heads
                       * f.geometry.bytes_per_token(0.3, 0.5))
    assert pool.token_capacity == pytest.approx(10 * GIB / bytes_per_token, rel=0.01)


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
    pool = make_format("diffkv", 128).build_pool(load_model("llama-3-8b"), 1, 10 * GIB)
    assert pool.compression_pairs(1000) == 64 * 1000      # 64 scoring queries x 1000 keys
    assert pool.compression_pairs(10) == 10 * 10
    assert make_format("bf16", 128).build_pool(load_model("llama-3-8b"), 1,
                                               GIB).compression_pairs(1000) == 0


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
