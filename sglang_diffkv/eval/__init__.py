"""Offline quality harness: the reference DiffKV cache inside a real causal LM on the CPU.

``model`` loads a local HF or GGUF model, ``hook`` routes its attention through KV
backends (the reference :class:`sglang_diffkv.cache.CompressedKVCache` and baselines),
``runner`` teacher-forces / generates through them, ``metrics`` compares against the
uncompressed run, ``calibrate`` picks thresholds and ``report`` draws the Pareto picture.
``cli`` is ``diffkv-eval``; ``full_run`` (``python -m sglang_diffkv.eval.full_run``) is the
calibrate -> evaluate -> report run behind docs/quality.md.

May import: the core package root; never ``bench``, ``kernels`` or ``sglang``.
"""
