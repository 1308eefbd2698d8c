"""Prompt significance from the log-sum-exp, and prompt compression (count + compact + store).

Scoring (``prefill_scores``): token i's significance is, per query head, the softmax mass it
gets from the last Q = min(score_queries, L) queries, maxed over the GQA group (DESIGN §2).
Given those queries' natural-log LSE (from the prefill attention, or from ``_lse_kernel``,
a flash-style pass over K that keeps only the running max and sum), ``_colsum_kernel``
recomputes exp(q.k * scale - lse) tile by tile and column-sums it: nothing [Q, L]-sized ever
reaches HBM and any prompt length works.

Compression (``compress_prefill``): ``_classify_kernel`` decides every token's tier and
counts each block's members; an exclusive prefix sum over blocks (``_scan_kernel``)
gives each block its first rank; ``_store_prefill_kernel`` ranks members inside the block
with a cumsum (a stable compaction: no sort) and quantises them into row pages exactly
where ``CompressedKVCache.store_prefill`` puts them (high pages [0, hp), low pages right
after), ready for ``PageManager.reclaim_prefill``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_diffkv.kernels._quant import quantize_store, store_score_pos
from sglang_diffkv.kernels._tier import INTERPRET, page_views, tier_constexprs
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


@triton.jit
def _qk(qt, kt, DOT_F32: tl.constexpr):
    # bf16 products are exact in fp32 either way; the interpreter's bf16 dot is broken
    # (triton 3.9), so it computes in fp32 with IEEE precision.
    if DOT_F32:
        return tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(qt, tl.trans(kt))


@triton.jit
def _lse_kernel(
    q, q_start, q_sh, q_sl, k, k_start, k_sh, k_sl, lengths, lse, qk_scale,
    G: tl.constexpr, Q: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """lse[b, hq, r] (base 2) of query L - nq + r over its causal keys, r < nq."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    n = tl.load(lengths + b)
    nq = tl.minimum(n, Q)
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
        ok = (kpos[None, :] <= qpos[:, None]) & rmask[:, None]
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
    lse_mul, sig, Lmax, qk_scale,
    G: tl.constexpr, Q: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
    LSE_PACKED: tl.constexpr, DOT_F32: tl.constexpr,
):
    """sig[b, h, i] = max over the group of sum_r exp2(s[r, i] - lse[r]) for one key tile.
    lse row r of prompt b: b * lse_sb + r * lse_sr (per prompt), or, LSE_PACKED (one row per
    packed query token, as a varlen attention returns it), (q_start[b] + L - nq + r) * lse_sr."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.program_id(2) * BK
    n = tl.load(lengths + b)
    kpos = start + tl.arange(0, BK)
    best = tl.zeros([BK], tl.float32)
    if start < n:
        nq = tl.minimum(n, Q)
        r = tl.arange(0, QB)
        qpos = n - nq + r
        rmask = r < nq
        d = tl.arange(0, D)
        kt = tl.load(k + (tl.load(k_start + b) + kpos[:, None]) * k_sl + h * k_sh + d[None, :],
                     mask=(kpos < n)[:, None], other=0.0)
        ok = (kpos[None, :] <= qpos[:, None]) & rmask[:, None]
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
                  starts: torch.Tensor | None, max_len: int | None) -> tuple[int, int]:
    """(B, Lmax) of padded [B, H, Lmax, D] or packed [T, H, D] prompts (then ``starts``
    [B] int64 and the host's ``max_len`` are needed: reading them off the device would
    synchronise)."""
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
        same = k.shape[0] == q.shape[0]
    else:
        b, lmax = q.shape[0], q.shape[2]
        same = k.shape[0] == b and k.shape[2] == lmax
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    if not same or k.shape[-1] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match "
                         "(same prompts, same D; Hq a multiple of Hkv)")
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q and k must both be fp16 or bf16, got {q.dtype} / {k.dtype}")
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
) -> torch.Tensor:
    """Significance sums [B, Hkv, Lmax] fp32 (maxed over the group; 0 past a prompt's end).

    q [B, Hq, Lmax, D], k [B, Hkv, Lmax, D] (any strides with a contiguous last dim), or
    packed q [T, Hq, D], k [T, Hkv, D] with ``starts`` (int64 [B], prompt b's first row)
    and ``max_len`` (Lmax). ``lse``: optional natural-log LSE of each prompt's last
    min(score_queries, L) queries, as the prefill attention returns it: [B, Hq,
    score_queries] (row r is query L - nq + r), or for packed prompts [T, Hq] (every
    query's row, any strides); computed here when absent. ``out``: fp32 [B, Hkv, Lmax] to
    write into.
    """
    b, lmax = _check_prompt(q, k, lengths, starts, max_len)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    q, q_rows, q_sh, q_sl = _token_rows(q, starts)
    k, k_rows, k_sh, k_sl = _token_rows(k, starts)
    qb = max(16, triton.next_power_of_2(score_queries))
    lengths = lengths.to(device=q.device, dtype=torch.int32)
    packed_lse = lse is not None and lse.dim() == 2
    if lse is None:
        lse = torch.empty(b, hq, qb, dtype=torch.float32, device=q.device)
        _lse_kernel[(b, hq)](
            q, q_rows, q_sh, q_sl, k, k_rows, k_sh, k_sl, lengths, lse, sm_scale * LOG2E,
            G=hq // hkv, Q=score_queries, QB=qb, D=d, BK=64, DOT_F32=INTERPRET, num_warps=4,
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
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    bk = 64
    _colsum_kernel[(b, hkv, triton.cdiv(lmax, bk))](
        q, q_rows, q_sh, q_sl, k, k_rows, k_sh, k_sl, lengths, lse, lse_sb, lse_sh, lse_sr,
        lse_mul, out, lmax, sm_scale * LOG2E,
        G=hq // hkv, Q=score_queries, QB=qb, D=d, BK=bk, LSE_PACKED=packed_lse,
        DOT_F32=INTERPRET, num_warps=4,
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


@triton.jit(do_not_specialize=("Lmax", "NB"))
def _classify_kernel(
    sig, lengths, alpha_h, alpha_l, tier_out, score_out, pos_out, block_counts, Lmax, NB,
    WINDOW: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(lengths + b)
    i = blk * BL + tl.arange(0, BL)
    inside = i < Lmax
    s = tl.load(sig + (b * tl.num_programs(1) + h) * Lmax + i, mask=inside, other=0.0)
    count = tl.maximum(tl.minimum(n - i, Q), 1).to(tl.float32)
    mean = tl.math.div_rn(s, count)
    th = _threshold(tl.load(alpha_h + b), n)
    tlow = _threshold(tl.load(alpha_l + b), n)
    valid = i < n
    tl.store(score_out + (b * tl.num_programs(1) + h) * Lmax + i, tl.where(valid, s, 0.0),
             mask=inside)
    if h == 0:  # policy.virtual_positions: L - clamp(L - i, 0, Q)
        tl.store(pos_out + b * Lmax + i, n - tl.minimum(tl.maximum(n - i, 0), Q), mask=inside)
    high = ((mean >= th) | (i >= n - WINDOW)) & valid
    low = (mean >= tlow) & ~high & valid
    tier = tl.where(high, 0, tl.where(low, 1, 2)).to(tl.int8)
    tl.store(tier_out + (b * tl.num_programs(1) + h) * Lmax + i, tier, mask=inside)
    cbase = block_counts + ((b * tl.num_programs(1) + h) * NB + blk) * 2
    tl.store(cbase, tl.sum(high.to(tl.int32), axis=0))
    tl.store(cbase + 1, tl.sum(low.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=("NB",))
def _scan_kernel(block_counts, first_rank, totals, NB, BLOCK_NB: tl.constexpr):
    """Exclusive prefix sum of one head's per-block (high, low) member counts, BLOCK_NB
    blocks at a time (a fixed tile: one compiled variant for every prompt length)."""
    head = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    for t in tl.static_range(2):
        carry = tl.zeros([], tl.int32)
        for s in range(0, NB, BLOCK_NB):
            j = s + tl.arange(0, BLOCK_NB)
            base = (head * NB + j) * 2
            c = tl.load(block_counts + base + t, mask=j < NB, other=0)
            inc = tl.cumsum(c, 0)
            tl.store(first_rank + base + t, carry + inc - c, mask=j < NB)
            carry += tl.sum(c, 0)
        tl.store(totals + head * 2 + t, carry)


@triton.jit(do_not_specialize=("Lmax", "NB"))
def _store_prefill_kernel(
    u8, f16, f32, i32, key, k_start, k_sh, k_sl, value, v_start, v_sh, v_sl,
    sig, tier_in, first_rank, n_high, lengths, table, t_sr, t_sh, req, Lmax, NB,
    PAGE_BYTES: tl.constexpr, D: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(lengths + b)
    if blk * BL < n:
        head = b * tl.num_programs(1) + h
        i = blk * BL + tl.arange(0, BL)
        inside = i < n
        tier = tl.load(tier_in + head * Lmax + i, mask=inside, other=2)
        row = table + tl.load(req + b).to(tl.int64) * t_sr + h * t_sh
        hp = tl.cdiv(tl.load(n_high + head * 2), H_N)  # n_high: the totals [B, Hkv, 2]
        d = tl.arange(0, D)
        kx = tl.load(key + (tl.load(k_start + b) + i[:, None]) * k_sl + h * k_sh + d[None, :],
                     mask=inside[:, None], other=0.0).to(tl.float32)
        vx = tl.load(value + (tl.load(v_start + b) + i[:, None]) * v_sl + h * v_sh + d[None, :],
                     mask=inside[:, None], other=0.0).to(tl.float32)
        score = tl.load(sig + head * Lmax + i, mask=inside, other=0.0)
        pos = n - tl.minimum(Q, n - i)  # virtual position (policy.virtual_positions)
        # high tier: rank -> page rank // N_hi at row position rank // N_hi
        member = tier == 0
        rank = tl.load(first_rank + (head * NB + blk) * 2) + tl.cumsum(member.to(tl.int32), 0) - 1
        page = tl.load(row + rank // H_N, mask=member, other=0)
        base = page.to(tl.int64) * PAGE_BYTES
        slot = rank % H_N
        quantize_store(u8, f16, kx, base, slot, member, BL, D, H_KB, H_KG, H_KOFF, H_KMOFF)
        quantize_store(u8, f16, vx, base, slot, member, BL, D, H_VB, H_VG, H_VOFF, H_VMOFF)
        store_score_pos(f32, i32, base, slot, member, score, pos, H_SOFF, H_POFF)
        # low tier: the pages right after the high ones (reclaim_prefill reverses them later)
        member = tier == 1
        rank = (tl.load(first_rank + (head * NB + blk) * 2 + 1)
                + tl.cumsum(member.to(tl.int32), 0) - 1)
        page = tl.load(row + hp + rank // L_N, mask=member, other=0)
        base = page.to(tl.int64) * PAGE_BYTES
        slot = rank % L_N
        quantize_store(u8, f16, kx, base, slot, member, BL, D, L_KB, L_KG, L_KOFF, L_KMOFF)
        quantize_store(u8, f16, vx, base, slot, member, BL, D, L_VB, L_VG, L_VOFF, L_VMOFF)
        store_score_pos(f32, i32, base, slot, member, score, pos, L_SOFF, L_POFF)


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
) -> PromptClassification:
    """Classify, count and compact one layer's prompts into their row pages.

    key/value [B, Hkv, Lmax, D], or packed [T, Hkv, D] with ``starts`` (int64 [B], prompt
    b's first row) (fp16/bf16/fp32, contiguous last dim); significance [B, Hkv, Lmax] (from
    :func:`prefill_scores`); lengths, alpha_h, alpha_l [B]; table is the manager's
    [max_reqs, layers, Hkv, row_len] after ``allocate_prefill``. ``totals``: int32
    [B, Hkv, 2] to write each head's (n_high, n_low) into. Returns the classification (its
    n_high / n_low feed ``PageManager.reclaim_prefill``)."""
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
    # (three launches and no torch ops in between: at short prompts the host's launch
    # overhead, not the GPU, bounds this function)
    key, k_rows, k_sh, k_sl = _token_rows(key, starts)
    value, v_rows, v_sh, v_sl = _token_rows(value, starts)
    lengths_i = lengths.to(device=dev, dtype=torch.int32)
    bl = 64
    nb = triton.cdiv(lmax, bl)
    tier = torch.empty(b, hkv, lmax, dtype=torch.int8, device=dev)
    score = torch.empty(b, hkv, lmax, dtype=torch.float32, device=dev)
    pos = torch.empty(b, lmax, dtype=torch.int32, device=dev)
    block_counts = torch.empty(b, hkv, nb, 2, dtype=torch.int32, device=dev)
    first_rank = torch.empty_like(block_counts)
    if totals is None:
        totals = torch.empty(b, hkv, 2, dtype=torch.int32, device=dev)
    elif totals.shape != (b, hkv, 2) or totals.dtype != torch.int32 or not totals.is_contiguous():
        raise ValueError(f"totals must be contiguous int32 [{b}, {hkv}, 2], got "
                         f"{totals.dtype} {tuple(totals.shape)}")
    sig = significance if significance.dtype == torch.float32 else significance.float()
    sig = sig.contiguous()
    _classify_kernel[(b, hkv, nb)](
        sig, lengths_i, alpha_h.to(device=dev, dtype=torch.float32).contiguous(),
        alpha_l.to(device=dev, dtype=torch.float32).contiguous(), tier, score, pos,
        block_counts, lmax, nb, WINDOW=window, Q=score_queries, BL=bl, num_warps=2,
    )
    _scan_kernel[(b, hkv)](block_counts, first_rank, totals, nb, BLOCK_NB=128, num_warps=1)
    n_high = totals[..., 0]
    u8, f16, f32, i32 = page_views(pages)
    tab = table[:, layer]
    _store_prefill_kernel[(b, hkv, nb)](
        u8, f16, f32, i32, key, k_rows, k_sh, k_sl, value, v_rows, v_sh, v_sl, sig, tier,
        first_rank, totals, lengths_i, tab, tab.stride(0), tab.stride(1), req_idx, lmax, nb,
        PAGE_BYTES=geometry.page_bytes, D=d, Q=score_queries, BL=bl,
        **tier_constexprs(geometry.high, "H_"), **tier_constexprs(geometry.low, "L_"),
        num_warps=4, enable_fp_fusion=False,
    )
    return PromptClassification(tier=tier, score=score, pos=pos, n_high=n_high,
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
