"""DiffKV KV-cache compression for SGLang. A folder is a layer; each may import only the
layers listed before it (tests/test_import_rules.py checks the rules).

Core, at this package root: ``config`` (tiers, thresholds, presets; ``presets/`` holds the
shipped preset files), ``model_record`` (the model a preset was calibrated on and the
start-up guard comparing it with the served one), ``layout`` (the unified page geometry, the
single source of every byte size), ``capacity``, ``quant``, ``policy``, ``pages``,
``attention``, ``prompt_attention``, ``bench_mix`` (benchmark mode's tier draw: a policy
setting that ``cache`` and the kernels use, so core, not bench/) and ``cache`` (the reference
cache lifecycle). Imports torch and nothing above it; nothing here is SGLang-specific.

  memory/    the device-resident page manager (core layer; imports the core root)
  kernels/   Triton and CUDA kernels with their torch references, and their GPU check and
             benchmark (``python -m sglang_diffkv.kernels.gpu_check`` / ``.bench``);
             imports the core and memory/
  eval/      the offline quality harness (``diffkv-eval``); imports the core
  serving_io/  what the bench harness and the simulator both read: the trace schema, its
             loaders, writer and bundled traces, arrival processes, the SGLang server-log
             parser and the DiffKV step profile's log lines (``profile_lines``), the
             lone-prefill probe's record and the ``InputError`` they raise;
             imports the core root only, so neither side imports the other
  bench/     the end-to-end serving harness and its measurement tools (``python -m
             sglang_diffkv.bench.e2e`` ...), and the format of the loop trace a traced
             server writes (``loop_records``) with its reader; drives SGLang servers over
             HTTP, never imports sglang or sglang/; imports the core and serving_io/, never
             ``simulator``
  sglang/    the SGLang plug-in and its tracing (``loop_trace``, ``step_profile``: the
             writers of bench/'s loop trace and serving_io/'s profile lines): the only code
             that imports sglang; imports the core, memory/, kernels/, bench/ and
             serving_io/ (those formats)

Importing this package imports nothing: SGLang loads the plug-in (``sglang/plugin``, an
``sglang.srt.plugins`` entry point) in its processes, so that import must stay cheap.
"""
