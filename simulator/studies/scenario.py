"""A scenario: everything but the KV format and the load, so one scenario runs many of both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.serving_io.trace import Trace
from simulator.engine.cluster import RunResult, simulate
from simulator.kv.formats import KVFormat, make_format
from simulator.kv.mix import TierMix
from simulator.metrics.slo import SLO
from simulator.metrics.summary import summarize
from simulator.serving.server import Deployment, ResolvedServer
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration import Calibration
from simulator.specs.calibration_set import CalibrationSet
from simulator.specs.gpu import GPUSpec
from simulator.specs.model import ModelSpec
from simulator.workload.generate import ClosedLoop


@dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    gpu: GPUSpec
    # one calibration for every KV format, or a set with one per backend (``--gpu``'s default)
    calibration: Calibration | CalibrationSet
    settings: ServerSettings
    diffkv_config: DiffKVConfig | None = None
    mix: TierMix | None = None
    replicas: int = 1
    router: str = "round_robin"
    seed: int = 0
    progress: bool | None = False

    def kv_format(self, name: str) -> KVFormat:
        return make_format(name, self.model.head_dim, self.diffkv_config, self.mix)

    def calibration_for(self, kv: KVFormat) -> Calibration:
        c = self.calibration
        return c.for_key(kv.calibration_key) if isinstance(c, CalibrationSet) else c

    def server(self, fmt: str) -> ResolvedServer:
        kv = self.kv_format(fmt)
        return ResolvedServer(Deployment(self.model, self.gpu, kv, self.settings,
                                         self.calibration_for(kv)))

    def with_replicas(self, n: int) -> Scenario:
        return replace(self, replicas=n)

    def run(self, workload: Trace | ClosedLoop, fmt: str,
            server: ResolvedServer | None = None,
            warm_cache: Sequence[Sequence[int]] = ()) -> RunResult:
        """``warm_cache``: the radix cache at the start (``simulate``); empty: a fresh
        server."""
        srv = server or self.server(fmt)
        return simulate(workload, srv, replicas=self.replicas, router=self.router,
                        seed=self.seed, progress=self.progress, warm_cache=warm_cache)

    def run_summary(self, workload: Trace | ClosedLoop, fmt: str, slo: SLO | None = None,
                    server: ResolvedServer | None = None) -> tuple[RunResult, dict[str, Any]]:
        res = self.run(workload, fmt, server)
        return res, summarize(res, slo)

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.name, "gpu": self.gpu.key, "gpu_name": self.gpu.name,
                "tp": self.settings.tp, "replicas": self.replicas, "router": self.router,
                "seed": self.seed, "settings": self.settings.to_dict(),
                "calibration": (self.calibration.describe()
                                if isinstance(self.calibration, CalibrationSet)
                                else {"kind": "given", "files": self.calibration.source_file}),
                "diffkv_config": (self.diffkv_config.to_dict() if self.diffkv_config else None),
                "mix": self.mix.describe() if self.mix else None}
