"""The decode policy step (DESIGN §2) for one layer, one program per (request, KV head).

Each program scans its head's (score, pos) pairs of both tiers through the page table
(8 bytes per cached token; K/V are not touched), takes the eligible argmin of
avg = score / (p - pos) per tier, decides the action exactly as ``policy.decode_step``,
then performs it: the demoted token is dequantised from its high copy and re-quantised into
the low tier, the new token is quantised into its high slot, and the token counters
advance. Same effect, byte for byte, as ``CompressedKVCache.decode_layer_store``.
Preconditions as there: ``ensure_decode_room`` ran for this step.

Benchmark mode (``BENCH``, a constexpr: the normal kernel carries none of it) replaces the
thresholds' verdict by the action ``bench_mix.forced_actions`` draws; the hash is the same
32-bit arithmetic in int64 with explicit masks, so the bits match torch's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_diffkv import bench_mix
from sglang_diffkv.cache import apply_decode_step
from sglang_diffkv.kernels._quant import load_dequant, quantize_store, store_score_pos
from sglang_diffkv.kernels._tier import page_views, tier_constexprs
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.policy import DecodeDecision


@triton.jit
def _eligible_argmin(f32, i32, row, n_tok, p, WINDOW: tl.constexpr, ROW_LEN: tl.constexpr,
                     LOW: tl.constexpr, PAGE_BYTES: tl.constexpr, N: tl.constexpr,
                     SOFF: tl.constexpr, POFF: tl.constexpr, BT: tl.constexpr):
    """(min avg, its slot) over eligible tokens; (inf, -1) if none. Ties: first slot."""
    best = tl.full([], float("inf"), tl.float32)
    best_i = tl.full([], -1, tl.int32)
    for start in range(0, n_tok, BT):
        tok = start + tl.arange(0, BT)
        inside = tok < n_tok
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
    bench_seed, layer, cut_h, cut_hl,
    PAGE_BYTES: tl.constexpr, ROW_LEN: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    BT: tl.constexpr, BENCH: tl.constexpr, MUL_A: tl.constexpr, MUL_B: tl.constexpr,
    SALT: tl.constexpr, U_BITS: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.load(req + b).to(tl.int64)
    row = table + r * t_sr + h * t_sh
    cnt = counts + r * c_sr + h * c_sh
    n_hi = tl.load(cnt)
    n_lo = tl.load(cnt + 1)
    p = tl.load(positions + b).to(tl.int64)
    h_avg, hmin = _eligible_argmin(f32, i32, row, n_hi, p, WINDOW, ROW_LEN, False, PAGE_BYTES,
                                   H_N, H_SOFF, H_POFF, BT)
    l_avg, lmin = _eligible_argmin(f32, i32, row, n_lo, p, WINDOW, ROW_LEN, True, PAGE_BYTES,
                                   L_N, L_SOFF, L_POFF, BT)
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

    # Rows of width 2 with only row 0 live: tiles of one token.
    one = tl.arange(0, 2) < 1
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

    tl.store(cnt, n_hi + (action == 0).to(tl.int32))
    tl.store(cnt + 1, n_lo + (action == 2).to(tl.int32))
    out = b * tl.num_programs(1) + h
    tl.store(action_out + out, action.to(tl.int8))
    tl.store(hmin_out + out, hmin.to(tl.int64))
    tl.store(lmin_out + out, lmin.to(tl.int64))


def hash_constexprs() -> dict[str, int]:
    """The hash constants of ``bench_mix``, as the kernel's constexprs (one source)."""
    return {"MUL_A": bench_mix.MUL_A, "MUL_B": bench_mix.MUL_B, "SALT": bench_mix.SEED_SALT,
            "U_BITS": bench_mix.U_BITS}


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
) -> DecodeDecision:
    """Decide and apply one decode step of one layer; updates ``pages`` and the token
    counters in ``counts`` in place. alpha: [B, 2] = (alpha_h, alpha_l) per request.
    bench: benchmark mode's (seed per request [B], mix); actions follow the mix."""
    _check(geometry, table, counts, req_idx, positions, alpha, key, value)
    b, hkv, d = key.shape
    dev = key.device
    action = torch.empty(b, hkv, dtype=torch.int8, device=dev)
    hmin = torch.empty(b, hkv, dtype=torch.int64, device=dev)
    lmin = torch.empty(b, hkv, dtype=torch.int64, device=dev)
    u8, f16, f32, i32 = page_views(pages)
    tab, cnt = table[:, layer], counts[:, layer]
    positions = positions.to(torch.int64).contiguous()
    if bench is None:
        seed, cut_h, cut_hl = positions, 0, 0  # the seed pointer is never read
    else:
        seed = bench[0].to(device=dev, dtype=torch.int64).contiguous()
        if seed.shape != (b,):
            raise ValueError(f"bench seeds must be [{b}], got {tuple(seed.shape)}")
        cut_h, cut_hl = bench_mix.decode_cuts(bench[1])
    _policy_kernel[(b, hkv)](
        u8, f16, f32, i32, tab, tab.stride(0), tab.stride(1), cnt, cnt.stride(0),
        cnt.stride(1), req_idx, positions,
        alpha.float().contiguous(), key, key.stride(0), key.stride(1), value, value.stride(0),
        value.stride(1), action, hmin, lmin, seed, layer, cut_h, cut_hl,
        PAGE_BYTES=geometry.page_bytes, ROW_LEN=table.shape[-1], D=d, WINDOW=window, BT=256,
        BENCH=bench is not None, **hash_constexprs(),
        **tier_constexprs(geometry.high, "H_"), **tier_constexprs(geometry.low, "L_"),
        num_warps=4, enable_fp_fusion=False,
    )
    return DecodeDecision(action=action, hmin=hmin, lmin=lmin)


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
) -> DecodeDecision:
    """``cache.apply_decode_step`` (what ``CompressedKVCache.decode_layer_store`` runs) over
    these tensors, with the counters advanced as the kernel does."""
    req = req_idx.long()
    forced = None
    if bench is not None:
        forced = bench_mix.forced_actions(bench[0], layer, key.shape[1], positions, bench[1])
    d, growth = apply_decode_step(pages, geometry, table[req, layer], counts[req, layer],
                                  positions, alpha.float(), window, key, value, forced=forced)
    counts[req, layer, :, :2] += growth.to(counts.dtype)
    return d


