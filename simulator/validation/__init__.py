"""Validation against real SGLang runs: parse the server log and bench_serving's result file,
and put measured and simulated numbers side by side."""
