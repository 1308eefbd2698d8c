"""Read sglang.bench_serving's result file (``--output-file``: one JSON object per run, JSONL).

The fields used (bench_serving names): duration, completed, request_throughput,
input_throughput, output_throughput, mean/median/p99 ttft_ms, tpot_ms, itl_ms, e2e_latency_ms,
concurrency. The last line is taken unless ``index`` picks another run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from simulator.errors import SimulatorInputError


def read_bench_result(path: str | Path, index: int = -1) -> dict[str, Any]:
    p = Path(path)
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise SimulatorInputError(f"cannot read bench_serving result {str(p)!r}: "
                                  f"{e.strerror}") from e
    if not lines:
        raise SimulatorInputError(f"{p}: empty bench_serving result file")
    runs = []
    for n, ln in enumerate(lines, start=1):
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise SimulatorInputError(f"{p}: line {n}: invalid JSON ({e.msg})") from e
        if not isinstance(obj, dict) or "output_throughput" not in obj:
            raise SimulatorInputError(f"{p}: line {n}: not a bench_serving result (no "
                                      "'output_throughput')")
        runs.append(obj)
    try:
        return runs[index]
    except IndexError as e:
        raise SimulatorInputError(f"{p} has {len(runs)} runs; index {index} is out of "
                                  "range") from e
