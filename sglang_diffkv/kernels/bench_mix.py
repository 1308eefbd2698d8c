"""Benchmark mode's synthetic prompt significance in one launch per layer.

``bench_mix.synthetic_significance`` in torch is some thirty elementwise launches per layer;
at short prompts that host overhead would be a cost the real system does not have and would
bias a throughput benchmark. This kernel computes the same values, bit for bit: the same
int64-masked hash (``decode_policy._hash_u24``), the same float64 rescale of the mix per
prompt, the same fp32 means times the same query counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_diffkv import bench_mix
from sglang_diffkv.kernels.decode_policy import _hash_u24, hash_constexprs
from sglang_diffkv.kernels.prefill import _threshold


@triton.jit(do_not_specialize=("Lmax",))  # a per-step size (as in prefill.py)
def _bench_sig_kernel(
    seed, lengths, alpha_h, alpha_l, mix, sig, layer, Lmax,
    WINDOW: tl.constexpr, Q: tl.constexpr, BL: tl.constexpr, HIGH_MEAN: tl.constexpr,
    PRUNED_MEAN: tl.constexpr, MUL_A: tl.constexpr, MUL_B: tl.constexpr, SALT: tl.constexpr,
    U_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2) * BL + tl.arange(0, BL)
    inside = i < Lmax
    n = tl.load(lengths + b)
    # bench_mix.prefill_fractions, float64, same operations in the same order
    high = tl.load(mix)
    low = tl.load(mix + 1)
    rest = low + tl.load(mix + 2)
    nf = n.to(tl.float64)
    w = tl.minimum(nf, WINDOW)
    outside = tl.maximum(nf - w, 1.0)
    fh = tl.minimum(tl.maximum(high * nf - w, 0.0) / outside, 1.0)
    fl = tl.where(rest > 0, (1.0 - fh) * (low / tl.where(rest > 0, rest, 1.0)), 0.0)
    u_range = (1 << U_BITS) * 1.0
    cut_h = tl.minimum(tl.maximum(tl.floor(fh * u_range + 0.5), 0.0), u_range).to(tl.int64)
    cut_hl = tl.minimum(tl.maximum(tl.floor((fh + fl) * u_range + 0.5), 0.0),
                        u_range).to(tl.int64)
    u = _hash_u24(tl.load(seed + b), layer, h, i, MUL_A, MUL_B, SALT, U_BITS)
    t_h = _threshold(tl.load(alpha_h + b), n)
    t_l = _threshold(tl.load(alpha_l + b), n)
    low_mean = 0.5 * (t_l + t_h)
    mean = tl.where(u < cut_h, HIGH_MEAN, tl.where(u < cut_hl, low_mean, PRUNED_MEAN))
    count = tl.maximum(tl.minimum(tl.maximum(n - i, 0), Q), 1).to(tl.float32)
    tl.store(sig + (b * tl.num_programs(1) + h) * Lmax + i, mean * count, mask=inside)


def synthetic_significance(
    seed: torch.Tensor,
    layer: int,
    num_kv_heads: int,
    length: torch.Tensor,
    max_len: int,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    mix: bench_mix.Mix,
    window: int,
    score_queries: int,
    mix_tensor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bench_mix.synthetic_significance`` as one Triton launch (same arguments; ``mix_tensor``
    = the mix as float64 on the device, to skip a host copy per call; ``out`` = fp32
    [B, Hkv, max_len] to write into)."""
    dev = length.device
    b = length.shape[0]
    if seed.shape != (b,) or alpha_h.shape != (b,) or alpha_l.shape != (b,):
        raise ValueError(f"seed, alpha_h and alpha_l must be [{b}] like length")
    if mix_tensor is None:
        mix_tensor = torch.tensor(mix, dtype=torch.float64, device=dev)
    shape = (b, num_kv_heads, max_len)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=dev)
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    bl = 128
    _bench_sig_kernel[(b, num_kv_heads, triton.cdiv(max_len, bl))](
        seed.to(device=dev, dtype=torch.int64).contiguous(),
        length.to(device=dev, dtype=torch.int32).contiguous(),
        alpha_h.to(device=dev, dtype=torch.float32).contiguous(),
        alpha_l.to(device=dev, dtype=torch.float32).contiguous(),
        mix_tensor, out, layer, max_len,
        WINDOW=window, Q=score_queries, BL=bl, HIGH_MEAN=bench_mix.HIGH_MEAN,
        PRUNED_MEAN=bench_mix.PRUNED_MEAN, **hash_constexprs(), num_warps=4,
        enable_fp_fusion=False,
    )
    return out
