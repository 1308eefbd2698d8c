"""The inline-PTX code conversion of decode attention (sglang_diffkv/kernels/_codes.py).

The interpreter cannot run inline asm, so the PTX's instruction sequence is checked through
its numpy model (same constants, same operations) on every byte value, and the PTX text is
checked to be made of exactly those instructions with those constants.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from sglang_diffkv.kernels._codes import (
    EXP_1024,
    PRMT_SELECTORS,
    asm_source,
    emulate,
    field_constants,
)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_every_byte_converts_exactly(bits):
    rng = np.random.default_rng(bits)
    codes = np.concatenate([np.arange(256, dtype=np.uint8),
                            rng.integers(0, 256, 4096, dtype=np.uint8)])
    outs = emulate(codes, bits)
    assert len(outs) == 8 // bits
    for j, got in enumerate(outs):
        want = ((codes >> (j * bits)) & ((1 << bits) - 1)).astype(np.float16)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ptx_uses_the_emulated_constants(bits):
    asm, constraints = asm_source(bits)
    per = 8 // bits
    assert constraints.split(",") == ["=r"] * (2 * per) + ["r"]
    src = f"${2 * per}"
    prmt = re.findall(r"prmt\.b32 (t\d), (\$\d+), 0, (0x[0-9a-f]+);", asm)
    assert prmt == [(f"t{h}", src, hex(s)) for h, s in enumerate(PRMT_SELECTORS)]
    orr = hex((EXP_1024 << 16) | EXP_1024)
    for j in range(per):
        mask, mul, add = field_constants(bits, j)
        for h in range(2):
            out = f"${2 * j + h}"
            assert f"lop3.b32 {out}, t{h}, {hex(mask)}, {orr}, 0xEA;" in asm
        assert f"mov.b32 m, {hex(mul)};" in asm and f"mov.b32 a, {hex(add)};" in asm
    # every output register is written by exactly one lop3 and one fma
    for r in range(2 * per):
        assert asm.count(f"fma.rn.f16x2 ${r}, ${r}, m, a;") == 1
