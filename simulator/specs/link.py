"""KV transfer link specs (nominal bandwidth, efficiency, latency, with their provenance) from
the bundled ``links.json`` or a file."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.json_file import read_json
from simulator.errors import SimulatorInputError

FIELDS = ("name", "bandwidth", "efficiency", "latency_s", "provenance")


@dataclass(frozen=True)
class LinkSpec:
    key: str
    name: str
    bandwidth: float     # nominal bytes/s, one direction, one GPU's port
    efficiency: float    # fraction of the nominal rate a transfer reaches, in (0, 1]
    latency_s: float     # fixed seconds per transfer
    provenance: str

    def __post_init__(self) -> None:
        for f, ok, allowed in (("bandwidth", self.bandwidth > 0, "a number > 0 (bytes/s)"),
                               ("efficiency", 0 < self.efficiency <= 1, "in (0, 1]"),
                               ("latency_s", self.latency_s >= 0, "a number >= 0 (seconds)")):
            v = getattr(self, f)
            if isinstance(v, bool) or not math.isfinite(v) or not ok:
                raise SimulatorInputError(f"link {self.key!r}: {f}={v!r} must be {allowed}")

    @property
    def rate(self) -> float:
        """Bytes/s a transfer moves at."""
        return self.bandwidth * self.efficiency

    def transfer_s(self, nbytes: float) -> float:
        """Seconds one transfer of ``nbytes`` holds the link."""
        return self.latency_s + nbytes / self.rate

    def describe(self) -> str:
        eff = "" if self.efficiency == 1 else f" x {self.efficiency:g} efficiency"
        return (f"{self.name}: {self.bandwidth / 1e9:g} GB/s each way{eff}, "
                f"{self.latency_s * 1e6:g} us per transfer")

    @classmethod
    def from_dict(cls, key: str, d: Any) -> LinkSpec:
        if not isinstance(d, dict):
            raise SimulatorInputError(f"link spec {key!r} must be a JSON object with {FIELDS}")
        missing = [f for f in FIELDS if f not in d]
        if missing:
            raise SimulatorInputError(f"link spec {key!r} lacks field(s) {missing}")
        try:
            return cls(key, str(d["name"]), float(d["bandwidth"]), float(d["efficiency"]),
                       float(d["latency_s"]), str(d["provenance"]))
        except (TypeError, ValueError) as e:
            raise SimulatorInputError(f"link spec {key!r}: {e}") from e


def _bundled() -> dict[str, Any]:
    return json.loads(resources.files("simulator.specs").joinpath("links.json").read_text())


def link_names() -> list[str]:
    return [k for k in _bundled() if not k.startswith("_")]


def load_link(spec: str) -> LinkSpec:
    """A bundled link key (nvlink4, pcie5, rdma-100, rdma-200, rdma-400, and tcp-loopback,
    Mooncake's TCP transport within one host, measured idle on an H200) or a JSON file with
    one link's fields."""
    key = spec.strip().lower()
    data = _bundled()
    if key in data and not key.startswith("_"):
        return LinkSpec.from_dict(key, data[key])
    p = Path(spec)
    if p.suffix == ".json" and p.is_file():
        return LinkSpec.from_dict(p.stem, read_json(p, "link file", SimulatorInputError))
    raise SimulatorInputError(f"unknown link {spec!r}; use one of {', '.join(link_names())} "
                              "or a JSON file with the fields " + ", ".join(FIELDS))
