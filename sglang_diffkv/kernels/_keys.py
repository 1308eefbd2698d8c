"""Packed (avg, slot) keys of the eligible argmin: one int64 whose signed order is avg's,
then the slot's, so a min (``tl.min``, ``tl.atomic_min``) is the argmin with ties to the
first slot. Shared by the policy kernels and the decode merge pass (fused argmin)."""

import triton
import triton.language as tl


@triton.jit
def _none_key():
    """The packed key of "no eligible token": +inf's order bits over slot 0xFFFFFFFF (-1).
    (A function, not a module global: the GPU compiler rejects non-constexpr globals.)"""
    return tl.full([], 0x7F800000FFFFFFFF, tl.int64)


@triton.jit
def _pack_key(avg, slot):
    """(avg, slot) -> int64 whose signed order is avg's order, then slot's (slot < 2^32).

    The float's bits become an int32 of the same order (negative floats: magnitude bits
    flipped; -0.0 first folded to +0.0 so that 0 and -0 tie as in the float compare). Scores
    are sums of probabilities (>= 0), so the flip never fires in practice: it is there so
    the key is exact for any non-NaN avg at the cost of two integer ops."""
    bits = avg.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (slot.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _unpack_key(key):
    """int64 key -> (avg fp32, slot int64 with -1 for none): the inverse of _pack_key."""
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    slot = key & 0xFFFFFFFF
    return bits.to(tl.float32, bitcast=True), tl.where(slot == 0xFFFFFFFF, -1, slot)
