"""SGLang's memory sizing: mem_fraction_static, the KV pool size and derived limits."""

from __future__ import annotations

import pytest
from sim_helpers import scenario

from simulator.serving.memory import (
    GIB,
    cuda_graph_batch_sizes,
    default_chunk_and_graph,
    default_max_running_requests,
    mem_fraction_static,
    piecewise_graph_token_sizes,
)


def test_defaults_by_gpu_memory():
    assert default_chunk_and_graph(81559, 1) == (8192, 256)
    assert default_chunk_and_graph(81559, 4) == (8192, 512)
    assert default_chunk_and_graph(143771, 1) == (8192, 256)
    assert default_chunk_and_graph(46068, 1) == (4096, 32)
    assert default_chunk_and_graph(200_000, 1) == (16384, 512)


def test_mem_fraction_static_formula_hand_computed():
    # H100: 512 + 8192*1.5 + 256*2 + 1/8*1024 + 58 piecewise sizes * 8 = 13904 MB reserved
    assert len(piecewise_graph_token_sizes(8192)) == 58
    assert mem_fraction_static(81559, 8192, 16384, 256, 1, True) == round(
        (81559 - 13904) / 81559, 3) == 0.83
    assert mem_fraction_static(81559, 8192, 16384, 256, 1, False) == round(
        (81559 - 13440) / 81559, 3)
    # small settings on a big GPU: the 10 GB floor applies
    assert mem_fraction_static(143771, 2048, 16384, 8, 1, False) == round(
        (143771 - 10240) / 143771, 3)
    # chunking off: max_prefill_tokens sizes the activation reserve
    assert mem_fraction_static(40000, -1, 4096, 32, 1, False) == round(
        (40000 - (512 + 4096 * 1.5 + 64 + 128)) / 40000, 3)


def test_kv_pool_size_equals_sglang_formula():
    sc = scenario()                                  # llama-3-8b, h100, defaults
    srv = sc.server("bf16")
    cal, gpu, m = sc.calibration, sc.gpu, sc.model
    mfs = 0.83
    before = gpu.usable_mib * 2**20 - cal.cuda_context_gib * GIB
    after = before - m.total_params * 2 - cal.post_load_overhead_gib * GIB
    rest = after - before * (1 - mfs)
    cell = m.num_kv_heads * (128 + 128) * m.num_layers * 2     # get_cell_size_per_token
    assert srv.mem_fraction_static == mfs
    assert srv.pool.capacity == int(rest // cell)
    assert srv.pool.token_capacity == int(rest // cell)
    fp8 = sc.server("fp8")
    assert fp8.pool.capacity == int(rest // (cell // 2))
    # explicit settings are honoured
    srv2 = scenario(mem_fraction_static=0.7, max_total_tokens=100_000).server("bf16")
    assert srv2.mem_fraction_static == 0.7 and srv2.pool.capacity == 100_000


def test_cuda_graph_sizes_and_max_running():
    sizes = cuda_graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-1] == 256 and 24 in sizes
    assert cuda_graph_batch_sizes(512)[-3:] == [480, 496, 512]
    assert default_max_running_requests(400_000, 8192) == 4096
    assert default_max_running_requests(20_000, 32768) == 2048
    assert default_max_running_requests(1000, 8192) == 500


def test_no_room_for_kv_is_a_clear_error():
    from simulator.errors import SimulatorInputError

    with pytest.raises(SimulatorInputError, match="leaves no KV memory"):
        scenario("llama-3-70b", "h100").server("bf16")
    assert scenario("llama-3-70b", "h100", tp=4).server("bf16").pool.capacity > 0


def test_diffkv_cuda_graph_max_bs_defaults_to_512_and_user_value_wins():
    from simulator.serving.settings import DIFFKV_DEFAULT_CUDA_GRAPH_MAX_BS

    assert DIFFKV_DEFAULT_CUDA_GRAPH_MAX_BS == 512
    dk = scenario(chunked_prefill_size=-1, disable_radix_cache=True).server("diffkv")
    assert dk.cuda_graph_max_bs == 512 and dk.cost.graph_max == 512 and dk.cost.graphs_enabled
    # SGLang sizes memory after the backend's default: the reserve counts 512 graphs
    assert dk.mem_fraction_static == mem_fraction_static(81559, -1, 16384, 512, 1, True)
    assert scenario().server("bf16").cuda_graph_max_bs == 256
    user = scenario(cuda_graph_max_bs=160, chunked_prefill_size=-1).server("diffkv")
    assert user.cuda_graph_max_bs == 160 and user.cost.graph_max == 160
    off = scenario(disable_cuda_graph=True).server("diffkv")
    assert not off.cost.graphs_enabled
