"""Replay speed of the simulator: a 10,000-request trace through bf16, fp8 and DiffKV.

Generates a ShareGPT-shaped trace (seeded Poisson arrivals), replays it once per KV format on
Llama-3-8B / H100 and prints wall time and simulated requests per second. The target is
<= 10 s per 10,000-request replay on a 2-core CI machine. Results go to
results/bench_simulator.json (git-ignored).

    python -m simulator.studies.replay_speed [--requests 10000] [--rate 40] \
        [--formats bf16,fp8,diffkv]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from simulator.engine.cluster import simulate
from simulator.kv.formats import make_format
from simulator.metrics.summary import summarize
from simulator.report.table import render
from simulator.serving.server import Deployment, ResolvedServer
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration import load_calibration
from simulator.specs.gpu import load_gpu
from simulator.specs.model import load_model
from simulator.workload.generate import synthetic_trace
from simulator.workload.lengths import length_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000, help="trace length")
    p.add_argument("--rate", type=float, default=40.0, help="Poisson arrival rate (req/s)")
    p.add_argument("--lengths", default="sharegpt", help="length model of the trace")
    p.add_argument("--formats", default="bf16,fp8,diffkv", help="KV formats to replay")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path("results") / "bench_simulator.json"),
                   help="where the JSON result goes (default: results/ under the current folder)")
    a = p.parse_args()

    t0 = time.perf_counter()
    trace = synthetic_trace(length_model(a.lengths), a.requests, a.rate, seed=a.seed)
    gen_s = time.perf_counter() - t0
    model, gpu = load_model(a.model), load_gpu(a.gpu)
    calib = load_calibration(gpu.key)
    rows, results = [], []
    for name in a.formats.split(","):
        srv = ResolvedServer(Deployment(model, gpu, make_format(name, model.head_dim),
                                        ServerSettings(), calib))
        t1 = time.perf_counter()
        res = simulate(trace, srv, seed=a.seed)
        sim_s = time.perf_counter() - t1
        s = summarize(res)
        total_s = time.perf_counter() - t1
        steps = s["steps"]
        rows.append([name, s["completed"], steps, sim_s, total_s, a.requests / sim_s,
                     steps / sim_s, s["duration_s"], s["output_throughput"], s["mean_batch"]])
        results.append({"format": name, "requests": a.requests, "completed": s["completed"],
                        "steps": steps, "replay_wall_s": sim_s,
                        "replay_plus_summary_wall_s": total_s,
                        "simulated_requests_per_s": a.requests / sim_s,
                        "steps_per_s": steps / sim_s, "simulated_duration_s": s["duration_s"],
                        "output_throughput": s["output_throughput"],
                        "mean_batch": s["mean_batch"]})
    print(render(["format", "completed", "steps", "replay s", "+summary s", "sim req/s",
                  "steps/s", "simulated s", "out tok/s", "mean batch"], rows,
                 f"{a.requests:,}-request {a.lengths} trace at {a.rate:g} req/s, "
                 f"{model.name} on {gpu.key} (trace generated in {gen_s:.2f} s)"))
    worst = max(r["replay_wall_s"] for r in results)
    print(f"slowest replay: {worst:.2f} s (target <= 10 s); "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.machine()}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "cpu_count": os.cpu_count(),
                               "python": platform.python_version(),
                               "platform": platform.platform(), "trace_gen_s": gen_s,
                               "results": results}, indent=1) + "\n")
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
