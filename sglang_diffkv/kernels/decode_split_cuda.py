"""Launcher of ``cuda/decode_attention.cu``: the tensor-core split-K pass of decode attention
(``DecodeAttentionPlan`` variant ``cuda``). It writes the same scratch as the Triton split-K
pass except that the per-iteration running max is kept per warp (``WARPS`` of them), which
the shared merge pass reads with ``MW = WARPS``.

:func:`unsupported_reason` says why a plan cannot use it (None when it can): the kernel is
built for the K8V4 / K4V2 tier pair with one metadata group per token, head_dim 128, a GQA
group of at most 8 query heads and one page per iteration.
"""

from __future__ import annotations

import ctypes

import torch

from sglang_diffkv.kernels._nvcc import CudaLibrary
from sglang_diffkv.layout import PageGeometry

WARPS = 4  # per program; each keeps its own running max (mit has WARPS entries per iteration)
# Pages in flight per program: 0 = the next page prefetched into registers, else a pipeline of
# that many bulk copies into shared memory (the launcher is built for these depths).
STAGES = (0, 2, 3, 4)
DEFAULT_STAGES = 4
MAX_GROUP = 8


class _Tier(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in (
        "tokens_per_page", "pages_per_part", "maxp", "key_offset", "key_meta_offset",
        "value_offset", "value_meta_offset", "copy_bytes")]


class SplitArgs(ctypes.Structure):
    """Mirror of ``SplitArgs`` in the .cu file (the size is checked against the library)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_sb", ctypes.c_int64), ("q_sh", ctypes.c_int64),
        ("q_bf16", ctypes.c_int32),
        ("pages", ctypes.c_void_p), ("page_bytes", ctypes.c_int64),
        ("table", ctypes.c_void_p), ("t_sr", ctypes.c_int64), ("t_sh", ctypes.c_int64),
        ("counts", ctypes.c_void_p), ("c_sr", ctypes.c_int64), ("c_sh", ctypes.c_int64),
        ("req", ctypes.c_void_p), ("req_i64", ctypes.c_int32),
        ("acc", ctypes.c_void_p), ("ml", ctypes.c_void_p), ("p", ctypes.c_void_p),
        ("mit", ctypes.c_void_p),
        ("qk_scale", ctypes.c_float),
        ("row_len", ctypes.c_int32), ("group", ctypes.c_int32), ("block_g", ctypes.c_int32),
        ("iters_max", ctypes.c_int32), ("row_stride", ctypes.c_int32),
        ("maxp_total", ctypes.c_int32), ("stages", ctypes.c_int32),
        ("hi", _Tier), ("lo", _Tier),
    ]


def declare(lib: ctypes.CDLL) -> None:
    """Types the launcher; raises RuntimeError unless the library speaks this module's
    ``SplitArgs`` (same symbols, same struct size)."""
    if not hasattr(lib, "diffkv_decode_split_launch"):
        raise RuntimeError("the library exports no diffkv_decode_split_launch")
    lib.diffkv_decode_split_launch.restype = ctypes.c_int
    lib.diffkv_decode_split_launch.argtypes = [
        ctypes.POINTER(SplitArgs), ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
    lib.diffkv_decode_split_args_size.restype = ctypes.c_int32
    size = lib.diffkv_decode_split_args_size()
    if size != ctypes.sizeof(SplitArgs):
        raise RuntimeError(f"SplitArgs is {size} bytes in the library but "
                           f"{ctypes.sizeof(SplitArgs)} in Python")


LIBRARY = CudaLibrary("decode_attention.cu", declare)


def geometry_reason(geometry: PageGeometry, group: int, pages_per_iter: int) -> str | None:
    """Why this shape is outside what the kernel is built for (None if inside)."""
    hi, lo = geometry.high, geometry.low
    if geometry.head_dim != 128:
        return f"head_dim={geometry.head_dim} (the CUDA split-K pass is built for 128)"
    for t, want in ((hi, (8, 4, 32)), (lo, (4, 2, 64))):
        tc = t.tier
        bn = 1 << (t.tokens_per_page - 1).bit_length()
        if (tc.key_bits, tc.value_bits, bn) != want or tc.key_groups != 1 or tc.value_groups != 1:
            return (f"tier {tc.name} with {t.tokens_per_page} tokens per page (the CUDA pass "
                    f"is built for K8V4 / K4V2, one metadata group, 32 / 64-token tiles)")
        d = geometry.head_dim
        for off, per_token in ((t.key_offset, d * tc.key_bits // 8), (t.key_meta_offset, 4),
                               (t.value_offset, d * tc.value_bits // 8),
                               (t.value_meta_offset, 4)):
            if off + bn * per_token > geometry.page_bytes:
                return f"tier {tc.name}: a {bn}-slot tile overruns the page"
    if group > MAX_GROUP:
        return f"GQA group {group} > {MAX_GROUP}"
    if pages_per_iter != 1:
        return f"pages_per_iter={pages_per_iter} (the CUDA pass takes one page per iteration)"
    return None


def check_stages(stages: int) -> int:
    if stages not in STAGES:
        raise ValueError(f"num_stages={stages} for the CUDA split-K pass; allowed: {STAGES}")
    return stages


def unsupported_reason(geometry: PageGeometry, group: int, pages_per_iter: int,
                       device: torch.device) -> str | None:
    """Why the CUDA split-K pass cannot serve this plan, or None when it can."""
    why = geometry_reason(geometry, group, pages_per_iter)
    if why is None and device.type != "cuda":
        why = "not a CUDA device"
    if why is None and LIBRARY.get() is None:
        why = f"library unavailable: {LIBRARY.error}"
    return why


def make_args(plan, geometry: PageGeometry) -> SplitArgs:
    """The launch-invariant part of a plan's SplitArgs (pointers are filled per run)."""
    a = SplitArgs()
    a.page_bytes = geometry.page_bytes
    a.group, a.block_g = plan.group, plan.block_g
    a.iters_max, a.row_stride = plan.iters_max, plan.row_stride
    a.maxp_total = plan.maxp_hi + plan.maxp_lo
    a.stages = check_stages(plan.num_stages)
    a.acc, a.ml = plan.acc.data_ptr(), plan.ml.data_ptr()
    a.p, a.mit = plan.pbuf.data_ptr(), plan.mit.data_ptr()
    for dst, t, ppp, maxp in ((a.hi, geometry.high, plan.ppp_hi, plan.maxp_hi),
                              (a.lo, geometry.low, plan.ppp_lo, plan.maxp_lo)):
        dst.tokens_per_page, dst.pages_per_part, dst.maxp = t.tokens_per_page, ppp, maxp
        dst.key_offset, dst.key_meta_offset = t.key_offset, t.key_meta_offset
        dst.value_offset, dst.value_meta_offset = t.value_offset, t.value_meta_offset
        dst.copy_bytes = -(-t.score_offset // 16) * 16  # key | meta | value | meta
    return a


def launch(a: SplitArgs, q: torch.Tensor, pages: torch.Tensor, tab: torch.Tensor,
           cnt: torch.Tensor, req_idx: torch.Tensor, qk_scale: float, kv_heads: int) -> None:
    """One split-K launch on the current stream (capturable; no synchronisation)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bf16 or fp16 for the CUDA split-K pass, got {q.dtype}")
    if q.data_ptr() % 16 or (q.stride(1) * 2) % 16 or (q.stride(0) * 2) % 16:
        raise ValueError("q rows must be 16-byte aligned for the CUDA split-K pass")
    if req_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"req_idx must be int32 or int64, got {req_idx.dtype}")
    a.q, a.q_sb, a.q_sh = q.data_ptr(), q.stride(0), q.stride(1)
    a.q_bf16 = int(q.dtype == torch.bfloat16)
    a.pages = pages.data_ptr()
    a.table, a.t_sr, a.t_sh = tab.data_ptr(), tab.stride(0), tab.stride(1)
    a.counts, a.c_sr, a.c_sh = cnt.data_ptr(), cnt.stride(0), cnt.stride(1)
    a.req, a.req_i64 = req_idx.data_ptr(), int(req_idx.dtype == torch.int64)
    a.qk_scale = qk_scale
    a.row_len = tab.shape[-1]
    rc = LIBRARY.get().diffkv_decode_split_launch(
        ctypes.byref(a), q.shape[0], kv_heads, torch.cuda.current_stream(q.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"CUDA split-K launch failed: CUDA error {rc}")
