#!/usr/bin/env python3
"""How calibrate_gpu.py's GEMM times compare with the same kernels' profiled durations (GPU).

The calibration times F.linear as a CUDA-graph replay over weight copies
(``calibrate_gpu.time_gemm``: triton's do_bench, which clears the L2 before each replay).
A server profile (``profile_server_step.py``) reports each kernel's own duration. This script
times each of the model's GEMMs at the given token counts both ways, on the calibration's
randn data and, with ``--data``, on SGLang's dummy weights (uniform +-1e-3, what
``--load-format dummy`` serves), small normal weights (N(0, 0.02)) or zeros, and prints:

    | m | op | data | graph replay us | profiled kernel us | replay / kernel | kernel |

A replay above the kernel duration is time the calibration charges that the kernel does not
spend (the replay's gaps, or the GPU's clocks between replays); a data kind that changes the
time is a data-dependent (power) effect. Writes ``--out``/gemm_timing.{json,md}.

    python scripts/bench_gemm_timing.py --out /tmp/gemm --m 8,240,384,496 --data randn,dummy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import capture_graph  # noqa: E402
from calibrate_gpu import DEV, gemm_calls, gemm_shapes, provenance, time_gemm  # noqa: E402

DATA = ("randn", "dummy", "n002", "zeros")
# the activations each weight kind is multiplied by: the calibration's randn with randn,
# small normal values (a normalised hidden state times small weights) otherwise
ACTIVATIONS = {"randn": "randn", "dummy": "n002", "n002": "n002", "zeros": "zeros"}
PROFILED_CALLS = 32
REPLAYS = 3


def tensor(kind: str, rows: int, cols: int) -> torch.Tensor:
    """A bf16 [rows, cols] tensor of one data kind (``DATA``)."""
    if kind == "randn":
        return torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16)
    if kind == "dummy":
        return torch.empty(rows, cols, device=DEV, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3)
    if kind == "n002":
        return (torch.randn(rows, cols, device=DEV) * 0.02).to(torch.bfloat16)
    if kind == "zeros":
        return torch.zeros(rows, cols, device=DEV, dtype=torch.bfloat16)
    raise ValueError(f"data kind {kind!r}; allowed: {', '.join(DATA)}")


def profiled_kernel_us(x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[float, str]:
    """Kernel time per call of a graph of PROFILED_CALLS calls cycling ``ws`` (torch
    profiler, CUDA activity: every kernel of the call), and the name of the kernel that
    takes most of it."""
    from torch.profiler import ProfilerActivity, profile

    g = capture_graph(gemm_calls(x, ws), PROFILED_CALLS)
    for _ in range(REPLAYS):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(REPLAYS):
            g.replay()
        torch.cuda.synchronize()
    ks = [e for e in p.events() if e.device_type.name == "CUDA" and "memset" not in e.name.lower()
          and "memcpy" not in e.name.lower()]
    if not ks:
        raise RuntimeError("the profiler saw no GEMM kernel")
    # a split-K GEMM is two kernels per call (the GEMM and its reduction): both count
    per_name: dict[str, float] = {}
    for e in ks:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    return sum(per_name.values()) / (REPLAYS * PROFILED_CALLS), max(per_name, key=per_name.get)


def measure(m_list: list[int], data: list[str], model: str, gpu: str) -> list[dict[str, Any]]:
    rows = []
    for op, (n, k, copies) in gemm_shapes(model, gpu).items():
        for kind in data:
            ws = [tensor(kind, n, k) for _ in range(copies)]
            for m in m_list:
                x = tensor(ACTIVATIONS[kind], m, k)
                replay = time_gemm(x, ws) * 1e6
                kernel, name = profiled_kernel_us(x, ws)
                rows.append({"m": m, "op": op, "n": n, "k": k, "data": kind, "replay_us": replay,
                             "kernel_us": kernel, "kernel": name})
                print(f"m={m:5d} {op:8s} {kind:5s} replay {replay:8.1f} us  kernel "
                      f"{kernel:8.1f} us  ({replay / kernel:.2f})  {name[:50]}", flush=True)
            del ws
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| m | op | data | graph replay us | profiled kernel us | replay / kernel | kernel |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['m']} | {r['op']} | {r['data']} | {r['replay_us']:.1f} | "
            f"{r['kernel_us']:.1f} | {r['replay_us'] / r['kernel_us']:.2f} | "
            f"`{r['kernel'][:60]}` |" for r in rows]
    return "\n".join(out)


def positive_ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 1")
    return vals


def data_kinds(text: str) -> list[str]:
    kinds = text.split(",")
    bad = [k for k in kinds if k not in DATA]
    if bad:
        raise argparse.ArgumentTypeError(f"data kind(s) {bad}; allowed: {', '.join(DATA)}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/gemm_timing")
    ap.add_argument("--m", type=positive_ints, default=[8, 240, 384, 496],
                    help="token counts (a decode step's padded batch), comma-separated")
    ap.add_argument("--data", type=data_kinds, default=["randn"],
                    help=f"data kinds, comma-separated: {', '.join(DATA)} (randn: the "
                         "calibration's)")
    ap.add_argument("--gpu", default="h100", help="simulator GPU key (default: %(default)s)")
    ap.add_argument("--model", default="llama-3-8b")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_timing: no CUDA device", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = measure(a.m, a.data, a.model, a.gpu)
    text = table(rows)
    (out / "gemm_timing.json").write_text(json.dumps(
        {"provenance": provenance("", ""), "rows": rows}, indent=1) + "\n")
    (out / "gemm_timing.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
