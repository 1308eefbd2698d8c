"""Packed integer codes -> exact fp16, four bytes per inline-PTX call (decode attention).

The plain Triton path (``_codes_f16`` in decode_attention.py) spends per element a shift, a
mask, a widening convert, an OR with 0x6400 and a half subtract. Here one ``prmt.b32`` spreads
two code bytes into the low bytes of an fp16x2 pair, one ``lop3.b32`` keeps a bit field and ORs
in the exponent 0x64 (fp16 1024, whose ulp is 1), and one ``sub``/``fma.rn.f16x2`` removes the
1024 and the field's power-of-two weight: 3 instructions per 2 codes of a 8-bit field, and the
``prmt`` is shared by every field of a byte (Marlin/FasterTransformer style).

Bit field ``j`` of a ``bits``-wide code sits at bits [j*bits, (j+1)*bits) of its byte (the page
layout packs little end first). Masked in place it reads as 1024 + c * 2**(j*bits), so
``fma(x, 2**-(j*bits), -1024 * 2**-(j*bits))`` is c, exactly (every value is an fp16 integer
times a power of two, well inside the 11-bit mantissa).

The PTX is generated from :func:`field_constants`, and :func:`emulate` evaluates the same
instruction sequence with the same constants in numpy, so the CPU tests check every byte
value (the Triton interpreter cannot run inline asm; there the kernels take the plain path).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

# prmt selectors: result bytes (b_lo, 0, b_hi, 0) from source bytes (0, 1) and (2, 3); the
# zero comes from the second operand (byte index 4 = its byte 0, which is 0)
PRMT_SELECTORS = (0x4140, 0x4342)
EXP_1024 = 0x6400  # fp16 1024.0: exponent 25 - 15 = 10, so the mantissa's ulp is 1


def _f16_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float16).view(np.uint16))


def field_constants(bits: int, j: int) -> tuple[int, int, int]:
    """(lop3 mask, fp16x2 multiplier bits, fp16x2 addend bits) for bit field ``j``."""
    field = ((1 << bits) - 1) << (j * bits)
    weight = 2.0 ** -(j * bits)
    mul, add = _f16_bits(weight), _f16_bits(-1024.0 * weight)
    return (field << 16) | field, (mul << 16) | mul, (add << 16) | add


def asm_source(bits: int) -> tuple[str, str]:
    """(PTX, constraints) for one call on 4 packed code bytes: 8 // bits results, each 4 fp16
    in two .b32 registers (result-major: $0,$1 = field 0, $2,$3 = field 1, ...)."""
    per = 8 // bits
    src = 2 * per  # the input register follows the outputs
    lines = ["{", ".reg .b32 t0, t1, m, a;"]
    for h, sel in enumerate(PRMT_SELECTORS):
        lines.append(f"prmt.b32 t{h}, ${src}, 0, {sel:#x};")
    for j in range(per):
        mask, mul, add = field_constants(bits, j)
        orr = (EXP_1024 << 16) | EXP_1024
        for h in range(2):
            out = f"${2 * j + h}"
            # lop3 immLut 0xEA = (a & b) | c
            lines.append(f"lop3.b32 {out}, t{h}, {mask:#x}, {orr:#x}, 0xEA;")
            lines.append(f"mov.b32 m, {mul:#x};")
            lines.append(f"mov.b32 a, {add:#x};")
            lines.append(f"fma.rn.f16x2 {out}, {out}, m, a;")
    lines.append("}")
    constraints = ",".join(["=r"] * (2 * per) + ["r"])
    return "\n".join(lines), constraints


def emulate(codes: np.ndarray, bits: int) -> list[np.ndarray]:
    """The asm's result on uint8 ``codes`` (any length divisible by 4), per field, computed by
    the same prmt / lop3 / fma sequence with the same constants."""
    words = codes.astype(np.uint8).view(np.uint32)
    outs = []
    for j in range(8 // bits):
        mask, mul, add = field_constants(bits, j)
        halves = []
        for sel in PRMT_SELECTORS:
            pair = np.zeros_like(words)
            src8 = np.stack([(words >> (8 * i)) & 0xFF for i in range(4)] + [0 * words] * 4)
            for i in range(4):  # result byte i takes source byte (sel >> 4i) & 7
                pair |= src8[(sel >> (4 * i)) & 7].astype(np.uint32) << (8 * i)
            x = (pair & mask) | ((EXP_1024 << 16) | EXP_1024)
            xh = x.astype(np.uint32).view(np.float16).reshape(-1, 2)
            m = np.array([mul & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
            a = np.array([add & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
            # fma.rn: exact product and sum (all exact here), rounded once to fp16
            y = (xh.astype(np.float64) * float(m) + float(a)).astype(np.float16)
            halves.append(y)
        outs.append(np.stack(halves, 1).reshape(-1))  # (b0, b1) then (b2, b3) per word
    return outs


# (constexpr globals: a jitted function may only read module globals wrapped this way)
ASM8 = tl.constexpr(asm_source(8)[0])
CON8 = tl.constexpr(asm_source(8)[1])
ASM4 = tl.constexpr(asm_source(4)[0])
CON4 = tl.constexpr(asm_source(4)[1])
ASM2 = tl.constexpr(asm_source(2)[0])
CON2 = tl.constexpr(asm_source(2)[1])


@triton.jit
def unpack_codes_asm(packed, BITS: tl.constexpr):
    """All 8 // BITS bit fields of uint8 codes as exact fp16 tensors of packed's shape (a
    4-tuple; unused entries repeat field 0)."""
    if BITS == 8:
        c0 = tl.inline_asm_elementwise(ASM8, CON8, [packed], dtype=tl.float16, is_pure=True,
                                       pack=4)
        return c0, c0, c0, c0
    elif BITS == 4:
        c0, c1 = tl.inline_asm_elementwise(ASM4, CON4, [packed], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
        return c0, c1, c0, c0
    else:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            ASM2, CON2, [packed], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=4)
        return c0, c1, c2, c3
