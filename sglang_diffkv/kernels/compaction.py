"""Decode-step compaction (``PageManager.ensure_decode_room``) for a whole batch in one CUDA
launch: ``cuda/compaction.cu``.

The CUDA source is plain CUDA C++ (no torch headers): on first use nvcc builds it into a
shared library cached under ``$SGLANG_DIFFKV_CACHE`` (default ``~/.cache/sglang_diffkv``),
keyed by the source's hash, and ctypes launches it on the current stream (capturable in a
CUDA graph; no host synchronisation). Where nvcc or CUDA is missing the torch reference runs
instead (:func:`compaction_backend` says which).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from sglang_diffkv.kernels._nvcc import CudaLibrary, nvcc_path
from sglang_diffkv.memory import AllocResult, PageManager, PageTableRowFull
from sglang_diffkv.memory.inputs import Phase, check_shape

# The cooperative grid kernel: 10 us of GPU time vs 118 us single-block at 128 x 32 x 8 on the
# H100 (docs/benchmarks.md); the launcher falls back to one block if a cooperative launch is
# refused. SGLANG_DIFFKV_COOP_COMPACTION=0 forces the single-block kernel.
COOPERATIVE_DEFAULT = "1"
SCRATCH = 2 * 8 * 1024  # int64 slots: (total, room) per warp of up to 1024 blocks of 8 warps
__all__ = ["build_library", "compaction_backend", "decode_compaction",
           "decode_compaction_reference", "nvcc_path"]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.diffkv_decode_room_launch
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_int32] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]


LIBRARY = CudaLibrary("compaction.cu", _declare)


def build_library(out_dir: Path | None = None) -> Path:
    """Compile cuda/compaction.cu into a shared library (cached by source hash)."""
    return LIBRARY.build(out_dir)


def compaction_backend() -> str:
    """'cuda' when the one-launch kernel is in use, else 'torch (<why>)'."""
    return "cuda" if LIBRARY.get() is not None else f"torch ({LIBRARY.error})"


def decode_compaction(
    manager: PageManager, req_idx: torch.Tensor, tiers: torch.Tensor, *,
    cooperative: bool | None = None,
) -> AllocResult:
    """``manager.ensure_decode_room(req_idx, tiers)`` in one launch; same state changes and
    result. With ``manager.validate`` the same host checks run (and sync). ``cooperative``:
    the grid kernel (True) or the single-block one (False); None reads
    SGLANG_DIFFKV_COOP_COMPACTION (default the grid kernel)."""
    lib = LIBRARY.get() if manager.device.type == "cuda" else None
    if lib is None:
        return manager.ensure_decode_room(req_idx, tiers)
    op = "ensure_decode_room"
    req = manager._req(req_idx, op, (Phase.DECODING,)).contiguous()
    want = torch.as_tensor(tiers, device=manager.device)
    if want.dtype not in (torch.bool, torch.uint8):  # bool is one byte of 0/1: read as is
        want = want.to(torch.uint8)
    want = want.contiguous()
    if manager.validate:
        check_shape("tiers", want, (req.shape[0], 2))
    for name, t in (("table", manager.table), ("counts", manager.counts)):
        if not t.is_contiguous():
            raise ValueError(f"manager.{name} must be contiguous")
    result = torch.empty(4, dtype=torch.int64, device=manager.device)
    scratch = torch.empty(SCRATCH, dtype=torch.int64, device=manager.device)  # 2 per warp
    fl = manager.free_list
    s = manager.spec
    rc = lib.diffkv_decode_room_launch(
        req.data_ptr(), want.data_ptr(), manager.counts.data_ptr(), manager.table.data_ptr(),
        fl.free_pages.data_ptr(), fl.head.data_ptr(), fl.tail.data_ptr(), result.data_ptr(),
        req.shape[0], s.num_layers * s.num_kv_heads, s.row_len, s.num_pages,
        s.high_tokens_per_page, s.low_tokens_per_page, scratch.data_ptr(), SCRATCH,
        int(os.environ.get("SGLANG_DIFFKV_COOP_COMPACTION", COOPERATIVE_DEFAULT)
            if cooperative is None else cooperative),
        torch.cuda.current_stream(manager.device).cuda_stream,
    )
    if rc != 0:
        raise RuntimeError(f"decode compaction launch failed: CUDA error {rc}")
    flags = result.view(torch.bool)  # byte 0 of each little-endian int64: views, no launch
    res = AllocResult(op, flags[0], result[1], result[2], flags[24])
    if manager.validate and not bool(res.rows_ok):
        raise PageTableRowFull(f"{op}: a page-table row would exceed row_len={s.row_len}")
    return res


def decode_compaction_reference(
    manager: PageManager, req_idx: torch.Tensor, tiers: torch.Tensor
) -> AllocResult:
    return manager.ensure_decode_room(req_idx, tiers)
