"""Prompts that end over tokens already stored: a chunked prompt's last chunk and a radix
hit's prompt suffix, scored, classified and stored without a host sync (Triton).

The torch oracles are ``CompressedKVCache.store_last_chunk`` (chunked prefill) and
``PromptSharing.store_last`` (a suffix over an attached prefix); ``sglang.extend_ops``
drives these kernels for one step's group of such prompts. Every prompt b of a group is
laid out in *positions* 0 .. total_b - 1:

- positions [0, A_b): the attached prefix of a radix hit (A_b = its cut; 0 for a chunked
  prompt). Frozen: read for the scoring only. Head h's row holds c_h = a_h + a_l of them
  (its cut counts per tier, ``base``), fewer than A_b when the exporter pruned some;
- positions [A_b, A_b + S_b): the *span's* tokens earlier chunks stored at the high tier,
  in position order, at high slots a_h + (position - A_b) (a chunked prompt: slot =
  position);
- positions [A_b + S_b, total_b): the fresh tokens of this step (rows ``fresh_start`` of the
  step's packed k / v).

The span is [A_b, total_b): its tokens are classified with the prefill policy at their
positions in the whole prompt and appended to the row's tiers after (a_h, a_l). Three
steps, each one launch for the whole group:

1. ``gather_prompts``: the packed scoring prompt, fp32 K [rows, Hkv, D]
   (prompt b at rows ``packed_start[b]`` + position): attached tokens dequantised from both
   tiers, right-aligned per head (head h's c_h tokens at positions [A_b - c_h, A_b), so
   ``key_first[b, h] = A_b - c_h`` hides the empty ones from the scoring), stored tokens
   dequantised, fresh ones converted; and the stored tokens' K8V4 bytes (``raw``), for the
   tokens that stay high to keep them bit for bit and for the values of those that go low.
   Everything is read here, before step 3 writes: stored tokens may move to slots other
   stored tokens occupied. No value is gathered: the scoring reads keys only, and step 3
   reads the values it quantises where they already are (``raw``, the step's packed v).
2. ``kernels.prefill_scores`` on the packed prompt (its ``key_first`` / ``num_queries`` /
   ``q_starts`` mode): the causal mask gives each scoring query exactly the keys the
   oracles' probabilities use (fresh queries: every stored token and the fresh ones up to
   their own; earlier chunks' kept queries: stored tokens up to their own position).
3. ``compress_span``: ``_classify_span_kernel`` (tiers and per-block member counts of the
   span; benchmark mode draws here) then ``_store_span_kernel``: ranks as
   ``_store_prefill_kernel`` does, high slot a_h + rank, low slot a_l + rank whose page m is
   the row's old low page m (from the right end) or, past the lp_old pages the row already
   has, high-run column hp_new + m - lp_old (hp_new = ceil((a_h + n_high) / N_high)): the
   layout ``reclaim_prefill`` (a chunked prompt: a_h = a_l = lp_old = 0, so low pages
   follow the high ones) and ``reclaim_extend`` (a radix suffix) expect. Stored tokens
   that stay high get their ``raw`` bytes back instead of a re-quantisation (not the
   identity for a group far from zero); every other member is quantised from its fp32 key
   row and its value (a stored one's dequantised from ``raw``, a fresh one's converted
   from the step's). Block 0 writes the row's final counts (a_h + n_high, a_l + n_low)
   into ``totals``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_diffkv.kernels._quant import load_dequant, quantize_store, store_score_pos
from sglang_diffkv.kernels._tier import page_views, tier_constexprs
from sglang_diffkv.kernels.prefill import (
    COUNT_TILE,
    PREFILL_BLOCK,
    _bench_draw,
    _block_prefix,
    _check_buffer,
    _store_tiers,
    _threshold,
    bench_constexprs,
)
from sglang_diffkv.layout import META_BYTES_PER_GROUP, PageGeometry, TierLayout

GATHER_BLOCK = 32  # positions per gather program


def raw_segments(layout: TierLayout) -> dict[str, int]:
    """Byte sizes of a token's four K/V segments in ``layout`` (key codes, key meta, value
    codes, value meta): what ``raw`` keeps per stored token and head, as constexprs."""
    t, d = layout.tier, layout.head_dim
    return {"R_KB": d * t.key_bits // 8, "R_KM": t.key_groups * META_BYTES_PER_GROUP,
            "R_VB": d * t.value_bits // 8, "R_VM": t.value_groups * META_BYTES_PER_GROUP}


def raw_bytes(layout: TierLayout) -> int:
    return sum(raw_segments(layout).values())


@dataclass(frozen=True)
class PromptGroup:
    """One step's prompts that end over stored tokens (module docstring), as the kernels
    read them; built once per step, read by every layer. Host ints size the launches."""

    req: torch.Tensor  # int64 [B]: request slots
    total: torch.Tensor  # int32 [B]: whole prompt lengths
    attached: torch.Tensor  # int32 [B]: A_b, positions of the attached prefix (0: none)
    stored: torch.Tensor  # int32 [B]: S_b, span tokens stored by earlier chunks
    fresh_start: torch.Tensor  # int64 [B]: the span's fresh tokens' first packed row
    packed_start: torch.Tensor  # int64 [B]: prompt b's first row of the packed prompt
    max_total: int
    max_span: int
    num_rows: int  # rows of the packed prompt: sum of totals

    @property
    def batch(self) -> int:
        return self.req.shape[0]

    @property
    def span_blocks(self) -> int:
        return triton.cdiv(max(self.max_span, 1), PREFILL_BLOCK)


@functools.lru_cache(maxsize=16)
def _constexprs(geometry: PageGeometry) -> dict[str, int]:
    return {**tier_constexprs(geometry.high, "H_"), **tier_constexprs(geometry.low, "L_"),
            **raw_segments(geometry.high)}


@triton.jit
def _segment(base, slot, OFF: tl.constexpr, NB: tl.constexpr):
    """Byte offsets [T, NB] of a token-major segment's rows (``pages._byte_index``)."""
    return (base + OFF + slot.to(tl.int64) * NB)[:, None] + tl.arange(0, NB)[None, :]


@triton.jit
def _raw_row(raw, rrow, OFF: tl.constexpr, NB: tl.constexpr, RAWB: tl.constexpr):
    return raw + (rrow * RAWB + OFF)[:, None] + tl.arange(0, NB)[None, :]


@triton.jit
def _copy_raw(u8, raw, pbase, slot, rrow, mask, TO_PAGE: tl.constexpr,
              H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr, H_VOFF: tl.constexpr,
              H_VMOFF: tl.constexpr, R_KB: tl.constexpr, R_KM: tl.constexpr,
              R_VB: tl.constexpr, R_VM: tl.constexpr):
    """A high token's four K/V segments between its page slot and its ``raw`` row (raw
    row rrow = packed row * Hkv + head holds them back to back), where ``mask``."""
    RAWB: tl.constexpr = R_KB + R_KM + R_VB + R_VM
    _copy_segment(u8, raw, pbase, slot, rrow, mask, TO_PAGE, H_KOFF, 0, R_KB, RAWB)
    _copy_segment(u8, raw, pbase, slot, rrow, mask, TO_PAGE, H_KMOFF, R_KB, R_KM, RAWB)
    _copy_segment(u8, raw, pbase, slot, rrow, mask, TO_PAGE, H_VOFF, R_KB + R_KM, R_VB, RAWB)
    _copy_segment(u8, raw, pbase, slot, rrow, mask, TO_PAGE, H_VMOFF, R_KB + R_KM + R_VB,
                  R_VM, RAWB)


@triton.jit
def _copy_segment(u8, raw, pbase, slot, rrow, mask, TO_PAGE: tl.constexpr, SEG: tl.constexpr,
                  OFF: tl.constexpr, NB: tl.constexpr, RAWB: tl.constexpr):
    page = u8 + _segment(pbase, slot, SEG, NB)
    kept = _raw_row(raw, rrow, OFF, NB, RAWB)
    if TO_PAGE:
        tl.store(page, tl.load(kept, mask=mask[:, None], other=0), mask=mask[:, None])
    else:
        tl.store(kept, tl.load(page, mask=mask[:, None], other=0), mask=mask[:, None])


@triton.jit(do_not_specialize=("row_len",))
def _gather_kernel(
    u8, f16, table, t_sr, t_sh, req, base, attached, stored, total, fresh_start,
    packed_start, key, k_sl, k_sh, out_k, raw, key_first, row_len,
    PAGE_BYTES: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
    R_KB: tl.constexpr, R_KM: tl.constexpr, R_VB: tl.constexpr, R_VM: tl.constexpr,
):
    """Positions [blk * BL, +BL) of prompt b, head h, into the packed prompt (module
    docstring, step 1). Rows with no token (before key_first, or past the prompt) are 0."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    hkv = tl.num_programs(1)
    n = tl.load(total + b)
    a_h = tl.load(base + (b * hkv + h) * 2)
    a_l = tl.load(base + (b * hkv + h) * 2 + 1)
    att = tl.load(attached + b)
    first = att - a_h - a_l
    if blk == 0:
        tl.store(key_first + b * hkv + h, first)
    if blk * BL < n:
        j = blk * BL + tl.arange(0, BL)
        inside = j < n
        sto_end = att + tl.load(stored + b)
        t = j - first  # the attached token's index in the row: high ones, then low ones
        att_hi = inside & (j < att) & (t >= 0) & (t < a_h)
        att_lo = inside & (j < att) & (t >= a_h)
        sto = inside & (j >= att) & (j < sto_end)
        fresh = inside & (j >= sto_end)
        row = table + tl.load(req + b).to(tl.int64) * t_sr + h * t_sh
        hmask = att_hi | sto
        hslot = tl.where(att_hi, t, a_h + j - att)
        hpage = tl.load(row + hslot // H_N, mask=hmask, other=0).to(tl.int64) * PAGE_BYTES
        hslot = hslot % H_N
        u = t - a_h
        lpage = tl.load(row + row_len - 1 - u // L_N, mask=att_lo, other=0).to(tl.int64)
        lpage = lpage * PAGE_BYTES
        lslot = u % L_N
        frow = (tl.load(fresh_start + b) + j - sto_end).to(tl.int64)
        d = tl.arange(0, D)
        kh = load_dequant(u8, f16, hpage, hslot, hmask, BL, D, H_KB, H_KG, H_KOFF, H_KMOFF)
        kl = load_dequant(u8, f16, lpage, lslot, att_lo, BL, D, L_KB, L_KG, L_KOFF, L_KMOFF)
        kf = tl.load(key + frow[:, None] * k_sl + h * k_sh + d[None, :], mask=fresh[:, None],
                     other=0.0).to(tl.float32)
        kx = tl.where(hmask[:, None], kh, tl.where(att_lo[:, None], kl, kf))
        prow = tl.load(packed_start + b) + j  # int64
        out = (prow * hkv + h)[:, None] * D + d[None, :]
        tl.store(out_k + out, kx, mask=inside[:, None])
        # the stored tokens' bytes (read before any store): those that stay high get them
        # back, those that go low are re-quantised from their values dequantised from
        # them; no value is written here (the store kernel reads fresh ones from the step)
        _copy_raw(u8, raw, hpage, hslot, prow * hkv + h, sto, False, H_KOFF, H_KMOFF, H_VOFF,
                  H_VMOFF, R_KB, R_KM, R_VB, R_VM)


@triton.jit(do_not_specialize=("layer", "Lsig", "Smax", "NB"))
def _classify_span_kernel(
    sig, total, attached, alpha_h, alpha_l, tier_out, block_counts, seed, mix, layer, Lsig,
    Smax, NB,
    WINDOW: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr, BENCH: tl.constexpr,
    HIGH_MEAN: tl.constexpr, PRUNED_MEAN: tl.constexpr, MUL_A: tl.constexpr,
    MUL_B: tl.constexpr, SALT: tl.constexpr, U_BITS: tl.constexpr,
):
    """``prefill._classify_kernel`` over span index i (position A_b + i of an n-token
    prompt; sig rows are by position, Lsig wide): the tier of one block of BL span tokens
    and its (high, low) member counts. BENCH draws the significance (into sig)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(total + b)
    i = blk * BL + tl.arange(0, BL)
    ipos = tl.load(attached + b) + i
    inside = i < Smax
    valid = ipos < n
    th = _threshold(tl.load(alpha_h + b), n)
    tlow = _threshold(tl.load(alpha_l + b), n)
    srow = sig + (b * tl.num_programs(1) + h) * Lsig + ipos
    if BENCH:
        s = _bench_draw(tl.load(seed + b), layer, h, ipos, n, mix, th, tlow, WINDOW, Q,
                        HIGH_MEAN, PRUNED_MEAN, MUL_A, MUL_B, SALT, U_BITS)
        tl.store(srow, s, mask=valid)
    else:
        s = tl.load(srow, mask=valid, other=0.0)
    _store_tiers(s, ipos, n, th, tlow, valid, inside,
                 tier_out + (b * tl.num_programs(1) + h) * Smax + i,
                 block_counts + ((b * tl.num_programs(1) + h) * NB + blk) * 2, WINDOW, Q)


@triton.jit(do_not_specialize=("Lsig", "Smax", "NB", "row_len"))
def _store_span_kernel(
    u8, f16, f32, i32, pk, value, v_sl, v_sh, fresh_start, raw, raw_f16, packed_start, sig,
    tier_in, block_counts, totals, total, attached, stored, base, table, t_sr, t_sh, counts,
    c_sr, c_sh, req, Lsig, Smax, NB, row_len,
    PAGE_BYTES: tl.constexpr, D: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr,
    COUNT_TILE: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
    R_KB: tl.constexpr, R_KM: tl.constexpr, R_VB: tl.constexpr, R_VM: tl.constexpr,
):
    """Ranks and stores one block's span members of both tiers (module docstring, step 3);
    block 0's program writes the row's final (n_high, n_low) into totals (so it runs even
    when nothing is stored). Only the members that are quantised here read K / V: a fresh
    one from the packed K and the step's ``value``, a stored one that goes low from the
    packed K and its kept V bytes (``raw``, dequantised as the gather read the page); a
    stored one that stays high copies its kept bytes, a pruned one reads nothing."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    hkv = tl.num_programs(1)
    n = tl.load(total + b)
    att = tl.load(attached + b)
    span = n - att
    if blk * BL < tl.maximum(span, 1):
        head = b * hkv + h
        h_first, l_first, n_hi, n_lo = _block_prefix(block_counts + head * NB * 2, blk,
                                                     tl.cdiv(span, BL), COUNT_TILE)
        a_h = tl.load(base + head * 2)
        a_l = tl.load(base + head * 2 + 1)
        if blk == 0:
            tl.store(totals + head * 2, a_h + n_hi)
            tl.store(totals + head * 2 + 1, a_l + n_lo)
        i = blk * BL + tl.arange(0, BL)
        inside = i < span
        ipos = att + i
        tier = tl.load(tier_in + head * Smax + i, mask=inside, other=2)
        r = tl.load(req + b).to(tl.int64)
        row = table + r * t_sr + h * t_sh
        lp_old = tl.load(counts + r * c_sr + h * c_sh + 3)  # the row's low pages (P_LOW)
        d = tl.arange(0, D)
        prow = tl.load(packed_start + b) + ipos
        rrow = prow * hkv + h  # the token's packed K row and its raw row
        n_sto = tl.load(stored + b)
        was_stored = i < n_sto
        quant = inside & ((tier == 1) | ((tier == 0) & ~was_stored))
        kx = tl.load(pk + rrow[:, None] * D + d[None, :], mask=quant[:, None], other=0.0)
        # V: a stored token's from its kept bytes (the gather's page read), a fresh one's
        # from the step's packed values, converted as the gather converts fresh keys
        RAWB: tl.constexpr = R_KB + R_KM + R_VB + R_VM
        v_sto = quant & was_stored
        vs = load_dequant(raw, raw_f16, rrow * RAWB, tl.zeros_like(rrow), v_sto, BL, D, H_VB,
                          H_VG, R_KB + R_KM, R_KB + R_KM + R_VB)
        frow = (tl.load(fresh_start + b) + i - n_sto).to(tl.int64)
        vf = tl.load(value + frow[:, None] * v_sl + h * v_sh + d[None, :],
                     mask=(quant & ~was_stored)[:, None], other=0.0).to(tl.float32)
        vx = tl.where(was_stored[:, None], vs, vf)
        score = tl.load(sig + head * Lsig + ipos, mask=inside, other=0.0)
        pos = n - tl.minimum(Q, n - ipos)  # virtual position (policy.virtual_positions)
        # high tier: slot a_h + rank, page (a_h + rank) // N_hi of the row
        member = tier == 0
        rank = a_h + h_first + tl.cumsum(member.to(tl.int32), 0) - 1
        page = tl.load(row + rank // H_N, mask=member, other=0)
        pbase = page.to(tl.int64) * PAGE_BYTES
        slot = rank % H_N
        kept = member & was_stored  # stored earlier: its bytes come back
        fresh = member & ~kept
        quantize_store(u8, f16, kx, pbase, slot, fresh, BL, D, H_KB, H_KG, H_KOFF, H_KMOFF)
        quantize_store(u8, f16, vx, pbase, slot, fresh, BL, D, H_VB, H_VG, H_VOFF, H_VMOFF)
        _copy_raw(u8, raw, pbase, slot, rrow, kept, True, H_KOFF, H_KMOFF, H_VOFF, H_VMOFF,
                  R_KB, R_KM, R_VB, R_VM)
        store_score_pos(f32, i32, pbase, slot, member, score, pos, H_SOFF, H_POFF)
        # low tier: slot a_l + rank; low page m is the row's own (from the right end) below
        # lp_old, else the high run's column hp_new + m - lp_old (reclaim_* move it there)
        member = tier == 1
        rank = a_l + l_first + tl.cumsum(member.to(tl.int32), 0) - 1
        m = rank // L_N
        hp_new = (a_h + n_hi + H_N - 1) // H_N
        col = tl.where(m < lp_old, row_len - 1 - m, hp_new + m - lp_old)
        page = tl.load(row + col, mask=member, other=0)
        pbase = page.to(tl.int64) * PAGE_BYTES
        slot = rank % L_N
        quantize_store(u8, f16, kx, pbase, slot, member, BL, D, L_KB, L_KG, L_KOFF, L_KMOFF)
        quantize_store(u8, f16, vx, pbase, slot, member, BL, D, L_VB, L_VG, L_VOFF, L_VMOFF)
        store_score_pos(f32, i32, pbase, slot, member, score, pos, L_SOFF, L_POFF)


def _check_group(g: PromptGroup, base: torch.Tensor, hkv: int, dev: torch.device) -> None:
    b = g.batch
    for name, x, dtype in (("req", g.req, torch.int64), ("total", g.total, torch.int32),
                           ("attached", g.attached, torch.int32),
                           ("stored", g.stored, torch.int32),
                           ("fresh_start", g.fresh_start, torch.int64),
                           ("packed_start", g.packed_start, torch.int64)):
        _check_buffer(f"group {name}", x, (b,), dtype, dev)
    _check_buffer("base", base, (b, hkv, 2), torch.int32, dev)


def _check_fresh(name: str, x: torch.Tensor, hkv: int, d: int) -> None:
    if x.dim() != 3 or x.shape[1:] != (hkv, d) or x.stride(-1) != 1:
        raise ValueError(f"{name} must be the step's packed [T, {hkv}, {d}] with a "
                         f"contiguous last dimension, got {tuple(x.shape)}")


def gather_prompts(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    layer: int,
    group: PromptGroup,
    base: torch.Tensor,
    key: torch.Tensor,
    *,
    out_k: torch.Tensor,
    raw: torch.Tensor,
    key_first: torch.Tensor,
) -> None:
    """Step 1 (module docstring), one launch: fills ``out_k`` (fp32 [rows, Hkv, D], rows
    ``group.num_rows``), ``raw`` (uint8 [rows, Hkv, raw_bytes(high)]: the stored tokens'
    K8V4 bytes; other rows untouched) and ``key_first`` (int32 [B, Hkv]). ``base``: int32
    [B, Hkv, 2], each row's attached (a_h, a_l) in ``layer`` (zeros without one); key: the
    step's packed fresh keys [T, Hkv, D]. No value is gathered: the scoring reads keys only,
    and ``compress_span`` takes the span's values from ``raw`` and the step's own."""
    hkv, d = table.shape[2], geometry.head_dim
    dev = key.device
    _check_group(group, base, hkv, dev)
    rows = (group.num_rows, hkv, d)
    _check_buffer("out_k", out_k, rows, torch.float32, dev)
    _check_buffer("raw", raw, (*rows[:2], raw_bytes(geometry.high)), torch.uint8, dev)
    _check_buffer("key_first", key_first, (group.batch, hkv), torch.int32, dev)
    _check_fresh("key", key, hkv, d)
    if group.batch == 0:
        return
    u8, f16, _, _ = page_views(pages)
    tab = table[:, layer]
    _gather_kernel[(group.batch, hkv, triton.cdiv(group.max_total, GATHER_BLOCK))](
        u8, f16, tab, tab.stride(0), tab.stride(1), group.req, base, group.attached,
        group.stored, group.total, group.fresh_start, group.packed_start, key, key.stride(0),
        key.stride(1), out_k, raw, key_first, table.shape[-1],
        PAGE_BYTES=geometry.page_bytes, D=d, BL=GATHER_BLOCK, **_constexprs(geometry),
        num_warps=4, enable_fp_fusion=False,
    )


def compress_span(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    layer: int,
    group: PromptGroup,
    base: torch.Tensor,
    packed_k: torch.Tensor,
    value: torch.Tensor,
    raw: torch.Tensor,
    significance: torch.Tensor,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    window: int,
    score_queries: int,
    *,
    tier_out: torch.Tensor,
    block_counts: torch.Tensor,
    totals: torch.Tensor,
    bench: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Step 3 (module docstring), two launches: classify every span token (significance
    fp32 [B, Hkv, max_total] by position, from ``prefill_scores`` on the packed prompt)
    and store the spans into their rows (``table`` / ``counts``: the manager's; keys from
    ``packed_k``, values from ``raw`` for stored tokens and from ``value``, the step's
    packed fresh values [T, Hkv, D], for fresh ones). Writes
    ``tier_out`` (int8 [B, Hkv, max_span], by span index; PRUNED past a span),
    ``block_counts`` (int32 [B, Hkv, span_blocks, 2], scratch) and ``totals`` (int32
    [B, Hkv, 2]: the rows' final (n_high, n_low)). ``bench=(seed int64 [B], mix float64
    [3])``: benchmark mode's draw, as ``compress_prefill``'s."""
    b, hkv = group.batch, table.shape[2]
    dev = packed_k.device
    _check_group(group, base, hkv, dev)
    lsig, smax, nb = group.max_total, group.max_span, group.span_blocks
    _check_buffer("significance", significance, (b, hkv, lsig), torch.float32, dev)
    _check_buffer("tier_out", tier_out, (b, hkv, smax), torch.int8, dev)
    _check_buffer("block_counts", block_counts, (b, hkv, nb, 2), torch.int32, dev)
    _check_buffer("totals", totals, (b, hkv, 2), torch.int32, dev)
    _check_fresh("value", value, hkv, geometry.head_dim)
    for name, a in (("alpha_h", alpha_h), ("alpha_l", alpha_l)):
        _check_buffer(name, a, (b,), torch.float32, dev)
    if b == 0:
        return
    seed = mix = None
    if bench is not None:
        seed, mix = bench
        _check_buffer("bench seed", seed, (b,), torch.int64, dev)
        _check_buffer("bench mix", mix, (3,), torch.float64, dev)
    _classify_span_kernel[(b, hkv, nb)](
        significance, group.total, group.attached, alpha_h, alpha_l, tier_out, block_counts,
        seed, mix, layer, lsig, smax, nb,
        WINDOW=window, Q=score_queries, BL=PREFILL_BLOCK, BENCH=bench is not None,
        **bench_constexprs(), num_warps=2, enable_fp_fusion=False,
    )
    u8, f16, f32, i32 = page_views(pages)
    tab, cnt = table[:, layer], counts[:, layer]
    _store_span_kernel[(b, hkv, nb)](
        u8, f16, f32, i32, packed_k, value, value.stride(0), value.stride(1),
        group.fresh_start, raw, raw.view(torch.float16), group.packed_start, significance,
        tier_out, block_counts, totals, group.total, group.attached, group.stored, base, tab,
        tab.stride(0), tab.stride(1), cnt, cnt.stride(0), cnt.stride(1), group.req, lsig,
        smax, nb, table.shape[-1],
        PAGE_BYTES=geometry.page_bytes, D=geometry.head_dim, Q=score_queries,
        BL=PREFILL_BLOCK, COUNT_TILE=COUNT_TILE, **_constexprs(geometry), num_warps=4,
        enable_fp_fusion=False,
    )

