#!/usr/bin/env python3
"""Kernel micro-benchmarks for the simulator's cost model (issue 8), one GPU run.

Measures, per layer call on this GPU, for Llama-3-8B's shapes (32 query / 8 KV heads, d 128):

  gemm     F.linear bf16 for the exact (n, k) of qkv, o, gate_up, down, lm_head over m tokens
  decode   SGLang 0.5.10's Triton decode kernel (decode_attention_fwd, the triton backend's)
           on bf16 and fp8_e4m3 KV; DiffKV's DecodeAttentionPlan on all-high (K8V4), all-low
           (K4V2) and a 30/50/20 high/low/pruned mix; batch x context grid
  prefill  SGLang's Triton extend kernel (extend_attention_fwd: what the triton backend's
           prefill runs) on bf16 and fp8 KV over chunk x past; torch SDPA (flash, is_causal,
           enable_gqa: DiffKV's extend) over chunk with no past

Decode and GEMM times are CUDA-graph replays (bench_kernels.bench_graph: no host launch
overhead, as under SGLang's decode CUDA graphs) cycling through enough weight / KV copies that
the 50 MB L2 cannot serve a call from the previous one (a real step reads a different layer's
weights and KV each call). Prefill is eager (bench_kernels.bench, CUDA events), as SGLang runs
it with piecewise graphs off.

Writes under --out: measurements.json (raw rows + provenance: GPU, driver, CUDA, torch,
triton, sglang, date, git commit, command), calibration.json (loadable with
``diffkv-sim ... --calibration OUT/calibration.json``; built by
simulator.calibration.build from the measurements) and calibrate.md (tables). Budget: the
grids are ordered cheapest first and points left when --budget-s runs out are recorded as
unmeasured (null), which the calibration holds at the nearest measured value.

    python scripts/calibrate_gpu.py --out results/calibration            # ~4 min on an H100
    python scripts/calibrate_gpu.py --out /tmp/cal --quick               # smoke, ~1 min
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import glob
import importlib.util
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
import triton

from sglang_diffkv.config import K4V2, K8V4
from sglang_diffkv.kernels import DecodeAttentionPlan
from sglang_diffkv.kernels.bench import bench, bench_graph, copy_bandwidth
from sglang_diffkv.kernels.testing import random_decode_case
from sglang_diffkv.layout import PageGeometry
from simulator.calibration.build import (
    _cost_models,
    build_calibration,
    gemm_ops,
)
from simulator.specs.calibration import load_calibration

# the repository root (run from a checkout with the package installed, scripts/device_install.sh)
ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"
HQ, HKV, D = 32, 8, 128
L2_BYTES = 50 << 20          # H100 L2; copies are cycled until a graph touches 4x this
MAX_COPIES = 16
MAX_KV_SPLITS = 8            # ServerArgs.triton_attention_num_kv_splits on CUDA

FULL = {
    "m": [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096,
          8192, 16384],
    "batch": [1, 4, 16, 32, 64, 128, 256, 512],
    "context": [256, 1024, 4096, 16384],
    "max_tokens": 1 << 21,   # B x L cap (2M tokens, 8 GiB of bf16 KV per copy)
    "chunk": [128, 512, 2048, 8192],
    "past": [0, 1024, 4096, 16384],
}
QUICK = {"m": [1, 16, 128, 1024, 8192], "batch": [1, 16, 128], "context": [512, 4096],
         "max_tokens": 1 << 19, "chunk": [512, 4096], "past": [0, 4096]}
# DiffKV mixes: calibration key -> (high fraction, low fraction); the rest is pruned
MIXES = {"K8V4": (1.0, 0.0), "K4V2": (0.0, 1.0), "diffkv": (0.3, 0.5)}


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.end


def copies_for(nbytes: float) -> int:
    return max(1, min(MAX_COPIES, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


def cycling(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One call runs the next of ``fns``: a graph captured over n calls replays n copies."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def timed(fn: Callable[[], Any], graph: bool, n: int) -> float:
    """Seconds per call: a graph of ``n`` (>= copies) calls, or eager do_bench."""
    if graph:
        return bench_graph(fn, reps=max(n, 20)) * 1e-3
    return bench(fn) * 1e-3


def _log(msg: str) -> None:
    print(msg, flush=True)


# ---- GEMM -----------------------------------------------------------------------------------
def gemm_shapes(model: str, gpu: str) -> dict[str, tuple[int, int, int]]:
    """(n, k, weight copies) of each of the model's GEMMs, by op name."""
    cost = _cost_models(model, gpu, load_calibration(gpu))["bf16"]
    return {name: (n, k, copies_for(wbytes))
            for name, (wbytes, _params, k, n) in gemm_ops(cost).items()}


def gemm_calls(x: torch.Tensor, ws: list[torch.Tensor]):
    """The calibration's GEMM call: ``F.linear(x, w)``, each call the next of ``ws``."""
    return cycling([partial(F.linear, x, w) for w in ws])


def time_gemm(x: torch.Tensor, ws: list[torch.Tensor]) -> float:
    """Seconds per ``gemm_calls`` call, timed as a CUDA graph's replay."""
    return timed(gemm_calls(x, ws), True, len(ws))


def gemm_rows(ops: dict[str, tuple], ms: list[int], budget: Budget,
              peak_flops: float) -> list[dict]:
    rows = []
    for name, (wbytes, _params, k, n) in ops.items():
        copies = copies_for(wbytes)
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        for m in ms:
            if not budget.left():
                rows.append({"op": name, "m": m, "time_s": None, "skipped": "budget"})
                continue
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            t = time_gemm(x, ws)
            rows.append({"op": name, "m": m, "n": n, "k": k, "time_s": t, "copies": copies})
            _log(f"gemm {name:8s} m={m:6d} n={n} k={k}: {t * 1e6:9.1f} us "
                 f"({(wbytes + m * (n + k) * 2) / t / 1e12:.2f} TB/s, "
                 f"{2 * m * n * k / t / peak_flops:.0%} of datasheet BF16 peak)")
            del x
        del ws
        torch.cuda.empty_cache()
    return rows


# ---- decode: SGLang triton ------------------------------------------------------------------
SGL_UTILS = "from sglang.srt.utils import is_cuda, is_hip"
SGL_STUBS = ("def is_cuda():\n    return torch.cuda.is_available()\n\n\n"
             "def is_hip():\n    return False\n")


def sglang_source(rel: str) -> tuple[str, str]:
    """Text of ``sglang/<rel>`` from the installed package (found, not imported: importing
    sglang.srt pulls in the whole server) or else the carried wheel in .whl/."""
    spec = importlib.util.find_spec("sglang")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        f = Path(loc) / rel
        if f.exists():
            return f.read_text(), str(f)
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "sglang-*.whl")))
    if not wheels:
        raise FileNotFoundError(f"sglang/{rel}: sglang is not installed and .whl/ has no wheel")
    with zipfile.ZipFile(wheels[-1]) as z:
        return z.read(f"sglang/{rel}").decode(), f"{Path(wheels[-1]).name}:sglang/{rel}"


def load_sglang_module(rel: str, name: str, replace: dict[str, str]) -> types.ModuleType:
    """Execute one SGLang kernel file as module ``name`` with its sglang imports replaced
    (triton.jit needs a real file, so the patched text is written under /tmp)."""
    src, origin = sglang_source(rel)
    for old, new in {SGL_UTILS: SGL_STUBS, **replace}.items():
        src = src.replace(old, new)
    path = Path(f"/tmp/calibrate_{name}.py")
    path.write_text(src)
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__origin__ = origin  # type: ignore[attr-defined]
    sys.modules[name] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


def sglang_function(rel: str, func: str) -> Callable:
    """One top-level (decorated) function of an SGLang file, executed alone: for
    get_num_kv_splits_triton, whose file (triton_backend.py) imports half the server."""
    src, _ = sglang_source(rel)
    tree = ast.parse(src)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func)
    text = ast.get_source_segment(src, node)
    deco = "".join(f"@{ast.get_source_segment(src, d)}\n" for d in node.decorator_list)
    path = Path(f"/tmp/calibrate_{func}.py")
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + deco + text + "\n")
    ns: dict[str, Any] = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns[func]


def kv_split_fn() -> tuple[Callable | None, str]:
    """SGLang's own split heuristic (triton_backend.get_num_kv_splits_triton, what its decode
    uses on CUDA), else every request gets MAX_KV_SPLITS (what static splits do)."""
    try:
        kern = sglang_function("srt/layers/attention/triton_backend.py",
                               "get_num_kv_splits_triton")
    except Exception as e:  # noqa: BLE001 - any failure: static splits, said in provenance
        return None, f"static {MAX_KV_SPLITS} splits (get_num_kv_splits_triton: {e})"

    def splits(seq_lens: torch.Tensor) -> torch.Tensor:
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        b = seq_lens.numel()
        out = torch.empty(b, dtype=torch.int32, device=seq_lens.device)
        kern[(1,)](out, seq_lens, b, 1, HQ, HKV, MAX_KV_SPLITS, sms,
                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(b)))
        return out

    return splits, "SGLang get_num_kv_splits_triton"


def sglang_kernels() -> tuple[Callable | None, Callable | None, str]:
    """(decode_attention_fwd, extend_attention_fwd, where from); None for one that fails."""
    ops = "srt/layers/attention/triton_ops/"
    notes = []
    try:
        dec = load_sglang_module(ops + "decode_attention.py", "_sgl_decode_attention", {
            "from sglang.srt.utils import is_hip": "def is_hip():\n    return False\n"})
        notes.append(f"decode {dec.__origin__}")
        decode = dec.decode_attention_fwd
    except Exception as e:  # noqa: BLE001
        decode, _ = None, notes.append(f"decode FAILED {type(e).__name__}: {e}")
    try:
        load_sglang_module(ops + "prefill_attention.py", "_sgl_prefill_attention", {})
        ext = load_sglang_module(
            ops + "extend_attention.py", "_sgl_extend_attention",
            {"from sglang.srt.layers.attention.triton_ops.prefill_attention import":
             "from _sgl_prefill_attention import"})
        notes.append(f"extend {ext.__origin__}")
        extend = ext.extend_attention_fwd
    except Exception as e:  # noqa: BLE001
        extend, _ = None, notes.append(f"extend FAILED {type(e).__name__}: {e}")
    return decode, extend, "; ".join(notes)


def time_sglang_decode(fwd: Callable, splits: Callable | None, dtype: torch.dtype,
                       seq_lens: list[int], slots: torch.Tensor | None = None
                       ) -> tuple[float, int, int]:
    """(seconds per call, copies cycled, KV bytes read) of SGLang's decode kernel on one batch:
    request r holds ``seq_lens[r]`` tokens at ``slots`` (flat pool indices, request-major, each
    request's in position order; default contiguous). The output is poisoned first and must
    come back finite."""
    b, tokens = len(seq_lens), int(sum(seq_lens))
    kv_bytes = 2 * tokens * HKV * D * torch.empty(0, dtype=dtype).element_size()
    copies = copies_for(kv_bytes)
    k = torch.randn(copies * tokens, HKV, D, device=DEV, dtype=torch.bfloat16).to(dtype)
    v = torch.randn(copies * tokens, HKV, D, device=DEV, dtype=torch.bfloat16).to(dtype)
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    o = torch.full((b, HQ, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    seq = torch.as_tensor(seq_lens, device=DEV, dtype=torch.int32)
    indptr = torch.zeros(b + 1, device=DEV, dtype=torch.int32)
    indptr[1:] = torch.cumsum(seq, 0)
    nsplit = (splits(seq) if splits is not None
              else torch.full((b,), MAX_KV_SPLITS, device=DEV, dtype=torch.int32))
    logits = torch.empty(b, HQ, MAX_KV_SPLITS, D, device=DEV, dtype=torch.float32)
    lse = torch.empty(b, HQ, MAX_KV_SPLITS, device=DEV, dtype=torch.float32)
    base = (torch.arange(tokens, device=DEV, dtype=torch.int64) if slots is None
            else slots.to(device=DEV, dtype=torch.int64))
    fns = [partial(fwd, q, k, v, o, indptr, base + c * tokens, logits, lse, nsplit,
                   MAX_KV_SPLITS, D**-0.5, 1.0, 1.0) for c in range(copies)]
    t = timed(cycling(fns), True, copies)
    if not torch.isfinite(o).all():
        raise RuntimeError(f"SGLang decode, batch {b}: output not fully written")
    del k, v, fns
    torch.cuda.empty_cache()
    return t, copies, kv_bytes


def sglang_decode_rows(fwd: Callable, splits: Callable | None, dtype: torch.dtype, key: str,
                       grid: dict, budget: Budget) -> list[dict]:
    rows = []
    for b in grid["batch"]:
        for ctx in grid["context"]:
            base = {"format": key, "batch": b, "context": ctx}
            if b * ctx > grid["max_tokens"]:
                rows.append({**base, "time_s": None, "skipped": "memory cap"})
                continue
            if not budget.left():
                rows.append({**base, "time_s": None, "skipped": "budget"})
                continue
            t, copies, kv_bytes = time_sglang_decode(fwd, splits, dtype, [ctx] * b)
            rows.append({**base, "time_s": t, "copies": copies, "read_bytes": kv_bytes})
            _log(f"decode {key:6s} B={b:4d} L={ctx:6d}: {t * 1e6:8.1f} us "
                 f"({kv_bytes / t / 1e12:.2f} TB/s)")
    return rows


# ---- decode: DiffKV -------------------------------------------------------------------------
def time_diffkv_decode(geo: PageGeometry, contexts: list[int], plan_context: int,
                       high_frac: float, low_frac: float, seed: int
                       ) -> tuple[float, int, float]:
    """(seconds per call, copies cycled, stored page bytes read per call) of DiffKV's decode on
    one batch of random cache states, its plan built for ``plan_context`` tokens."""
    b = len(contexts)
    # bf16-equivalent bytes bound the copies; the case's layers are the copies
    copies = copies_for(2 * sum(contexts) * HKV * D * 2 * max(high_frac + low_frac, 0.25) / 2)
    case = random_decode_case(geo, list(contexts), HKV, num_layers=copies, high_frac=high_frac,
                              low_frac=low_frac, device=DEV, seed=seed,
                              max_context=max(max(contexts), plan_context))
    plan = DecodeAttentionPlan.build(geo, HQ, HKV, b, plan_context, DEV)
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    fns = [partial(plan.run, q, case.pages, case.table, case.counts, case.req_idx, layer,
                   D**-0.5) for layer in range(copies)]
    t = timed(cycling(fns), True, copies)
    stored = sum(case.stored_bytes(layer) for layer in range(copies)) / copies
    del case, plan, fns
    torch.cuda.empty_cache()
    return t, copies, stored


def diffkv_decode_rows(grid: dict, budget: Budget) -> list[dict]:
    geo = PageGeometry.build(D, K8V4, K4V2)
    rows = []
    for key, (fh, fl) in MIXES.items():
        for b in grid["batch"]:
            for ctx in grid["context"]:
                base = {"format": key, "batch": b, "context": ctx}
                if b * ctx > grid["max_tokens"]:
                    rows.append({**base, "time_s": None, "skipped": "memory cap"})
                    continue
                if not budget.left():
                    rows.append({**base, "time_s": None, "skipped": "budget"})
                    continue
                try:
                    t, copies, stored = time_diffkv_decode(geo, [ctx] * b, ctx, fh, fl, b + ctx)
                except Exception as e:  # noqa: BLE001 - record and keep measuring
                    _log(f"decode {key} B={b} L={ctx}: FAILED {type(e).__name__}: {e}")
                    rows.append({**base, "time_s": None, "skipped": f"failed: {e}"})
                    continue
                rows.append({**base, "time_s": t, "copies": copies, "read_bytes": stored})
                _log(f"decode {key:6s} B={b:4d} L={ctx:6d}: {t * 1e6:8.1f} us "
                     f"({stored / t / 1e12:.2f} TB/s of stored pages)")
    return rows


# ---- prefill --------------------------------------------------------------------------------
def extend_rows(ext: Callable, dtype: torch.dtype, key: str, grid: dict,
                budget: Budget) -> list[dict]:
    rows = []
    for c in grid["chunk"]:
        for past in grid["past"]:
            base = {"format": key, "chunk": c, "past": past}
            if not budget.left():
                rows.append({**base, "time_s": None, "skipped": "budget"})
                continue
            q = torch.randn(c, HQ, D, device=DEV, dtype=torch.bfloat16)
            k = torch.randn(c, HKV, D, device=DEV, dtype=torch.bfloat16)
            v = torch.randn(c, HKV, D, device=DEV, dtype=torch.bfloat16)
            o = torch.empty_like(q)
            kb = torch.randn(past + c, HKV, D, device=DEV, dtype=torch.bfloat16).to(dtype)
            vb = torch.randn(past + c, HKV, D, device=DEV, dtype=torch.bfloat16).to(dtype)
            qo = torch.tensor([0, c], device=DEV, dtype=torch.int32)
            kvp = torch.tensor([0, past], device=DEV, dtype=torch.int32)
            idx = torch.arange(past, device=DEV, dtype=torch.int64)
            fn = partial(ext, q, k, v, o, kb, vb, qo, kvp, idx, None, True, None, c, 1.0, 1.0,
                         D**-0.5)
            t = timed(fn, False, 1)
            rows.append({**base, "time_s": t})
            fl = 4 * HQ * D * (c * past + c * c / 2)
            _log(f"prefill {key:6s} chunk={c:5d} past={past:6d}: {t * 1e6:9.1f} us "
                 f"({fl / t / 1e12:.0f} TFLOPS)")
            del q, k, v, o, kb, vb
            torch.cuda.empty_cache()
    return rows


def sdpa_rows(grid: dict, budget: Budget) -> list[dict]:
    rows = []
    for c in grid["chunk"]:
        base = {"format": "diffkv", "chunk": c, "past": 0}
        if not budget.left():
            rows.append({**base, "time_s": None, "skipped": "budget"})
            continue
        q = torch.randn(1, HQ, c, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, c, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, c, D, device=DEV, dtype=torch.bfloat16)
        t = timed(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True,
                          enable_gqa=True), False, 1)
        rows.append({**base, "time_s": t})
        _log(f"prefill sdpa   chunk={c:5d}: {t * 1e6:9.1f} us")
    return rows


# ---- provenance -----------------------------------------------------------------------------
def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance(kernel_src: str, splits_src: str) -> dict[str, Any]:
    smi = _cmd("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
               "--format=csv,noheader")
    try:
        import sglang

        sgl = sglang.__version__
    except Exception:  # noqa: BLE001
        sgl = None
    dirty = bool(_cmd("git", "status", "--porcelain", "--untracked-files=no"))
    return {
        "gpu_name": torch.cuda.get_device_name(), "nvidia_smi": smi,
        "driver": smi.split(", ")[1] if smi.count(",") >= 1 else None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
        "sglang": sgl, "python": platform.python_version(),
        "sm_count": torch.cuda.get_device_properties(DEV).multi_processor_count,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _cmd("git", "rev-parse", "HEAD") + (" (dirty)" if dirty else ""),
        "command": " ".join([sys.executable, *sys.argv]),
        "sglang_kernels": kernel_src, "kv_splits": splits_src,
        "timing": "per layer call; decode and GEMM: CUDA-graph replay over L2-defeating "
                  "copies (bench_kernels.bench_graph); prefill: eager, CUDA events "
                  "(bench_kernels.bench, median)",
    }


def tables(meas: dict) -> str:
    out = [f"GPU {meas['provenance']['gpu_name']}, copy bandwidth "
           f"{meas['copy_tbs']:.2f} TB/s; times in us per layer call.", ""]
    for kind, cols in (("gemm", ("op", "m")), ("decode", ("format", "batch", "context")),
                       ("prefill", ("format", "chunk", "past"))):
        out += [f"| {' | '.join(cols)} | us |", "|" + "---|" * (len(cols) + 1)]
        for r in meas[kind]:
            t = "-" if r["time_s"] is None else f"{r['time_s'] * 1e6:.1f}"
            out.append("| " + " | ".join(str(r[c]) for c in cols) + f" | {t} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/calibration")
    ap.add_argument("--quick", action="store_true", help="small grids (smoke test)")
    ap.add_argument("--only", default="gemm,decode,prefill")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop measuring after this many seconds (default 240, quick 90)")
    ap.add_argument("--gpu", default="h100", help="simulator GPU key (default: %(default)s)")
    ap.add_argument("--model", default="llama-3-8b")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("calibrate_gpu: no CUDA device", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = QUICK if a.quick else FULL
    total = a.budget_s or (90 if a.quick else 240)
    # per-kind shares, so a slow kind cannot starve the others of every point
    only = set(a.only.split(","))
    t0 = time.time()
    fwd, ext, src = sglang_kernels()
    splits, splits_src = kv_split_fn()
    meas: dict[str, Any] = {"gpu": a.gpu, "model": a.model,
                            "provenance": provenance(src, splits_src),
                            "gemm": [], "decode": [], "prefill": []}
    meas["copy_tbs"] = copy_bandwidth() / 1e12
    _log(f"{meas['provenance']['gpu_name']}: copy {meas['copy_tbs']:.2f} TB/s; kernels: {src}")
    cost = _cost_models(a.model, a.gpu, load_calibration(a.gpu))["bf16"]
    # the cheap-per-point grids first, so a tight budget still leaves every kind some points
    budget = Budget(0.6 * total)
    if "decode" in only:
        if fwd is not None:
            meas["decode"] += sglang_decode_rows(fwd, splits, torch.bfloat16, "bf16", grid,
                                                 budget)
            meas["decode"] += sglang_decode_rows(fwd, splits, torch.float8_e4m3fn, "fp8", grid,
                                                 budget)
        meas["decode"] += diffkv_decode_rows(grid, budget)
    if "gemm" in only:
        budget = Budget(0.25 * total)
        meas["gemm"] = gemm_rows(gemm_ops(cost), grid["m"], budget, cost.flops)
    if "prefill" in only:
        budget = Budget(0.15 * total)
        if ext is not None:
            meas["prefill"] += extend_rows(ext, torch.bfloat16, "bf16", grid, budget)
            meas["prefill"] += extend_rows(ext, torch.float8_e4m3fn, "fp8", grid, budget)
        meas["prefill"] += sdpa_rows(grid, budget)
    meas["seconds"] = time.time() - t0
    (out / "measurements.json").write_text(json.dumps(meas, indent=1) + "\n")
    (out / "calibrate.md").write_text(tables(meas) + "\n")
    cal = build_calibration(meas, None, str(out / "measurements.json"))
    (out / "calibration.json").write_text(json.dumps(cal, indent=1) + "\n")
    skipped = sum(r["time_s"] is None for k in ("gemm", "decode", "prefill") for r in meas[k])
    _log(f"wrote {out}/measurements.json, calibration.json, calibrate.md in "
         f"{meas['seconds']:.0f} s ({skipped} grid points unmeasured, held)")
    os.sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
