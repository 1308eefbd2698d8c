"""Baselines: what they store and the bytes they are charged (from the page layout)."""

import torch
from tiny import tiny

from sglang_diffkv.config import TierConfig
from sglang_diffkv.eval.baselines import KIVIBackend, PruningBackend, UniformBackend
from sglang_diffkv.layout import fp16_bytes_per_token
from sglang_diffkv.quant import fake_quantize


def _prefill(b, length, seed=0):
    s = b.shape
    g = torch.Generator().manual_seed(seed)
    b.start(length, length + 8)
    for layer in range(s.num_layers):
        q = torch.randn(b.rows, s.num_q_heads, length, s.head_dim, generator=g)
        k = torch.randn(b.rows, s.num_kv_heads, length, s.head_dim, generator=g)
        v = torch.randn(b.rows, s.num_kv_heads, length, s.head_dim, generator=g)
        b.prefill(layer, q, k, v)
    return k, v


def test_uniform_stores_the_reference_round_trip_and_layout_bytes():
    shape = tiny().shape
    b = UniformBackend("k4v4", shape, [0], TierConfig(4, 4))
    k, v = _prefill(b, 40)
    last = shape.num_layers - 1
    assert torch.equal(b.k[last][:, :, :40], fake_quantize(k, 4, 1))
    assert torch.equal(b.v[last][:, :, :40], fake_quantize(v, 4, 1))
    # 64-dim K4V4: 32 + 32 data, 2 x 4 metadata, 4 score + 4 pos = 80 B, 32 tokens per page
    assert b.memory(40).bytes_per_token.tolist() == [80.0]


def test_kivi_keeps_the_recent_window_exact_and_quantises_whole_blocks():
    shape = tiny().shape
    b = KIVIBackend("kivi", shape, [0], bits=2, group=32, residual=32)
    k, v = _prefill(b, 100)
    # 100 tokens, >= 32 kept exact, blocks of 32: 64 quantised, the last 36 exact
    assert b.n_quant == [64] * shape.num_layers
    last = shape.num_layers - 1
    assert torch.equal(b.k[last][:, :, 64:100], k[:, :, 64:])
    block = k[:, :, 32:64].transpose(-1, -2)  # per channel over the block's 32 tokens
    torch.testing.assert_close(
        b.k[last][:, :, 32:64], fake_quantize(block, 2, 1).transpose(-1, -2))
    torch.testing.assert_close(b.v[last][:, :, :64], fake_quantize(v[:, :, :64], 2, 2))
    d = shape.head_dim
    quant = 2 * d * 2 / 8 + d * 4 / 32 + (d // 32) * 4  # codes + key/value metadata
    expect = (64 * quant + 36 * fp16_bytes_per_token(d)) / 100
    assert abs(float(b.memory(100).bytes_per_token[0]) - expect) < 1e-9


def test_pruning_keeps_its_budget_and_the_recent_window():
    shape = tiny().shape
    b = PruningBackend("prune", shape, [0, 0], keep_fraction=0.4, window=16, score_queries=16)
    _prefill(b, 100)
    kept = b.keep[0][:, :, :100]
    assert (kept.sum(-1) == 40).all()
    assert kept[:, :, 84:].all()  # the window
    mem = b.memory(100)
    assert torch.allclose(mem.bytes_per_token, torch.full((2,), 0.4 * 256, dtype=torch.float64))
    assert torch.allclose(mem.fractions[..., 2], torch.full_like(mem.fractions[..., 2], 0.6))
