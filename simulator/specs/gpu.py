"""GPU specs (datasheet numbers with their provenance) from the bundled ``gpus.json`` or a file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.json_file import read_json
from simulator.errors import SimulatorInputError


@dataclass(frozen=True)
class GPUSpec:
    key: str
    name: str
    memory_mib: int
    hbm_bandwidth: float       # bytes/s
    bf16_flops: float          # dense FLOP/s
    fp8_flops: float
    interconnect_bandwidth: float  # bytes/s each way, between GPUs of one host
    provenance: str
    usable_mib: int = 0        # what the driver exposes to torch; 0: same as memory_mib
    compute_capability: tuple[int, int] | None = None  # (major, minor); None: not given

    def __post_init__(self) -> None:
        for f in ("memory_mib", "hbm_bandwidth", "bf16_flops", "fp8_flops",
                  "interconnect_bandwidth"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise SimulatorInputError(f"GPU {self.key!r}: {f}={v!r} must be a number > 0")

    @property
    def memory_bytes(self) -> float:
        return self.memory_mib * 2**20

    @property
    def usable_bytes(self) -> float:
        """Total memory torch sees (free-before-load = this minus the CUDA context)."""
        return (self.usable_mib or self.memory_mib) * 2**20

    @classmethod
    def from_dict(cls, key: str, d: dict[str, Any]) -> GPUSpec:
        fields = ("name", "memory_mib", "hbm_bandwidth", "bf16_flops", "fp8_flops",
                  "interconnect_bandwidth", "provenance")
        missing = [f for f in fields if f not in d]
        if missing:
            raise SimulatorInputError(f"GPU spec {key!r} lacks field(s) {missing}")
        usable = int(d.get("usable_mib", 0))
        if usable < 0 or usable > int(d["memory_mib"]):
            raise SimulatorInputError(f"GPU spec {key!r}: usable_mib={usable} must be in "
                                      f"[0, memory_mib={d['memory_mib']}]")
        return cls(key, str(d["name"]), int(d["memory_mib"]), float(d["hbm_bandwidth"]),
                   float(d["bf16_flops"]), float(d["fp8_flops"]),
                   float(d["interconnect_bandwidth"]), str(d["provenance"]), usable,
                   _compute_capability(key, d.get("compute_capability")))


def _compute_capability(key: str, v: Any) -> tuple[int, int] | None:
    """"9.0" -> (9, 0); absent -> None."""
    if v is None:
        return None
    try:
        major, minor = (int(x) for x in str(v).split("."))
    except ValueError:
        raise SimulatorInputError(f"GPU spec {key!r}: compute_capability={v!r} must be "
                                  f"'MAJOR.MINOR', e.g. '9.0'") from None
    return major, minor


def _bundled() -> dict[str, Any]:
    return json.loads(resources.files("simulator.specs").joinpath("gpus.json").read_text())


def gpu_names() -> list[str]:
    return [k for k in _bundled() if not k.startswith("_")]


def load_gpu(spec: str) -> GPUSpec:
    """A bundled GPU key (h100, h200, a100, l40) or a JSON file with one GPU's fields."""
    key = spec.strip().lower()
    data = _bundled()
    if key in data and not key.startswith("_"):
        return GPUSpec.from_dict(key, data[key])
    p = Path(spec)
    if p.suffix == ".json" and p.is_file():
        return GPUSpec.from_dict(p.stem, read_json(p, "GPU file", SimulatorInputError))
    raise SimulatorInputError(f"unknown GPU {spec!r}; use one of {', '.join(gpu_names())} "
                              "or a JSON file")
