"""Session 27's ad-hoc reading of DiffKV loop traces (sglang_diffkv/loop_trace.py), kept with
the data it was run on. CPU only:

    python docs/data/h200-2026-11-25/s27-dk-sharegpt/loop_costs.py LOOP.jsonl.gz [...]

Two tables, by decode batch:
- a prefill's cost: the wall time of an extend iteration and the four decode iterations after
  it, less four decode iterations of the same batch with no batch change around them;
- a release's cost: the four decode iterations from one whose batch shrank (a request
  finished, no prefill) less the same unchanged-batch iterations.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np

from sglang_diffkv.loop_trace import Iteration, Mode, Phase, read_loop_trace, timed_iterations

AFTER = 4       # decode iterations counted after the event
BUSY_S = 0.08   # an iteration longer than this spans idle time: left out
BIN = 16


def recv_iterations(path: str) -> list[Iteration]:
    """The loop iterations that begin with recv_requests, the last one (no next start to end
    its wall time) left out."""
    return [it for it in timed_iterations(read_loop_trace(path))[:-1]
            if it.records[0].phase == Phase.RECV]


def main(paths: list[str]) -> None:
    base: dict[int, list[float]] = defaultdict(list)
    prefill: dict[int, list[float]] = defaultdict(list)
    release: dict[int, list[float]] = defaultdict(list)
    for path in paths:
        its = recv_iterations(path)
        mode = [it.run.mode if it.run else None for it in its]
        n = [it.run.size if it.run else 0 for it in its]
        for i in range(1, len(its) - AFTER - 1):
            walls = [its[j].wall_s * 1e3 for j in range(i, i + AFTER + 1)]
            if max(walls) > BUSY_S * 1e3 or mode[i - 1] != Mode.DECODE:
                continue
            after = mode[i + 1:i + AFTER + 1]
            steady = all(n[j] == n[i + 1] for j in range(i + 1, i + AFTER + 1))
            if mode[i] == Mode.EXTEND and all(m == Mode.DECODE for m in after):
                prefill[n[i + 1] // BIN].append(sum(walls))
            elif mode[i] == Mode.DECODE and all(m == Mode.DECODE for m in after):
                if n[i] == n[i - 1] and steady and n[i + 1] == n[i]:
                    base[n[i] // BIN].append(sum(walls[1:]))
                elif 0 < n[i - 1] - n[i] and all(n[j] == n[i] for j in range(i, i + AFTER)):
                    release[n[i] // BIN].append(sum(walls[:AFTER]))
    print(f"batch    | steps ms/it | prefill n, cost ms | release n, cost ms  (each: wall less "
          f"{AFTER} unchanged-batch iterations)")
    for b in sorted(base):
        ref = float(np.mean(base[b]))
        p, r = prefill.get(b, []), release.get(b, [])
        ps = f"{len(p):4d} {np.mean(p) - ref:6.2f}" if len(p) >= 5 else "   -      -"
        rs = f"{len(r):4d} {np.mean(r) - ref:6.2f}" if len(r) >= 5 else "   -      -"
        print(f"{b * BIN:3d}-{b * BIN + BIN - 1:3d}  | {ref / AFTER:11.2f} | {ps:>18} | {rs:>18}")


if __name__ == "__main__":
    main(sys.argv[1:])
