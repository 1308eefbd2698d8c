"""The small shape, config and random q/k/v the chunked-prefill and radix-suffix cache tests
share (imported as a sibling module): two layers, two KV heads of GQA group 2, head_dim 64,
thresholds that put tokens in both tiers and prune some, a short window and 8 scoring
queries."""

from __future__ import annotations

import torch

from sglang_diffkv.config import DiffKVConfig

D, HKV, G, LAYERS = 64, 2, 2, 2
SCALE = D**-0.5
CFG = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 1.2, "alpha_l": 0.3,
                              "window": 4, "score_queries": 8})


def qkv(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [LAYERS, n, HKV * G, D], k / v [LAYERS, n, HKV, D], seeded."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(LAYERS, n, HKV * G, D, generator=g) * 1.5
    k = torch.randn(LAYERS, n, HKV, D, generator=g) * 1.5
    v = torch.randn(LAYERS, n, HKV, D, generator=g)
    return q, k, v
