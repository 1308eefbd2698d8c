"""SGLang's triton extend kernel's launch padding (simulator/serving/extend_grid.py): the tile
count against a loop that walks the kernel's own loop bounds, the padding of real chunk mixes,
and the cost model applying it to the triton formats only."""

from __future__ import annotations

import random

import pytest
from sim_helpers import scenario

from simulator.errors import SimulatorInputError
from simulator.serving.cost import StepShape
from simulator.serving.extend_grid import ExtendTiles
from simulator.specs.gpu import GPUSpec, load_gpu


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


def test_cost_model_pads_the_triton_formats_only():
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
