"""End-to-end serving benchmark harness for SGLang with ``--attention-backend diffkv``, and the
tools that measure a serving run.

It launches ``python -m sglang.launch_server`` as a subprocess and talks HTTP to it, so nothing
here imports sglang (only ``sglang_diffkv.sglang`` may). May import: the core package root and
``sglang_diffkv.serving_io`` (trace schema and loaders, server-log parsing, the probe record:
what the simulator reads too); never ``simulator`` (its predictions come through
``diffkv-sim``), ``eval``, sglang or ``sglang_diffkv.sglang`` (which imports this layer's
trace and profile formats). The simulator never imports this layer either
(tests/test_import_rules.py). Modules:

  server     named configurations (bf16, fp8, diffkv variants) -> command line + env; the
             server process (setsid, ready wait, process-group stop)
  client     an asyncio/aiohttp streaming client that replays (arrival, input, output) requests
  metrics    sglang.bench_serving's summary metrics (+ window and steady-state rates)
  logstats   per-workload statistics from a byte slice of the server log
  workloads  longgen / sharegpt / ladder request lists (``serving_io`` traces)
  budget     a wall-clock budget that skips or shortens steps instead of overrunning
  e2e        the CLI: ``python -m sglang_diffkv.bench.e2e`` (``scripts/bench_e2e.py`` on the
             GPU machine; see docs/e2e.md)
  errors     the one exception a bad harness input raises
  fakeserver a CPU stand-in server for rehearsing the harness without a GPU
  loop_records   the scheduler loop trace's file format and reader (written by
                 ``sglang_diffkv.sglang.loop_trace``)

(The step profile's log line format, which the simulator reads too, is
``sglang_diffkv.serving_io.profile_lines``.)

Measurement tools, each ``python -m sglang_diffkv.bench.<name>`` (docs/benchmarks.md):

  loop_trace_report    where the scheduler loop's time goes (``SGLANG_DIFFKV_LOOP_TRACE``)
  profile_server_step  a served decode step under SGLang's torch profiler
  prefill_ttft         lone-prefill TTFT on live servers (``diffkv-sim prefill-probes`` puts
                       the simulator beside it and fits its eager prefill launch)
  host_probe           the host's and GPU's speed right now, beside a run
  pd_replay            a trace at several rates against a real P/D deployment (or its
                       colocated control), every request recorded (``diffkv-sim
                       validate-disagg`` replays the same requests; scripts/gpu_pd_run.sh)
  link_probe           the bandwidth between the machine's two GPUs without RDMA: loopback
                       socket, GPU<->host copies, Mooncake's TCP transport
"""

from sglang_diffkv.bench.errors import BenchInputError

__all__ = ["BenchInputError"]
