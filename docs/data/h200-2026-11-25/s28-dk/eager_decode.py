"""Session 28's reading of DiffKV loop traces (sglang_diffkv/loop_trace.py): what a decode step
above the largest CUDA graph costs, kept with the data it was run on. CPU only:

    python docs/data/h200-2026-11-25/s28-dk/eager_decode.py LOOP.jsonl.gz [...]

Per trace, the decode iterations of its ShareGPT burst (the longest busy segment that launched
1,000 prefills or more), by batch:
- the edge: median wall time of the 32 batch sizes below the largest graph (graphed) and the 32
  above it (eager); their difference is what running a step outside the graphs costs, the
  kernels' growth over ~30 requests (about 1.4 ms) aside;
- by batch bin above the edge: median wall, and the host phases of the iteration (run_batch:
  the eager launches; get_next_batch; process_batch_result), whose sum is the wall when the
  iteration never waits for the GPU in process_batch_result.
"""

from __future__ import annotations

import sys

import numpy as np

from sglang_diffkv.bench.loop_records import (
    Mode,
    Phase,
    read_loop_trace,
    segments,
    timed_iterations,
)

GRAPH_MAX = 512   # the diffkv backend's cuda_graph_max_bs (the servers' logged args)
EDGE = 32
BINS = (513, 640, 768, 1024, 1300, 1601)
BUSY_S = 0.2      # an iteration longer than this spans idle time: left out


def burst_decodes(path: str) -> np.ndarray:
    """Rows (batch, wall s, run_batch s, get_next_batch s, process_batch_result s) of the
    burst's decode iterations."""
    segs = segments(read_loop_trace(path))
    seg = max(segs, key=lambda s: sum(r.size for r in s
                                      if r.phase == Phase.RUN and r.mode == Mode.EXTEND))
    rows = []
    for it in timed_iterations(seg)[:-1]:     # the last: no next start to end its wall time
        if (it.records[0].phase != Phase.RECV or it.run is None
                or it.run.mode != Mode.DECODE or it.wall_s > BUSY_S):
            continue

        def host(phase: Phase, records: list = it.records) -> float:
            return sum(r.t1 - r.t0 for r in records if r.phase == phase)
        rows.append((it.run.size, it.wall_s, host(Phase.RUN), host(Phase.NEXT),
                     host(Phase.RESULT)))
    return np.array(rows)


def main(paths: list[str]) -> None:
    for path in paths:
        a = burst_decodes(path)
        below = a[(a[:, 0] > GRAPH_MAX - EDGE) & (a[:, 0] <= GRAPH_MAX)]
        above = a[(a[:, 0] > GRAPH_MAX) & (a[:, 0] <= GRAPH_MAX + EDGE)]
        g, e = np.median(below[:, 1]) * 1e3, np.median(above[:, 1]) * 1e3
        print(f"{path}\n  edge: graphed {g:.2f} ms (n {len(below)}), eager {e:.2f} ms "
              f"(n {len(above)}): +{e - g:.2f} ms a step")
        print("  batch      n  wall  run_batch  next  result  (median ms)")
        for lo, hi in zip(BINS, BINS[1:], strict=False):
            m = (a[:, 0] >= lo) & (a[:, 0] < hi)
            if m.any():
                med = np.median(a[m], axis=0) * 1e3
                print(f"  {lo:4d}-{hi - 1:4d} {int(m.sum()):4d} {med[1]:5.1f} {med[2]:10.1f} "
                      f"{med[3]:5.1f} {med[4]:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
