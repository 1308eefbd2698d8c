"""Fit the length models shipped in ``length_fits.json`` from the traces in a data folder.

Run ``python -m simulator.workload.fit [DATA_DIR]`` (default ``../shared/data/traces``) to
regenerate the file. ShareGPT and the long-generation (MATH-like) models are not fitted from
data here: ShareGPT text cannot be redistributed, so its entry carries the published lognormal
fit of its first turns; the long-generation entry is a stated assumption (see its source).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.loaders import load_trace
from sglang_diffkv.serving_io.trace import Trace
from simulator.workload.lengths import LengthModel, Marginal

FITTED = {
    "azure-conv": ("azure2023_conv_full.csv.gz", "Azure LLM inference 2023 conv (CC-BY-4.0)"),
    "azure-code": ("azure2023_code_first30min.csv.gz",
                   "Azure LLM inference 2023 code, first 30 min (CC-BY-4.0)"),
    "mooncake-conversation": ("mooncake_conversation_trace.jsonl.gz",
                              "Mooncake FAST'25 conversation trace (Apache-2.0)"),
    "mooncake-synthetic": ("mooncake_synthetic_trace.jsonl.gz",
                           "Mooncake FAST'25 synthetic trace (Apache-2.0)"),
}

STATED = {
    "sharegpt": {
        "source": "ShareGPT first turns (>= 2 tokens), Qwen BPE: lognormal fit (4.61, 1.70) in, "
                  "(4.47, 1.54) out, log-corr -0.36, from reference/simulator_anchors.md 3.2; "
                  "clipped to [4, 4096] in and [4, 2048] out",
        "input": {"mu": 4.61, "sigma": 1.70, "low": 4, "high": 4096},
        "output": {"mu": 4.47, "sigma": 1.54, "low": 4, "high": 2048},
        "log_corr": -0.36, "rate_rps": None, "interarrival_cv": None,
    },
    "long-generation": {
        "source": "ASSUMPTION, not fitted: MATH-style reasoning prompts (lognormal median 150 "
                  "tokens) and long chain-of-thought outputs (lognormal median 3000 tokens, "
                  "sigma 0.6, clipped to [512, 7680] so prompt + output fits an 8k context); "
                  "replace with measured QwQ output lengths",
        "input": {"mu": 5.01, "sigma": 0.5, "low": 32, "high": 480},
        "output": {"mu": 8.006, "sigma": 0.6, "low": 512, "high": 7680},
        "log_corr": 0.1, "rate_rps": None, "interarrival_cv": None,
    },
}


def fit_trace(trace: Trace, name: str, source: str) -> LengthModel:
    inp = np.array([r.input_tokens for r in trace.requests], dtype=float)
    out = np.array([r.output_tokens for r in trace.requests], dtype=float)
    corr = float(np.corrcoef(np.log(inp), np.log(out))[0, 1])
    gaps = np.diff([r.arrival_s for r in trace.requests])
    cv = float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0 else None
    return LengthModel(name=name, input=Marginal.fit(inp), output=Marginal.fit(out),
                       log_corr=round(max(-0.99, min(0.99, corr)), 4), source=source,
                       rate_rps=round(trace.mean_rate, 4), interarrival_cv=cv and round(cv, 4))


def build(data_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"_about": __doc__.strip().splitlines()[0]}
    for name, (fname, source) in FITTED.items():
        model = fit_trace(load_trace(data_dir / fname), name, f"{source}: {fname}")
        out[name] = model.to_dict()
    out.update(STATED)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    data = Path(args[0]) if args else Path(__file__).resolve().parents[2] / "../shared/data/traces"
    fits = build(data.resolve())
    dest = Path(__file__).with_name("length_fits.json")
    dest.write_text(json.dumps(fits, indent=1) + "\n")
    print(f"wrote {dest} ({len(fits) - 1} length models)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
