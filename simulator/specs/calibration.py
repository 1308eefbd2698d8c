"""Calibration: the efficiency factors and fixed costs of the cost model, per GPU, with their
provenance. Defaults ship in ``simulator/calibration/default.json``; a fitted file with the same
schema replaces them (``--calibration PATH``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from simulator.errors import SimulatorInputError

ETA_FIELDS = ("eta_mem_gemm", "eta_comp_gemm", "eta_comp_prefill_attention",
              "eta_comp_decode_attention", "eta_interconnect")
SECONDS_FIELDS = ("allreduce_latency_s", "layer_overhead_s", "eager_layer_overhead_s",
                  "step_overhead_s", "seq_overhead_s")
GIB_FIELDS = ("cuda_context_gib", "post_load_overhead_gib")


@dataclass(frozen=True)
class Calibration:
    gpu: str
    eta_mem_gemm: float
    eta_comp_gemm: float
    eta_comp_prefill_attention: float
    eta_comp_decode_attention: float
    eta_interconnect: float
    eta_mem_decode_attention: dict[str, float]
    allreduce_latency_s: float
    layer_overhead_s: float
    eager_layer_overhead_s: float
    step_overhead_s: float
    seq_overhead_s: float
    cuda_context_gib: float
    post_load_overhead_gib: float
    provenance: dict[str, Any]
    source_file: str

    def attention_eta(self, key: str) -> float:
        if key not in self.eta_mem_decode_attention:
            raise SimulatorInputError(
                f"calibration {self.source_file} for {self.gpu} has no decode-attention eta for "
                f"KV format {key!r}; it has {sorted(self.eta_mem_decode_attention)}"
            )
        return self.eta_mem_decode_attention[key]

    @classmethod
    def from_dict(cls, gpu: str, d: dict[str, Any], source: str) -> Calibration:
        where = f"{source}: gpus.{gpu}"
        missing = [f for f in (*ETA_FIELDS, *SECONDS_FIELDS, *GIB_FIELDS,
                               "eta_mem_decode_attention", "provenance") if f not in d]
        if missing:
            raise SimulatorInputError(f"{where} lacks field(s) {missing}")
        for f in ETA_FIELDS:
            v = d[f]
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise SimulatorInputError(f"{where}.{f}={v!r} must be in (0, 1]")
        etas = d["eta_mem_decode_attention"]
        if not isinstance(etas, dict) or not etas:
            raise SimulatorInputError(f"{where}.eta_mem_decode_attention must map formats to eta")
        for k, v in etas.items():
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise SimulatorInputError(f"{where}.eta_mem_decode_attention.{k}={v!r} must be "
                                          "in (0, 1]")
        for f in (*SECONDS_FIELDS, *GIB_FIELDS):
            v = d[f]
            if not isinstance(v, (int, float)) or v < 0:
                raise SimulatorInputError(f"{where}.{f}={v!r} must be a number >= 0")
        if not isinstance(d["provenance"], dict) or "source" not in d["provenance"]:
            raise SimulatorInputError(f"{where}.provenance must be an object with a 'source'")
        return cls(gpu=gpu, eta_mem_decode_attention={k: float(v) for k, v in etas.items()},
                   provenance=dict(d["provenance"]), source_file=source,
                   **{f: float(d[f]) for f in (*ETA_FIELDS, *SECONDS_FIELDS, *GIB_FIELDS)})


def load_calibration(gpu: str, path: str | Path | None = None) -> Calibration:
    if path is None:
        text = resources.files("simulator.calibration").joinpath("default.json").read_text()
        source = "simulator/calibration/default.json"
    else:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise SimulatorInputError(f"cannot read calibration {str(p)!r}: {e.strerror}") from e
        source = str(p)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SimulatorInputError(f"{source}: line {e.lineno}: invalid JSON ({e.msg})") from e
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(gpus, dict):
        raise SimulatorInputError(f"{source}: expected an object with a 'gpus' mapping")
    if gpu not in gpus:
        raise SimulatorInputError(f"{source} has no calibration for GPU {gpu!r}; it has "
                                  f"{sorted(gpus)}")
    return Calibration.from_dict(gpu, gpus[gpu], source)
