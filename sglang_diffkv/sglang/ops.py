"""The one seam between the SGLang backend and the DiffKV compute.

Both paths act on the same ``CompressedKVCache`` state (pages, page table, counters):

- ``reference``: the cache's own torch methods (any device; what CPU CI runs);
- ``kernels``: ``sglang_diffkv.kernels`` (Triton prefill scoring + compression, decode
  policy step, split-K decode attention), each byte-compatible with its reference.

``SGLANG_DIFFKV_KERNELS``: ``auto`` (default: kernels on CUDA, reference elsewhere),
``1`` (kernels everywhere; on CPU only under ``TRITON_INTERPRET=1``) or ``0`` (reference).

``SGLANG_DIFFKV_FUSED_ARGMIN`` (kernel path): ``1`` (or ``loop``) has each layer's decode
merge pass leave the next step's eligible argmin for the policy step
(``sglang_diffkv.decode_hint``), computed inside its score loop, which then scans only the
rows whose record is stale; ``2`` (or ``pass``) the same, computed in a second loop of the
merge pass over the scores it stored (``decode_attention.HINT_FILLS``); ``0`` (the default:
both fills measured slower than the scan on an H200) keeps the scan. Same decisions every way.

Benchmark mode (``config.bench_mix``) is the same on both paths: the scores are computed,
then replaced by the draw's (``CompressedKVCache.bench_significance``; on the Triton path
drawn inside the classify kernel); the decode step takes the drawn actions
(``bench_mix.forced_actions``, in-kernel on the Triton path).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.prompt_attention import (
    PackedPrompts,
    causal_sdpa,
    choose_prompt_attention,
)
from sglang_diffkv.sglang.step_profile import StepProfiler, span

logger = logging.getLogger("sglang_diffkv")

KERNELS_ENV = "SGLANG_DIFFKV_KERNELS"
REFERENCE_MODES = ("0", "false", "off", "reference")
FUSED_ARGMIN_ENV = "SGLANG_DIFFKV_FUSED_ARGMIN"

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


def _full_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """``out`` with zero rows appended up to ``rows`` (the step's padding rows)."""
    if out.shape[0] == rows:
        return out
    full = out.new_zeros(rows, *out.shape[1:])
    full[: out.shape[0]] = out
    return full


def _split_attached(cache: CompressedKVCache, ext: ExtendRequests
                    ) -> tuple[ExtendRequests, list[int]]:
    """(the step's requests less those prefilling a suffix over an attached radix prefix,
    those requests' rows in ``ext``)."""
    radix = cache.radix
    att = [b for b, r in enumerate(ext.slots) if radix is not None and r in radix.attached]
    if not att:
        return ext, []
    keep = [b for b in range(len(ext.slots)) if b not in att]
    pick = lambda xs: tuple(xs[b] for b in keep)  # noqa: E731
    # (indexing with the host list would copy it to the device pageable: a sync)
    req = ext.req.index_select(0, upload([keep], ext.req.device)[0])
    return ExtendRequests(req, pick(ext.slots), pick(ext.starts), pick(ext.fresh),
                          pick(ext.prefix), pick(ext.total)), att


# int64 elements per 16 bytes: every uploaded column starts on a multiple of it
UPLOAD_ALIGN = 2


def upload(columns: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors of host int lists, made by one host-to-device copy: from pinned
    memory and non-blocking on CUDA (a pageable copy synchronises the stream). Each column
    starts 16-byte aligned (padded after the one before): Triton specialises a kernel on
    whether each pointer is, so a column placed after an odd number of int64s would compile
    another variant of every kernel reading it, following the step's request count."""
    sizes = [len(c) for c in columns]
    padded = [-(-n // UPLOAD_ALIGN) * UPLOAD_ALIGN for n in sizes]
    flat = torch.tensor([int(x) for c, n, p in zip(columns, sizes, padded, strict=True)
                         for x in (*c, *(0,) * (p - n))], dtype=torch.int64)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [x if n == p else x[:n]
            for x, n, p in zip(flat.split(padded), sizes, padded, strict=True)]


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


def fused_argmin_fill(environ: dict[str, str] | None = None) -> str | None:
    """``SGLANG_DIFFKV_FUSED_ARGMIN``: the merge pass's fill of the fused argmin's records,
    "loop" (1/true/on/loop) or "pass" (2/pass), or None (0/false/off, the default)."""
    env = os.environ if environ is None else environ
    mode = env.get(FUSED_ARGMIN_ENV, "0").strip().lower()
    if mode in ("1", "true", "on", "loop"):
        return "loop"
    if mode in ("2", "pass"):
        return "pass"
    if mode in ("0", "false", "off", ""):
        return None
    raise ValueError(f"{FUSED_ARGMIN_ENV}={mode!r}: use 1 (loop), 2 (pass) or 0")


@dataclass
class PrefillStep:
    """One prefill step's shared inputs (``DiffKVOps.begin_prefill_step``), read by every
    layer: the requests, where their prompts sit in the packed tokens, their thresholds
    and benchmark seeds, and (kernel path) each layer's kept (n_high, n_low) per head,
    which ``end_prefill_step`` hands to the reclaim in one copy, and the scratch every
    layer reuses (significance, tiers, block counts: no allocation per layer).

    With chunked prefill in the step (``ext``), ``req`` / ``prompts`` / thresholds / seeds /
    ``totals`` / ``buffers`` describe its whole prompts only (``prompts`` packs them
    contiguously: their rows of the step are ``whole_rows``; None when there are none) and
    ``all_prompts`` packs every request's fresh tokens as SGLang passes them."""

    req: torch.Tensor  # int64 [B]
    prompts: PackedPrompts | None
    alpha_h: torch.Tensor  # fp32 [B], contiguous
    alpha_l: torch.Tensor  # fp32 [B], contiguous
    seed: torch.Tensor | None  # int64 [B], benchmark mode only
    totals: torch.Tensor | None  # int32 [layers, B, Hkv, 2], kernel path only
    buffers: Any = None  # kernels.prefill.PrefillBuffers, kernel path only
    ext: ExtendRequests | None = None  # chunked prefill in this step (None: whole prompts)
    all_prompts: PackedPrompts | None = None  # ext only: every request's fresh tokens
    whole_rows: torch.Tensor | None = None  # ext only: int64, the whole prompts' rows
    # ext only, made once per step (a per-layer host-to-device copy synchronises on CUDA):
    prefixed: PrefixedRows | None = None  # requests over stored tokens (extend attention)
    chunks: ExtendRequests | None = None  # ext less the attached radix hits
    attached: list[int] = field(default_factory=list)  # the attached ones' rows in ext
    stores: Any = None  # kernel path: extend_ops.ExtendStores


@dataclass(frozen=True)
class PrefixedRows:
    """The step's requests whose fresh tokens follow stored ones (extend attention): their
    slots, first packed rows and fresh lengths on the device, the longest on the host."""

    req: torch.Tensor  # int64 [P]
    starts: torch.Tensor  # int64 [P]
    lens: torch.Tensor  # int64 [P]
    max_new: int


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
                 plan_cache_bytes: int = PLAN_CACHE_BYTES,
                 fused_argmin: bool | str | None = None) -> None:
        """``fused_argmin``: None reads ``SGLANG_DIFFKV_FUSED_ARGMIN`` (kernel path only);
        True is the "loop" fill, a string names the fill ("loop" or "pass")."""
        self.cache = cache
        self.use_kernels = use_kernels
        # the step profiler (``SGLANG_DIFFKV_PROFILE``): the backend sets it; None records
        # nothing
        self.prof: StepProfiler | None = None
        if fused_argmin is None:
            fused_argmin = fused_argmin_fill()
        fill = "loop" if fused_argmin is True else (fused_argmin or None)
        if fill is not None and fill not in ("loop", "pass"):
            raise ValueError(f"fused_argmin={fused_argmin!r}: use 'loop' or 'pass'")
        self.fused_argmin = bool(fill and use_kernels)
        # how the merge pass fills the records (decode_attention.HINT_FILLS)
        self.hint_fill = fill or "loop"
        # the fused argmin's per-row records (None: the policy kernel scans every row)
        self.hints = cache.manager.enable_decode_hints() if self.fused_argmin else None
        # (bucketed batch, bucketed context, q heads) -> DecodeAttentionPlan, least recently
        # used first
        self._plans: OrderedDict[tuple[int, int, int], Any] = OrderedDict()
        self.plan_cache_bytes = plan_cache_bytes
        self.plans_built = 0
        self._logged_plan_keys: set[tuple[int, int, int]] = set()
        self._bench_mix_t: torch.Tensor | None = None
        if use_kernels:
            from sglang_diffkv import kernels
            from sglang_diffkv.kernels import decode_policy as policy_kernels

            self.k = kernels
            self.policy_k = policy_kernels
            cache.decode_room = functools.partial(kernels.decode_compaction, cache.manager)
            # Build (or load) the CUDA compaction library now, at server start: built lazily,
            # the nvcc run (~4 s) landed in the first decode step of the first requests.
            room = (kernels.compaction_backend() if cache.device.type == "cuda"
                    else "torch (not on CUDA)")
            # prefill attention over the packed prompts: flash varlen where its probe
            # passes, padded SDPA otherwise (prompt_attention)
            self.prompt_attention = choose_prompt_attention(cache.device)
            argmin = (f"fused into the merge pass ({self.hint_fill}; "
                      f"SGLANG_DIFFKV_FUSED_ARGMIN)" if self.fused_argmin else "scan")
            self.name = (f"Triton kernels (sglang_diffkv.kernels); decode page allocation: "
                         f"{room}; prefill attention: {self.prompt_attention.name} "
                         f"({self.prompt_attention.reason}); decode argmin: {argmin}")
        else:
            self.name = "torch reference (sglang_diffkv.cache)"

    # ---- prefill ----------------------------------------------------------------------

    def begin_prefill_step(self, req: torch.Tensor, lengths: list[int],
                           lengths_dev: torch.Tensor | None = None,
                           ext: ExtendRequests | None = None) -> PrefillStep:
        """What every layer of a prefill step shares, after the pages are allocated
        (``CompressedKVCache.begin_prefill``): where the packed prompts sit, and the
        per-request thresholds and benchmark seeds as the kernels read them. ``ext``: the
        step's requests as chunked prefill sees them; when any is a chunk (not a whole
        prompt) the whole prompts' inputs are built for them alone."""
        c = self.cache
        if ext is None or not ext.chunked:
            prompts = PackedPrompts.from_lengths(lengths, c.device, lengths_dev)
            return self._whole_prompts_step(req, prompts)
        whole = ext.whole
        all_prompts = PackedPrompts.from_lengths(lengths, c.device, lengths_dev)
        if not whole:
            empty = torch.zeros(0, device=c.device)
            step = PrefillStep(req=req[:0], prompts=None, alpha_h=empty, alpha_l=empty,
                               seed=None, totals=None, ext=ext, all_prompts=all_prompts)
        else:
            rows = torch.cat([torch.arange(ext.starts[b], ext.starts[b] + ext.fresh[b])
                              for b in whole]).to(c.device)
            step = self._whole_prompts_step(
                req[whole], PackedPrompts.from_lengths([lengths[b] for b in whole], c.device))
            step.ext, step.all_prompts, step.whole_rows = ext, all_prompts, rows
        pre = ext.prefixed
        if pre:
            idx, starts, lens = upload([pre, [ext.starts[b] for b in pre],
                                        [ext.fresh[b] for b in pre]], c.device)
            step.prefixed = PrefixedRows(ext.req[idx], starts, lens,
                                         max(ext.fresh[b] for b in pre))
        step.chunks, step.attached = _split_attached(c, ext)
        if self.use_kernels:
            from sglang_diffkv.sglang.extend_ops import ExtendStores

            mix = None if c.config.bench_mix is None else self._bench_mix()
            step.stores = ExtendStores.build(c, ext, mix)
        return step

    def _bench_mix(self) -> torch.Tensor:
        """Benchmark mode's mix as the kernels read it (float64 [3] on the device), made
        once: a copy per layer would be an upload per layer."""
        if self._bench_mix_t is None:
            self._bench_mix_t = torch.tensor(self.cache.config.bench_mix, dtype=torch.float64,
                                             device=self.cache.device)
        return self._bench_mix_t

    def _whole_prompts_step(self, req: torch.Tensor, prompts: PackedPrompts) -> PrefillStep:
        c = self.cache
        alpha = c.alpha[req]
        totals = buffers = None
        if self.use_kernels:
            totals = torch.empty(c.spec.num_layers, prompts.batch, c.spec.num_kv_heads, 2,
                                 dtype=torch.int32, device=c.device)
            buffers = self.k.PrefillBuffers.allocate(prompts.batch, c.spec.num_kv_heads,
                                                     prompts.max_len, c.device)
        # (copies, never views: at one request alpha[:, 1] is already contiguous, 4 bytes
        # into alpha, and a misaligned pointer is another compiled variant of the kernels)
        return PrefillStep(
            req=req, prompts=prompts,
            alpha_h=alpha[:, 0].clone(memory_format=torch.contiguous_format),
            alpha_l=alpha[:, 1].clone(memory_format=torch.contiguous_format),
            seed=None if c.config.bench_mix is None else c.bench_seed[req], totals=totals,
            buffers=buffers,
        )

    def extend_layer(self, layer: int, step: PrefillStep, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, scale: float) -> torch.Tensor:
        """One layer of a prefill step on packed tokens (q [T, Hq, D], k/v [T, Hkv, D]; rows
        past the step's tokens are padding): exact causal attention on the fresh K/V, then
        score, classify, quantise and store. Returns the attention output [T, Hq, Dv].
        A step with chunks goes through ``_chunked_extend_layer``."""
        if step.ext is not None:
            return self._chunked_extend_layer(layer, step, q, k, v, scale)
        p = step.prompts
        if not self.use_kernels:
            qp, kp, vp = p.pad(q), p.pad(k), p.pad(v)
            with span(self.prof, "attend"):
                out = p.unpad(causal_sdpa(qp, kp, vp, scale))
            with span(self.prof, "compress"):
                self.cache.prefill_layer(layer, step.req, p.lengths.long(), qp, kp, vp, scale)
        else:
            with span(self.prof, "attend"):
                out, lse = self.prompt_attention.run(q, k, v, p, scale)
            with span(self.prof, "compress"):
                self._score_and_compress(layer, step.req, p.lengths, q, k, v, scale,
                                         step.alpha_h, step.alpha_l, step.seed, lse=lse,
                                         starts=p.starts, max_len=p.max_len,
                                         totals=step.totals[layer], buffers=step.buffers)
        return _full_rows(out, q.shape[0])

    def _chunked_extend_layer(self, layer: int, step: PrefillStep, q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One layer of a step with chunked prefill. Attention: every request causally over
        its fresh tokens (as whole prompts), then requests with stored chunks again over
        those and their fresh tokens (extend attention: the Triton kernel or its torch
        reference), replacing their rows. Store: whole prompts as in stage 1, chunks before
        the last at the high tier (``CompressedKVCache.store_chunk``), last chunks scored
        over the whole prompt and stored compressed (``store_last_chunk``), radix suffixes
        likewise over their attached prefix (``PromptSharing``). The kernel path stores the
        chunks and the prompt ends as groups, with no host sync (``extend_ops``)."""
        c, ext = self.cache, step.ext
        with span(self.prof, "attend"):
            out, lse = self._chunked_attend(layer, step, q, k, v, scale)
        if step.whole_rows is not None:
            rows, p = step.whole_rows, step.prompts
            qw, kw, vw = q[rows], k[rows], v[rows]
            with span(self.prof, "compress"):
                if not self.use_kernels:
                    c.prefill_layer(layer, step.req, p.lengths.long(), p.pad(qw), p.pad(kw),
                                    p.pad(vw), scale)
                else:
                    self._score_and_compress(
                        layer, step.req, p.lengths, qw, kw, vw, scale, step.alpha_h,
                        step.alpha_l, step.seed, lse=None if lse is None else lse[rows],
                        starts=p.starts, max_len=p.max_len, totals=step.totals[layer],
                        buffers=step.buffers)
        if self.use_kernels:  # (every chunk and prompt end as one group: extend_ops)
            with span(self.prof, "chunk"):
                step.stores.store_chunks(layer, q, k, v)
            with span(self.prof, "end"):
                step.stores.store_prompt_ends(layer, q, k, v, scale)
            return out
        chunks, attached = step.chunks, step.attached
        with span(self.prof, "chunk"):
            c.store_chunk(layer, chunks, q, k, v)
            for b in attached:  # radix hits: the suffix's chunks before its last
                a = c.radix.attached[ext.slots[b]]
                if ext.prefix[b] + ext.fresh[b] < a.total:
                    c.radix.store_chunk(layer, b, ext.slots[b], ext, q, k, v)
        with span(self.prof, "end"):
            c.store_last_chunk(layer, chunks, q, k, v, scale)
            for b in attached:  # radix hits: the suffix's last chunk over the attached prefix
                a = c.radix.attached[ext.slots[b]]
                if ext.prefix[b] + ext.fresh[b] >= a.total:
                    c.radix.store_last(layer, b, ext.slots[b], ext, q, k, v, scale)
        return out

    def _chunked_attend(self, layer: int, step: PrefillStep, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every request causally over its fresh tokens, then requests with stored tokens
        again over those and their fresh tokens, replacing their rows: (out [T, Hq, Dv],
        the fresh-only pass's LSE or None)."""
        c, ap = self.cache, step.all_prompts
        if not self.use_kernels:
            out, lse = ap.unpad(causal_sdpa(ap.pad(q), ap.pad(k), ap.pad(v), scale)), None
        else:
            out, lse = self.prompt_attention.run(q, k, v, ap, scale)
        out = _full_rows(out, q.shape[0])
        pre = step.prefixed
        if pre is not None:
            if self.use_kernels:
                self.k.extend_attention(q, k, v, pre.starts, pre.lens, c.pages, c.geometry,
                                        c.manager.table, c.manager.counts, pre.req, layer,
                                        scale, out=out, max_new=pre.max_new)
            else:
                c.extend_layer_attend(layer, pre.req, q, k, v, pre.starts, pre.lens, scale,
                                      out=out)
        return out, lse

    def end_prefill_step(self, step: PrefillStep) -> None:
        """After the last layer: record what each row kept and return the pages that
        compression freed (``CompressedKVCache.end_prefill``; with chunks ``end_extend``,
        which also counts the continued prompts' new tokens)."""
        c = self.cache
        if step.totals is not None:
            c._prompt_kept[step.req] = step.totals.transpose(0, 1).long()
        if step.ext is not None:
            if step.stores is not None:
                step.stores.end_step()
            chunks, attached = step.chunks, step.attached
            c.end_extend(chunks)
            if attached:
                c.radix.end_step(step.ext, attached)
        else:
            c.end_prefill(step.req)
        if c.radix is not None:  # (radix prefix sharing: the completed prompts)
            with span(self.prof, "export"):
                c.radix.export()

    def prefill_layer(self, layer: int, req: torch.Tensor, lengths: torch.Tensor,
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """Score, classify, quantise and store one layer of whole prompts, padded
        (q [B, Hq, Lmax, D], k/v [B, Hkv, Lmax, D]); the cache's ``begin_prefill`` /
        ``end_prefill`` come before and after all layers."""
        c = self.cache
        if not self.use_kernels:
            c.prefill_layer(layer, req, lengths, q, k, v, scale)
            return
        alpha = c.alpha[req]
        seed = None if c.config.bench_mix is None else c.bench_seed[req]
        cls = self._score_and_compress(layer, req, lengths, q, k, v, scale, alpha[:, 0],
                                       alpha[:, 1], seed)
        # what CompressedKVCache.store_prefill records for end_prefill's reclaim
        c._prompt_kept[req, layer, :, 0] = cls.n_high.long()
        c._prompt_kept[req, layer, :, 1] = cls.n_low.long()

    def _score_and_compress(self, layer: int, req: torch.Tensor, lengths: torch.Tensor,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            alpha_h: torch.Tensor, alpha_l: torch.Tensor,
                            seed: torch.Tensor | None, *, lse: torch.Tensor | None = None,
                            starts: torch.Tensor | None = None, max_len: int | None = None,
                            totals: torch.Tensor | None = None, buffers: Any = None) -> Any:
        """Kernel path of one layer, padded or packed (lse / starts / max_len / totals as
        ``prefill_scores`` and ``compress_prefill`` take them; ``buffers``: the step's
        ``PrefillBuffers``, or None to allocate). Three launches, benchmark mode included:
        scores (plus the LSE pass when no ``lse`` is given), classify, store. The
        classification's score / pos are not produced (nothing here reads them)."""
        c = self.cache
        cfg = c.config
        sig = self.k.prefill_scores(q, k, lengths, scale, cfg.score_queries, lse=lse,
                                    starts=starts, max_len=max_len,
                                    out=None if buffers is None else buffers.significance)
        bench = None
        if cfg.bench_mix is not None:
            # the scoring kernels above ran for their cost; the draw decides the tiers
            # (in the classify kernel: CompressedKVCache.bench_significance, bit for bit)
            bench = (seed, self._bench_mix())
        cls = self.k.compress_prefill(
            c.pages, c.geometry, c.manager.table, req, layer, k, v, sig, lengths,
            alpha_h, alpha_l, cfg.window, cfg.score_queries, starts=starts, totals=totals,
            tier_out=None if buffers is None else buffers.tier,
            block_counts=None if buffers is None else buffers.block_counts, scores=False,
            bench=bench,
        )
        if c.radix is not None:  # (radix prefix sharing: the prompts' cut counts)
            c.radix.record(layer, req, cls.tier)
        return cls

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
            bench=None if mix is None else (p.seed, mix), step=p, shared=c.manager.shared,
            hints=self.hints,
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
                          layer, scale, views=views, shared=c.manager.shared, hints=self.hints,
                          hint_fill=self.hint_fill)
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
