"""Benchmark mode's synthetic prompt significance in one launch per layer.

``bench_mix.synthetic_significance`` in torch is some thirty elementwise launches per layer;
at short prompts that host overhead would be a cost the real system does not have and would
bias a throughput benchmark. This kernel computes the same values, bit for bit: the same
int64-masked hash (``decode_policy._hash_u24``), the same float64 rescale of the mix per
prompt, the same fp32 means times the same query counts. The arithmetic is
``prefill._bench_draw``, which the prefill classifier also runs (``compress_prefill``'s
``bench=``): the serving path draws there, without this launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_diffkv import bench_mix
from sglang_diffkv.kernels.prefill import (
    _as,
    _bench_draw,
    _check_buffer,
    _threshold,
    bench_constexprs,
)


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
    n = tl.load(lengths + b)
    t_h = _threshold(tl.load(alpha_h + b), n)
    t_l = _threshold(tl.load(alpha_l + b), n)
    s = _bench_draw(tl.load(seed + b), layer, h, i, n, mix, t_h, t_l, WINDOW, Q, HIGH_MEAN,
                    PRUNED_MEAN, MUL_A, MUL_B, SALT, U_BITS)
    tl.store(sig + (b * tl.num_programs(1) + h) * Lmax + i, s, mask=i < Lmax)


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
    else:
        _check_buffer("out", out, shape, torch.float32, dev)
    bl = 128
    _bench_sig_kernel[(b, num_kv_heads, triton.cdiv(max_len, bl))](
        _as(seed, torch.int64, dev), _as(length, torch.int32, dev),
        _as(alpha_h, torch.float32, dev), _as(alpha_l, torch.float32, dev),
        mix_tensor, out, layer, max_len,
        WINDOW=window, Q=score_queries, BL=bl, **bench_constexprs(), num_warps=4,
        enable_fp_fusion=False,
    )
    return out
