"""Triton device functions for the quantiser of ``sglang_diffkv.quant`` and the page store of
``sglang_diffkv.pages``, bit-exact with them.

Exactness needs three things the references spell out: fp16 metadata rounded with the
direction they use (zero down, scale up), IEEE division (``div_rn``: Triton's ``/`` may be
approximate on the GPU) and round-half-even codes. Kernels that quantise are launched with
``enable_fp_fusion=False`` so ``x * s + z`` is not contracted into an FMA the reference does
not do.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP16_MAX = tl.constexpr(65504.0)
SCALE_EPS = tl.constexpr(6.103515625e-05)  # 2**-14, the smallest normal fp16
ROUND_MAGIC = tl.constexpr(8388608.0)  # 2**23: (y + 2**23) - 2**23 rounds 0 <= y < 2**23 RNE


@triton.jit
def fp16_down(x):
    """Largest fp16 <= x (x finite fp32 within +-65504)."""
    h = x.to(tl.float16)
    b = h.to(tl.int16, bitcast=True)
    # int16 view: positive floats grow with the bits, negative ones (sign set) shrink
    below = tl.where(b > 0, b - 1, tl.where(b == 0, -32767, b + 1)).to(tl.int16)
    return tl.where(h.to(tl.float32) > x, below.to(tl.float16, bitcast=True), h)


@triton.jit
def fp16_up_positive(x):
    """Smallest fp16 >= x for x > 0 (saturating at 65504)."""
    h = x.to(tl.float16)
    b = h.to(tl.int16, bitcast=True)
    hf = h.to(tl.float32)
    above = (b + 1).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where((hf < x) & (hf < FP16_MAX), above, h)


@triton.jit
def quantize_store(
    u8,
    f16,
    x,
    base,
    slot,
    mask,
    T: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUPS: tl.constexpr,
    DOFF: tl.constexpr,
    MOFF: tl.constexpr,
):
    """Quantise rows x (fp32 [T, D]) and store codes + (scale, zero) at byte ``base`` (int64
    [T], the page start) + segment offsets, token slot ``slot`` [T], where ``mask`` [T]."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    GS: tl.constexpr = D // GROUPS
    RB: tl.constexpr = D // PER  # packed bytes per row
    x = tl.minimum(tl.maximum(x, -FP16_MAX), FP16_MAX)
    xg = tl.reshape(x, [T, GROUPS, GS])
    zero = fp16_down(tl.min(xg, axis=2))
    zf = zero.to(tl.float32)
    levels = tl.full([T, GROUPS], LEVELS, tl.float32)
    scale = fp16_up_positive(tl.maximum(tl.math.div_rn(tl.max(xg, axis=2) - zf, levels),
                                        SCALE_EPS))
    sf = scale.to(tl.float32)
    y = tl.math.div_rn(xg - zf[:, :, None], tl.broadcast_to(sf[:, :, None], [T, GROUPS, GS]))
    y = tl.minimum(tl.maximum(y, 0.0), LEVELS * 1.0)
    q = ((y + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)
    q = tl.reshape(q, [T, RB, PER])
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(q << shifts[None, None, :], axis=2).to(tl.uint8)
    cols = tl.arange(0, RB)
    ptr = u8 + (base + DOFF + slot.to(tl.int64) * RB)[:, None] + cols[None, :]
    tl.store(ptr, packed, mask=mask[:, None])
    g = tl.arange(0, GROUPS)
    meta = ((base + MOFF) // 2 + slot.to(tl.int64) * (2 * GROUPS))[:, None] + g[None, :] * 2
    tl.store(f16 + meta, scale, mask=mask[:, None])
    tl.store(f16 + meta + 1, zero, mask=mask[:, None])


@triton.jit
def load_dequant(
    u8,
    f16,
    base,
    slot,
    mask,
    T: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUPS: tl.constexpr,
    DOFF: tl.constexpr,
    MOFF: tl.constexpr,
):
    """fp32 [T, D] dequantised rows (codes * scale + zero, as ``quant.dequantize``)."""
    PER: tl.constexpr = 8 // BITS
    GS: tl.constexpr = D // GROUPS
    RB: tl.constexpr = D // PER
    cols = tl.arange(0, RB)
    ptr = u8 + (base + DOFF + slot.to(tl.int64) * RB)[:, None] + cols[None, :]
    packed = tl.load(ptr, mask=mask[:, None], other=0).to(tl.int32)
    shifts = tl.arange(0, PER) * BITS
    codes = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes.to(tl.float32), [T, GROUPS, GS])
    g = tl.arange(0, GROUPS)
    meta = ((base + MOFF) // 2 + slot.to(tl.int64) * (2 * GROUPS))[:, None] + g[None, :] * 2
    scale = tl.load(f16 + meta, mask=mask[:, None], other=0.0).to(tl.float32)
    zero = tl.load(f16 + meta + 1, mask=mask[:, None], other=0.0).to(tl.float32)
    out = codes * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(out, [T, D])


@triton.jit
def store_score_pos(f32, i32, base, slot, mask, score, pos, SOFF: tl.constexpr,
                    POFF: tl.constexpr):
    tl.store(f32 + (base + SOFF) // 4 + slot, score, mask=mask)
    tl.store(i32 + (base + POFF) // 4 + slot, pos, mask=mask)


