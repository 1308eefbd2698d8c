"""DiffKV KV-cache compression for SGLang. A folder is a layer; each may import only the
layers listed before it (tests/test_import_rules.py checks the rules).

Core, at this package root: ``config`` (tiers, thresholds, presets), ``layout`` (the unified
page geometry, the single source of every byte size), ``capacity``, ``quant``, ``policy``,
``pages``, ``attention``, ``prompt_attention``, ``bench_mix`` (benchmark mode's tier draw) and
``cache`` (the reference cache lifecycle). Imports torch and nothing above it.

  memory/    the device-resident page manager (core layer; imports the core root)
  kernels/   Triton and CUDA kernels with their torch references, and their GPU check and
             benchmark (``python -m sglang_diffkv.kernels.gpu_check`` / ``.bench``);
             imports the core and memory/
  eval/      the offline quality harness (``diffkv-eval``); imports the core
  bench/     the end-to-end serving harness and its measurement tools (``python -m
             sglang_diffkv.bench.e2e`` ...); drives SGLang servers over HTTP, never imports
             sglang; imports the core and ``simulator`` (traces, log parsing)
  sglang/    the SGLang plug-in: the only code that imports sglang; imports the core,
             memory/ and kernels/

``loop_trace`` and ``step_profile`` (SGLang-specific tracing) still sit at the root while the
SGLang layer is ported; they move under ``sglang/``. Importing this package imports nothing:
the interpreter-start hook (``sglang/_bootstrap``) must stay cheap.
"""
