"""Quantise-and-store kernels: any tokens at given (page, slot) of one tier, and a decode
token per (request, KV head). Mirror ``pages.write_tokens`` byte for byte."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_diffkv.kernels._quant import quantize_store, store_score_pos
from sglang_diffkv.kernels._tier import page_views, tier_constexprs
from sglang_diffkv.layout import TierLayout
from sglang_diffkv.pages import write_tokens

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# T (tokens to store) follows the step's chunk sizes or the decode batch: a runtime int that
# Triton must not specialise (1 or a multiple of 16 would each be a compile of its own)
@triton.jit(do_not_specialize=("T",))
def _store_tokens_kernel(
    u8, f16, f32, i32,
    key, k_s, value, v_s, score, pos, page_ids, slots, T,
    PAGE_BYTES: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    T_KB: tl.constexpr, T_VB: tl.constexpr, T_KG: tl.constexpr, T_VG: tl.constexpr,
    T_N: tl.constexpr, T_BN: tl.constexpr, T_KOFF: tl.constexpr, T_KMOFF: tl.constexpr,
    T_VOFF: tl.constexpr, T_VMOFF: tl.constexpr, T_SOFF: tl.constexpr, T_POFF: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < T
    d = tl.arange(0, D)
    k = tl.load(key + t[:, None] * k_s + d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(value + t[:, None] * v_s + d[None, :], mask=mask[:, None], other=0.0)
    page = tl.load(page_ids + t, mask=mask, other=0).to(tl.int64)
    slot = tl.load(slots + t, mask=mask, other=0)
    base = page * PAGE_BYTES
    quantize_store(u8, f16, k.to(tl.float32), base, slot, mask, BLOCK_T, D, T_KB, T_KG,
                   T_KOFF, T_KMOFF)
    quantize_store(u8, f16, v.to(tl.float32), base, slot, mask, BLOCK_T, D, T_VB, T_VG,
                   T_VOFF, T_VMOFF)
    s = tl.load(score + t, mask=mask, other=0.0)
    p = tl.load(pos + t, mask=mask, other=0)
    store_score_pos(f32, i32, base, slot, mask, s, p, T_SOFF, T_POFF)


def _check_rows(name: str, x: torch.Tensor, t: int, d: int) -> torch.Tensor:
    if x.shape != (t, d):
        raise ValueError(f"{name} must be [{t}, {d}], got {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{name} must be one of {ACT_DTYPES}, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def store_tokens(
    pages: torch.Tensor,
    layout: TierLayout,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score: torch.Tensor,
    pos: torch.Tensor,
) -> None:
    """Kernel twin of :func:`sglang_diffkv.pages.write_tokens` (same arguments)."""
    if page_ids.dim() != 1 or slots.shape != page_ids.shape:
        raise ValueError("page_ids and slots must be equal 1-D shapes")
    t, d = page_ids.shape[0], layout.head_dim
    if t == 0:
        return
    key = _check_rows("key", key, t, d)
    value = _check_rows("value", value, t, d)
    if score.numel() != t or pos.numel() != t:
        raise ValueError(f"score and pos must have {t} elements")
    u8, f16, f32, i32 = page_views(pages)
    block = 16
    _store_tokens_kernel[(triton.cdiv(t, block),)](
        u8, f16, f32, i32,
        key, key.stride(0), value, value.stride(0),
        score.reshape(-1).float().contiguous(), pos.reshape(-1).int().contiguous(),
        page_ids.int().contiguous(), slots.int().contiguous(), t,
        PAGE_BYTES=pages.shape[1], D=d, BLOCK_T=block,
        **tier_constexprs(layout, "T_"), num_warps=4, enable_fp_fusion=False,
    )


store_tokens_reference = write_tokens


def store_decode(
    pages: torch.Tensor,
    layout: TierLayout,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score: torch.Tensor,
    pos: torch.Tensor,
) -> None:
    """One decode token per (request, KV head) of one tier: page_ids/slots/score/pos
    [B, Hkv], key/value [B, Hkv, D] (fp16/bf16/fp32)."""
    b, h = page_ids.shape
    store_tokens(pages, layout, page_ids.reshape(-1), slots.reshape(-1),
                 key.reshape(b * h, -1), value.reshape(b * h, -1),
                 score.reshape(-1), pos.reshape(-1))


def store_decode_reference(pages, layout, page_ids, slots, key, value, score, pos) -> None:
    b, h = page_ids.shape
    write_tokens(pages, layout, page_ids.reshape(-1), slots.reshape(-1).int(),
                 key.reshape(b * h, -1), value.reshape(b * h, -1),
                 score.reshape(-1), pos.reshape(-1))
