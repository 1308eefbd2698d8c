"""The decode policy step (DESIGN §2) for one layer, one program per (request, KV head).

Each program scans its head's (score, pos) pairs of both tiers through the page table
(8 bytes per cached token; K/V are not touched), takes the eligible argmin of
avg = score / (p - pos) per tier, decides the action exactly as ``policy.decode_step``,
then performs it: the demoted token is dequantised from its high copy and re-quantised into
the low tier, the new token is quantised into its high slot, and the token counters
advance. Same effect, byte for byte, as ``CompressedKVCache.decode_layer_store``.
Preconditions as there: ``ensure_decode_room`` ran for this step.

The eligible argmin runs one of two ways (``argmin=``). "scan" (default): each policy
program walks its row's tokens serially, BT at a time. "parallel": a first kernel,
``_argmin_kernel``, splits every row over ``S`` programs (grid (B, Hkv, S)); each reduces
its blocks of tokens to one packed int64 key per tier (see :func:`_pack_key`) and stores it
in a [B, Hkv, S, 2] buffer; the policy kernel then takes the min over the S partial keys.
Every argmin program writes its two keys unconditionally, so the buffer needs no
initialisation (no fill launch, no atomics, no state carried between calls) and the result
is deterministic. Both give the same (min avg, first slot) bit for bit. Scan stays the
default: on the H100 (B 32-305 x context 1k-4k, 30/50/20, graph-replayed) parallel was
0.8-1.3x the scan's time (B305 x 1k: 43 vs 36 us; x 4k: 74 vs 78 us) and costs one more
launch, which counts in the eager decode path (docs/benchmarks.md).

Fused argmin (``hints=``, ``sglang_diffkv.decode_hint``): the previous step's decode merge
pass, which already reads and writes every token's score, leaves each row's eligible argmin
for this step in a per-row record with a validity stamp; the policy kernel reads it instead
of scanning where the stamp matches the row (else it scans) and re-arms the record for the
next step. Same decisions as the scan, bit for bit.

Shared prefixes (``shared=``, ``PageManager.shared``): a tier's first shared pages' tokens
are never victims (``policy.decode_step``'s ``shared_tokens``), in all three argmins.

Benchmark mode (``BENCH``, a constexpr: the normal kernel carries none of it) replaces the
thresholds' verdict by the action ``bench_mix.forced_actions`` draws; the hash is the same
32-bit arithmetic in int64 with explicit masks, so the bits match torch's exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_diffkv import bench_mix, decode_hint
from sglang_diffkv.cache import apply_decode_step
from sglang_diffkv.kernels._keys import _none_key, _pack_key, _unpack_key
from sglang_diffkv.kernels._quant import load_dequant, quantize_store, store_score_pos
from sglang_diffkv.kernels._tier import page_views, row_pointers, tier_constexprs
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.policy import DecodeDecision


@triton.jit
def _eligible_argmin(f32, i32, row, n_tok, p, first, WINDOW: tl.constexpr,
                     ROW_LEN: tl.constexpr, LOW: tl.constexpr, PAGE_BYTES: tl.constexpr,
                     N: tl.constexpr, SOFF: tl.constexpr, POFF: tl.constexpr,
                     BT: tl.constexpr):
    """(min avg, its slot) over eligible tokens of slots [first, n_tok); (inf, -1) if none.
    Ties: first slot. The walk starts at first's block (a shared prefix is never read)."""
    best = tl.full([], float("inf"), tl.float32)
    best_i = tl.full([], -1, tl.int32)
    for start in range((first // BT) * BT, n_tok, BT):
        tok = start + tl.arange(0, BT)
        inside = (tok < n_tok) & (tok >= first)
        if LOW:
            col = ROW_LEN - 1 - tok // N
        else:
            col = tok // N
        page = tl.load(row + col, mask=inside, other=0).to(tl.int64)
        slot = tok % N
        score = tl.load(f32 + (page * PAGE_BYTES + SOFF) // 4 + slot, mask=inside, other=0.0)
        pos = tl.load(i32 + (page * PAGE_BYTES + POFF) // 4 + slot, mask=inside, other=0)
        age = p - pos.to(tl.int64)
        ok = inside & (age >= WINDOW)
        avg = tl.where(ok, tl.math.div_rn(score, tl.maximum(age, 1).to(tl.float32)),
                       float("inf"))
        bmin = tl.min(avg, axis=0)
        bidx = tl.argmin(avg, axis=0)
        better = bmin < best
        best_i = tl.where(better, start + bidx, best_i)
        best = tl.where(better, bmin, best)
    return best, best_i


@triton.jit
def _shared_first(shared, s_sr, s_sh, req, b, h, H_N: tl.constexpr, L_N: tl.constexpr,
                  SHARED: tl.constexpr):
    """Row (b, h)'s first victim slot per tier: its shared pages (``PageManager.shared``,
    a layer's [max_reqs, Hkv, 2] view) times tokens per page; 0, 0 without SHARED."""
    if SHARED:
        sp = shared + tl.load(req + b).to(tl.int64) * s_sr + h * s_sh
        first_h = tl.load(sp) * H_N
        first_l = tl.load(sp + 1) * L_N
    else:
        first_h = tl.full([], 0, tl.int32)
        first_l = tl.full([], 0, tl.int32)
    return first_h, first_l


@triton.jit
def _argmin_kernel(
    f32, i32, table, t_sr, t_sh, counts, c_sr, c_sh, req, positions, part,
    shared, s_sr, s_sh,
    PAGE_BYTES: tl.constexpr, ROW_LEN: tl.constexpr, WINDOW: tl.constexpr, BT: tl.constexpr,
    H_N: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_N: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr, SHARED: tl.constexpr,
):
    """Program (b, h, s) of S = num_programs(2): the eligible argmin keys of blocks
    s, s + S, s + 2S, ... of row (b, h), where blocks 0..nb_hi-1 are the high tier's tokens
    BT at a time and the following ones the low tier's (a block never mixes tiers, so one
    reduction per block). Stores part[b, h, s] = (high key, low key); a program with no
    block stores the none key. Same float ops as _eligible_argmin. With SHARED, a tier's
    slots before its shared bound are no victims."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    row, cnt = row_pointers(table, t_sr, t_sh, counts, c_sr, c_sh, req, b, h)
    first_h, first_l = _shared_first(shared, s_sr, s_sh, req, b, h, H_N, L_N, SHARED)
    n_hi = tl.load(cnt)
    n_lo = tl.load(cnt + 1)
    p = tl.load(positions + b).to(tl.int64)
    nb_hi = tl.cdiv(n_hi, BT)
    nb = nb_hi + tl.cdiv(n_lo, BT)
    none = _none_key()
    best_hi = none
    best_lo = none
    for v in range(s, nb, n_split):
        hi = v < nb_hi
        tok = tl.where(hi, v, v - nb_hi) * BT + tl.arange(0, BT)
        inside = (tok < tl.where(hi, n_hi, n_lo)) & (tok >= tl.where(hi, first_h, first_l))
        # both tiers' page index is computed and one selected: int32 division by a
        # constexpr is a multiply-high; the slot as tok - q * N, since ``%`` by a
        # non-power-of-two constexpr compiles to a separate (emulated) rem.s32
        q_hi = tok // H_N
        q_lo = tok // L_N
        col = tl.where(hi, q_hi, ROW_LEN - 1 - q_lo)
        slot = tok - tl.where(hi, q_hi * H_N, q_lo * L_N)
        page = tl.load(row + col, mask=inside, other=0).to(tl.int64)
        # word offsets: page_bytes and the score/position offsets are multiples of 4
        base = page * (PAGE_BYTES // 4) + slot
        score = tl.load(f32 + base + tl.where(hi, H_SOFF // 4, L_SOFF // 4), mask=inside,
                        other=0.0)
        pos = tl.load(i32 + base + tl.where(hi, H_POFF // 4, L_POFF // 4), mask=inside,
                      other=0)
        age = p - pos.to(tl.int64)
        avg = tl.math.div_rn(score, tl.maximum(age, 1).to(tl.float32))
        # an eligible +inf avg is no victim either (the reference's isfinite test)
        ok = inside & (age >= WINDOW) & (avg < float("inf"))
        key = tl.min(tl.where(ok, _pack_key(avg, tok), none), axis=0)
        best_hi = tl.where(hi, tl.minimum(best_hi, key), best_hi)
        best_lo = tl.where(hi, best_lo, tl.minimum(best_lo, key))
    out = part + ((b * tl.num_programs(1) + h) * n_split + s).to(tl.int64) * 2
    tl.store(out, best_hi)
    tl.store(out + 1, best_lo)


@triton.jit
def _min_partial(part, n_split, TIER: tl.constexpr):
    """Min over a row's n_split partial keys of one tier, 16 at a time."""
    none = _none_key()
    best = none
    for i in range(0, n_split, 16):
        j = i + tl.arange(0, 16)
        k = tl.load(part + j.to(tl.int64) * 2 + TIER, mask=j < n_split,
                    other=0x7F800000FFFFFFFF)
        best = tl.minimum(best, tl.min(k, axis=0))
    return best


@triton.jit
def _mix32(x, MUL_A: tl.constexpr, MUL_B: tl.constexpr):
    # bench_mix._mix32: x < 2^32 and MUL_* < 2^31, so no int64 product overflows
    x = x ^ (x >> 16)
    x = (x * MUL_A) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * MUL_B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _hash_u24(seed, layer, head, position, MUL_A: tl.constexpr, MUL_B: tl.constexpr,
              SALT: tl.constexpr, U_BITS: tl.constexpr):
    """bench_mix.hash_u24 for one (seed, layer, head, position). tl.cast, not .to: an int
    argument equal to 1 arrives as a constexpr (Triton specialises it), which has no .to."""
    x = _mix32((tl.cast(seed, tl.int64) & 0xFFFFFFFF) ^ SALT, MUL_A, MUL_B)
    x = _mix32(x ^ (tl.cast(layer, tl.int64) & 0xFFFFFFFF), MUL_A, MUL_B)
    x = _mix32(x ^ (tl.cast(head, tl.int64) & 0xFFFFFFFF), MUL_A, MUL_B)
    x = _mix32(x ^ (tl.cast(position, tl.int64) & 0xFFFFFFFF), MUL_A, MUL_B)
    return x >> (32 - U_BITS)


@triton.jit
def _threshold(alpha, p):
    # policy.thresholds: alpha / max(p, 1) in float64, clamped to [0, 1], then float32
    t = alpha.to(tl.float64) / tl.maximum(p, 1).to(tl.float64)
    return tl.minimum(tl.maximum(t, 0.0), 1.0).to(tl.float32)


@triton.jit
def _policy_kernel(
    u8, f16, f32, i32, table, t_sr, t_sh, counts, c_sr, c_sh, req, positions, alpha,
    key, k_sb, k_sh, value, v_sb, v_sh, action_out, hmin_out, lmin_out,
    bench_seed, layer, cut_h, cut_hl, part, n_split, shared, s_sr, s_sh, hk, hs, h_sr, h_sh,
    PAGE_BYTES: tl.constexpr, ROW_LEN: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    BT: tl.constexpr, PARALLEL: tl.constexpr, BENCH: tl.constexpr, SHARED: tl.constexpr,
    HINT: tl.constexpr, MUL_A: tl.constexpr,
    MUL_B: tl.constexpr, SALT: tl.constexpr, U_BITS: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row, cnt = row_pointers(table, t_sr, t_sh, counts, c_sr, c_sh, req, b, h)
    n_hi = tl.load(cnt)
    n_lo = tl.load(cnt + 1)
    p = tl.load(positions + b).to(tl.int64)
    first_h, first_l = _shared_first(shared, s_sr, s_sh, req, b, h, H_N, L_N, SHARED)
    live = p >= 0
    if HINT:
        # the fused argmin's record (decode_hint): the previous step's merge pass left this
        # row's keys; used only when its stamp says they are for exactly this row state
        hrow = tl.load(req + b).to(tl.int64) * h_sr + h * h_sh
        fi = tl.arange(0, 8)
        st = tl.load(hs + hrow * 2 + 4 + fi)
        st_p = tl.sum(tl.where(fi == 0, st, 0), axis=0)
        ok_hint = (live & (st_p == p) & (tl.sum(tl.where(fi == 6, st, 0), axis=0) == p)
                   & (tl.sum(tl.where(fi == 1, st, 0), axis=0) == n_hi)
                   & (tl.sum(tl.where(fi == 2, st, 0), axis=0) == n_lo)
                   & (tl.sum(tl.where(fi == 3, st, 0), axis=0) == first_h)
                   & (tl.sum(tl.where(fi == 4, st, 0), axis=0) == first_l)
                   & (tl.sum(tl.where(fi == 5, st, 0), axis=0) == p - WINDOW))
        h_avg, hmin = _unpack_key(tl.load(hk + hrow))
        l_avg, lmin = _unpack_key(tl.load(hk + hrow + 1))
        if not ok_hint:
            h_avg, hmin_s = _eligible_argmin(f32, i32, row, n_hi, p, first_h, WINDOW, ROW_LEN,
                                             False, PAGE_BYTES, H_N, H_SOFF, H_POFF, BT)
            l_avg, lmin_s = _eligible_argmin(f32, i32, row, n_lo, p, first_l, WINDOW, ROW_LEN,
                                             True, PAGE_BYTES, L_N, L_SOFF, L_POFF, BT)
            hmin = hmin_s.to(tl.int64)
            lmin = lmin_s.to(tl.int64)
    elif PARALLEL:
        # _argmin_kernel's n_split partial keys of this row (it ran just before, same stream)
        prow = part + (b * tl.num_programs(1) + h).to(tl.int64) * n_split * 2
        h_avg, hmin = _unpack_key(_min_partial(prow, n_split, 0))
        l_avg, lmin = _unpack_key(_min_partial(prow, n_split, 1))
    else:
        h_avg, hmin = _eligible_argmin(f32, i32, row, n_hi, p, first_h, WINDOW, ROW_LEN,
                                       False, PAGE_BYTES, H_N, H_SOFF, H_POFF, BT)
        l_avg, lmin = _eligible_argmin(f32, i32, row, n_lo, p, first_l, WINDOW, ROW_LEN,
                                       True, PAGE_BYTES, L_N, L_SOFF, L_POFF, BT)
    full = (n_hi + n_lo + 1) > WINDOW
    # DecodeAction: 0 APPEND_HIGH, 1 EVICT_HIGH, 2 DEMOTE_APPEND, 3 DEMOTE_REPLACE
    if BENCH:
        u = _hash_u24(tl.load(bench_seed + b), layer, h, p, MUL_A, MUL_B, SALT, U_BITS)
        forced = tl.where(u < cut_h, 0, tl.where(u < cut_hl, 2, 1))
        action = tl.where(full & (hmin >= 0), forced, 0)
    else:
        t_h = _threshold(tl.load(alpha + b * 2), p)
        t_l = _threshold(tl.load(alpha + b * 2 + 1), p)
        evict = full & (h_avg < t_l) & (h_avg < l_avg)
        demote_t = full & ~evict & (h_avg < t_h)
        replace = demote_t & (l_avg < t_l)
        action = tl.where(replace, 3, tl.where(demote_t, 2, tl.where(evict, 1, 0)))
    demote = (action == 2) | (action == 3)

    # Rows of width 2 with only row 0 live: tiles of one token. A CUDA-graph padding row
    # (position -1, on the pool's empty pad request) stores nothing and counts nothing.
    one = (tl.arange(0, 2) < 1) & ((tl.zeros([2], tl.int32) + live.to(tl.int32)) > 0)
    hmin_c = tl.maximum(hmin, 0)
    src_page = tl.load(row + hmin_c // H_N).to(tl.int64)
    src_base = tl.zeros([2], tl.int64) + src_page * PAGE_BYTES
    src_slot = tl.zeros([2], tl.int32) + (hmin_c % H_N).to(tl.int32)
    # (a scalar predicate broadcast through an int32 tile: the interpreter rejects a mask
    # made from a 0-d boolean directly)
    dmask = one & ((tl.zeros([2], tl.int32) + demote.to(tl.int32)) > 0)
    # demotion first: it reads hmin's high copy before the new token overwrites it
    kx = load_dequant(u8, f16, src_base, src_slot, dmask, 2, D, H_KB, H_KG, H_KOFF, H_KMOFF)
    vx = load_dequant(u8, f16, src_base, src_slot, dmask, 2, D, H_VB, H_VG, H_VOFF, H_VMOFF)
    s_score = tl.load(f32 + (src_base + H_SOFF) // 4 + src_slot, mask=dmask, other=0.0)
    s_pos = tl.load(i32 + (src_base + H_POFF) // 4 + src_slot, mask=dmask, other=0)
    dst = tl.where(action == 2, n_lo, tl.maximum(lmin, 0))
    dst_page = tl.load(row + (ROW_LEN - 1 - dst // L_N), mask=demote, other=0).to(tl.int64)
    dst_base = tl.zeros([2], tl.int64) + dst_page * PAGE_BYTES
    dst_slot = tl.zeros([2], tl.int32) + (dst % L_N).to(tl.int32)
    quantize_store(u8, f16, kx, dst_base, dst_slot, dmask, 2, D, L_KB, L_KG, L_KOFF, L_KMOFF)
    quantize_store(u8, f16, vx, dst_base, dst_slot, dmask, 2, D, L_VB, L_VG, L_VOFF, L_VMOFF)
    store_score_pos(f32, i32, dst_base, dst_slot, dmask, s_score, s_pos, L_SOFF, L_POFF)
    tl.debug_barrier()

    new = tl.where(action == 0, n_hi, hmin_c)
    new_page = tl.load(row + new // H_N).to(tl.int64)
    new_base = tl.zeros([2], tl.int64) + new_page * PAGE_BYTES
    new_slot = tl.zeros([2], tl.int32) + (new % H_N).to(tl.int32)
    d = tl.arange(0, D)
    kn = tl.load(key + b * k_sb + h * k_sh + tl.zeros([2], tl.int32)[:, None] + d[None, :])
    vn = tl.load(value + b * v_sb + h * v_sh + tl.zeros([2], tl.int32)[:, None] + d[None, :])
    quantize_store(u8, f16, kn.to(tl.float32), new_base, new_slot, one, 2, D, H_KB, H_KG,
                   H_KOFF, H_KMOFF)
    quantize_store(u8, f16, vn.to(tl.float32), new_base, new_slot, one, 2, D, H_VB, H_VG,
                   H_VOFF, H_VMOFF)
    store_score_pos(f32, i32, new_base, new_slot, one, tl.zeros([2], tl.float32),
                    (tl.zeros([2], tl.int64) + p).to(tl.int32), H_SOFF, H_POFF)

    n_hi_next = n_hi + ((action == 0) & live).to(tl.int32)
    n_lo_next = n_lo + ((action == 2) & live).to(tl.int32)
    tl.store(cnt, n_hi_next)
    tl.store(cnt + 1, n_lo_next)
    if HINT:
        # arm the record for position p + 1 (live rows only): keys none, the merge pass of
        # this layer mins into them next; DONE -1 until it has run exactly once
        lv = (tl.zeros([8], tl.int32) + live.to(tl.int32)) > 0
        pn = (p + 1).to(tl.int32)
        stamp = tl.where(fi == 0, pn, tl.where(fi == 1, n_hi_next, tl.where(
            fi == 2, n_lo_next, tl.where(fi == 3, first_h, tl.where(
                fi == 4, first_l, tl.where(fi == 5, pn - WINDOW, tl.where(fi == 6, -1, 0)))))))
        tl.store(hs + hrow * 2 + 4 + fi, stamp, mask=lv)
        lv2 = (tl.zeros([2], tl.int32) + live.to(tl.int32)) > 0
        tl.store(hk + hrow + tl.arange(0, 2), tl.zeros([2], tl.int64) + _none_key(), mask=lv2)
    out = b * tl.num_programs(1) + h
    tl.store(action_out + out, action.to(tl.int8))
    tl.store(hmin_out + out, hmin.to(tl.int64))
    tl.store(lmin_out + out, lmin.to(tl.int64))


def hash_constexprs() -> dict[str, int]:
    """The hash constants of ``bench_mix``, as the kernel's constexprs (one source)."""
    return {"MUL_A": bench_mix.MUL_A, "MUL_B": bench_mix.MUL_B, "SALT": bench_mix.SEED_SALT,
            "U_BITS": bench_mix.U_BITS}


# Parallel argmin defaults. A block of 512 tokens is 4 KB of (score, position) loads per
# iteration with 4 warps (4 tokens per thread), so a 1-3k-token row is 2-6 blocks. ~8192
# programs are ~4 per resident slot of an H100 (132 SMs x 16 programs of 4 warps): at batch
# 305 x 8 heads that is S = 4 programs per row, each with ~1 block, i.e. a chain of ~4
# dependent loads (req -> counts -> table -> score/pos) instead of the scan's ~20-40.
ARGMIN_BLOCK = 512
ARGMIN_PROGRAMS = 8192


def argmin_splits(b: int, hkv: int, row_len: int, geometry: PageGeometry,
                  block: int = ARGMIN_BLOCK, programs: int = ARGMIN_PROGRAMS) -> int:
    """Programs per (request, KV head) row of ``_argmin_kernel``: enough for ~``programs``
    in all, but no more than the blocks the longest possible row has (a row's two tiers
    share ``row_len`` columns, so it holds at most row_len x the larger tokens-per-page
    tokens; +2 for the partial last block of each tier). Shapes only: no host sync, and one
    grid per batch size under CUDA graphs. The kernel loops over its blocks with stride S,
    so any S >= 1 gives the same result; this only sets the parallelism."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"argmin_block must be a power of two >= 16, got {block}")
    per_page = max(geometry.high.tokens_per_page, geometry.low.tokens_per_page)
    most = triton.cdiv(row_len * per_page, block) + 2
    return max(1, min(triton.cdiv(programs, max(b * hkv, 1)), most))


def _check(geometry, table, counts, req_idx, positions, alpha, key, value):
    b, hkv, d = key.shape
    if value.shape != key.shape or d != geometry.head_dim:
        raise ValueError(f"key/value must be [B, Hkv, {geometry.head_dim}], got "
                         f"{tuple(key.shape)} / {tuple(value.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need a contiguous last dimension")
    if table.shape[2] != hkv or counts.shape[:3] != table.shape[:3]:
        raise ValueError("table/counts must be [max_reqs, layers, Hkv, ...] with Hkv = "
                         f"{hkv}")
    if table.dtype != torch.int32 or counts.dtype != torch.int32 or not counts.is_contiguous():
        raise ValueError("table and counts must be int32 (counts contiguous)")
    if req_idx.shape != (b,) or positions.shape != (b,) or alpha.shape != (b, 2):
        raise ValueError(f"req_idx and positions must be [{b}], alpha [{b}, 2]")


def _shared_args(shared: torch.Tensor | None, table: torch.Tensor, layer: int):
    """(layer view, row strides) of ``PageManager.shared`` for the kernels, or the table's
    (never read: SHARED=False) when there is none."""
    if shared is None:
        tab = table[:, layer]
        return tab, 0, 0
    if shared.shape != (*table.shape[:3], 2) or shared.dtype != torch.int32 or \
            shared.stride(-1) != 1:
        raise ValueError(f"shared must be int32 [{', '.join(map(str, table.shape[:3]))}, 2] "
                         f"(PageManager.shared), got {shared.dtype} {tuple(shared.shape)}")
    sh = shared[:, layer]
    return sh, sh.stride(0), sh.stride(1)


def _hint_args(hints: torch.Tensor | None, table: torch.Tensor, layer: int):
    """(int64 layer view, int32 layer view, row strides in int64 words) of the fused
    argmin's records (``decode_hint``), or placeholders (never read: HINT=False)."""
    if hints is None:
        tab = table[:, layer]
        return tab, tab, 0, 0
    if hints.shape != (*table.shape[:3], decode_hint.HINT_WORDS) or \
            hints.dtype != torch.int64 or not hints.is_contiguous():
        raise ValueError(f"hints must be contiguous int64 [{', '.join(map(str, table.shape[:3]))}"
                         f", {decode_hint.HINT_WORDS}] (decode_hint.allocate), got "
                         f"{hints.dtype} {tuple(hints.shape)}")
    hk = hints[:, layer]
    return hk, hints.view(torch.int32)[:, layer], hk.stride(0), hk.stride(1)


def argmin_partials(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    positions: torch.Tensor,
    window: int,
    block: int = ARGMIN_BLOCK,
    programs: int = ARGMIN_PROGRAMS,
    out: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """``_argmin_kernel``: int64 [B, Hkv, S, 2] partial keys (high, low) per row and split;
    the row's eligible argmin is the min over S (:func:`unpack_keys`). ``out``: a buffer
    of that shape to fill (every entry is written; tests pass a poisoned one). ``shared``:
    ``PageManager.shared`` (a tier's first shared pages are no victims) or None."""
    b, hkv = req_idx.shape[0], table.shape[2]
    row_len = table.shape[-1]
    n_split = argmin_splits(b, hkv, row_len, geometry, block, programs)
    if out is None:
        # every program stores its two keys, so torch.empty suffices (no fill launch)
        out = torch.empty(b, hkv, n_split, 2, dtype=torch.int64, device=pages.device)
    elif out.shape != (b, hkv, n_split, 2) or out.dtype != torch.int64 or \
            not out.is_contiguous():
        raise ValueError(f"out must be contiguous int64 [{b}, {hkv}, {n_split}, 2]")
    _, _, f32, i32 = page_views(pages)
    tab, cnt = table[:, layer], counts[:, layer]
    hi_c, lo_c = tier_constexprs(geometry.high, "H_"), tier_constexprs(geometry.low, "L_")
    sh, s_sr, s_sh = _shared_args(shared, table, layer)
    _argmin_kernel[(b, hkv, n_split)](
        f32, i32, tab, tab.stride(0), tab.stride(1), cnt, cnt.stride(0), cnt.stride(1),
        req_idx, positions.to(torch.int64).contiguous(), out, sh, s_sr, s_sh,
        PAGE_BYTES=geometry.page_bytes, ROW_LEN=row_len, WINDOW=window, BT=block,
        SHARED=shared is not None,
        **{k: hi_c[k] for k in ("H_N", "H_SOFF", "H_POFF")},
        **{k: lo_c[k] for k in ("L_N", "L_SOFF", "L_POFF")},
        num_warps=4, enable_fp_fusion=False,
    )
    return out


def unpack_keys(part: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Torch side of the policy kernel's reduction: [B, Hkv, S, 2] partial keys ->
    (h_avg, hmin, l_avg, lmin), [B, Hkv] each; (inf, -1) where a tier has no victim."""
    key = part.amin(dim=2)
    ordered = (key >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    avg = bits.view(torch.float32)
    slot = key & 0xFFFFFFFF
    slot = torch.where(slot == 0xFFFFFFFF, -1, slot)
    return avg[..., 0], slot[..., 0], avg[..., 1], slot[..., 1]


# Tokens per step of the scan's serial walk (a row of n tokens takes ceil(n / BT) dependent
# page-table -> score/position loads per tier). 512: on the H100 (30/50/20, graph-replayed,
# docs/benchmarks.md session 8) 8-12% faster than 256 at 4k contexts (B 305 x 4k: 75 vs
# 82 us), equal at 1k; 1024 is slower at B 128-305.
SCAN_BLOCK = 512
# Warps per policy program (one program per (request, KV head) row). Two, not four: the
# row's scalar decision code runs in every warp of its program, and each D-wide reduction of
# the quantisation (about twenty a row) crosses warps through shared memory and a barrier.
# Measured on an H200 at batch 369 x 3,300 (docs/backend.md, "The policy kernel's warps"):
# the scan path 75.9 -> 69.6 us a layer, the fused path 28.1 -> 19.2; one warp slows the
# scan (91.7: too few threads for the BT-token steps).
POLICY_WARPS = 2


@functools.lru_cache(maxsize=64)
def _policy_constexprs(geometry: PageGeometry, row_len: int, window: int,
                       bench: bool, scan_block: int) -> dict[str, int | bool]:
    """The policy kernel's constexprs for one (geometry, row length, window, mode): built
    once, not per layer (the tier dicts and the hash constants cost host time on every
    eager call). Geometry layouts are frozen dataclasses, hence hashable."""
    return dict(PAGE_BYTES=geometry.page_bytes, ROW_LEN=row_len, D=geometry.head_dim,
                WINDOW=window, BT=scan_block, BENCH=bench, **hash_constexprs(),
                **tier_constexprs(geometry.high, "H_"), **tier_constexprs(geometry.low, "L_"))


@dataclass(frozen=True)
class DecodeStepInputs:
    """What every layer's policy step of one decode step shares, converted once per step
    (eagerly each conversion, gather or allocation is a launch and host time on all 32+
    layers). ``decode_policy_step(..., step=...)`` uses these as given, so they must be
    exactly what :func:`prepare_decode_step` produces. The action/hmin/lmin buffers are
    reused by every layer: a :class:`DecodeDecision` from a prepared call is overwritten
    by the next layer's call (the backend discards it)."""

    positions: torch.Tensor  # int64 contiguous [B]
    alpha: torch.Tensor  # float32 contiguous [B, 2]
    seed: torch.Tensor  # int64 contiguous [B] (benchmark mode) or positions (never read)
    bench: bool
    cut_h: int
    cut_hl: int
    views: tuple[torch.Tensor, ...]  # page_views(pages): uint8, fp16, fp32, int32
    action: torch.Tensor  # int8 [B, Hkv]
    hmin: torch.Tensor  # int64 [B, Hkv]
    lmin: torch.Tensor  # int64 [B, Hkv]


def prepare_decode_step(
    pages: torch.Tensor,
    req_idx: torch.Tensor,
    positions: torch.Tensor,
    alpha: torch.Tensor,
    num_kv_heads: int,
    bench: tuple[torch.Tensor, bench_mix.Mix] | None = None,
) -> DecodeStepInputs:
    """The per-step conversions ``decode_policy_step`` otherwise does on every call.
    (``req_idx`` only sizes the buffers: the kernels take any integer dtype and widen it
    on load, so it is passed per call unconverted.)"""
    b = req_idx.shape[0]
    dev = pages.device
    positions = positions.to(torch.int64).contiguous()
    if bench is None:
        seed, cut_h, cut_hl = positions, 0, 0  # the seed pointer is never read
    else:
        seed = bench[0].to(device=dev, dtype=torch.int64).contiguous()
        if seed.shape != (b,):
            raise ValueError(f"bench seeds must be [{b}], got {tuple(seed.shape)}")
        cut_h, cut_hl = bench_mix.decode_cuts(bench[1])
    return DecodeStepInputs(
        positions=positions, alpha=alpha.float().contiguous(), seed=seed,
        bench=bench is not None, cut_h=cut_h, cut_hl=cut_hl, views=page_views(pages),
        action=torch.empty(b, num_kv_heads, dtype=torch.int8, device=dev),
        hmin=torch.empty(b, num_kv_heads, dtype=torch.int64, device=dev),
        lmin=torch.empty(b, num_kv_heads, dtype=torch.int64, device=dev),
    )


def decode_policy_step(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    positions: torch.Tensor,
    alpha: torch.Tensor,
    window: int,
    key: torch.Tensor,
    value: torch.Tensor,
    bench: tuple[torch.Tensor, bench_mix.Mix] | None = None,
    argmin: str = "scan",
    argmin_block: int = ARGMIN_BLOCK,
    argmin_programs: int = ARGMIN_PROGRAMS,
    *,
    step: DecodeStepInputs | None = None,
    scan_block: int = SCAN_BLOCK,
    shared: torch.Tensor | None = None,
    hints: torch.Tensor | None = None,
) -> DecodeDecision:
    """Decide and apply one decode step of one layer; updates ``pages`` and the token
    counters in ``counts`` in place. alpha: [B, 2] = (alpha_h, alpha_l) per request.
    bench: benchmark mode's (seed per request [B], mix); actions follow the mix.
    argmin: "parallel" (``_argmin_kernel`` first, then the policy kernel) or "scan" (the
    policy kernel scans its row itself); same results. argmin_block / argmin_programs: the
    parallel path's tokens per block and target grid size (:func:`argmin_splits`).
    scan_block: the scan's tokens per step (a power of two >= 16; same results for any).
    step: the step's inputs from :func:`prepare_decode_step` (same ``pages``, ``req_idx``,
    ``positions``, ``alpha`` and ``bench``); then those arguments are not converted again
    (they are only shape-checked) and the decision lands in the step's shared buffers.
    shared: ``PageManager.shared`` (int32 [max_reqs, layers, Hkv, 2] pages): a tier's slots
    before shared pages x tokens per page are never victims (``policy.decode_step``'s
    ``shared_tokens``); None: no row shares.
    hints: the fused argmin's records (``decode_hint``; int64 [max_reqs, layers, Hkv,
    HINT_WORDS]): where a row's record is valid the kernel takes its argmin from it instead
    of scanning, and it re-arms every live row's record for the next step, which the same
    layer's decode attention (``DecodeAttentionPlan.run(hints=...)``) fills. Same results
    as without (the scan is the fallback); needs ``argmin="scan"``."""
    if argmin not in ("parallel", "scan"):
        raise ValueError(f"argmin must be 'parallel' or 'scan', got {argmin!r}")
    if hints is not None and argmin != "scan":
        raise ValueError("hints (the fused argmin) fall back to the scan: argmin must be 'scan'")
    if scan_block < 16 or scan_block & (scan_block - 1):
        raise ValueError(f"scan_block must be a power of two >= 16, got {scan_block}")
    _check(geometry, table, counts, req_idx, positions, alpha, key, value)
    b, hkv, d = key.shape
    if step is None:
        step = prepare_decode_step(pages, req_idx, positions, alpha, hkv, bench)
    elif step.action.shape != (b, hkv) or step.bench != (bench is not None):
        raise ValueError(f"step inputs are for {tuple(step.action.shape)} rows "
                         f"(bench={step.bench}), this call is for ({b}, {hkv}) "
                         f"(bench={bench is not None})")
    u8, f16, f32, i32 = step.views
    tab, cnt = table[:, layer], counts[:, layer]
    if argmin == "parallel":
        part = argmin_partials(pages, geometry, table, counts, req_idx, layer, step.positions,
                               window, argmin_block, argmin_programs, shared=shared)
        n_split = part.shape[2]
    else:
        n_split, part = 1, step.action  # never read: PARALLEL=False compiles the scan
    sh, s_sr, s_sh = _shared_args(shared, table, layer)
    hk, hs, h_sr, h_sh = _hint_args(hints, table, layer)
    _policy_kernel[(b, hkv)](
        u8, f16, f32, i32, tab, tab.stride(0), tab.stride(1), cnt, cnt.stride(0),
        cnt.stride(1), req_idx, step.positions,
        step.alpha, key, key.stride(0), key.stride(1), value, value.stride(0),
        value.stride(1), step.action, step.hmin, step.lmin, step.seed, layer, step.cut_h,
        step.cut_hl, part, n_split, sh, s_sr, s_sh, hk, hs, h_sr, h_sh,
        PARALLEL=argmin == "parallel", SHARED=shared is not None, HINT=hints is not None,
        **_policy_constexprs(geometry, table.shape[-1], window, step.bench, scan_block),
        num_warps=POLICY_WARPS, enable_fp_fusion=False,
    )
    return DecodeDecision(action=step.action, hmin=step.hmin, lmin=step.lmin)


def decode_policy_step_reference(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    positions: torch.Tensor,
    alpha: torch.Tensor,
    window: int,
    key: torch.Tensor,
    value: torch.Tensor,
    bench: tuple[torch.Tensor, bench_mix.Mix] | None = None,
    shared: torch.Tensor | None = None,
) -> DecodeDecision:
    """``cache.apply_decode_step`` (what ``CompressedKVCache.decode_layer_store`` runs) over
    these tensors, with the counters advanced as the kernel does. ``shared``: as
    ``decode_policy_step``'s (``PageManager.shared``)."""
    req = req_idx.long()
    forced = None
    if bench is not None:
        forced = bench_mix.forced_actions(bench[0], layer, key.shape[1], positions, bench[1])
    shared_tokens = None
    if shared is not None:
        per_page = torch.tensor([geometry.high.tokens_per_page, geometry.low.tokens_per_page],
                                device=shared.device)
        shared_tokens = shared[req, layer].long() * per_page
    d, growth = apply_decode_step(pages, geometry, table[req, layer], counts[req, layer],
                                  positions, alpha.float(), window, key, value, forced=forced,
                                  shared_tokens=shared_tokens)
    counts[req, layer, :, :2] += growth.to(counts.dtype)
    return d


