"""The small traces shipped in the ``traces`` package (see traces/ATTRIBUTION.md)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.loaders import load_trace
from sglang_diffkv.serving_io.trace import Trace

# name -> (file, format, one-line description)
BUNDLED_TRACES: dict[str, tuple[str, str, str]] = {
    "sharegpt": ("sharegpt_shaped.jsonl.gz", "mooncake",
                 "2,000 synthetic ShareGPT-shaped requests, Poisson 64 req/s"),
    "long-generation": ("long_generation.jsonl.gz", "mooncake",
                        "600 synthetic MATH-like requests, outputs 512-7,680 tokens, "
                        "Poisson 8 req/s"),
    "azure-conv": ("azure2023_conv_10min.csv.gz", "azure",
                   "Azure LLM inference 2023 conversation, first 10 minutes"),
    "azure-code": ("azure2023_code_10min.csv.gz", "azure",
                   "Azure LLM inference 2023 code, first 10 minutes"),
    "mooncake-conversation": ("mooncake_conversation_1k.jsonl.gz", "mooncake",
                              "Mooncake conversation trace, first 1,000 requests"),
    "mooncake-synthetic": ("mooncake_synthetic_500.jsonl.gz", "mooncake",
                           "Mooncake synthetic trace, first 500 requests"),
}


def bundled_path(name: str) -> Path:
    if name not in BUNDLED_TRACES:
        raise InputError(
            f"unknown bundled trace {name!r}; available: {', '.join(BUNDLED_TRACES)}")
    ref = resources.files("traces").joinpath(BUNDLED_TRACES[name][0])
    with resources.as_file(ref) as p:
        return Path(p)


def load_named_trace(spec: str, fmt: str | None = None) -> Trace:
    """A bundled trace name or a path to a trace file."""
    if spec in BUNDLED_TRACES:
        return load_trace(bundled_path(spec), BUNDLED_TRACES[spec][1], name=spec)
    if Path(spec).is_file():
        return load_trace(spec, fmt)
    raise InputError(
        f"trace {spec!r} is neither a bundled trace ({', '.join(BUNDLED_TRACES)}) nor a file")
