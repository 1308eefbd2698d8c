"""Builds and loads the plain-CUDA sources of ``cuda/`` as shared libraries (ctypes).

A source is compiled once by nvcc into ``$SGLANG_DIFFKV_CACHE`` (default
``~/.cache/sglang_diffkv``), keyed by the source's hash and the flags, so an edited source
rebuilds and concurrent processes never load a half-written file. No torch headers: a
build takes seconds, not the minute a torch extension spends on them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
ARCH_FLAGS = ("-gencode=arch=compute_90,code=sm_90",)


def cache_dir() -> Path:
    return Path(os.environ.get("SGLANG_DIFFKV_CACHE", Path.home() / ".cache" / "sglang_diffkv"))


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_library(source: Path, out_dir: Path | None = None,
                  extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` into a shared library (cached by source hash and flags)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    if not source.exists():
        raise RuntimeError(f"{source} is missing (not an editable checkout?)")
    flags = (*ARCH_FLAGS, *extra_flags)
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"libdiffkv_{source.stem}_{digest}.so"
    if lib.exists():
        return lib
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-O3", *flags, str(source), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}")
    tmp.replace(lib)  # atomic: concurrent builders never load a half-written file
    return lib


class CudaLibrary:
    """One ``cuda/`` source, built and loaded on first use; ``get()`` is None (with
    ``error`` saying why) where there is no GPU, no nvcc, the build fails or ``declare``
    rejects the library, so callers fall back to their Triton or torch path. ``declare``
    types the entry points once per load (ctypes argtypes) and raises RuntimeError when the
    library is not the one its Python side expects."""

    def __init__(self, source_name: str,
                 declare: Callable[[ctypes.CDLL], None] | None = None,
                 extra_flags: tuple[str, ...] = ()) -> None:
        self.source = CUDA_DIR / source_name
        self.declare = declare
        self.extra_flags = extra_flags
        self._lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def build(self, out_dir: Path | None = None) -> Path:
        return build_library(self.source, out_dir, self.extra_flags)

    def get(self) -> ctypes.CDLL | None:
        if self._lib is not None or self.error is not None:
            return self._lib
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            lib = ctypes.CDLL(str(self.build()))
            if self.declare is not None:
                self.declare(lib)
            self._lib = lib
        except (RuntimeError, OSError, AttributeError) as e:  # (a missing symbol)
            self.error = str(e)
        return self._lib
