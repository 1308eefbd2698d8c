"""Compile every Triton kernel ahead of time for Hopper (sm_90), no GPU needed.

The CPU tests run the kernels under TRITON_INTERPRET=1, which accepts code the GPU compiler
rejects (it did: module-level ``x: tl.constexpr = ...`` globals). Run with TRITON_INTERPRET
unset (the decorators must build real JIT functions):

    python -m sglang_diffkv.kernels.aot_check      # exit 0 when all compile
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton

from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED
from sglang_diffkv.kernels._tier import tier_constexprs
from sglang_diffkv.kernels.decode_attention import TRITON_ASM
from sglang_diffkv.kernels.decode_policy import POLICY_WARPS, SCAN_BLOCK, hash_constexprs
from sglang_diffkv.kernels.extend_store import raw_segments
from sglang_diffkv.kernels.prefill import bench_constexprs
from sglang_diffkv.layout import PageGeometry

GEO = PageGeometry.build(128, K8V4_GROUPED, K4V2_GROUPED)
HI, LO = tier_constexprs(GEO.high, "H_"), tier_constexprs(GEO.low, "L_")
T = tier_constexprs(GEO.high, "T_")
# the benchmarked pair (one quantisation group per token: the p * scale folding path)
GEO1 = PageGeometry.build(128, K8V4, K4V2)
HI1, LO1 = tier_constexprs(GEO1.high, "H_"), tier_constexprs(GEO1.low, "L_")
BENCH_C = bench_constexprs()
RAW = raw_segments(GEO.high)
ATTN = dict(PAGE_BYTES=GEO.page_bytes, G=4, BLOCK_G=16, D=128, PPI=1, RS=64)
POINTERS = {  # pointer arguments and their element types; everything else is an i32 scalar
    "q": "*bf16", "k": "*bf16", "key": "*bf16", "value": "*bf16", "u8": "*u8",
    "f16": "*fp16", "f32": "*fp32", "i32": "*i32", "table": "*i32", "counts": "*i32",
    "req": "*i64", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "p_ptr": "*fp16", "mit_ptr": "*fp32",
    "out": "*bf16", "lse_out": "*fp32", "score": "*fp32", "pos": "*i32", "page_ids": "*i32",
    "slots": "*i32", "lengths": "*i32", "lse": "*fp32", "sig": "*fp32", "alpha_h": "*fp32",
    "alpha_l": "*fp32", "tier_out": "*i8", "score_out": "*fp32", "pos_out": "*i32",
    "block_counts": "*i32", "totals": "*i32", "tier_in": "*i8", "positions": "*i64",
    "alpha": "*fp32", "action_out": "*i8", "hmin_out": "*i64", "lmin_out": "*i64",
    "bench_seed": "*i64",
    "seed": "*i64", "mix": "*fp64", "part": "*i64", "q_start": "*i64", "k_start": "*i64",
    "v_start": "*i64", "shared": "*i32", "hk": "*i64", "hs": "*i32", "key_first": "*i32",
    "q_count": "*i32", "base": "*i32", "attached": "*i32", "stored": "*i32", "total": "*i32",
    "fresh_start": "*i64", "packed_start": "*i64", "out_k": "*fp32",
    "raw": "*u8", "raw_f16": "*fp16", "pk": "*fp32", "k_from": "*i32",
    "v": "*bf16", "starts": "*i64", "lens": "*i32",
}
FLOATS = {"qk_scale", "lse_mul"}
# kernels launched with other than four warps (compiled as they launch: registers differ)
LAUNCH_WARPS = {"_policy_kernel": POLICY_WARPS}
KERNELS = [
    # every split-K variant (decode_attention.TRITON_ASM; ASM = inline PTX, which the CPU
    # tests cannot run, so this is where it is first compiled)
    *[("decode_attention", "_partition_kernel", {**ATTN, **HI, **LO, "ASM": asm})
      for asm in TRITON_ASM.values()],
    *[("decode_attention", "_partition_kernel",
       {**ATTN, "PAGE_BYTES": GEO1.page_bytes, **HI1, **LO1, "ASM": asm})
      for asm in TRITON_ASM.values() if asm],
    # the merge pass alone, with shared-prefix bounds, and with the fused argmin (HINT:
    # decode_attention.HINT_FILLS, 1 in the score loop, 2 in a pass of its own)
    *(("decode_attention", "_merge_kernel",
       {**ATTN, "BLOCK_P": 16, "CH": 16, "MW": 4, "MG": 4, "SHARED": sh, "HINT": hint,
        "AT": 128, **{k: HI[k] for k in ("H_N", "H_BN", "H_SOFF", "H_POFF")},
        **{k: LO[k] for k in ("L_N", "L_BN", "L_SOFF", "L_POFF")}})
      for sh, hint in ((False, 0), (True, 0), (True, 1), (True, 2), (False, 2))),
    # extend attention over a compressed prefix: one program per (tile, head) writing the
    # output, or split with the merge pass (the split count is a runtime argument)
    *(("extend_attention", "_extend_kernel",
       dict(PAGE_BYTES=GEO.page_bytes, G=4, QT=16, BLOCK_M=64, D=128, BK=64, SPLIT=split,
            DOT_F32=False, **HI, **LO))
      for split in (False, True)),
    ("extend_attention", "_merge_kernel", dict(G=4, QT=16, BLOCK_M=64, D=128)),
    ("store", "_store_tokens_kernel", {"PAGE_BYTES": GEO.page_bytes, "D": 128, "BLOCK_T": 16,
                                       **T}),
    ("prefill", "_lse_kernel", dict(G=4, Q=64, QB=64, D=128, BK=64, DOT_F32=False, EXT=False,
                                    key_first=None, q_count=None)),
    *(("prefill", "_colsum_kernel", dict(G=4, Q=64, QB=64, D=128, BK=64, DOT_F32=False,
                                         LSE_PACKED=packed, EXT=False, key_first=None,
                                         q_count=None, k_from=None))
      for packed in (False, True)),
    # scoring a prompt over stored tokens (extend_store): fp32 keys, IEEE dots
    ("prefill", "_lse_kernel", dict(G=4, Q=64, QB=64, D=128, BK=64, DOT_F32=True, EXT=True),
     {"k": "*fp32"}),
    ("prefill", "_colsum_kernel", dict(G=4, Q=64, QB=64, D=128, BK=64, DOT_F32=True,
                                       LSE_PACKED=False, EXT=True), {"k": "*fp32"}),
    ("extend_store", "_gather_kernel", dict(PAGE_BYTES=GEO.page_bytes, D=128, BL=32, **HI,
                                            **LO, **RAW)),
    *(("extend_store", "_classify_span_kernel",
       dict(WINDOW=64, Q=64, BL=64, BENCH=bench, **BENCH_C,
            **({} if bench else {"seed": None, "mix": None})))
      for bench in (False, True)),
    ("extend_store", "_store_span_kernel", dict(PAGE_BYTES=GEO.page_bytes, D=128, Q=64, BL=64,
                                                COUNT_TILE=128, **HI, **LO, **RAW)),
    # the serving path's (no score / pos outputs; benchmark draw or not) and the tests'
    # (everything); absent buffers arrive as None, a constexpr
    *(("prefill", "_classify_kernel",
       dict(WINDOW=64, Q=64, BL=64, SCORES=scores, BENCH=bench, **BENCH_C,
            **({} if scores else {"score_out": None, "pos_out": None}),
            **({} if bench else {"seed": None, "mix": None})))
      for scores, bench in ((False, False), (False, True), (True, False), (True, True))),
    ("prefill", "_store_prefill_kernel", dict(PAGE_BYTES=GEO.page_bytes, D=128, Q=64, BL=64,
                                              COUNT_TILE=128, **HI, **LO)),
    *(("decode_policy", "_policy_kernel", dict(PAGE_BYTES=GEO.page_bytes, ROW_LEN=130, D=128,
                                               WINDOW=64, BT=SCAN_BLOCK, PARALLEL=par, BENCH=bench,
                                               SHARED=sh, HINT=hint, **HI, **LO,
                                               **hash_constexprs()))
      for bench in (False, True) for par, sh, hint in (
          (False, False, False), (True, False, False), (False, True, False),
          (True, True, False), (False, True, True), (False, False, True))),
    # layer == 1 arrives as a constexpr: the hash must not call tensor methods on it; so
    # does n_split == 1 (one argmin program per row at large batches)
    ("decode_policy", "_policy_kernel", dict(PAGE_BYTES=GEO.page_bytes, ROW_LEN=130, D=128,
                                             WINDOW=64, BT=SCAN_BLOCK, PARALLEL=True, BENCH=True,
                                             SHARED=False, HINT=False, layer=1, n_split=1,
                                             **HI, **LO, **hash_constexprs())),
    # the parallel argmin, on both geometries (non-power-of-two low tokens per page)
    *(("decode_policy", "_argmin_kernel",
       dict(PAGE_BYTES=g.page_bytes, ROW_LEN=130, WINDOW=64, BT=512, SHARED=sh,
            **{k: h[k] for k in ("H_N", "H_SOFF", "H_POFF")},
            **{k: lo[k] for k in ("L_N", "L_SOFF", "L_POFF")}))
      for g, h, lo in ((GEO, HI, LO), (GEO1, HI1, LO1)) for sh in (False, True)),
    *(("bench_mix", "_bench_sig_kernel", dict(WINDOW=64, Q=64, BL=128, **BENCH_C, **one))
      for one in ({}, {"layer": 1})),
]


# The merge pass as kernels.bench --only fused launches it at 369 x 3300 (K8V4 / K4V2, Hq 32,
# Hkv 8, one page per iteration, the CUDA split-K pass: MW 4; one partition per tier):
# Triton specialises the runtime 1 (MAXP_HI) into a constant and marks the ints that are
# multiples of 16 (strides, MAXP) divisible, which moves ptxas' register count (72 here
# against 56 without). MERGE_BENCH_DIV: those ints.
MERGE_BENCH = dict(PAGE_BYTES=GEO1.page_bytes, G=4, BLOCK_G=16, D=128, PPI=1, RS=64,
                   BLOCK_P=2, CH=8, MW=4, MG=4, SHARED=True, MAXP_HI=1, AT=128,
                   **{k: HI1[k] for k in ("H_N", "H_BN", "H_SOFF", "H_POFF")},
                   **{k: LO1[k] for k in ("L_N", "L_BN", "L_SOFF", "L_POFF")})
MERGE_BENCH_DIV = ("t_sr", "c_sr", "o_sb", "o_sh", "s_sr", "h_sr", "MAXP")


def compile_one(module: str, name: str, constexprs: dict,
                pointers: dict[str, str] | None = None, divisible: tuple[str, ...] = (),
                num_stages: int = 2) -> str:
    """Compile one kernel for sm_90; returns its PTX. ``pointers``: element types of
    pointer arguments that differ from ``POINTERS``' (by name); ``divisible``: int
    arguments Triton would mark divisible by 16 (as it does for such runtime values)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"sglang_diffkv.kernels.{module}"), name)
    signature = {}
    for arg, param in zip(fn.arg_names, fn.params, strict=True):
        # an int argument given a value here is compiled as Triton specialises a runtime 1
        if param.is_constexpr or arg in constexprs:
            signature[arg] = "constexpr"
        else:
            signature[arg] = {**POINTERS, **(pointers or {})}.get(
                arg, "fp32" if arg in FLOATS else "i32")
    missing = [a for a in fn.arg_names if signature[a] == "constexpr" and a not in constexprs]
    if missing:
        raise ValueError(f"{name}: constexprs without a value: {missing}")
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a].startswith("*") or a in divisible}
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": LAUNCH_WARPS.get(name, 4),
                                     "num_stages": num_stages})
    return kernel.asm["ptx"]


@dataclass(frozen=True)
class Registers:
    """What ptxas reports for one kernel: registers a thread, spilled bytes a thread."""

    registers: int
    spill_stores: int
    spill_loads: int


def registers(module: str, name: str, constexprs: dict,
              pointers: dict[str, str] | None = None, divisible: tuple[str, ...] = (),
              num_stages: int = 2) -> Registers | None:
    """ptxas -v's register and spill counts of one kernel for sm_90a (None when no ptxas
    here assembles Triton's PTX). A spilling kernel runs from local memory: the prompt-end
    scoring did, 16 ms a layer on an H200, before its fp32 dots moved to tensor cores."""
    import triton.backends.nvidia as nvidia

    ptx = compile_one(module, name, constexprs, pointers, divisible, num_stages)
    bin_dir = Path(nvidia.__file__).parent / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for ptxas in ("ptxas-blackwell", "ptxas"):  # (the newer one reads newer PTX)
            exe = bin_dir / ptxas
            if not exe.exists():
                continue
            proc = subprocess.run([str(exe), "-arch=sm_90a", "-v", str(src), "-o",
                                   str(Path(tmp) / "k.cubin")], capture_output=True,
                                  text=True, timeout=300)
            if proc.returncode:
                continue
            out = proc.stdout + proc.stderr
            regs = re.search(r"Used (\d+) registers", out)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
            if regs and spill:
                return Registers(int(regs[1]), int(spill[1]), int(spill[2]))
    return None


def _label(constexprs: dict) -> str:
    keys = [k for k in ("ASM", "H_VG", "SCORES", "BENCH", "PARALLEL", "SHARED", "HINT",
                        "SPLIT")
            if k in constexprs]
    return f" ({', '.join(f'{k}={constexprs[k]}' for k in keys)})" if keys else ""


def main() -> int:
    failed = 0
    for module, name, constexprs, *pointers in KERNELS:
        try:
            compile_one(module, name, constexprs, *pointers)
            print(f"ok      {module}.{name}{_label(constexprs)}")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED  {module}.{name}{_label(constexprs)}: {type(e).__name__}: "
                  f"{str(e)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
