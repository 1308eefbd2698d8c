"""A few seconds' reading of how fast this machine's host and GPU are right now, as one JSON
line: single-thread Python speed, CUDA launch overhead (what an eager prefill step and the
scheduler pay per op), a bf16 GEMM's TFLOP/s, a device copy's bandwidth, and nvidia-smi's
clocks. Run it next to a serving benchmark to tell a slow server start from a slow host.

  python -m sglang_diffkv.bench.host_probe              # GPU parts too when CUDA is there
  python -m sglang_diffkv.bench.host_probe --repeat 5 --out probe.json
  python -m sglang_diffkv.bench.host_probe --watch 1.0 --out host.jsonl
      # --watch: Python speed every second (epoch time), until killed
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


# ---- host speed: a fixed single-thread Python workload --------------------------------------
# SGLang's scheduler, its eager prefill launches and the HTTP front end are single-threaded
# Python, so a server start on a slower (or busier) host pays more per step. The workload mixes
# what that code does: attribute and dict access, small-list building, integer arithmetic.
def _workload(n: int) -> int:
    table: dict[int, int] = {}
    acc = 0
    for i in range(n):
        row = [i, i + 1, i + 2]
        table[i & 1023] = row[1] * 3 + acc % 7
        acc += table.get((i * 7) & 1023, 0) + len(row)
    return acc


def python_loop_ms(repeat: int = 3, n: int = 200_000) -> float:
    """Best wall time, in ms, of ``repeat`` runs of the workload at size ``n``: a reading of
    host speed that travels with a run (lower is faster)."""
    if repeat < 1 or n < 1:
        raise ValueError(f"repeat={repeat}, n={n}: both must be >= 1")
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        _workload(n)
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def launch_us(n: int, repeat: int) -> float:
    """Best per-op host time of ``n`` tiny in-place CUDA adds (each one kernel launch)."""
    import torch

    x = torch.zeros(1, device="cuda")
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def _gpu_seconds(fn, reps: int) -> float:
    """GPU time of ``reps`` back-to-back calls of ``fn``, by CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def gemm_tflops(size: int, reps: int) -> float:
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * size**3 * reps / _gpu_seconds(lambda: a @ b, reps) / 1e12


def copy_gbps(mib: int, reps: int) -> float:
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * reps / _gpu_seconds(lambda: dst.copy_(src), reps) / 1e9  # r + w


def smi() -> dict[str, str]:
    fields = ("clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu,"
              "clocks_throttle_reasons.active")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    return dict(zip(fields.split(","), (v.strip() for v in out.split(",")), strict=False))


def probe(repeat: int) -> dict:
    res: dict = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "python_loop_ms": python_loop_ms(repeat)}
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        res["launch_us"] = launch_us(5000, repeat)
        res["gemm8192_tflops"] = gemm_tflops(8192, 10)
        res["copy1gib_gbps"] = copy_gbps(1024, 10)
        res["nvidia_smi"] = smi()
    return res


def watch(interval_s: float, out: Path | None) -> None:
    """A ~5 ms Python reading every ``interval_s``, one JSON line each, until interrupted."""
    sink = out.open("a") if out else sys.stdout
    try:
        while True:
            line = json.dumps({"t": round(time.time(), 3),
                               "python_loop_ms": round(python_loop_ms(1, 20_000), 3)})
            print(line, file=sink, flush=True)
            time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    finally:
        if out:
            sink.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="take the best of this many (>= 1)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--watch", type=float, metavar="SECONDS",
                    help="keep sampling Python speed at this interval (> 0) instead")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat {a.repeat}: must be >= 1")
    if a.watch is not None:
        if a.watch <= 0:
            ap.error(f"--watch {a.watch}: must be > 0")
        watch(a.watch, a.out)
        return 0
    line = json.dumps(probe(a.repeat))
    print(line)
    if a.out:
        a.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
