"""Reference asymmetric min-max quantisation per token and group, and bit packing.

For a group x of one token: ``zero = min(x)`` and ``scale = (max(x) - min(x)) / (2^b - 1)``,
both stored as fp16. ``zero`` is rounded *down* and ``scale`` *up* to fp16 so that the stored
range [zero, zero + (2^b - 1) * scale] still covers the group: the round-trip error of every
element is then at most scale / 2 (plus fp32 arithmetic). A constant group gets the smallest
normal fp16 scale instead of 0, so dequantisation never divides by or multiplies with 0 by
accident and returns the constant within fp16 precision of ``zero``. Values beyond the fp16
range saturate at +-65504.

Codes are ``round_half_even((x - zero) / scale)`` clamped to [0, 2^b - 1], computed in fp32
from the fp16 metadata, so a kernel that uses the same metadata reproduces them exactly.
Packing is little-end first: element i of a row sits in byte (i*b) // 8 at bit (i*b) % 8.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP16_MAX = 65504.0
SCALE_EPS = 2.0**-14  # smallest normal fp16
ALLOWED_BITS = (1, 2, 4, 8)


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 [..., D], unpacked, each < 2^bits
    scale: torch.Tensor  # fp16 [..., groups]
    zero: torch.Tensor  # fp16 [..., groups]


def _check(x: torch.Tensor, bits: int, groups: int) -> None:
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits} is not allowed; choose one of {ALLOWED_BITS}")
    if groups < 1 or x.shape[-1] % groups:
        raise ValueError(f"groups={groups} does not divide the last dimension {x.shape[-1]}")


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    h = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    below = torch.nextafter(h, torch.full_like(h, float("-inf")))
    return torch.where(h.float() > x, below, h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    h = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    above = torch.nextafter(h, torch.full_like(h, float("inf")))
    return torch.where((h.float() < x) & (h.float() < FP16_MAX), above, h)


def quantize(x: torch.Tensor, bits: int, groups: int = 1) -> Quantized:
    """Quantise the last dimension of ``x`` in ``groups`` equal groups to ``bits`` bits."""
    _check(x, bits, groups)
    levels = 2**bits - 1
    xg = x.float().clamp(-FP16_MAX, FP16_MAX).unflatten(-1, (groups, -1))
    lo = xg.amin(dim=-1)
    hi = xg.amax(dim=-1)
    zero = _fp16_down(lo)
    # Divide by a tensor: torch on CUDA turns division by a Python scalar into a multiply by
    # its reciprocal, which can round an ulp away from the IEEE quotient the kernels compute.
    span = hi - zero.float()
    scale = _fp16_up((span / torch.full_like(span, levels)).clamp_min(SCALE_EPS))
    q = torch.round((xg - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
    codes = q.clamp(0, levels).to(torch.uint8).flatten(-2)
    return Quantized(codes, scale, zero)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 values from unpacked codes and fp16 (scale, zero) per group."""
    groups = scale.shape[-1]
    cg = codes.float().unflatten(-1, (groups, -1))
    out = cg * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return out.flatten(-2)


def error_bound(scale: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| for inputs within fp16 range."""
    groups = scale.shape[-1]
    s = scale.float().repeat_interleave(dim // groups, dim=-1)
    return s * 0.5 * (1 + 1e-5) + 1e-6


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., D] codes (< 2^bits) -> uint8 [..., D * bits / 8], little-end first."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits} is not allowed; choose one of {ALLOWED_BITS}")
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dimension {codes.shape[-1]} is not a multiple of {per_byte}")
    c = codes.to(torch.int32).unflatten(-1, (-1, per_byte))
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 [..., B] -> uint8 [..., B * 8 / bits]."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits} is not allowed; choose one of {ALLOWED_BITS}")
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return c.flatten(-2).to(torch.uint8)


def fake_quantize(x: torch.Tensor, bits: int, groups: int = 1) -> torch.Tensor:
    """Quantise then dequantise (fp32): what attention sees after a round trip."""
    return dequantize(*quantize(x, bits, groups))
