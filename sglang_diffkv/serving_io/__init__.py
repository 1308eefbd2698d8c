"""What the bench harness and the simulator both read, in one place that imports neither
(tests/test_import_rules.py): the bench produces these files and the simulator replays them or
is validated against them. Imports the core package root only.

  errors         ``InputError``: the one exception a bad trace, log, record or option raises
                 (the simulator's and the bench's input errors are its subclasses)
  trace          the one internal trace schema: ``Trace``, ``TraceRequest``
  json_file      ``read_json``: a JSON file (spec, calibration, run record) read and parsed,
                 every failure one line of the caller's error class naming the file
  launch_args    a recorded SGLang launch command's ``--flag`` options by ServerArgs name
  loaders        public trace formats (Mooncake, Azure, BurstGPT, SGLang custom) -> ``Trace``
  bundled        the small traces shipped in the ``traces`` package, by name
  writer         ``Trace`` -> Mooncake JSONL (what sglang.bench_serving and diffkv-sim replay)
  arrivals       seeded arrival processes; ``resample_arrivals`` re-times a trace
  sglang_log     an SGLang server log: pool size, server args, Decode / Prefill lines
  profile_lines  the DiffKV step profile's log lines (``SGLANG_DIFFKV_PROFILE``): format,
                 writer and parser (``sglang_diffkv.sglang.step_profile`` writes them)
  prefill_probe  the lone-prefill probe's plan, record and summary
  pd_run         a real prefill/decode validation run's files (replays, link probes) and the
                 TTFT/TPOT/throughput statistics both the bench and ``diffkv-sim
                 validate-disagg`` compute from them
"""
