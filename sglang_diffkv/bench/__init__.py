"""End-to-end serving benchmark harness for SGLang with ``--attention-backend diffkv``.

It launches ``python -m sglang.launch_server`` as a subprocess and talks HTTP to it, so nothing
here imports sglang (only ``sglang_diffkv.sglang`` may). Modules:

  server     named configurations (bf16, fp8, diffkv variants) -> command line + env; the
             server process (setsid, ready wait, process-group stop)
  client     an asyncio/aiohttp streaming client that replays (arrival, input, output) requests
  metrics    sglang.bench_serving's summary metrics (+ window and steady-state rates)
  logstats   per-workload statistics from a byte slice of the server log
  workloads  longgen / sharegpt / ladder request lists (simulator.workload traces)
  budget     a wall-clock budget that skips or shortens steps instead of overrunning
  e2e        the CLI behind ``scripts/bench_e2e.py`` (see docs/e2e.md)
"""

from sglang_diffkv.bench.errors import BenchInputError

__all__ = ["BenchInputError"]
