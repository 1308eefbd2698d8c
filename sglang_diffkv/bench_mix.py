"""Benchmark mode: tier decisions drawn from a fixed (high, low, pruned) mix, not from scores.

Random ("dummy") model weights give meaningless attention, so a throughput benchmark with
them would measure whatever tier mix the noise happens to produce. With
``DiffKVConfig.bench_mix`` set, every decision is drawn from a counter-based hash instead,
while everything else runs for real: the significance scores are still computed (and then
replaced), the same classifier, compression, decode policy, kernels, pages and memory
manager do the work.

The draw for a token is ``u = hash(request seed, layer, KV head, position)``: a 24-bit
integer, uniform over [0, 2^24). The hash is 32-bit integer arithmetic carried in int64 with
explicit masking (no product exceeds 2^63), so torch (CPU or CUDA) and the Triton decode
kernel compute the same bits; :func:`hash_u24` is the torch side and
``kernels.decode_policy._hash_u24`` the Triton side.

- Prefill: a token outside the recent window is high if ``u < cut_h``, low if
  ``u < cut_hl``, else pruned; :func:`synthetic_significance` encodes that as significance
  values the normal classifier (thresholds alpha / L) turns into exactly those tiers. The
  window is still kept high, and the cuts outside it are rescaled per prompt
  (:func:`prefill_fractions`) so the whole prompt follows the mix whenever
  ``high * L >= window``.
- Decode: per (request, KV head) the step's action is forced (:func:`forced_actions`):
  APPEND_HIGH with probability high, DEMOTE_APPEND with probability low, EVICT_HIGH with
  probability pruned. The victim is the real eligible argmin; without one (window not yet
  full, or no high token old enough) the action falls back to APPEND_HIGH. Each step adds
  one token, so the generated tokens end up high / low / pruned in the mix's proportions.
"""

from __future__ import annotations

import math

import torch

from sglang_diffkv.policy import DecodeAction, Tier, contributing_queries, thresholds

Mix = tuple[float, float, float]

U_BITS = 24  # the draw's resolution: fractions are realised to within 2^-24
U_RANGE = 1 << U_BITS
MASK32 = 0xFFFFFFFF
# Odd multipliers below 2^31: a 32-bit value times one stays below 2^63 in int64.
MUL_A = 0x7FEB352D
MUL_B = 0x2C1B3C6D
SEED_SALT = 0x3C6EF372
# Significance means the classifier sees: HIGH_MEAN >= any threshold (they are clamped to
# [0, 1]), PRUNED_MEAN < any threshold (they are >= 0); low tokens get the midpoint of
# [alpha_l / L, alpha_h / L).
HIGH_MEAN = 2.0
PRUNED_MEAN = -1.0


def cut(fraction: float | torch.Tensor) -> int | torch.Tensor:
    """The draw threshold of a cumulative fraction: ``u < cut(f)`` has probability f.
    floor(f * 2^24 + 0.5) in float64: the same bits in torch, Python and the kernel (a
    round-half-even would need a matching rint everywhere)."""
    if isinstance(fraction, torch.Tensor):
        return torch.floor(fraction.double() * U_RANGE + 0.5).long().clamp(0, U_RANGE)
    return min(max(math.floor(fraction * U_RANGE + 0.5), 0), U_RANGE)


def decode_cuts(mix: Mix) -> tuple[int, int]:
    """(cut_h, cut_hl): APPEND_HIGH below cut_h, DEMOTE_APPEND below cut_hl, else EVICT."""
    high, low, _ = mix
    return int(cut(high)), int(cut(high + low))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


def hash_u24(
    seed: torch.Tensor, layer: int, head: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """int64 draws in [0, 2^24) of (seed, layer, head, position); broadcasts."""
    x = _mix32((seed.long() & MASK32) ^ SEED_SALT)
    x = _mix32(x ^ (layer & MASK32))
    x = _mix32(x ^ (head.long() & MASK32))
    x = _mix32(x ^ (position.long() & MASK32))
    return x >> (32 - U_BITS)


def prefill_fractions(mix: Mix, length: torch.Tensor, window: int) -> torch.Tensor:
    """Per prompt, the (high, low) fractions to draw outside the recent window so that the
    whole prompt is ``mix`` in expectation: the window's min(W, L) high tokens count
    towards ``high * L``; when they exceed it (short prompts) nothing outside is high and
    low : pruned keep the mix's ratio. float64 [B, 2]."""
    high, low, pruned = mix
    # (the kernel, kernels.bench_mix, repeats these float64 operations in this order)
    n = length.double()
    w = n.clamp(max=window)
    outside = (n - w).clamp_min(1)
    fh = ((high * n - w).clamp_min(0) / outside).clamp(max=1)
    rest = low + pruned
    fl = (1 - fh) * (low / rest) if rest > 0 else torch.zeros_like(fh)
    return torch.stack([fh, fl], -1)


def synthetic_significance(
    seed: torch.Tensor,
    layer: int,
    num_kv_heads: int,
    length: torch.Tensor,
    max_len: int,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    mix: Mix,
    window: int,
    score_queries: int,
) -> torch.Tensor:
    """fp32 [B, Hkv, max_len] significance sums that ``policy.classify_prompt`` (and the
    prefill kernel's classifier) turns into the drawn tiers. seed, length, alpha_*: [B].

    Low needs alpha_h / L > alpha_l / L (else low tokens classify high)."""
    dev = length.device
    length = length.long()
    frac = prefill_fractions(mix, length, window)
    cut_h = cut(frac[:, 0])[:, None, None]
    cut_hl = cut(frac[:, 0] + frac[:, 1])[:, None, None]
    u = hash_u24(
        seed.to(dev)[:, None, None],
        layer,
        torch.arange(num_kv_heads, device=dev)[None, :, None],
        torch.arange(max_len, device=dev)[None, None, :],
    )
    t_h = thresholds(alpha_h.to(dev), length)
    t_l = thresholds(alpha_l.to(dev), length)
    low_mean = (0.5 * (t_l + t_h))[:, None, None]
    mean = torch.where(
        u < cut_h,
        torch.full_like(low_mean, HIGH_MEAN),
        torch.where(u < cut_hl, low_mean, torch.full_like(low_mean, PRUNED_MEAN)),
    )
    count = contributing_queries(length, max_len, score_queries).clamp_min(1).float()
    return (mean * count[:, None, :]).float()


def drawn_prompt_tiers(
    seed: torch.Tensor, layer: int, num_kv_heads: int, length: torch.Tensor, max_len: int,
    mix: Mix, window: int,
) -> torch.Tensor:
    """int8 [B, Hkv, max_len] tiers the draw asks for (window high, padding pruned): what
    classifying :func:`synthetic_significance` must give."""
    dev = length.device
    length = length.long()
    frac = prefill_fractions(mix, length, window)
    u = hash_u24(
        seed.to(dev)[:, None, None],
        layer,
        torch.arange(num_kv_heads, device=dev)[None, :, None],
        torch.arange(max_len, device=dev)[None, None, :],
    )
    i = torch.arange(max_len, device=dev)[None, None, :]
    n = length[:, None, None]
    tier = torch.where(
        u < cut(frac[:, 0])[:, None, None],
        Tier.HIGH,
        torch.where(u < cut(frac[:, 0] + frac[:, 1])[:, None, None], Tier.LOW, Tier.PRUNED),
    )
    tier = torch.where(i >= n - window, Tier.HIGH, tier)
    return torch.where(i < n, tier, Tier.PRUNED).to(torch.int8)


def forced_actions(
    seed: torch.Tensor, layer: int, num_kv_heads: int, positions: torch.Tensor, mix: Mix
) -> torch.Tensor:
    """int8 [B, Hkv] decode actions drawn for the token at ``positions`` ([B])."""
    dev = positions.device
    u = hash_u24(
        seed.to(dev)[:, None],
        layer,
        torch.arange(num_kv_heads, device=dev)[None, :],
        positions.long()[:, None],
    )
    cut_h, cut_hl = decode_cuts(mix)
    action = torch.where(
        u < cut_h,
        int(DecodeAction.APPEND_HIGH),
        torch.where(u < cut_hl, int(DecodeAction.DEMOTE_APPEND), int(DecodeAction.EVICT_HIGH)),
    )
    return action.to(torch.int8)
