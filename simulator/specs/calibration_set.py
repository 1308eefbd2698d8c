"""Which calibration a KV format runs with: the validated set shipped for a measured GPU, or
an uncalibrated estimate.

SGLang serves bf16 and fp8 KV caches with its triton attention backend and the DiffKV formats
(diffkv, uniform k8v4 / k4v2) with the DiffKV backend; the two have their own kernels and
their own host work per step, so a validated calibration is one file per backend:
``simulator/calibration/<gpu>-<backend>.json``. A GPU with both files is *measured*: its
files are the ones its validation report scored (their top-level ``validated_by`` names the
report), and ``--gpu <gpu>`` uses them by default. Any other GPU runs on
``simulator/calibration/default.json`` (published efficiencies, no host terms): an
uncalibrated estimate, and every output says so. A file given with ``--calibration`` applies
to every format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from simulator.specs.calibration import Calibration, load_calibration

BACKENDS = ("triton", "diffkv")
TRITON_KEYS = ("bf16", "fp8")   # the KV formats (calibration keys) SGLang's triton backend serves
PACKAGE = "simulator.calibration"


def backend_of(calibration_key: str) -> str:
    """The attention backend that serves a KV format (its calibration key): ``triton`` for
    bf16 and fp8, ``diffkv`` for the DiffKV backend's formats; a backend's name is its own."""
    if calibration_key in BACKENDS:
        return calibration_key
    return "triton" if calibration_key in TRITON_KEYS else "diffkv"


def shipped_file(gpu: str, backend: str) -> str:
    return f"{gpu}-{backend}.json"


def measured_gpus() -> list[str]:
    """GPUs with a validated calibration shipped for every backend."""
    names = {p.name for p in resources.files(PACKAGE).iterdir()}
    gpus = {n.rsplit("-", 1)[0] for n in names if n.endswith(".json") and "-" in n}
    return sorted(g for g in gpus if all(shipped_file(g, b) in names for b in BACKENDS))


@dataclass(frozen=True)
class CalibrationSet:
    """One calibration per backend, and what they are: ``kind`` is ``measured`` (shipped,
    fitted to real runs and scored against them in ``report``), ``uncalibrated`` (published
    efficiencies for a GPU we have not measured) or ``given`` (a file given by the user)."""

    gpu: str
    by_backend: Mapping[str, Calibration]
    kind: str
    report: str = ""

    def for_key(self, calibration_key: str) -> Calibration:
        return self.by_backend[backend_of(calibration_key)]

    @property
    def files(self) -> dict[str, str]:
        return {b: c.source_file for b, c in self.by_backend.items()}

    def note(self) -> str:
        """One line for a table's foot: which calibration ran, and how far to trust it."""
        files = sorted(set(self.files.values()))
        if self.kind == "measured":
            return (f"calibration: fitted to measured {self.gpu.upper()} runs "
                    f"({', '.join(files)}); validation: {self.report}")
        if self.kind == "uncalibrated":
            return (f"calibration: UNCALIBRATED ESTIMATE for {self.gpu}: no measured runs on "
                    f"this GPU; published efficiencies and no host costs ({files[0]}); "
                    f"measured GPUs: {', '.join(measured_gpus())}")
        return f"calibration: {files[0]} (given with --calibration; not a shipped validated set)"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "gpu": self.gpu, "files": self.files,
                "report": self.report or None, "note": self.note()}


def load_calibration_set(gpu: str, path: str | Path | None = None) -> CalibrationSet:
    """The calibration ``--gpu gpu`` runs with: the file at ``path`` for every format when
    given, else the GPU's measured set, else the uncalibrated defaults."""
    if path is not None:
        c = load_calibration(gpu, path)
        return CalibrationSet(gpu, {b: c for b in BACKENDS}, "given")
    if gpu not in measured_gpus():
        c = load_calibration(gpu)
        return CalibrationSet(gpu, {b: c for b in BACKENDS}, "uncalibrated")
    by_backend, reports = {}, set()
    for b in BACKENDS:
        f = resources.files(PACKAGE).joinpath(shipped_file(gpu, b))
        data = json.loads(f.read_text())
        reports.add(str(data.get("validated_by", "")))
        # named by its place in the package, not by the install's absolute path
        by_backend[b] = replace(load_calibration(gpu, Path(str(f))),
                                source_file=f"simulator/calibration/{f.name}")
    return CalibrationSet(gpu, by_backend, "measured", "; ".join(sorted(r for r in reports if r)))

