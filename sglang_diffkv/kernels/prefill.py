"""Prompt significance from the log-sum-exp, and prompt compression (count + compact + store).

Scoring (``prefill_scores``): token i's significance is, per query head, the softmax mass it
gets from the last Q = min(score_queries, L) queries, maxed over the GQA group (DESIGN §2).
Given those queries' natural-log LSE (from the prefill attention, or from ``_lse_kernel``,
a flash-style pass over K that keeps only the running max and sum), ``_colsum_kernel``
recomputes exp(q.k * scale - lse) tile by tile and column-sums it: nothing [Q, L]-sized ever
reaches HBM and any prompt length works.

Compression (``compress_prefill``): ``_classify_kernel`` decides every token's tier and
counts each block's members; ``_store_prefill_kernel`` sums the counts of the blocks before
its own (a block's first rank) and of the whole head (n_high: where the low pages start),
ranks members inside the block with a cumsum (a stable compaction: no sort) and quantises
them into row pages exactly where ``CompressedKVCache.store_prefill`` puts them (high pages
[0, hp), low pages right after), ready for ``PageManager.reclaim_prefill``. Two launches a
layer: at short prompts the host's launch cost (~40-50 us of Python each), not the GPU,
bounds this step, so every store program recomputes its prefix (2 x NB int32 loads, from
L2) rather than a scan taking a launch of its own.

Benchmark mode (``bench=``, a constexpr in the classifier) draws each token's significance
in the classify kernel (``_bench_draw``: ``bench_mix.synthetic_significance``'s arithmetic,
shared with ``kernels.bench_mix``), stores it as the significance and classifies it, instead
of a separate launch writing it first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_diffkv import bench_mix
from sglang_diffkv.kernels._quant import quantize_store, store_score_pos
from sglang_diffkv.kernels._tier import INTERPRET, page_views, tier_constexprs
from sglang_diffkv.kernels.decode_policy import _hash_u24, hash_constexprs
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.pages import write_tokens
from sglang_diffkv.policy import (
    PromptClassification,
    Tier,
    classify_prompt,
    group_max,
    prompt_attention_mass,
)

LOG2E = 1.4426950408889634
PREFILL_BLOCK = 64  # tokens per classify / store program (BL)
COUNT_TILE = 128  # blocks' member counts a store program sums per iteration


def prefill_blocks(max_len: int) -> int:
    """Blocks of ``PREFILL_BLOCK`` tokens per head: ``block_counts``' third dimension."""
    return triton.cdiv(max_len, PREFILL_BLOCK)


@dataclass(frozen=True)
class PrefillBuffers:
    """Scratch one prefill step's layers share (``DiffKVOps.begin_prefill_step``): every
    layer overwrites what the last one read, which stream order makes safe, and no layer
    pays for allocations."""

    significance: torch.Tensor  # fp32 [B, Hkv, Lmax]: prefill_scores' out
    tier: torch.Tensor  # int8 [B, Hkv, Lmax]: compress_prefill's tier_out
    block_counts: torch.Tensor  # int32 [B, Hkv, prefill_blocks(Lmax), 2]

    @classmethod
    def allocate(cls, batch: int, num_kv_heads: int, max_len: int,
                 device: torch.device | str) -> PrefillBuffers:
        shape = (batch, num_kv_heads, max_len)
        return cls(
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.int8, device=device),
            torch.empty(*shape[:2], prefill_blocks(max_len), 2, dtype=torch.int32,
                        device=device),
        )


def _as(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``x`` as a contiguous ``dtype`` tensor on ``device``; ``x`` itself when it already is
    (a no-op ``.to`` / ``.contiguous`` still costs host time on every layer)."""
    if x.dtype == dtype and x.device == device and x.is_contiguous():
        return x
    return x.to(device=device, dtype=dtype).contiguous()


def _check_buffer(name: str, x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    """A caller's output buffer is written in place: it must be exactly what the kernels
    address (contiguous, this shape and dtype, on the device)."""
    if (x.shape != shape or x.dtype != dtype or x.device != device
            or not x.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} tensor on "
                         f"{device}, got {x.dtype} {list(x.shape)} on {x.device}"
                         + ("" if x.is_contiguous() else " (not contiguous)"))


# (a constexpr global: jit code reads it at compile time, and it is part of the cache key)
_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def _qk(qt, kt, DOT_F32: tl.constexpr):
    """q . k for a [QB, D] query tile and a [BK, D] key tile, fp32 [QB, BK].

    bf16 products are exact in fp32 either way; the interpreter's bf16 dot is broken
    (triton 3.9), so it computes in fp32 with IEEE precision. DOT_F32 on a GPU means fp32
    keys (dequantised from pages): an IEEE fp32 dot there runs on the CUDA cores and, at
    these tiles, does not fit the registers (ptxas for sm_90: 255 registers and ~1 KB of
    spills a thread in ``_lse_kernel``, a 7.8 KB stack frame in ``_colsum_kernel``), which
    made the scoring of prompts over stored tokens the prefill step's largest cost. With
    bf16 queries the keys are split instead into three bf16 pieces whose sum is each key
    exactly (``_split3``), and three tensor-core dots accumulate their exact products in
    fp32: the same products as the IEEE dot, summed in another order."""
    if DOT_F32:
        if not _INTERPRETED and qt.dtype == tl.bfloat16:
            k1, k2, k3 = _split3(kt.to(tl.float32))
            acc = tl.dot(qt, tl.trans(k3))  # (smallest first)
            acc = tl.dot(qt, tl.trans(k2), acc)
            return tl.dot(qt, tl.trans(k1), acc)
        return tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(qt, tl.trans(kt))


@triton.jit
def _split3(x):
    """fp32 x as bf16 (k1, k2, k3) with k1 + k2 + k3 == x exactly: k1 rounds x to 8
    significant bits, the residual x - k1 is exact in fp32 (Sterbenz) and has at most 16,
    k2 rounds it, and the last residual (at most 8 bits) is exact in bf16, which has fp32's
    exponent range (for 2**-110 <= |x| < 3.38e38: page keys, whose fp16 scales and zeros
    keep them far from both ends; ``split3_reference`` is the same in torch)."""
    k1 = x.to(tl.bfloat16)
    r = x - k1.to(tl.float32)
    k2 = r.to(tl.bfloat16)
    k3 = (r - k2.to(tl.float32)).to(tl.bfloat16)
    return k1, k2, k3


def split3_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_split3`` in torch (round to nearest even, as Triton's fp32 -> bf16 cast)."""
    k1 = x.bfloat16()
    r = x - k1.float()
    k2 = r.bfloat16()
    return k1, k2, (r - k2.float()).bfloat16()


@triton.jit
def _lse_kernel(
    q, q_start, q_sh, q_sl, k, k_start, k_sh, k_sl, lengths, lse, qk_scale, key_first,
    q_count,
    G: tl.constexpr, Q: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr, EXT: tl.constexpr,
):
    """lse[b, hq, r] (base 2) of query L - nq + r over its causal keys, r < nq. EXT: nq is
    also at most q_count[b], and keys before key_first[b, hq // G] are masked."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    n = tl.load(lengths + b)
    nq = tl.minimum(n, Q)
    first = 0
    if EXT:
        nq = tl.minimum(nq, tl.load(q_count + b))
        first = tl.load(key_first + b * (tl.num_programs(1) // G) + hq // G)
    r = tl.arange(0, QB)
    qpos = n - nq + r
    rmask = r < nq
    d = tl.arange(0, D)
    qt = tl.load(q + (tl.load(q_start + b) + qpos[:, None]) * q_sl + hq * q_sh + d[None, :],
                 mask=rmask[:, None], other=0.0)
    kbase = k + tl.load(k_start + b) * k_sl + (hq // G) * k_sh
    m = tl.full([QB], float("-inf"), tl.float32)
    acc = tl.zeros([QB], tl.float32)
    for start in range(0, n, BK):
        kpos = start + tl.arange(0, BK)
        kt = tl.load(kbase + kpos[:, None] * k_sl + d[None, :], mask=(kpos < n)[:, None],
                     other=0.0)
        s = _qk(qt, kt, DOT_F32) * qk_scale
        ok = (kpos[None, :] <= qpos[:, None]) & rmask[:, None] & (kpos[None, :] >= first)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new
    tl.store(lse + (b * tl.num_programs(1) + hq) * QB + r, m + tl.log2(acc), mask=rmask)


# Sizes that change every prefill step (Lmax, block counts, a packed LSE's token stride) are
# not specialised (do_not_specialize): Triton would compile a variant per value class
# (== 1, % 16 == 0, other) and combination, and each compile stalled a serving step by
# ~1 s on first use.
@triton.jit(do_not_specialize=("Lmax", "lse_sb", "lse_sh", "lse_sr"))
def _colsum_kernel(
    q, q_start, q_sh, q_sl, k, k_start, k_sh, k_sl, lengths, lse, lse_sb, lse_sh, lse_sr,
    lse_mul, sig, Lmax, qk_scale, key_first, q_count, k_from,
    G: tl.constexpr, Q: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
    LSE_PACKED: tl.constexpr, DOT_F32: tl.constexpr, EXT: tl.constexpr,
):
    """sig[b, h, i] = max over the group of sum_r exp2(s[r, i] - lse[r]) for one key tile.
    lse row r of prompt b: b * lse_sb + r * lse_sr (per prompt), or, LSE_PACKED (one row per
    packed query token, as a varlen attention returns it), (q_start[b] + L - nq + r) * lse_sr.
    EXT: as ``_lse_kernel`` (at most q_count[b] queries, keys before key_first[b, h] masked:
    their sig is 0), and tiles start at key k_from[b] (earlier keys get no sig)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.program_id(2) * BK
    if EXT:
        start += tl.load(k_from + b)
    n = tl.load(lengths + b)
    kpos = start + tl.arange(0, BK)
    best = tl.zeros([BK], tl.float32)
    if start < n:
        nq = tl.minimum(n, Q)
        first = 0
        if EXT:
            nq = tl.minimum(nq, tl.load(q_count + b))
            first = tl.load(key_first + b * tl.num_programs(1) + h)
        r = tl.arange(0, QB)
        qpos = n - nq + r
        rmask = r < nq
        d = tl.arange(0, D)
        kt = tl.load(k + (tl.load(k_start + b) + kpos[:, None]) * k_sl + h * k_sh + d[None, :],
                     mask=(kpos < n)[:, None], other=0.0)
        ok = (kpos[None, :] <= qpos[:, None]) & rmask[:, None] & (kpos[None, :] >= first)
        q0 = tl.load(q_start + b)
        if LSE_PACKED:
            lrow = lse + (q0 + qpos) * lse_sr
        else:
            lrow = lse + b * lse_sb + r * lse_sr
        for g in range(0, G):
            hq = h * G + g
            qt = tl.load(q + (q0 + qpos[:, None]) * q_sl + hq * q_sh + d[None, :],
                         mask=rmask[:, None], other=0.0)
            l2 = tl.load(lrow + hq * lse_sh, mask=rmask, other=0.0) * lse_mul
            s = _qk(qt, kt, DOT_F32) * qk_scale
            p = tl.where(ok, tl.exp2(s - l2[:, None]), 0.0)
            best = tl.maximum(best, tl.sum(p, axis=0))
    tl.store(sig + (b * tl.num_programs(1) + h) * Lmax + kpos, best, mask=kpos < Lmax)


def _token_rows(x: torch.Tensor, starts: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """x as the kernels address it: (x, row of each prompt's first token, head stride, row
    stride); token i of prompt b, head h is x + (row[b] + i) * row_stride + h * head_stride.
    Padded [B, H, Lmax, D]: row[b] = b * stride(0) / stride(2); packed [T, H, D]: starts."""
    if x.dim() == 3:
        return x, starts, x.stride(1), x.stride(0)
    if x.stride(2) == 0 or x.stride(0) % x.stride(2):
        x = x.contiguous()
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int64) * (
        x.stride(0) // x.stride(2))
    return x, rows, x.stride(1), x.stride(2)


def _check_prompt(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor,
                  starts: torch.Tensor | None, max_len: int | None,
                  own_q_rows: bool = False) -> tuple[int, int]:
    """(B, Lmax) of padded [B, H, Lmax, D] or packed [T, H, D] prompts (then ``starts``
    [B] int64 and the host's ``max_len`` are needed: reading them off the device would
    synchronise). ``own_q_rows``: packed q has rows of its own (``q_starts``)."""
    if q.dim() != k.dim() or q.dim() not in (3, 4):
        raise ValueError("q and k must be padded [B, H, Lmax, D] or packed [T, H, D] "
                         f"alike, got {tuple(q.shape)} / {tuple(k.shape)}")
    packed = q.dim() == 3
    if packed:
        if starts is None or max_len is None:
            raise ValueError("packed [T, H, D] prompts need starts [B] and max_len")
        if starts.dim() != 1 or starts.dtype != torch.int64:
            raise ValueError(f"starts must be int64 [B], got {starts.dtype} "
                             f"{tuple(starts.shape)}")
        b, lmax = starts.shape[0], int(max_len)
        same = own_q_rows or k.shape[0] == q.shape[0]
    else:
        b, lmax = q.shape[0], q.shape[2]
        same = k.shape[0] == b and k.shape[2] == lmax
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    if not same or k.shape[-1] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match "
                         "(same prompts, same D; Hq a multiple of Hkv)")
    half = (torch.float16, torch.bfloat16)
    if not ((q.dtype == k.dtype and q.dtype in half)
            or (k.dtype == torch.float32 and q.dtype in (*half, torch.float32))):
        raise ValueError(f"q and k must both be fp16 or bf16, or k fp32 (then q fp16, bf16 "
                         f"or fp32), got {q.dtype} / {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dimension")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [{b}]")
    return b, lmax


def prefill_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    sm_scale: float,
    score_queries: int,
    lse: torch.Tensor | None = None,
    *,
    starts: torch.Tensor | None = None,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
    q_starts: torch.Tensor | None = None,
    key_first: torch.Tensor | None = None,
    num_queries: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
    score_len: int | None = None,
) -> torch.Tensor:
    """Significance sums [B, Hkv, Lmax] fp32 (maxed over the group; 0 past a prompt's end).

    q [B, Hq, Lmax, D], k [B, Hkv, Lmax, D] (any strides with a contiguous last dim), or
    packed q [T, Hq, D], k [T, Hkv, D] with ``starts`` (int64 [B], prompt b's first row)
    and ``max_len`` (Lmax). ``lse``: optional natural-log LSE of each prompt's last
    min(score_queries, L) queries, as the prefill attention returns it: [B, Hq,
    score_queries] (row r is query L - nq + r), or for packed prompts [T, Hq] (every
    query's row, any strides); computed here when absent. ``out``: fp32 [B, Hkv, Lmax] to
    write into. k fp32 (keys dequantised from pages) scores with fp32 products.

    Prompts over stored tokens (``sglang.extend_ops``; packed, ``lse`` computed here):
    ``q_starts`` (int64 [B]): query token i of prompt b is q row q_starts[b] + i (default
    ``starts``: q holds only the scoring queries when q_starts[b] + L - nq >= 0 is their
    first row); ``key_first`` (int32 [B, Hkv]) and ``num_queries`` (int32 [B]), given
    together: keys before key_first[b, h] are invisible (head h of prompt b has fewer
    tokens than its row's positions) and each prompt's scoring queries are its last
    min(score_queries, L, num_queries[b]). ``score_from`` (int32 [B]) with ``score_len``
    (the host's longest L - score_from[b]), in that mode: only keys from position
    score_from[b] on get a significance (earlier ones are still in every query's softmax;
    their sig entries are left as they were): a radix suffix's attached tokens are frozen,
    so nothing reads theirs, and the column sums skip their tiles.
    """
    b, lmax = _check_prompt(q, k, lengths, starts, max_len, own_q_rows=q_starts is not None)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    if q_starts is not None:
        _check_buffer("q_starts", q_starts, (b,), torch.int64, k.device)
    ext = key_first is not None or num_queries is not None
    if ext:
        if key_first is None or num_queries is None or lse is not None or starts is None:
            raise ValueError("key_first and num_queries go together, with packed prompts "
                             "and no lse")
        _check_buffer("key_first", key_first, (b, hkv), torch.int32, k.device)
        _check_buffer("num_queries", num_queries, (b,), torch.int32, k.device)
        if score_from is None:
            score_from, score_len = torch.zeros(b, dtype=torch.int32, device=k.device), lmax
        _check_buffer("score_from", score_from, (b,), torch.int32, k.device)
        if score_len is None or not 0 <= score_len <= lmax:
            raise ValueError(f"score_from needs score_len in [0, {lmax}], got {score_len}")
    elif score_from is not None:
        raise ValueError("score_from goes with key_first and num_queries")
    q, q_rows, q_sh, q_sl = _token_rows(q, starts if q_starts is None else q_starts)
    k, k_rows, k_sh, k_sl = _token_rows(k, starts)
    qb = max(16, triton.next_power_of_2(score_queries))
    lengths = _as(lengths, torch.int32, q.device)
    packed_lse = lse is not None and lse.dim() == 2
    dot_f32 = INTERPRET or k.dtype == torch.float32
    if lse is None:
        lse = torch.empty(b, hq, qb, dtype=torch.float32, device=q.device)
        _lse_kernel[(b, hq)](
            q, q_rows, q_sh, q_sl, k, k_rows, k_sh, k_sl, lengths, lse, sm_scale * LOG2E,
            key_first, num_queries,
            G=hq // hkv, Q=score_queries, QB=qb, D=d, BK=64, DOT_F32=dot_f32, EXT=ext,
            num_warps=4,
        )
        lse_mul = 1.0
    else:
        if packed_lse and starts is None:
            raise ValueError(f"a per-token lse {tuple(lse.shape)} needs packed prompts")
        want = (q.shape[0], hq) if packed_lse else (b, hq, score_queries)
        if lse.shape != want or lse.dtype != torch.float32:
            raise ValueError(f"lse must be fp32 {list(want)}, got {lse.dtype} "
                             f"{tuple(lse.shape)}")
        lse_mul = LOG2E  # natural -> base 2
    if packed_lse:
        lse_sb, lse_sh, lse_sr = 0, lse.stride(1), lse.stride(0)
    else:
        lse_sb, lse_sh, lse_sr = lse.stride(0), lse.stride(1), lse.stride(2)
    shape = (b, hkv, lmax)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        _check_buffer("out", out, shape, torch.float32, q.device)
    bk = 64
    _colsum_kernel[(b, hkv, triton.cdiv(score_len if ext else lmax, bk))](
        q, q_rows, q_sh, q_sl, k, k_rows, k_sh, k_sl, lengths, lse, lse_sb, lse_sh, lse_sr,
        lse_mul, out, lmax, sm_scale * LOG2E, key_first, num_queries, score_from,
        G=hq // hkv, Q=score_queries, QB=qb, D=d, BK=bk, LSE_PACKED=packed_lse,
        DOT_F32=dot_f32, EXT=ext, num_warps=4,
    )
    return out


def prefill_scores_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    sm_scale: float,
    score_queries: int,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense oracle, prompt by prompt (as ``CompressedKVCache.prefill_layer``)."""
    b, _, lmax, _ = q.shape
    hkv = k.shape[1]
    sig = torch.zeros(b, hkv, lmax, device=q.device)
    for i, n in enumerate(lengths.tolist()):
        mass = prompt_attention_mass(q[i, :, :n], k[i, :, :n], sm_scale, score_queries)
        sig[i, :, :n] = group_max(mass, hkv)
    return sig


# ---- compression -------------------------------------------------------------------------


@triton.jit
def _threshold(alpha, n):
    # policy.thresholds: alpha / max(L, 1) in float64, clamped to [0, 1], then float32
    t = alpha.to(tl.float64) / tl.maximum(n, 1).to(tl.float64)
    return tl.minimum(tl.maximum(t, 0.0), 1.0).to(tl.float32)


@triton.jit
def _bench_draw(seed, layer, h, i, n, mix, t_h, t_l, WINDOW: tl.constexpr, Q: tl.constexpr,
                HIGH_MEAN: tl.constexpr, PRUNED_MEAN: tl.constexpr, MUL_A: tl.constexpr,
                MUL_B: tl.constexpr, SALT: tl.constexpr, U_BITS: tl.constexpr):
    """``bench_mix.synthetic_significance`` of tokens i, head h, of a prompt of n tokens
    (seed: the prompt's draw seed; t_h, t_l: its thresholds from ``_threshold``; mix: the
    float64 (high, low, pruned) mix), bit for bit: the same float64 rescale of the mix, the
    same int64-masked hash (``decode_policy._hash_u24``), the same fp32 mean times the same
    query count. Its kernels launch with enable_fp_fusion=False: an FMA would round the
    float64 cuts differently from torch."""
    # bench_mix.prefill_fractions, float64, same operations in the same order
    high = tl.load(mix)
    low = tl.load(mix + 1)
    rest = low + tl.load(mix + 2)
    nf = n.to(tl.float64)
    w = tl.minimum(nf, WINDOW)
    outside = tl.maximum(nf - w, 1.0)
    fh = tl.minimum(tl.maximum(high * nf - w, 0.0) / outside, 1.0)
    fl = tl.where(rest > 0, (1.0 - fh) * (low / tl.where(rest > 0, rest, 1.0)), 0.0)
    u_range = (1 << U_BITS) * 1.0
    cut_h = tl.minimum(tl.maximum(tl.floor(fh * u_range + 0.5), 0.0), u_range).to(tl.int64)
    cut_hl = tl.minimum(tl.maximum(tl.floor((fh + fl) * u_range + 0.5), 0.0),
                        u_range).to(tl.int64)
    u = _hash_u24(seed, layer, h, i, MUL_A, MUL_B, SALT, U_BITS)
    low_mean = 0.5 * (t_l + t_h)
    mean = tl.where(u < cut_h, HIGH_MEAN, tl.where(u < cut_hl, low_mean, PRUNED_MEAN))
    count = tl.maximum(tl.minimum(tl.maximum(n - i, 0), Q), 1).to(tl.float32)
    return mean * count


# layer: with the per-step sizes, not specialised either (it changes every launch)
@triton.jit(do_not_specialize=("layer", "Lmax", "NB"))
def _classify_kernel(
    sig, lengths, alpha_h, alpha_l, tier_out, score_out, pos_out, block_counts, seed, mix,
    layer, Lmax, NB,
    WINDOW: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr, SCORES: tl.constexpr,
    BENCH: tl.constexpr, HIGH_MEAN: tl.constexpr, PRUNED_MEAN: tl.constexpr,
    MUL_A: tl.constexpr, MUL_B: tl.constexpr, SALT: tl.constexpr, U_BITS: tl.constexpr,
):
    """Tiers of one block of BL tokens and its (high, low) member counts. BENCH: the
    significance is drawn here (``_bench_draw``, seed / mix / layer) and written into sig,
    where the store kernel reads each token's score. SCORES: also the classification's
    score (0 past the end) and virtual positions (score_out / pos_out; unused otherwise)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(lengths + b)
    i = blk * BL + tl.arange(0, BL)
    inside = i < Lmax
    th = _threshold(tl.load(alpha_h + b), n)
    tlow = _threshold(tl.load(alpha_l + b), n)
    srow = sig + (b * tl.num_programs(1) + h) * Lmax + i
    if BENCH:
        s = _bench_draw(tl.load(seed + b), layer, h, i, n, mix, th, tlow, WINDOW, Q,
                        HIGH_MEAN, PRUNED_MEAN, MUL_A, MUL_B, SALT, U_BITS)
        tl.store(srow, s, mask=inside)
    else:
        s = tl.load(srow, mask=inside, other=0.0)
    valid = i < n
    if SCORES:
        tl.store(score_out + (b * tl.num_programs(1) + h) * Lmax + i, tl.where(valid, s, 0.0),
                 mask=inside)
        if h == 0:  # policy.virtual_positions: L - clamp(L - i, 0, Q)
            tl.store(pos_out + b * Lmax + i, n - tl.minimum(tl.maximum(n - i, 0), Q),
                     mask=inside)
    _store_tiers(s, i, n, th, tlow, valid, inside,
                 tier_out + (b * tl.num_programs(1) + h) * Lmax + i,
                 block_counts + ((b * tl.num_programs(1) + h) * NB + blk) * 2, WINDOW, Q)


@triton.jit
def _store_tiers(s, pos, n, th, tlow, valid, inside, tier_ptr, count_ptr,
                 WINDOW: tl.constexpr, Q: tl.constexpr):
    """The prefill policy on one block: a token is high when its mean significance (over
    the min(n - pos, Q) queries that saw it) reaches ``th`` or it is in the last WINDOW,
    else low when it reaches ``tlow``, else pruned (tiers 0 / 1 / 2 at ``tier_ptr``); the
    block's (high, low) member counts go to ``count_ptr``."""
    count = tl.maximum(tl.minimum(n - pos, Q), 1).to(tl.float32)
    mean = tl.math.div_rn(s, count)
    high = ((mean >= th) | (pos >= n - WINDOW)) & valid
    low = (mean >= tlow) & ~high & valid
    tl.store(tier_ptr, tl.where(high, 0, tl.where(low, 1, 2)).to(tl.int8), mask=inside)
    tl.store(count_ptr, tl.sum(high.to(tl.int32), axis=0))
    tl.store(count_ptr + 1, tl.sum(low.to(tl.int32), axis=0))


@triton.jit
def _block_prefix(counts, blk, nblk, TILE: tl.constexpr):
    """One head's per-block (high, low) member counts ([NB, 2] at ``counts``) summed over
    the blocks before ``blk`` (its members' first ranks) and over the ``nblk`` blocks that
    hold tokens (the head's totals: later blocks counted no member), TILE blocks per
    iteration (a fixed tile: one compiled variant for every prompt length)."""
    h_before = tl.zeros([], tl.int32)
    l_before = tl.zeros([], tl.int32)
    h_total = tl.zeros([], tl.int32)
    l_total = tl.zeros([], tl.int32)
    for start in range(0, nblk, TILE):
        j = start + tl.arange(0, TILE)
        c_h = tl.load(counts + j * 2, mask=j < nblk, other=0)
        c_l = tl.load(counts + j * 2 + 1, mask=j < nblk, other=0)
        h_total += tl.sum(c_h, 0)
        l_total += tl.sum(c_l, 0)
        h_before += tl.sum(tl.where(j < blk, c_h, 0), 0)
        l_before += tl.sum(tl.where(j < blk, c_l, 0), 0)
    return h_before, l_before, h_total, l_total


@triton.jit(do_not_specialize=("Lmax", "NB"))
def _store_prefill_kernel(
    u8, f16, f32, i32, key, k_start, k_sh, k_sl, value, v_start, v_sh, v_sl,
    sig, tier_in, block_counts, totals, lengths, table, t_sr, t_sh, req, Lmax, NB,
    PAGE_BYTES: tl.constexpr, D: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr,
    COUNT_TILE: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
):
    """Ranks and stores one block's members of both tiers; block 0's program also writes
    the head's (n_high, n_low) into totals (so it runs even for an empty prompt, where every
    store below is masked off)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(lengths + b)
    if blk * BL < tl.maximum(n, 1):
        head = b * tl.num_programs(1) + h
        h_first, l_first, n_hi, n_lo = _block_prefix(block_counts + head * NB * 2, blk,
                                                     tl.cdiv(n, BL), COUNT_TILE)
        if blk == 0:
            tl.store(totals + head * 2, n_hi)
            tl.store(totals + head * 2 + 1, n_lo)
        i = blk * BL + tl.arange(0, BL)
        inside = i < n
        tier = tl.load(tier_in + head * Lmax + i, mask=inside, other=2)
        row = table + tl.load(req + b).to(tl.int64) * t_sr + h * t_sh
        hp = tl.cdiv(n_hi, H_N)  # the low tier's first page
        d = tl.arange(0, D)
        kx = tl.load(key + (tl.load(k_start + b) + i[:, None]) * k_sl + h * k_sh + d[None, :],
                     mask=inside[:, None], other=0.0).to(tl.float32)
        vx = tl.load(value + (tl.load(v_start + b) + i[:, None]) * v_sl + h * v_sh + d[None, :],
                     mask=inside[:, None], other=0.0).to(tl.float32)
        score = tl.load(sig + head * Lmax + i, mask=inside, other=0.0)
        pos = n - tl.minimum(Q, n - i)  # virtual position (policy.virtual_positions)
        # high tier: rank -> page rank // N_hi at row position rank // N_hi
        member = tier == 0
        rank = h_first + tl.cumsum(member.to(tl.int32), 0) - 1
        page = tl.load(row + rank // H_N, mask=member, other=0)
        base = page.to(tl.int64) * PAGE_BYTES
        slot = rank % H_N
        quantize_store(u8, f16, kx, base, slot, member, BL, D, H_KB, H_KG, H_KOFF, H_KMOFF)
        quantize_store(u8, f16, vx, base, slot, member, BL, D, H_VB, H_VG, H_VOFF, H_VMOFF)
        store_score_pos(f32, i32, base, slot, member, score, pos, H_SOFF, H_POFF)
        # low tier: the pages right after the high ones (reclaim_prefill reverses them later)
        member = tier == 1
        rank = l_first + tl.cumsum(member.to(tl.int32), 0) - 1
        page = tl.load(row + hp + rank // L_N, mask=member, other=0)
        base = page.to(tl.int64) * PAGE_BYTES
        slot = rank % L_N
        quantize_store(u8, f16, kx, base, slot, member, BL, D, L_KB, L_KG, L_KOFF, L_KMOFF)
        quantize_store(u8, f16, vx, base, slot, member, BL, D, L_VB, L_VG, L_VOFF, L_VMOFF)
        store_score_pos(f32, i32, base, slot, member, score, pos, L_SOFF, L_POFF)


@functools.cache
def bench_constexprs() -> dict[str, float | int]:
    """``_bench_draw``'s constants (``bench_mix``'s draw means and hash), as constexprs."""
    return {"HIGH_MEAN": bench_mix.HIGH_MEAN, "PRUNED_MEAN": bench_mix.PRUNED_MEAN,
            **hash_constexprs()}


@functools.lru_cache(maxsize=16)
def _tier_pair_constexprs(geometry: PageGeometry) -> dict[str, int]:
    """Both tiers' layout constexprs (H_ high, L_ low) of a geometry, built once (a frozen,
    hashable dataclass); callers unpack, never mutate, the shared dict."""
    return {**tier_constexprs(geometry.high, "H_"), **tier_constexprs(geometry.low, "L_")}


def compress_prefill(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    significance: torch.Tensor,
    lengths: torch.Tensor,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    window: int,
    score_queries: int,
    *,
    starts: torch.Tensor | None = None,
    totals: torch.Tensor | None = None,
    tier_out: torch.Tensor | None = None,
    block_counts: torch.Tensor | None = None,
    scores: bool = True,
    bench: tuple[torch.Tensor, torch.Tensor | bench_mix.Mix] | None = None,
) -> PromptClassification:
    """Classify, count and compact one layer's prompts into their row pages (two launches).

    key/value [B, Hkv, Lmax, D], or packed [T, Hkv, D] with ``starts`` (int64 [B], prompt
    b's first row) (fp16/bf16/fp32, contiguous last dim); significance [B, Hkv, Lmax] (from
    :func:`prefill_scores`); lengths, alpha_h, alpha_l [B]; table is the manager's
    [max_reqs, layers, Hkv, row_len] after ``allocate_prefill``. Returns the classification
    (its n_high / n_low feed ``PageManager.reclaim_prefill``).

    Outputs to write into instead of allocating (contiguous, on the device; a
    :class:`PrefillBuffers` holds a step's): ``totals`` int32 [B, Hkv, 2] (each head's
    (n_high, n_low)), ``tier_out`` int8 [B, Hkv, Lmax], ``block_counts`` int32
    [B, Hkv, prefill_blocks(Lmax), 2] (scratch). ``scores=False`` skips the
    classification's score and pos, which nothing on the serving path reads (the store
    kernel takes each token's score from the significance); they are then None.

    ``bench=(seed, mix)``: benchmark mode. The classifier draws ``layer``'s significance
    as ``bench_mix.synthetic_significance`` does, bit for bit (seed int64 [B]; mix the
    ``bench_mix.Mix``, or it as float64 [3] on the device to spare a copy per call), writes
    it into ``significance`` (which must then be contiguous fp32) and classifies it.
    """
    b, hkv, lmax = significance.shape
    d = key.shape[-1]
    if value.shape != key.shape or key.dim() != (3 if starts is not None else 4):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} must match "
                         "and be [B, Hkv, Lmax, D], or [T, Hkv, D] with starts")
    if key.shape[1] != hkv or (key.dim() == 4 and key.shape[::2] != (b, lmax)):
        raise ValueError(f"significance {tuple(significance.shape)} does not match key "
                         f"{tuple(key.shape)}")
    if d != geometry.head_dim or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"key/value need head_dim {geometry.head_dim} and a contiguous "
                         "last dimension")
    if req_idx.shape != (b,) or table.shape[2] != hkv:
        raise ValueError(f"req_idx must be [{b}] and table [max_reqs, layers, {hkv}, row_len], "
                         f"got {tuple(req_idx.shape)} and {tuple(table.shape)}")
    if starts is not None and starts.shape != (b,):
        raise ValueError(f"starts must be [{b}], got {tuple(starts.shape)}")
    dev = key.device
    nb = prefill_blocks(lmax)
    if totals is None:
        totals = torch.empty(b, hkv, 2, dtype=torch.int32, device=dev)
    else:
        _check_buffer("totals", totals, (b, hkv, 2), torch.int32, dev)
    if tier_out is None:
        tier_out = torch.empty(b, hkv, lmax, dtype=torch.int8, device=dev)
    else:
        _check_buffer("tier_out", tier_out, (b, hkv, lmax), torch.int8, dev)
    if block_counts is None:
        block_counts = torch.empty(b, hkv, nb, 2, dtype=torch.int32, device=dev)
    else:
        _check_buffer("block_counts", block_counts, (b, hkv, nb, 2), torch.int32, dev)
    score = pos = seed = mix = None
    if scores:
        score = torch.empty(b, hkv, lmax, dtype=torch.float32, device=dev)
        pos = torch.empty(b, lmax, dtype=torch.int32, device=dev)
    if bench is None:
        sig = _as(significance, torch.float32, dev)
    else:
        # the draw is written in place: a converted copy would leave the caller's stale
        _check_buffer("significance (overwritten by the bench draw)", significance,
                      (b, hkv, lmax), torch.float32, dev)
        sig = significance
        seed, mix = bench
        if seed.shape != (b,):
            raise ValueError(f"bench seed must be [{b}], got {list(seed.shape)}")
        seed = _as(seed, torch.int64, dev)
        if isinstance(mix, torch.Tensor):
            _check_buffer("bench mix", mix, (3,), torch.float64, dev)
        else:
            mix = torch.tensor(mix, dtype=torch.float64, device=dev)
    # (two launches and no torch op between them on the serving path: at short prompts the
    # host's launch overhead, not the GPU, bounds this function)
    key, k_rows, k_sh, k_sl = _token_rows(key, starts)
    value, v_rows, v_sh, v_sl = _token_rows(value, starts)
    lengths_i = _as(lengths, torch.int32, dev)
    _classify_kernel[(b, hkv, nb)](
        sig, lengths_i, _as(alpha_h, torch.float32, dev), _as(alpha_l, torch.float32, dev),
        tier_out, score, pos, block_counts, seed, mix, layer, lmax, nb,
        WINDOW=window, Q=score_queries, BL=PREFILL_BLOCK, SCORES=scores, BENCH=bench is not None,
        **bench_constexprs(), num_warps=2, enable_fp_fusion=False,
    )
    u8, f16, f32, i32 = page_views(pages)
    tab = table[:, layer]
    _store_prefill_kernel[(b, hkv, nb)](
        u8, f16, f32, i32, key, k_rows, k_sh, k_sl, value, v_rows, v_sh, v_sl, sig, tier_out,
        block_counts, totals, lengths_i, tab, tab.stride(0), tab.stride(1), req_idx, lmax, nb,
        PAGE_BYTES=geometry.page_bytes, D=d, Q=score_queries, BL=PREFILL_BLOCK,
        COUNT_TILE=COUNT_TILE, **_tier_pair_constexprs(geometry), num_warps=4,
        enable_fp_fusion=False,
    )
    return PromptClassification(tier=tier_out, score=score, pos=pos, n_high=totals[..., 0],
                                n_low=totals[..., 1])


def compress_prefill_reference(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    significance: torch.Tensor,
    lengths: torch.Tensor,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    window: int,
    score_queries: int,
) -> PromptClassification:
    """``classify_prompt`` then the placement of ``CompressedKVCache.store_prefill``."""
    cls = classify_prompt(significance, lengths, alpha_h, alpha_l, window, score_queries)
    rows = table[req_idx.long(), layer]
    hp = -(-cls.n_high.long() // geometry.high.tokens_per_page)
    for tier, layout in zip((Tier.HIGH, Tier.LOW), geometry.tiers, strict=True):
        member = cls.tier == tier
        rank = member.long().cumsum(-1) - 1
        page_index = rank // layout.tokens_per_page
        if tier == Tier.LOW:
            page_index = page_index + hp[..., None]
        page_ids = torch.gather(rows, -1, page_index.clamp(min=0))
        slots = rank % layout.tokens_per_page
        bi, hi, li = member.nonzero(as_tuple=True)
        write_tokens(pages, layout, page_ids[bi, hi, li], slots[bi, hi, li].int(),
                     key[bi, hi, li], value[bi, hi, li], cls.score[bi, hi, li],
                     cls.pos[bi, li])
    return cls
