"""Tier layouts as the constexpr keyword arguments the Triton kernels take, and what every
paged kernel reads first: its (request, KV head) row of the page table and counters.

Kernels never hard-code a byte offset: every size comes from ``layout.TierLayout`` through
:func:`tier_constexprs`, under a prefix (``H_`` high tier, ``L_`` low tier, ``T_`` the one
tier a store kernel writes).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from sglang_diffkv.config import KERNEL_BITS  # widths the unpacking in the kernels handles
from sglang_diffkv.layout import TierLayout

# Under TRITON_INTERPRET=1 (CPU CI) some kernels take an fp32 path around interpreter gaps.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def tier_constexprs(layout: TierLayout, prefix: str) -> dict[str, int]:
    t = layout.tier
    for what, bits in (("key", t.key_bits), ("value", t.value_bits)):
        if bits not in KERNEL_BITS:
            raise ValueError(
                f"{t.name}: {what}_bits={bits} is not supported by the kernels ({KERNEL_BITS})"
            )
    return {
        f"{prefix}KB": t.key_bits,
        f"{prefix}VB": t.value_bits,
        f"{prefix}KG": t.key_groups,
        f"{prefix}VG": t.value_groups,
        f"{prefix}N": layout.tokens_per_page,
        f"{prefix}BN": triton.next_power_of_2(layout.tokens_per_page),
        f"{prefix}KOFF": layout.key_offset,
        f"{prefix}KMOFF": layout.key_meta_offset,
        f"{prefix}VOFF": layout.value_offset,
        f"{prefix}VMOFF": layout.value_meta_offset,
        f"{prefix}SOFF": layout.score_offset,
        f"{prefix}POFF": layout.pos_offset,
    }


def page_views(pages):
    """The one page pool seen as uint8, fp16, fp32 and int32 (same memory; page_bytes is a
    multiple of 32 so every view is exact)."""
    if pages.dtype.itemsize != 1 or pages.dim() != 2:
        raise ValueError(f"pages must be uint8 [num_pages, page_bytes], got {pages.dtype} "
                         f"{tuple(pages.shape)}")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")
    import torch

    return (pages, pages.view(torch.float16), pages.view(torch.float32),
            pages.view(torch.int32))


@triton.jit
def row_pointers(table, t_sr, t_sh, counts, c_sr, c_sh, req, b, h):
    """Program (b, h)'s page-table row and token counters (n_high at +0, n_low at +1) in a
    layer's [max_reqs, Hkv, ...] table / counts; the request is req[b], widened to int64."""
    r = tl.load(req + b).to(tl.int64)
    return table + r * t_sr + h * t_sh, counts + r * c_sr + h * c_sh
