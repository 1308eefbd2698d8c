"""Questions answered with runs: compare KV formats, sweep rates, max QPS and GPUs needed."""
