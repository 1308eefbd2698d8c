"""diffkv-sim: a trace-replay discrete-event simulator of SGLang serving with compressed KV caches.

Layers (a folder each):
  workload/  synthetic workloads: length models, generators, the closed loop (the trace
             schema, loaders, writer and bundled traces are ``sglang_diffkv.serving_io``'s)
  specs/     what the hardware and the model are: model, GPU and calibration (eta) specs
  kv/        KV-cache formats (bf16, fp8, K8V4, K4V2, DiffKV) and their pool accounting
  serving/   the MODEL of one SGLang server: memory formula, scheduler, per-step cost
  engine/    the simpy ENGINE: how time advances, arrivals, replicas behind a router
  metrics/   bench_serving metric definitions, time series, goodput
  studies/   questions built from runs: compare, sweep, max QPS, GPUs needed
  report/    tables, JSON and plots
  validation/  the bench harness's runs and bench_serving results: measured vs simulated,
             fitting (``validate-runs``, ``ablate-host-terms``, ``prefill-probes``)
The model never imports the engine; the engine drives the model through a narrow interface.

May import: the core of ``sglang_diffkv`` (config, layout, capacity: one source of every byte
size), ``sglang_diffkv.serving_io`` (traces and server logs, shared with the bench harness),
torch, simpy; never ``sglang_diffkv.bench``, ``.eval`` or ``.sglang``, nor sglang
(tests/test_import_rules.py).
"""

__version__ = "0.1.0"
