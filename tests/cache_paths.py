"""One request through the whole CPU path a config and per-request thresholds take (imported
as a sibling module by the validation and fuzz tests): capacity planning as the SGLang pool
sizes itself, then a small reference cache, one prefill and two decode steps, and the free
that must return every page."""

from __future__ import annotations

import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.capacity import CapacityPlan
from sglang_diffkv.config import DiffKVConfig

LAYERS, KV_HEADS, GROUP = 1, 2, 2
PROMPT, DECODE_STEPS, MAX_CONTEXT = 12, 2, 32


def plan_pool(config: DiffKVConfig, head_dim: int) -> None:
    """What the SGLang runner does at start-up (80 GB of a Llama-3-8B-like model's KV)."""
    plan = CapacityPlan.build(config, head_dim, 32, 8)
    budget_tokens = 80 * 2**30 // plan.cell_bytes
    size = plan.size_pool(budget_tokens, 256, 8192)
    assert size.num_pages > plan.min_pages and 0 < size.logical_slots < 2**31


def serve_one_request(config: DiffKVConfig, head_dim: int,
                      alpha: tuple[float, float] | None = None, seed: int = 0) -> None:
    """Prefill a PROMPT-token request (thresholds ``alpha`` = (alpha_h, alpha_l), else the
    config's), decode DECODE_STEPS tokens, free it; asserts every step fits and the pool
    is whole again."""
    cache = CompressedKVCache(config, head_dim=head_dim, num_layers=LAYERS,
                              num_kv_heads=KV_HEADS, num_pages=64, max_reqs=2,
                              max_context=MAX_CONTEXT)
    free_at_start = int(cache.manager.num_free_pages())
    g = torch.Generator().manual_seed(seed)
    req = torch.tensor([1])
    lengths = torch.tensor([PROMPT])
    ah, al = (None, None) if alpha is None else ([alpha[0]], [alpha[1]])
    assert bool(cache.begin_prefill(req, lengths, ah, al).ok)
    hq = KV_HEADS * GROUP
    for layer in range(LAYERS):
        q = torch.randn(1, hq, PROMPT, head_dim, generator=g)
        k = torch.randn(1, KV_HEADS, PROMPT, head_dim, generator=g)
        v = torch.randn(1, KV_HEADS, PROMPT, head_dim, generator=g)
        cache.prefill_layer(layer, req, lengths, q, k, v, head_dim**-0.5)
    cache.end_prefill(req)
    for step in range(DECODE_STEPS):
        assert bool(cache.begin_decode(req).ok)
        for layer in range(LAYERS):
            k = torch.randn(1, KV_HEADS, head_dim, generator=g)
            v = torch.randn(1, KV_HEADS, head_dim, generator=g)
            cache.decode_layer_store(layer, req, lengths + step, k, v)
            out = cache.decode_layer_attend(layer, req, torch.randn(1, hq, head_dim,
                                                                    generator=g),
                                            head_dim**-0.5)
            assert torch.isfinite(out.out).all()
    cache.manager.check_invariants()
    cache.free(req)
    assert int(cache.manager.num_free_pages()) == free_at_start
