"""SGLang's triton extend kernel priced by its tiles (simulator/serving/extend_grid.py): the tile
count against a loop that walks the kernel's own loop bounds, the launch padding of real chunk
mixes, per-tile times that reproduce the calibration grid, and the cost model applying them to
the triton formats only."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sim_helpers import ROOT, scenario

from simulator.errors import SimulatorInputError
from simulator.serving.cost import StepShape
from simulator.serving.extend_grid import BLOCK_OVERHEAD_TILES, ExtendTiles, ExtendTileTimes
from simulator.specs.calibration import load_calibration
from simulator.specs.gpu import GPUSpec, load_gpu

H200_CALIBRATION = ROOT / "docs" / "data" / "h200-2026-11-24" / "calibration" / "calibration.json"


def kernel_tiles(extend: int, past: int, blocks: int, bm: int, bn: int) -> int:
    """Key tiles of one head, as extend_attention_fwd's _fwd_kernel loops them: every query
    block of the launch scans the prefix (stage 1) and min(extend, (block + 1) * BLOCK_M) of
    the sequence's own keys (stage 2), BLOCK_N keys a tile."""
    n = 0
    for block in range(blocks):
        n += len(range(0, past, bn))
        n += len(range(0, min(extend, (block + 1) * bm), bn))
    return n


@pytest.mark.parametrize("bm,bn", [(128, 64), (64, 128), (128, 128), (32, 64)])
def test_tiles_match_the_kernels_loops(bm, bn):
    rng = random.Random(bm * 1000 + bn)
    tiles = ExtendTiles(bm, bn)
    for _ in range(300):
        e, p = rng.randint(1, 9000), rng.choice([0, rng.randint(1, 20000)])
        own = -(-e // bm)
        blocks = own + rng.choice([0, rng.randint(1, 80)])
        assert tiles.tiles(e, p, blocks) == kernel_tiles(e, p, blocks, bm, bn), (e, p, blocks)


def test_padding_is_one_for_one_sequence_or_equal_ones():
    t = ExtendTiles(128, 64)
    assert t.padding([(8000, 0)]) == 1.0
    assert t.padding([(700, 300)]) == 1.0
    assert t.padding([(400, 0)] * 20) == 1.0
    assert t.padding([]) == 1.0


def test_a_prompt_tail_with_a_long_past_beside_the_next_head_costs_triple():
    # a burst of 8000-token prompts in 8192-token chunks, late in the cycle: 130 tokens of one
    # prompt (its first 7870 already in the KV) beside the next prompt's first 8062. The tail
    # runs the head's 63 query blocks, each scanning the 7870-token prefix: on an H200 the
    # chunk's launch took 8.8 ms against 2.8 ms for one 8000-token prompt (benchmarks.md)
    pad = ExtendTiles(128, 64).padding([(130, 7870), (8062, 0)])
    assert 2.5 < pad < 3.5
    # early in the cycle the long sequence has no past and the short one pays little
    assert ExtendTiles(128, 64).padding([(8000, 0), (192, 0)]) < 1.1


def test_tile_sizes_follow_sglangs_table():
    assert ExtendTiles.for_gpu((9, 0), 128) == ExtendTiles(128, 64)
    assert ExtendTiles.for_gpu((8, 0), 128) == ExtendTiles(128, 128)
    assert ExtendTiles.for_gpu((8, 9), 128) == ExtendTiles(64, 128)
    assert ExtendTiles.for_gpu((12, 0), 128) == ExtendTiles(64, 128)
    assert ExtendTiles.for_gpu(None, 128) is None
    assert ExtendTiles.for_gpu((7, 5), 128) is None
    assert load_gpu("h200").compute_capability == (9, 0)


def test_bad_compute_capability_names_the_value():
    d = {"name": "x", "memory_mib": 1000, "hbm_bandwidth": 1e12, "bf16_flops": 1e15,
         "fp8_flops": 2e15, "interconnect_bandwidth": 1e11, "provenance": "test",
         "compute_capability": "nine"}
    with pytest.raises(SimulatorInputError, match="compute_capability='nine'"):
        GPUSpec.from_dict("x", d)


def h200_measured():
    """The H200 scenario on its measured calibration (grids included)."""
    return replace(scenario(gpu="h200"), calibration=load_calibration("h200", H200_CALIBRATION))


def test_work_counts_a_block_overhead_and_the_rows_launched():
    t = ExtendTiles(128, 64)
    w = t.work([(130, 7870), (8062, 0)])
    blocks = 63
    assert w.rows == 2 * blocks * 128
    assert w.units == (t.tiles(130, 7870, blocks) + t.tiles(8062, 0, blocks)
                       + BLOCK_OVERHEAD_TILES * 2 * blocks)
    one = t.work([(1, 8000)])
    assert (one.units, one.rows) == (125 + 1 + BLOCK_OVERHEAD_TILES, 128)


def _synthetic_times(rng: random.Random) -> tuple[list[int], list[float], dict]:
    chunks, pasts = [128, 512, 2048, 8192], [1.0, 1024.0, 4096.0, 16384.0]
    # the past axis's 1 stands for no past, as the calibration stores it: timed as 0
    return chunks, pasts, {(c, 0 if p == 1 else int(p)): rng.uniform(1e-5, 2e-2)
                           for c in chunks for p in pasts}


def test_tile_times_reproduce_every_grid_point():
    rng = random.Random(7)
    tiles = ExtendTiles(128, 64)
    for _ in range(5):
        chunks, pasts, sec = _synthetic_times(rng)
        times = ExtendTileTimes.from_grid(tiles, chunks, pasts, lambda c, p, s=sec: s[(c, p)])
        for (c, p), s in sec.items():
            assert times([(c, p)]) == pytest.approx(s, rel=1e-12)


def test_tile_times_interpolate_power_laws_exactly():
    # below one wave a unit costs a program's serial step (~1 / rows); log-log interpolation
    # is exact on any power law of rows and past
    tiles = ExtendTiles(128, 64)
    chunks, pasts = [128, 512, 2048, 8192], [1.0, 1024.0, 4096.0, 16384.0]

    def unit_s(rows, past):
        return 3e-6 * rows ** -0.9 * max(past, 1) ** 0.05

    def seconds(c, p):
        return tiles.work([(c, p)]).units * unit_s(c, max(p, 1))

    times = ExtendTileTimes.from_grid(tiles, chunks, pasts, seconds)
    for rows, past in [(256, 2000.0), (1024, 700.0), (3000, 9000.0)]:
        assert times.unit_s(rows, past) == pytest.approx(unit_s(rows, past), rel=1e-9)
    assert times.unit_s(64, 1e6) == pytest.approx(unit_s(128, 16384), rel=1e-9)  # held


def test_a_one_token_extend_costs_a_whole_query_block_against_its_past():
    # a fully cached 8,000-token prompt recomputes its last token: the kernel runs one
    # 128-query block over all 125 prefix tiles (H200: 540 us a layer, 530 modelled;
    # benchmarks.md session 21), as long as a 128-token extend
    cost = h200_measured().server("bf16").cost
    one = cost.prefill_attention_time(1, 8000, 8000.5, 1, ((1, 8000),))
    block = cost.prefill_attention_time(128, 8000, 128 * 8000 + 128 * 64, 1, ((128, 8000),))
    assert one == pytest.approx(block * (126 + 1) / (127 + 1), rel=1e-9)
    assert 500e-6 < one < 560e-6


def test_without_a_grid_the_cost_model_pads_the_triton_formats_only():
    chunks = ((130, 7870), (8062, 0))
    pairs = sum(e * p + e * e / 2 for e, p in chunks)
    shape = StepShape(prefill_tokens=8192, prefill_pairs=pairs, prefill_past_tokens=7870,
                      prefill_seqs=2, prefill_chunks=chunks)
    alike = StepShape(prefill_tokens=8192, prefill_pairs=pairs, prefill_past_tokens=7870,
                      prefill_seqs=2)
    sc = scenario()
    for fmt in ("bf16", "fp8"):
        cost = sc.server(fmt).cost
        extra = cost.step_time(shape) - cost.step_time(alike)
        attn = cost.layers * cost.prefill_attention_time(8192, 7870, pairs, 2)
        pad = ExtendTiles.for_gpu(sc.gpu.compute_capability, 128).padding(chunks)
        assert extra == pytest.approx(attn * (pad - 1), rel=1e-9)
        assert extra > 0
    cost = sc.server("diffkv").cost
    assert cost.step_time(shape) == cost.step_time(alike)


def test_with_a_grid_the_triton_formats_are_priced_by_their_tiles():
    late = ((130, 7870), (8062, 0))       # measured 8.8 ms a layer against 2.9 for 8192+0
    pairs = sum(e * p + e * e / 2 for e, p in late)
    sc = h200_measured()
    for fmt in ("bf16", "fp8"):
        cost = sc.server(fmt).cost
        fresh = cost.prefill_attention_time(8192, 0, 8192 * 4096, 1, ((8192, 0),))
        assert cost.prefill_attention_time(8192, 7870, pairs, 2, late) > 2.5 * fresh
        # no chunks given: the totals split evenly
        assert (cost.prefill_attention_time(800, 0, 20 * 40 * 20, 20)
                == cost.prefill_attention_time(800, 0, 20 * 40 * 20, 20, ((40, 0),) * 20))
    cost = sc.server("diffkv").cost
    assert (cost.prefill_attention_time(8192, 7870, pairs, 2, late)
            == cost.prefill_attention_time(8192, 7870, pairs, 2))
