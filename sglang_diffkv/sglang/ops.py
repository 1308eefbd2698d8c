"""The one seam between the SGLang backend and the DiffKV compute.

Both paths act on the same ``CompressedKVCache`` state (pages, page table, counters):

- ``reference``: the cache's own torch methods (any device; what CPU CI runs);
- ``kernels``: ``sglang_diffkv.kernels`` (Triton prefill scoring + compression, decode
  policy step, split-K decode attention), each byte-compatible with its reference.

``SGLANG_DIFFKV_KERNELS``: ``auto`` (default: kernels on CUDA, reference elsewhere),
``1`` (kernels everywhere; on CPU only under ``TRITON_INTERPRET=1``) or ``0`` (reference).

Benchmark mode (``config.bench_mix``) is the same on both paths: the scores are computed,
then replaced by the draw's (``CompressedKVCache.bench_significance``); the decode step
takes the drawn actions (``bench_mix.forced_actions``, in-kernel on the Triton path).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from sglang_diffkv.cache import CompressedKVCache

KERNELS_ENV = "SGLANG_DIFFKV_KERNELS"


def want_kernels(device: torch.device, environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    mode = env.get(KERNELS_ENV, "auto").strip().lower()
    if mode in ("0", "false", "off", "reference"):
        return False
    if mode in ("1", "true", "on", "kernels"):
        return True
    if mode != "auto":
        raise ValueError(f"{KERNELS_ENV}={mode!r}: use auto, 1 or 0")
    return device.type == "cuda"


class DiffKVOps:
    def __init__(self, cache: CompressedKVCache, use_kernels: bool) -> None:
        self.cache = cache
        self.use_kernels = use_kernels
        self._plans: dict[tuple[int, int], Any] = {}
        self._bench_mix_t: torch.Tensor | None = None
        if use_kernels:
            from sglang_diffkv import kernels
            from sglang_diffkv.kernels import bench_mix as bench_kernels

            self.k = kernels
            self.bench_k = bench_kernels
            self.name = "Triton kernels (sglang_diffkv.kernels) + CUDA decode compaction"
            cache.decode_room = functools.partial(kernels.decode_compaction, cache.manager)
        else:
            self.name = "torch reference (sglang_diffkv.cache)"

    # ---- prefill ----------------------------------------------------------------------

    def prefill_layer(self, layer: int, req: torch.Tensor, lengths: torch.Tensor,
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """Score, classify, quantise and store one layer of whole prompts
        (q [B, Hq, Lmax, D], k/v [B, Hkv, Lmax, D])."""
        c = self.cache
        if not self.use_kernels:
            c.prefill_layer(layer, req, lengths, q, k, v, scale)
            return
        cfg = c.config
        sig = self.k.prefill_scores(q, k, lengths, scale, cfg.score_queries)
        alpha = c.alpha[req]
        if cfg.bench_mix is not None:
            # the scoring kernels above ran for their cost; the draw decides the tiers
            # (one launch: CompressedKVCache.bench_significance, bit for bit)
            if self._bench_mix_t is None:
                self._bench_mix_t = torch.tensor(cfg.bench_mix, dtype=torch.float64,
                                                 device=c.device)
            sig = self.bench_k.synthetic_significance(
                c.bench_seed[req], layer, c.spec.num_kv_heads, lengths, k.shape[2],
                alpha[:, 0], alpha[:, 1], cfg.bench_mix, cfg.window, cfg.score_queries,
                self._bench_mix_t,
            )
        cls = self.k.compress_prefill(
            c.pages, c.geometry, c.manager.table, req, layer, k, v, sig, lengths,
            alpha[:, 0], alpha[:, 1], cfg.window, cfg.score_queries,
        )
        # what CompressedKVCache.store_prefill records for end_prefill's reclaim
        c._prompt_kept[req, layer, :, 0] = cls.n_high.long()
        c._prompt_kept[req, layer, :, 1] = cls.n_low.long()

    # ---- decode -----------------------------------------------------------------------

    def decode_store(self, layer: int, req: torch.Tensor, positions: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        if not self.use_kernels:
            c.decode_layer_store(layer, req, positions, k, v)
            return
        mix = c.config.bench_mix
        self.k.decode_policy_step(
            c.pages, c.geometry, c.manager.table, c.manager.counts, req, layer, positions,
            c.alpha[req], c.config.window, k.contiguous(), v.contiguous(),
            bench=None if mix is None else (c.bench_seed[req], mix),
        )

    def decode_attend(self, layer: int, req: torch.Tensor, q: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """Output [B, Hq, D] (scores of every cached token accumulated)."""
        c = self.cache
        if not self.use_kernels:
            return c.decode_layer_attend(layer, req, q, scale).out
        key = (q.shape[0], q.shape[1])
        plan = self._plans.get(key)
        if plan is None:
            # Plans hold split-K scratch sized for their batch: keep the few recent sizes.
            while len(self._plans) >= 4:
                self._plans.pop(next(iter(self._plans)))
            plan = self.k.DecodeAttentionPlan.build(
                c.geometry, q.shape[1], c.spec.num_kv_heads, q.shape[0], c.spec.max_context,
                q.device,
            )
            self._plans[key] = plan
        out, _ = plan.run(q.contiguous(), c.pages, c.manager.table, c.manager.counts, req,
                          layer, scale)
        return out
