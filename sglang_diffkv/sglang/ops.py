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
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_diffkv.cache import CompressedKVCache

logger = logging.getLogger("sglang_diffkv")

KERNELS_ENV = "SGLANG_DIFFKV_KERNELS"
REFERENCE_MODES = ("0", "false", "off", "reference")

# Decode-attention plans hold split-K scratch that grows with batch x context (about 2 MB
# per request at 8192 tokens for a Llama-3-8B layer shape), so the cache is bounded in
# bytes, not in plans; the plan in use is always kept even when it alone is larger.
PLAN_CACHE_BYTES = 1 << 30
MIN_PLAN_BATCH = 8
MIN_PLAN_CONTEXT = 256


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def plan_bucket(batch: int, max_seq_len: int, max_reqs: int, max_context: int
                ) -> tuple[int, int]:
    """(batch, context) a decode-attention plan is built for: powers of two (so the batch
    size changing every step reuses one plan and only log2 many are ever built), capped by
    what the cache can hold, and never below the actual batch / longest sequence (a plan's
    ``max_context`` must cover every row's tier counts, which are <= its sequence length)."""
    b = max(batch, min(_next_pow2(batch, MIN_PLAN_BATCH), max_reqs))
    ctx = max(max_seq_len, min(_next_pow2(max_seq_len, MIN_PLAN_CONTEXT), max_context))
    return b, ctx


def want_kernels(device: torch.device, environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    mode = env.get(KERNELS_ENV, "auto").strip().lower()
    if mode in REFERENCE_MODES:
        return False
    if mode in ("1", "true", "on", "kernels"):
        return True
    if mode != "auto":
        raise ValueError(f"{KERNELS_ENV}={mode!r}: use auto, 1 or 0")
    return device.type == "cuda"


@dataclass
class DecodeStep:
    """One decode step's shared inputs (``DiffKVOps.begin_decode_step``): the policy
    kernel's prepared tensors and the attention plan per q head count, looked up on the
    first layer and reused by the rest (a plan evicted from the cache meanwhile stays
    valid: the step holds it)."""

    max_seq_len: int | None
    policy: Any  # kernels.decode_policy.DecodeStepInputs
    plans: dict[int, Any] = field(default_factory=dict)


class DiffKVOps:
    def __init__(self, cache: CompressedKVCache, use_kernels: bool,
                 plan_cache_bytes: int = PLAN_CACHE_BYTES) -> None:
        self.cache = cache
        self.use_kernels = use_kernels
        # (bucketed batch, bucketed context, q heads) -> DecodeAttentionPlan, least recently
        # used first
        self._plans: OrderedDict[tuple[int, int, int], Any] = OrderedDict()
        self.plan_cache_bytes = plan_cache_bytes
        self.plans_built = 0
        self._logged_plan_keys: set[tuple[int, int, int]] = set()
        self._bench_mix_t: torch.Tensor | None = None
        if use_kernels:
            from sglang_diffkv import kernels
            from sglang_diffkv.kernels import bench_mix as bench_kernels
            from sglang_diffkv.kernels import decode_policy as policy_kernels

            self.k = kernels
            self.bench_k = bench_kernels
            self.policy_k = policy_kernels
            cache.decode_room = functools.partial(kernels.decode_compaction, cache.manager)
            # Build (or load) the CUDA compaction library now, at server start: built lazily,
            # the nvcc run (~4 s) landed in the first decode step of the first requests.
            room = (kernels.compaction_backend() if cache.device.type == "cuda"
                    else "torch (not on CUDA)")
            self.name = f"Triton kernels (sglang_diffkv.kernels); decode page allocation: {room}"
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

    def begin_decode_step(self, req: torch.Tensor, positions: torch.Tensor,
                          max_seq_len: int | None = None) -> DecodeStep | None:
        """What every layer of this decode step shares, prepared once per step (the page
        views are of ``cache.pages``, which is allocated once and never replaced). Eagerly,
        the per-layer gathers (alpha, benchmark seeds), dtype conversions, output buffers,
        page views and plan lookup cost host time on every layer; now once per step. None
        on the reference path (nothing to prepare)."""
        if not self.use_kernels:
            return None
        c = self.cache
        mix = c.config.bench_mix
        policy = self.policy_k.prepare_decode_step(
            c.pages, req, positions, c.alpha[req], c.spec.num_kv_heads,
            bench=None if mix is None else (c.bench_seed[req], mix),
        )
        return DecodeStep(max_seq_len=max_seq_len, policy=policy)

    def decode_store(self, layer: int, req: torch.Tensor, positions: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, step: DecodeStep | None = None
                     ) -> None:
        """``step``: this step's ``begin_decode_step`` (same ``req`` / ``positions``);
        None prepares the per-step inputs here (same results, more host time)."""
        c = self.cache
        if not self.use_kernels:
            c.decode_layer_store(layer, req, positions, k, v)
            return
        mix = c.config.bench_mix
        if step is None:
            step = self.begin_decode_step(req, positions)
        p = step.policy
        # (alpha / bench seeds / positions in the call are shape-checked only: the kernel
        # reads the step's prepared copies)
        self.k.decode_policy_step(
            c.pages, c.geometry, c.manager.table, c.manager.counts, req, layer, p.positions,
            p.alpha, c.config.window, k.contiguous(), v.contiguous(),
            bench=None if mix is None else (p.seed, mix), step=p,
        )

    def decode_attend(self, layer: int, req: torch.Tensor, q: torch.Tensor,
                      scale: float, max_seq_len: int | None = None,
                      step: DecodeStep | None = None) -> torch.Tensor:
        """Output [B, Hq, D] (scores of every cached token accumulated). ``max_seq_len``:
        the batch's longest sequence (tokens after this step's store), known on the host;
        None sizes the plan for the cache's ``max_context`` (always safe, more scratch).
        ``step``: this step's ``begin_decode_step``; its plan (per q head count) and page
        views are reused by every layer (its ``max_seq_len`` then applies)."""
        c = self.cache
        if not self.use_kernels:
            return c.decode_layer_attend(layer, req, q, scale).out
        hq = q.shape[1]
        if step is None:
            plan, views = self._plan_for(q.shape[0], max_seq_len, hq, q.device), None
        else:
            plan = step.plans.get(hq)
            if plan is None:
                plan = step.plans[hq] = self._plan_for(q.shape[0], step.max_seq_len, hq,
                                                       q.device)
            views = step.policy.views
        out, _ = plan.run(q.contiguous(), c.pages, c.manager.table, c.manager.counts, req,
                          layer, scale, views=views)
        return out

    def _plan_for(self, batch: int, max_seq_len: int | None, num_q_heads: int,
                  device: torch.device) -> Any:
        ctx = self.cache.spec.max_context if max_seq_len is None else max_seq_len
        return self.decode_plan(batch, ctx, num_q_heads, device)

    def decode_plan(self, batch: int, max_seq_len: int, num_q_heads: int,
                    device: torch.device) -> Any:
        """The cached plan covering ``batch`` requests of at most ``max_seq_len`` tokens,
        built on a miss; least recently used plans are dropped while the cache holds more
        than ``plan_cache_bytes`` of scratch (the returned plan is never dropped)."""
        c = self.cache
        spec = c.spec
        b, ctx = plan_bucket(batch, max_seq_len, spec.max_reqs, spec.max_context)
        key = (b, ctx, num_q_heads)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = self.k.DecodeAttentionPlan.build(
            c.geometry, num_q_heads, spec.num_kv_heads, b, ctx, device
        )
        self._plans[key] = plan
        self.plans_built += 1
        while len(self._plans) > 1 and self.cached_plan_bytes() > self.plan_cache_bytes:
            self._plans.popitem(last=False)
        # once per bucket at INFO: a bucket built again after eviction would otherwise log
        # every few steps when the batch oscillates across a boundary
        first = key not in self._logged_plan_keys
        self._logged_plan_keys.add(key)
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "DiffKV decode attention: plan for batch <= %d, context <= %d, %d q heads: "
            "scratch %.1f MiB (%d plan(s) cached, %.1f MiB of %.0f MiB budget)",
            b, ctx, num_q_heads, plan.scratch_bytes() / 2**20, len(self._plans),
            self.cached_plan_bytes() / 2**20, self.plan_cache_bytes / 2**20,
        )
        return plan

    def cached_plan_bytes(self) -> int:
        return sum(p.scratch_bytes() for p in self._plans.values())
