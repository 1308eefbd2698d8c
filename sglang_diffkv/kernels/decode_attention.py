"""Split-K decode attention over the compressed paged cache, with score accumulation.

Two launches, shapes fixed by the plan (CUDA-graph capturable, no host synchronisation):

1. ``_partition_kernel``, grid (B, Hkv, MAXP_HI + MAXP_LO). Program (b, h, s) owns a run of
   ``pages_per_part`` pages of ONE tier (s < MAXP_HI: high pages from the left of the row,
   else low pages from the right), so unpacking is uniform (bit widths are constexprs). It
   handles the whole GQA group, so each page is read once. Keys are never dequantised
   element-wise: with codes c, per-group scale s and zero z,
   ``q . k = sum_groups s * (q . c) + z * sum(q)`` — exact fp32 dots on integer codes.
   Values are dequantised to fp16 for the P.V dot. Packed bytes are not unpacked into
   [T, D] tiles: sub-tensor j of a byte holds dims i*PER + j, so q and the output are read
   and written with stride PER instead (no reshapes in the hot loop).
   It writes the partition's running max m, sum l and unnormalised accumulator, plus, for
   every token, its fp16 probability relative to the running max of its iteration and
   that max (the score pass needs them once the global LSE is known).
2. ``_merge_kernel``, grid (B, Hkv, MAXP): every program computes the (b, h) LSE from the
   partitions' (m, l); program 0 also merges the outputs; program s adds, for its
   partition's tokens, max over the group of exp(logit - lse) into the page score. One
   program per (partition) touches each score once: no atomics, no cross-program race
   (DiffKV's reduce_kernel bug, reference §9 pitfall 2). With ``shared`` a shared prefix's
   scores are left alone; with ``hints`` (the fused argmin, ``sglang_diffkv.decode_hint``)
   each program also reduces its tokens' eligible (avg, slot) keys for the next step, from
   the scores it just stored, and atomically mins them into the row's record (one atomic
   per program: the min is order-independent, so the result is deterministic): inside the
   score loop (``hint_fill="loop"``) or in a second loop over the stored scores
   (``"pass"``, see ``_tier_scores``).

Everything runs in base 2 (exp2) internally; the returned LSE is natural-log.

``DecodeAttentionPlan.variant`` picks the split-K pass (``VARIANTS``): ``cuda``, the
tensor-core kernel of ``cuda/decode_attention.cu`` (``decode_split_cuda``; the default
wherever it can run), or this file's Triton pass with codes converted by Triton ops
(``base``) or by inline PTX, 4 bytes per call (``asm``). All three are checked by
``kernels.gpu_check`` and ``tests/kernels`` (GPU) and timed side by side by
``kernels.bench --variants``. The merge pass is shared; the CUDA pass keeps one running max
per warp, which the merge reads with ``MW``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_diffkv import decode_hint
from sglang_diffkv.attention import paged_decode_attention
from sglang_diffkv.kernels import decode_split_cuda as split_cuda
from sglang_diffkv.kernels._codes import unpack_codes_asm
from sglang_diffkv.kernels._keys import _none_key, _pack_key
from sglang_diffkv.kernels._tier import INTERPRET, page_views, row_pointers, tier_constexprs
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.pages import add_scores, token_locations

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _codes_f16(packed, J: tl.constexpr, BITS: tl.constexpr):
    """Bit sub-tensor J of packed uint8 codes as exact fp16, without int->float converts
    (quarter-rate on Hopper, the bottleneck here): 0x6400 | c is the fp16 1024 + c, and
    subtracting 1024 in fp16 is exact."""
    c = ((packed >> (J * BITS)) & ((1 << BITS) - 1)).to(tl.int16)
    return (c | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _fields(packed, BITS: tl.constexpr, ASM: tl.constexpr):
    """The 8 // BITS bit fields of packed codes as exact fp16 (a 4-tuple, unused entries
    repeat field 0): one inline-PTX call per 4 bytes with ASM, else ``_codes_f16`` per field."""
    if ASM:
        return unpack_codes_asm(packed, BITS)
    else:
        c0 = _codes_f16(packed, 0, BITS)
        c1 = c0
        c2 = c0
        c3 = c0
        if BITS < 8:
            c1 = _codes_f16(packed, 1, BITS)
        if BITS < 4:
            c2 = _codes_f16(packed, 2, BITS)
            c3 = _codes_f16(packed, 3, BITS)
        return c0, c1, c2, c3


@triton.jit
def _in_group(qj, sel, KG: tl.constexpr):
    if KG == 1:
        return qj
    else:
        return tl.where(sel, qj, 0.0)


@triton.jit
def _pv(acc, alpha, p16, v, vs, vz, PER_TOKEN: tl.constexpr):
    """acc * alpha + P . V for one field's fp16 codes ``v``. With one value group per token
    (PER_TOKEN) the scale is already folded into p16 and the zero summed apart, so V is the
    raw codes (exact in fp16)."""
    if not PER_TOKEN:
        v = (v.to(tl.float32) * vs + vz).to(tl.float16)
    return acc * alpha[:, None] + tl.dot(p16, v)


@triton.jit
def _tier_partition(
    q, q_sb, q_sh, u8, f16, row, n_tok, b, h, part,
    acc_ptr, ml_ptr, p_ptr, mit_ptr, slot_base, qk_scale, ppp,
    PAGE_BYTES: tl.constexpr, ROW_LEN, LOW: tl.constexpr,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PPI: tl.constexpr,
    ITERS_MAX, MAXP, RS: tl.constexpr,
    KB: tl.constexpr, VB: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
    N: tl.constexpr, BN: tl.constexpr, KOFF: tl.constexpr, KMOFF: tl.constexpr,
    VOFF: tl.constexpr, VMOFF: tl.constexpr, ASM: tl.constexpr,
):
    KPER: tl.constexpr = 8 // KB
    VPER: tl.constexpr = 8 // VB
    KDB: tl.constexpr = D // KPER  # packed key bytes per token
    VDB: tl.constexpr = D // VPER
    KGS: tl.constexpr = KDB // KG  # a key group's columns within one sub-tensor
    VGS: tl.constexpr = VDB // VG
    R: tl.constexpr = PPI * BN
    n_pages = tl.cdiv(n_tok, N)
    first = part * ppp
    last = tl.minimum(first + ppp, n_pages)
    n_iters = tl.cdiv(last - first, PPI)

    gi = tl.arange(0, BLOCK_G)
    gmask = gi < G
    kc = tl.arange(0, KDB)
    vc = tl.arange(0, VDB)
    r = tl.arange(0, R)
    pg = r // BN
    slot = r % BN
    srow = slot.to(tl.int64)

    # q split by bit sub-tensor (dims i*KPER + j), loaded once, fp16 for the code dots
    q_rows = (q + b * q_sb + (h * G + gi) * q_sh)[:, None] + kc[None, :] * KPER
    q0 = tl.load(q_rows, mask=gmask[:, None], other=0.0).to(tl.float16)
    q1 = q0
    q2 = q0
    q3 = q0
    if KPER > 1:
        q1 = tl.load(q_rows + 1, mask=gmask[:, None], other=0.0).to(tl.float16)
    if KPER > 2:
        q2 = tl.load(q_rows + 2, mask=gmask[:, None], other=0.0).to(tl.float16)
        q3 = tl.load(q_rows + 3, mask=gmask[:, None], other=0.0).to(tl.float16)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc0 = tl.zeros([BLOCK_G, VDB], tl.float32)
    acc1 = tl.zeros([BLOCK_G, VDB], tl.float32)
    acc2 = tl.zeros([BLOCK_G, VDB], tl.float32)
    acc3 = tl.zeros([BLOCK_G, VDB], tl.float32)
    zsum = tl.zeros([BLOCK_G], tl.float32)  # sum of p * zero (one value group per token)
    # sum(q) per key group, loop-invariant with one key group
    qsum_all = tl.sum(q0.to(tl.float32), axis=1)
    if KPER > 1:
        qsum_all += tl.sum(q1.to(tl.float32), axis=1)
    if KPER > 2:
        qsum_all += tl.sum(q2.to(tl.float32), axis=1) + tl.sum(q3.to(tl.float32), axis=1)
    buf = ((b * tl.num_programs(1) + h) * MAXP + slot_base + part).to(tl.int64)
    for it in range(0, n_iters):
        page_local = first + it * PPI + pg
        tok = page_local * N + slot
        valid = (slot < N) & (page_local < last) & (tok < n_tok)
        if LOW:
            col = ROW_LEN - 1 - page_local
        else:
            col = page_local
        page = tl.load(row + col, mask=valid, other=0)
        base = page.to(tl.int64) * PAGE_BYTES
        kbytes = tl.load(u8 + (base + KOFF + srow * KDB)[:, None] + kc[None, :],
                         mask=valid[:, None], other=0)
        vbytes = tl.load(u8 + (base + VOFF + srow * VDB)[:, None] + vc[None, :],
                         mask=valid[:, None], other=0)

        # ---- logits = sum over key groups of scale * (q . codes) + zero * sum(q) ----
        k0, k1, k2, k3 = _fields(kbytes, KB, ASM)
        logits = tl.zeros([BLOCK_G, R], tl.float32)
        for gg in tl.static_range(KG):
            sel = ((kc // KGS) == gg)[None, :]
            dots = tl.dot(_in_group(q0, sel, KG), tl.trans(k0))
            if KPER > 1:
                dots += tl.dot(_in_group(q1, sel, KG), tl.trans(k1))
            if KPER > 2:
                dots += tl.dot(_in_group(q2, sel, KG), tl.trans(k2))
                dots += tl.dot(_in_group(q3, sel, KG), tl.trans(k3))
            if KG == 1:
                qsum = qsum_all
            else:
                qsum = tl.sum(_in_group(q0, sel, KG).to(tl.float32), axis=1)
                if KPER > 1:
                    qsum += tl.sum(_in_group(q1, sel, KG).to(tl.float32), axis=1)
                if KPER > 2:
                    qsum += tl.sum(_in_group(q2, sel, KG).to(tl.float32), axis=1)
                    qsum += tl.sum(_in_group(q3, sel, KG).to(tl.float32), axis=1)
            kmeta = (base + KMOFF) // 2 + srow * (2 * KG) + gg * 2
            ks = tl.load(f16 + kmeta, mask=valid, other=0.0).to(tl.float32)
            kz = tl.load(f16 + kmeta + 1, mask=valid, other=0.0).to(tl.float32)
            logits += dots * ks[None, :] + qsum[:, None] * kz[None, :]
        logits = tl.where(valid[None, :], logits * qk_scale, float("-inf"))

        # ---- online softmax (base 2) ----
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
        p16 = p.to(tl.float16)
        tl.store(p_ptr + ((buf * ITERS_MAX + it) * G + gi[:, None]) * RS + r[None, :],
                 p16, mask=gmask[:, None] & valid[None, :])
        tl.store(mit_ptr + (buf * ITERS_MAX + it) * G + gi, m_new, mask=gmask)

        # ---- values: P.V per bit sub-tensor ----
        # one group per token: sum_n p s_n (c_n + z_n / s_n) = (p * s) . c + (p . z), so codes
        # go to the dot unscaled; grouped values are dequantised element-wise instead
        if VG == 1:
            vmeta = (base + VMOFF) // 2 + srow * 2
            vs = tl.load(f16 + vmeta, mask=valid, other=0.0).to(tl.float32)
            vz = tl.load(f16 + vmeta + 1, mask=valid, other=0.0).to(tl.float32)
            zsum = zsum * alpha + tl.sum(p * vz[None, :], axis=1)
            pv16 = (p * vs[None, :]).to(tl.float16)
        else:
            pv16 = p16
            vs = tl.zeros([R, VDB], tl.float32)
            vz = tl.zeros([R, VDB], tl.float32)
            for gg in tl.static_range(VG):
                vmeta = (base + VMOFF) // 2 + srow * (2 * VG) + gg * 2
                s_g = tl.load(f16 + vmeta, mask=valid, other=0.0).to(tl.float32)
                z_g = tl.load(f16 + vmeta + 1, mask=valid, other=0.0).to(tl.float32)
                in_group = ((vc // VGS) == gg)[None, :]
                vs = tl.where(in_group, s_g[:, None], vs)
                vz = tl.where(in_group, z_g[:, None], vz)
        v0, v1, v2, v3 = _fields(vbytes, VB, ASM)
        acc0 = _pv(acc0, alpha, pv16, v0, vs, vz, VG == 1)
        if VPER > 1:
            acc1 = _pv(acc1, alpha, pv16, v1, vs, vz, VG == 1)
        if VPER > 2:
            acc2 = _pv(acc2, alpha, pv16, v2, vs, vz, VG == 1)
            acc3 = _pv(acc3, alpha, pv16, v3, vs, vz, VG == 1)

    acc0 += zsum[:, None]
    acc1 += zsum[:, None]
    acc2 += zsum[:, None]
    acc3 += zsum[:, None]
    acc_rows = acc_ptr + (buf * BLOCK_G + gi[:, None]) * D + vc[None, :] * VPER
    tl.store(acc_rows, acc0, mask=gmask[:, None])
    if VPER > 1:
        tl.store(acc_rows + 1, acc1, mask=gmask[:, None])
    if VPER > 2:
        tl.store(acc_rows + 2, acc2, mask=gmask[:, None])
        tl.store(acc_rows + 3, acc3, mask=gmask[:, None])
    tl.store(ml_ptr + (buf * 2) * BLOCK_G + gi, m)
    tl.store(ml_ptr + (buf * 2 + 1) * BLOCK_G + gi, l_sum)


@triton.jit
def _partition_kernel(
    q, q_sb, q_sh, u8, f16, table, t_sr, t_sh, counts, c_sr, c_sh, req,
    acc_ptr, ml_ptr, p_ptr, mit_ptr, qk_scale, ppp_hi, ppp_lo,
    PAGE_BYTES: tl.constexpr, ROW_LEN, G: tl.constexpr,
    BLOCK_G: tl.constexpr, D: tl.constexpr, PPI: tl.constexpr, ITERS_MAX,
    MAXP_HI, MAXP, RS: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
    ASM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    row, cnt = row_pointers(table, t_sr, t_sh, counts, c_sr, c_sh, req, b, h)
    if s < MAXP_HI:
        n_hi = tl.load(cnt)
        if s * ppp_hi < tl.cdiv(n_hi, H_N):
            _tier_partition(q, q_sb, q_sh, u8, f16, row, n_hi, b, h, s, acc_ptr, ml_ptr,
                            p_ptr, mit_ptr, 0, qk_scale, ppp_hi, PAGE_BYTES, ROW_LEN, False,
                            G, BLOCK_G, D, PPI, ITERS_MAX, MAXP, RS, H_KB, H_VB, H_KG, H_VG, H_N,
                            H_BN, H_KOFF, H_KMOFF, H_VOFF, H_VMOFF, ASM)
    else:
        n_lo = tl.load(cnt + 1)
        if (s - MAXP_HI) * ppp_lo < tl.cdiv(n_lo, L_N):
            _tier_partition(q, q_sb, q_sh, u8, f16, row, n_lo, b, h, s - MAXP_HI, acc_ptr,
                            ml_ptr, p_ptr, mit_ptr, MAXP_HI, qk_scale, ppp_lo, PAGE_BYTES,
                            ROW_LEN, True, G, BLOCK_G, D, PPI, ITERS_MAX, MAXP, RS, L_KB, L_VB,
                            L_KG, L_VG, L_N, L_BN, L_KOFF, L_KMOFF, L_VOFF, L_VMOFF, ASM)


@triton.jit
def _age_f32(p_next, pos):
    """fp32 of max(p_next - pos, 1) as the scan computes it in int64, for every token with
    pos <= p_next - window (window >= 0, p_next an int32): the true age is then in
    [0, 2^32), so the uint32 difference is exact and converts to the same fp32 (no int64
    subtraction and no int64 -> fp32 convert, I2F.U64, per token). Tokens it does not hold
    for are not eligible; a record whose LIMIT is not P - window is never used."""
    age = (p_next - pos).to(tl.uint32, bitcast=True)
    return tl.maximum(age, tl.full([], 1, tl.uint32)).to(tl.float32)


@triton.jit
def _argmin_pass(f32, i32, row, lo, hi, p_next, pos_limit, PAGE_BYTES: tl.constexpr,
                 ROW_LEN, LOW: tl.constexpr, N: tl.constexpr, SOFF: tl.constexpr,
                 POFF: tl.constexpr, AT: tl.constexpr):
    """Per lane of an AT-token block, the least avg = score / max(p_next - pos, 1) (fp32,
    div_rn: the scan's) over the tier's tokens [lo, hi) with pos <= pos_limit, and its token
    (inf / INT32_MAX where none). A lane's tokens grow from one block to the next, so a
    strict < keeps the first of equal avgs; nothing crosses lanes until the caller's one
    reduction (no per-block reduction, no 64-bit keys in the loop)."""
    best_v = tl.full([AT], float("inf"), tl.float32)
    best_t = tl.full([AT], 0x7FFFFFFF, tl.int32)
    for start in range(lo, hi, AT):
        tok = start + tl.arange(0, AT)
        inside = tok < hi
        q = tok // N
        slot = tok - q * N
        if LOW:
            col = ROW_LEN - 1 - q
        else:
            col = q
        page = tl.load(row + col, mask=inside, other=0)
        off = page.to(tl.int64) * (PAGE_BYTES // 4) + slot
        score = tl.load(f32 + off + (SOFF // 4), mask=inside, other=0.0)
        pos = tl.load(i32 + off + (POFF // 4), mask=inside, other=0)
        avg = tl.math.div_rn(score, _age_f32(p_next, pos))
        better = inside & (pos <= pos_limit) & (avg < best_v)
        best_v = tl.where(better, avg, best_v)
        best_t = tl.where(better, tok, best_t)
    return best_v, best_t


@triton.jit
def _tier_scores(
    f32, i32, row, n_tok, buf, part, lse2, gmask, p_ptr, mit_ptr, ppp, skip, first_tok,
    p_next, pos_limit, hkey, req, hk, hs, h_sr, h_sh,
    PAGE_BYTES: tl.constexpr, ROW_LEN, LOW: tl.constexpr, G: tl.constexpr,
    MG: tl.constexpr, PPI: tl.constexpr, ITERS_MAX, RS: tl.constexpr,
    N: tl.constexpr, BN: tl.constexpr, SOFF: tl.constexpr, POFF: tl.constexpr,
    CH: tl.constexpr, MW: tl.constexpr, HINT: tl.constexpr, AT: tl.constexpr,
):
    """score += max over the group of p * exp2(m_iter - lse) for one partition's tokens,
    CH partition iterations per loop step (independent loads in flight, few steps). The
    split-K pass kept MW running maxima per iteration, one per BN / MW slots of a page.
    Slots before ``skip`` (a shared prefix) keep their scores. With HINT, also the fused
    argmin (``decode_hint``): the min packed key of avg = new score / (p_next - pos) over
    the partition's slots >= ``first_tok`` with pos <= ``pos_limit``, atomically min'ed into
    ``hkey`` (the policy's float ops: the same stored fp32 score, div_rn). HINT 1 ("loop")
    computes it inside the score loop, one int64 key reduction per tile; HINT 2 ("pass")
    in a second loop over the stored scores (``_argmin_pass``), which keeps the score
    loop's registers as without the argmin (ptxas: 72 a thread for both, against 106 for
    HINT 1, at the benchmark's shape; docs/backend.md)."""
    R: tl.constexpr = PPI * BN
    MR: tl.constexpr = CH * RS
    n_pages = tl.cdiv(n_tok, N)
    first = part * ppp
    last = tl.minimum(first + ppp, n_pages)
    n_iters = tl.cdiv(last - first, PPI)
    gi = tl.arange(0, MG)
    t = tl.arange(0, MR)
    best = _none_key()
    for c in range(0, tl.cdiv(n_iters, CH)):
        it = c * CH + t // RS
        rr = t % RS
        page_local = first + it * PPI + rr // BN
        slot = rr % BN
        tok = page_local * N + slot
        valid = (rr < R) & (slot < N) & (page_local < last) & (tok < n_tok) & (it < n_iters)
        if LOW:
            col = ROW_LEN - 1 - page_local
        else:
            col = page_local
        page = tl.load(row + col, mask=valid, other=0)
        rows = (buf * ITERS_MAX + it) * G
        ok = gmask[:, None] & valid[None, :]
        p16 = tl.load(p_ptr + (rows[None, :] + gi[:, None]) * RS + rr[None, :], mask=ok,
                      other=0.0)
        mrows = ((buf * ITERS_MAX + it) * MW + slot // (BN // MW)) * G
        mit = tl.load(mit_ptr + mrows[None, :] + gi[:, None], mask=ok, other=0.0)
        prob = p16.to(tl.float32) * tl.exp2(mit - lse2[:, None])
        prob = tl.max(tl.where(ok, prob, 0.0), axis=0)
        sptr = f32 + (page.to(tl.int64) * PAGE_BYTES + SOFF) // 4 + slot
        old = tl.load(sptr, mask=valid, other=0.0)
        new = old + prob
        tl.store(sptr, new, mask=valid & (tok >= skip))
        if HINT == 1:
            pos = tl.load(i32 + (page.to(tl.int64) * PAGE_BYTES + POFF) // 4 + slot,
                          mask=valid, other=0)
            age = p_next.to(tl.int64) - pos.to(tl.int64)
            avg = tl.math.div_rn(new, tl.maximum(age, 1).to(tl.float32))
            ok = valid & (tok >= first_tok) & (pos <= pos_limit) & (avg < float("inf"))
            best = tl.minimum(best, tl.min(tl.where(ok, _pack_key(avg, tok), _none_key()),
                                           axis=0))
    if HINT == 1:
        tl.atomic_min(hkey, best)
    if HINT == 2:
        # the argmin pass: this program's scores, as just stored (the barrier makes every
        # thread's stores visible to the others), read back in a loop of its own. The
        # record is read only now: nothing of it is live through the score loop.
        tl.debug_barrier()
        hrow = tl.load(req + tl.program_id(0)).to(tl.int64) * h_sr + tl.program_id(1) * h_sh
        stamp = hs + hrow * 2 + 4
        p_next = tl.load(stamp)
        first_tok = tl.load(stamp + 3 + LOW)
        pos_limit = tl.load(stamp + 5)
        hkey = hk + hrow + LOW
        lo = tl.maximum(first * N, first_tok)
        hi = tl.minimum(last * N, n_tok)
        best_v, best_t = _argmin_pass(f32, i32, row, lo, hi, p_next, pos_limit, PAGE_BYTES,
                                      ROW_LEN, LOW, N, SOFF, POFF, AT)
        m = tl.min(best_v, axis=0)
        # ties (equal fp32 avg, -0.0 == 0.0 as the packed key folds them): first slot
        idx = tl.min(tl.where(best_v == m, best_t, 0x7FFFFFFF), axis=0)
        tl.atomic_min(hkey, tl.where(m < float("inf"), _pack_key(m, idx), _none_key()))


@triton.jit
def _merge_kernel(
    f32, i32, table, t_sr, t_sh, counts, c_sr, c_sh, req,
    acc_ptr, ml_ptr, p_ptr, mit_ptr, out, o_sb, o_sh, lse_out, ppp_hi, ppp_lo,
    shared, s_sr, s_sh, hk, hs, h_sr, h_sh,
    PAGE_BYTES: tl.constexpr, ROW_LEN, G: tl.constexpr,
    BLOCK_G: tl.constexpr, D: tl.constexpr, PPI: tl.constexpr, ITERS_MAX,
    MAXP_HI, MAXP, RS: tl.constexpr, BLOCK_P: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
    CH: tl.constexpr, MW: tl.constexpr, MG: tl.constexpr, SHARED: tl.constexpr,
    HINT: tl.constexpr, AT: tl.constexpr = 128,
):
    # Tiles here are MG = next_pow2(G) heads (the split-K scratch rows are BLOCK_G apart:
    # the Triton pass pads the group to 16 MMA rows, which the merge need not carry).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    row, cnt = row_pointers(table, t_sr, t_sh, counts, c_sr, c_sh, req, b, h)
    n_hi = tl.load(cnt)
    n_lo = tl.load(cnt + 1)
    r = tl.load(req + b).to(tl.int64)
    if SHARED:
        # a shared prefix's scores stay as exported (cache.decode_layer_attend)
        skip_h = tl.load(shared + r * s_sr + h * s_sh) * H_N
        skip_l = tl.load(shared + r * s_sr + h * s_sh + 1) * L_N
    else:
        skip_h = 0
        skip_l = 0
    # the fused argmin's record (decode_hint), armed by this step's policy kernel: the
    # position, eligibility limit and shared bounds the next step's argmin is for
    hrow = r * h_sr + h * h_sh
    p_next = 0
    pos_limit = 0
    first_h = 0
    first_l = 0
    if HINT == 1:
        p_next = tl.load(hs + hrow * 2 + 4)
        first_h = tl.load(hs + hrow * 2 + 7)
        first_l = tl.load(hs + hrow * 2 + 8)
        pos_limit = tl.load(hs + hrow * 2 + 9)
    if HINT:
        if s == 0:
            # DONE := P after exactly one merge of an armed record with unchanged counts
            done = tl.load(hs + hrow * 2 + 10)
            same = ((done == -1) & (tl.load(hs + hrow * 2 + 5) == n_hi)
                    & (tl.load(hs + hrow * 2 + 6) == n_lo))
            tl.store(hs + hrow * 2 + 10, tl.where(same, tl.load(hs + hrow * 2 + 4), -2))
    parts_hi = tl.cdiv(tl.cdiv(n_hi, H_N), ppp_hi)
    parts_lo = tl.cdiv(tl.cdiv(n_lo, L_N), ppp_lo)
    head_buf = ((b * tl.num_programs(1) + h) * MAXP).to(tl.int64)

    gi = tl.arange(0, MG)
    gmask = gi < G
    pi = tl.arange(0, BLOCK_P)
    pvalid = (pi < parts_hi) | ((pi >= MAXP_HI) & (pi - MAXP_HI < parts_lo) & (pi < MAXP))
    ml = ml_ptr + ((head_buf + pi[:, None]) * 2) * BLOCK_G + gi[None, :]
    m = tl.load(ml, mask=pvalid[:, None], other=float("-inf"))
    l_part = tl.load(ml + BLOCK_G, mask=pvalid[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.sum(l_part * tl.exp2(m - m_safe[None, :]), axis=0)
    lse2 = m_safe + tl.log2(l_tot)  # -inf for an empty cache

    if s == 0:
        d = tl.arange(0, D)
        o = tl.zeros([MG, D], tl.float32)
        for k in range(0, parts_hi + parts_lo):
            p_idx = tl.where(k < parts_hi, k, MAXP_HI + k - parts_hi)
            mk = tl.load(ml_ptr + ((head_buf + p_idx) * 2) * BLOCK_G + gi)
            w = tl.exp2(mk - m_safe)
            a = tl.load(acc_ptr + ((head_buf + p_idx) * BLOCK_G + gi[:, None]) * D + d[None, :],
                        mask=gmask[:, None], other=0.0)
            o += a * w[:, None]
        o = o / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
        tl.store(out + b * o_sb + (h * G + gi[:, None]) * o_sh + d[None, :],
                 o.to(out.dtype.element_ty), mask=gmask[:, None])
        tl.store(lse_out + b * tl.num_programs(1) * G + h * G + gi, lse2 * 0.6931471805599453,
                 mask=gmask)

    if s < MAXP_HI:
        if s < parts_hi:
            _tier_scores(f32, i32, row, n_hi, head_buf + s, s, lse2, gmask, p_ptr, mit_ptr,
                         ppp_hi, skip_h, first_h, p_next, pos_limit, hk + hrow, req, hk, hs, h_sr,
                         h_sh, PAGE_BYTES,
                         ROW_LEN, False, G, MG, PPI, ITERS_MAX, RS, H_N, H_BN, H_SOFF, H_POFF,
                         CH, MW, HINT, AT)
    else:
        if s - MAXP_HI < parts_lo:
            _tier_scores(f32, i32, row, n_lo, head_buf + s, s - MAXP_HI, lse2, gmask, p_ptr,
                         mit_ptr, ppp_lo, skip_l, first_l, p_next, pos_limit, hk + hrow + 1,
                         req, hk, hs, h_sr, h_sh, PAGE_BYTES, ROW_LEN, True, G, MG, PPI,
                         ITERS_MAX, RS, L_N, L_BN, L_SOFF, L_POFF, CH, MW, HINT, AT)


# Split-K pass variants (the merge pass is shared):
#   base: Triton, codes converted per field with Triton ops (shift, mask, OR 0x6400, subtract)
#   asm:  Triton, 4 code bytes per inline-PTX call (prmt + lop3 + fma.f16x2, see _codes.py):
#         in the sm_90 SASS of the K8V4/K4V2 loop, 566 -> 514 instructions per thread per high
#         page and 986 -> 780 per low page
#   cuda: cuda/decode_attention.cu, tensor-core fragments loaded straight from the pages
#         (decode_split_cuda.py); K8V4 / K4V2 with one metadata group, head_dim 128 only
# "auto" (the default) picks cuda where it can run and asm elsewhere.
TRITON_ASM = {"base": False, "asm": True}
VARIANTS = (*TRITON_ASM, "cuda")


def variant_constexprs(variant: str) -> dict[str, bool]:
    """The ASM constexpr of a Triton variant. The Triton interpreter cannot run inline asm,
    so under TRITON_INTERPRET=1 the asm conversion falls back to the plain one (the asm
    itself is checked byte by byte against ``_codes.emulate`` on the CPU, and on the GPU)."""
    return {"ASM": TRITON_ASM.get(variant, True) and not INTERPRET}


def describe_split_pass(geometry: PageGeometry, group: int, device: torch.device) -> str:
    """Which split-K pass a default plan runs, and why not the CUDA one (for start-up logs;
    builds or loads the CUDA library, so the first decode step does not)."""
    why = split_cuda.unsupported_reason(geometry, group, 1, torch.device(device))
    if why is None:
        return "cuda (cuda/decode_attention.cu, tensor cores)"
    return f"asm (Triton; the CUDA pass cannot run: {why})"


def resolve_variant(variant: str, geometry: PageGeometry, group: int, pages_per_iter: int,
                    device: torch.device) -> str:
    """``variant`` itself, or for "auto" the fastest one this plan can run."""
    if variant == "auto":
        why = split_cuda.unsupported_reason(geometry, group, pages_per_iter, device)
        return "cuda" if why is None else "asm"
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; known: auto, {', '.join(VARIANTS)}")
    if variant == "cuda":
        why = split_cuda.unsupported_reason(geometry, group, pages_per_iter, device)
        if why is not None:
            raise ValueError(f"variant='cuda' cannot run this plan: {why}")
    return variant


# The merge pass's launch: 4 warps, score tiles of 2048 elements. On the H100 at the
# end-to-end shape (B 384 x 2k, 30/50/20) the merge takes 59 us against 85 at 4096 and 138 at
# 8192; neutral at B 32 x 16k (docs/benchmarks.md, session 5).
MERGE_WARPS = 4
MERGE_TILE = 2048


class ScratchArena:
    """One split-K scratch buffer for plans that never run at the same time (the decode
    CUDA graphs of different batch sizes: one replays at a time). It grows to the largest
    plan built on it; a plan keeps views of the buffer it was built on, so growing never
    invalidates an earlier plan (its old buffer stays alive through those views). Build
    the largest plan first (SGLang captures batch sizes largest first) to hold one buffer."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.buf = torch.empty(0, dtype=torch.uint8, device=self.device)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buf[:nbytes]


@dataclass
class DecodeAttentionPlan:
    """Static launch shape and scratch for one (geometry, heads, batch, max_context).

    ``batch`` and ``max_context`` are upper bounds: ``run`` takes any batch of at most
    ``batch`` requests (the grid follows q; scratch is indexed by the program's batch
    index, so a smaller batch uses a prefix of it), and every (request, layer, head) row it
    reads must hold at most ``max_context`` tokens per tier (n_high, n_low <= max_context;
    a decode row holds at most its sequence length in n_high + n_low). Nothing checks this
    on the device: a longer row is wrong, not an error (its pages past ``maxp * ppp`` have
    no program and the merge reads partitions nobody wrote), so callers size
    ``max_context`` from the batch's longest sequence. ``run`` checks shapes and launches
    two kernels without any host synchronisation (CUDA graphs can capture it). Defaults
    are the fastest of ``kernels.bench``'s sweeps on an H100 (docs/benchmarks.md):
    one page per iteration and 8 programs per SM for both passes; for the Triton pass 4
    warps, 2 software-pipeline stages and 96 registers per thread (5 programs resident per
    SM instead of 4); for the CUDA pass ``num_stages`` is the bulk-copy depth, 4 pages in
    flight per program (``decode_split_cuda.DEFAULT_STAGES``; 0 = register prefetch).
    """

    geometry: PageGeometry
    num_q_heads: int
    num_kv_heads: int
    batch: int
    max_context: int
    device: torch.device
    pages_per_iter: int
    ppp_hi: int
    ppp_lo: int
    maxp_hi: int
    maxp_lo: int
    iters_max: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # register cap per thread (more programs per SM)
    variant: str = "asm"  # one of VARIANTS: which split-K pass runs (resolved, never "auto")
    # where the split-K scratch comes from (None: the plan allocates its own)
    arena: ScratchArena | None = None
    # merge pass: warps per program and score elements (heads x slots) per tile
    merge_warps: int = MERGE_WARPS
    merge_tile: int = MERGE_TILE


    @classmethod
    def build(
        cls,
        geometry: PageGeometry,
        num_q_heads: int,
        num_kv_heads: int,
        batch: int,
        max_context: int,
        device: torch.device | str,
        *,
        pages_per_iter: int = 1,
        target_programs: int | None = None,
        num_warps: int = 4,
        num_stages: int | None = None,
        maxnreg: int | None = 96,
        variant: str = "auto",
        arena: ScratchArena | None = None,
        merge_warps: int = MERGE_WARPS,
        merge_tile: int = MERGE_TILE,
    ) -> DecodeAttentionPlan:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if pages_per_iter < 1 or pages_per_iter & (pages_per_iter - 1):
            raise ValueError(f"pages_per_iter={pages_per_iter} must be a power of two")
        device = torch.device(device)
        variant = resolve_variant(variant, geometry, num_q_heads // num_kv_heads,
                                  pages_per_iter, device)
        if num_stages is None:  # Triton's software pipelining / the CUDA pass's copy depth
            num_stages = split_cuda.DEFAULT_STAGES if variant == "cuda" else 2
        for t in geometry.tiers:
            tier_constexprs(t, "")  # raises on unsupported bit widths
        if target_programs is None:
            sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if device.type == "cuda" else 4)
            target_programs = 8 * sms
        # Split each tier's worst-case row into enough partitions that the batch fills the
        # GPU; a partition is a whole number of iterations.
        parts = max(1, math.ceil(target_programs / max(1, batch * num_kv_heads)))
        ppp, maxp = [], []
        for t in geometry.tiers:
            pages = max(1, math.ceil(max_context / t.tokens_per_page))
            per = math.ceil(math.ceil(pages / parts) / pages_per_iter) * pages_per_iter
            ppp.append(per)
            maxp.append(math.ceil(pages / per))
        iters_max = max(math.ceil(p / pages_per_iter) for p in ppp)
        return cls(geometry, num_q_heads, num_kv_heads, batch, max_context, device,
                   pages_per_iter, ppp[0], ppp[1], maxp[0], maxp[1], iters_max, num_warps,
                   num_stages, maxnreg, variant, arena, merge_warps, merge_tile)

    def __post_init__(self) -> None:
        g = self.num_q_heads // self.num_kv_heads
        self.group = g
        self.block_g = max(16, triton.next_power_of_2(g))
        maxp = self.maxp_hi + self.maxp_lo
        bn = max(triton.next_power_of_2(t.tokens_per_page) for t in self.geometry.tiers)
        self.row_stride = self.pages_per_iter * bn
        # running maxima per split-K iteration: one per warp in the CUDA pass
        self.mit_per_iter = split_cuda.WARPS if self.variant == "cuda" else 1
        need = self.scratch_layout()
        if self.arena is None:
            self.acc, self.ml, self.pbuf, self.mit = (
                torch.empty(n, dtype=dt, device=self.device) for n, dt, _ in need)
        else:
            buf = self.arena.take(self.arena_bytes())
            self.acc, self.ml, self.pbuf, self.mit = (
                buf[off:off + n * dt.itemsize].view(dt) for n, dt, off in need)
        # Launch constants, built once per plan instead of on every (per-layer) run: the tier
        # dicts, the variant's constexpr, the merge pass's tier subset and block sizes.
        geo = self.geometry
        hi, lo = tier_constexprs(geo.high, "H_"), tier_constexprs(geo.low, "L_")
        self._part_c: dict[str, int | bool] = {**hi, **lo, **variant_constexprs(self.variant)}
        # score tiles of ~merge_tile elements: MG heads x CH iterations x row_stride slots
        # (enough independent loads in flight that a partition takes a few steps, not dozens)
        mg = max(2, triton.next_power_of_2(g))
        self._merge_c: dict[str, int] = dict(
            BLOCK_P=triton.next_power_of_2(maxp), MG=mg,
            CH=max(1, self.merge_tile // (mg * self.row_stride)),
            H_N=hi["H_N"], H_BN=hi["H_BN"], H_SOFF=hi["H_SOFF"], H_POFF=hi["H_POFF"],
            L_N=lo["L_N"], L_BN=lo["L_BN"], L_SOFF=lo["L_SOFF"], L_POFF=lo["L_POFF"],
            MW=self.mit_per_iter,
        )
        self._cuda_args = (split_cuda.make_args(self, geo) if self.variant == "cuda"
                           else None)
        # ``common`` per table row length (ROW_LEN is the only call-dependent entry)
        self._common: dict[int, dict[str, int]] = {}

    def _common_constexprs(self, row_len: int) -> dict[str, int]:
        common = self._common.get(row_len)
        if common is None:
            # (ROW_LEN is a runtime argument: one compile serves every max_context)
            common = self._common[row_len] = dict(
                PAGE_BYTES=self.geometry.page_bytes, ROW_LEN=row_len, G=self.group,
                BLOCK_G=self.block_g, D=self.geometry.head_dim, PPI=self.pages_per_iter,
                ITERS_MAX=self.iters_max, MAXP_HI=self.maxp_hi,
                MAXP=self.maxp_hi + self.maxp_lo, RS=self.row_stride)
        return common

    def scratch_layout(self) -> list[tuple[int, torch.dtype, int]]:
        """(elements, dtype, byte offset in an arena) of acc, ml, pbuf and mit; offsets
        are 256-byte aligned."""
        heads = self.batch * self.num_kv_heads
        rows = heads * (self.maxp_hi + self.maxp_lo)
        g, bg, d = self.group, self.block_g, self.geometry.head_dim
        sizes = ((rows * bg * d, torch.float32), (rows * 2 * bg, torch.float32),
                 (rows * self.iters_max * g * self.row_stride, torch.float16),
                 (rows * self.iters_max * self.mit_per_iter * g, torch.float32))
        out, off = [], 0
        for n, dt in sizes:
            out.append((n, dt, off))
            off += -(-n * dt.itemsize // 256) * 256
        return out

    def arena_bytes(self) -> int:
        """Bytes an arena needs to hold this plan's scratch."""
        n, dt, off = self.scratch_layout()[-1]
        return off + n * dt.itemsize

    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.acc, self.ml, self.pbuf, self.mit))

    def run(
        self,
        q: torch.Tensor,
        pages: torch.Tensor,
        table: torch.Tensor,
        counts: torch.Tensor,
        req_idx: torch.Tensor,
        layer: int,
        sm_scale: float,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        stages: str = "partition,merge",
        views: tuple[torch.Tensor, ...] | None = None,
        shared: torch.Tensor | None = None,
        hints: torch.Tensor | None = None,
        hint_fill: str = "loop",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [B, Hq, D] over layer ``layer`` of the requests in ``req_idx``;
        adds each token's max-over-group probability to its page score. Returns (out in
        q's dtype unless ``out`` is given, natural-log lse fp32 [B, Hq]). ``views``:
        ``page_views(pages)`` computed once per step by the caller (saves three tensor views
        per layer); None computes them here. ``shared``: ``PageManager.shared``; a shared
        prefix's scores are left as they are (``CompressedKVCache.decode_layer_attend``).
        ``hints``: the fused argmin's records (``decode_hint``), which this layer's policy
        step armed: the merge pass also leaves each row's eligible argmin for the next
        step's policy step there. ``hint_fill``: how the merge pass computes it
        (``HINT_FILLS``: "loop" inside the score loop, "pass" in a loop of its own after
        it); both leave the same keys."""
        geo = self.geometry
        hq, d = self.num_q_heads, geo.head_dim
        b = q.shape[0] if q.dim() == 3 else -1
        # Scratch offsets are (b * num_programs(1) + h) * MAXP + ...: num_programs(1) is the
        # KV head count, never the plan's batch, so any b <= batch stays inside the buffers.
        if q.dim() != 3 or q.shape[1:] != (hq, d) or b > self.batch:
            raise ValueError(f"q must be [B, {hq}, {d}] with B <= {self.batch} (the plan's "
                             f"batch), got {tuple(q.shape)}")
        if q.stride(-1) != 1:
            raise ValueError("q's last dimension must be contiguous")
        if table.dim() != 4 or table.shape[2] != self.num_kv_heads or table.stride(-1) != 1:
            raise ValueError(f"table must be int32 [max_reqs, layers, {self.num_kv_heads}, "
                             f"row_len] with contiguous rows, got {tuple(table.shape)}")
        if counts.shape[:3] != table.shape[:3] or counts.shape[3] != 4:
            raise ValueError(f"counts must be [{', '.join(map(str, table.shape[:3]))}, 4]")
        if table.dtype != torch.int32 or counts.dtype != torch.int32:
            raise ValueError("table and counts must be int32")
        if req_idx.shape != (b,):
            raise ValueError(f"req_idx must be [{b}]")
        if pages.shape[1] != geo.page_bytes:
            raise ValueError(f"pages must be [num_pages, {geo.page_bytes}]")
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
        if b == 0:  # a grid dimension of 0 is not launchable; nothing to attend
            return out, lse
        u8, f16, f32, _ = page_views(pages) if views is None else views
        tab = table[:, layer]
        cnt = counts[:, layer]
        common = self._common_constexprs(table.shape[-1])
        grid = (b, self.num_kv_heads, common["MAXP"])
        if "partition" in stages:  # (``stages`` lets the benchmark time each launch alone)
            self._partition(grid, q, u8, f16, tab, cnt, req_idx, sm_scale, common)
        if "merge" in stages:
            i32 = pages.view(torch.int32) if views is None else views[3]
            self._merge(grid, f32, i32, tab, cnt, req_idx, out, lse, common,
                        _row_args(shared, table, layer, 2, torch.int32, "shared"),
                        _hint_args(hints, table, layer), hint_mode(hint_fill))
        return out, lse

    def _partition(self, grid, q, u8, f16, tab, cnt, req_idx, sm_scale, common):
        if self._cuda_args is not None:
            split_cuda.launch(self._cuda_args, q, u8, tab, cnt, req_idx, sm_scale * LOG2E,
                              self.num_kv_heads)
            return
        _partition_kernel[grid](
            q, q.stride(0), q.stride(1), u8, f16, tab, tab.stride(0), tab.stride(1),
            cnt, cnt.stride(0), cnt.stride(1), req_idx, self.acc, self.ml, self.pbuf,
            self.mit, sm_scale * LOG2E, self.ppp_hi, self.ppp_lo, **common, **self._part_c,
            num_warps=self.num_warps, num_stages=self.num_stages,
            **({"maxnreg": self.maxnreg} if self.maxnreg and q.is_cuda else {}),
        )

    def _merge(self, grid, f32, i32, tab, cnt, req_idx, out, lse, common, shared, hints,
               mode):
        sh, s_sr, s_sh = shared
        hk, hs, h_sr, h_sh = hints
        _merge_kernel[grid](
            f32, i32, tab, tab.stride(0), tab.stride(1), cnt, cnt.stride(0), cnt.stride(1),
            req_idx, self.acc, self.ml, self.pbuf, self.mit, out, out.stride(0),
            out.stride(1), lse, self.ppp_hi, self.ppp_lo, sh, s_sr or 0, s_sh or 0, hk, hs,
            h_sr or 0, h_sh or 0, **common, **self._merge_c, SHARED=s_sr is not None,
            HINT=mode if h_sr is not None else 0, num_warps=self.merge_warps,
        )


# How the merge pass fills the fused argmin's records (its HINT constexpr): "loop" in the
# score loop (the first design), "pass" in a second loop over the stored scores.
HINT_FILLS = {"loop": 1, "pass": 2}


def hint_mode(fill: str) -> int:
    """The merge kernel's HINT for a fill name (``HINT_FILLS``)."""
    try:
        return HINT_FILLS[fill]
    except KeyError:
        raise ValueError(f"hint_fill={fill!r}; known: {', '.join(HINT_FILLS)}") from None


def _row_args(x: torch.Tensor | None, table: torch.Tensor, layer: int, width: int,
              dtype: torch.dtype, name: str):
    """(layer view, row strides) of a [max_reqs, layers, Hkv, width] per-row tensor, or
    (the table's layer view, None, None) when absent (the kernel never reads it)."""
    if x is None:
        return table[:, layer], None, None
    if x.shape != (*table.shape[:3], width) or x.dtype != dtype or x.stride(-1) != 1:
        raise ValueError(f"{name} must be {dtype} [{', '.join(map(str, table.shape[:3]))}, "
                         f"{width}], got {x.dtype} {tuple(x.shape)}")
    v = x[:, layer]
    return v, v.stride(0), v.stride(1)


def _hint_args(hints: torch.Tensor | None, table: torch.Tensor, layer: int):
    """(int64 layer view, int32 layer view, row strides in int64 words) of the fused
    argmin's records, or placeholders with None strides (HINT=False)."""
    hk, h_sr, h_sh = _row_args(hints, table, layer, decode_hint.HINT_WORDS, torch.int64,
                               "hints")
    if hints is None:
        return hk, hk, None, None
    if not hints.is_contiguous():
        raise ValueError("hints must be contiguous (decode_hint.allocate)")
    return hk, hints.view(torch.int32)[:, layer], h_sr, h_sh


def decode_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
    *,
    max_context: int | None = None,
    plan: DecodeAttentionPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot convenience: builds a plan (from ``max_context``, default: what the table
    row can address) unless one is given, then runs it."""
    if plan is None:
        if max_context is None:
            max_context = (table.shape[-1] - 2) * geometry.min_tokens_per_page
        plan = DecodeAttentionPlan.build(geometry, q.shape[1], table.shape[2], q.shape[0],
                                         max_context, q.device)
    return plan.run(q, pages, table, counts, req_idx, layer, sm_scale)


def decode_attention_reference(
    q: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch oracle with the same effect: ``paged_decode_attention`` then ``add_scores``
    (as ``CompressedKVCache.decode_layer_attend``)."""
    res = paged_decode_attention(q, pages, geometry, table, counts, req_idx, layer, sm_scale)
    rows = table[req_idx.long(), layer]
    cnt = counts[req_idx.long(), layer].long()
    for t, prob in enumerate((res.prob_high, res.prob_low)):
        layout = geometry.tiers[t]
        loc = token_locations(rows, cnt[..., t], layout.tokens_per_page, low=t == 1,
                              capacity=prob.shape[-1])
        mk = loc.mask
        add_scores(pages, layout, loc.page_ids[mk], loc.slots[mk], prob[mk])
    return res.out.to(q.dtype), res.lse
