"""Workloads the simulator builds: fitted length models, synthetic traces and the closed loop,
length scaling and resizing, named trace bundles. The trace schema, its loaders, the bundled
traces, arrival processes and the Mooncake writer live in ``sglang_diffkv.serving_io``, shared
with the bench harness (tests/test_import_rules.py)."""
