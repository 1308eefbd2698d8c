"""Small builders shared by the simulator tests (imported as a sibling module)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from simulator.kv.pool import TokenPool
from simulator.serving.request import SimRequest
from simulator.serving.scheduler import Scheduler, SchedulerLimits
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration import Calibration, load_calibration
from simulator.specs.gpu import load_gpu
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]


def h100_calibration_with(folder: Path, extra: dict) -> Calibration:
    """The bundled H100 calibration with the fields of ``extra`` set, written as a file into
    ``folder`` and loaded back (so the loader's checks run)."""
    f = folder / "cal.json"
    base = load_calibration("h100").to_dict()
    f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | extra}}))
    return load_calibration("h100", str(f))
H100_DATA = ROOT / "docs" / "data" / "h100-2026-11-22"  # the measured runs of 2026-11-22


def validator_options(vs: ModuleType, **given: Any) -> SimpleNamespace:
    """validate-runs' parsed options as ``with_given`` and ``fit_backend`` read them:
    none given (no launches, no holds), then ``given``."""
    return SimpleNamespace(**{
        **{field: {} for field in vs.GIVEN_SECONDS}, "eager_launch_holds_loop": [],
        "refine_hold": vs.refine_hold_arg([]),
        "model": "llama-3-8b", "gpu": "h200", "prefill_fit": "all", "fit_decode_run": [],
        "refine_on_metrics": [], **given})


def token_scheduler(capacity: int, chunk: int | None = None, max_prefill: int = 16384,
                    max_running: int = 4096, context_len: int = 100_000,
                    mixed: bool = False, ignore_eos_admission: bool = False) -> Scheduler:
    pool = TokenPool(capacity, 1, 512.0)
    limits = SchedulerLimits(chunk, max_prefill, max_running, context_len,
                             min(context_len, capacity) - 1, 1.0, mixed, ignore_eos_admission)
    return Scheduler(pool, limits, np.random.default_rng(0))


def req(rid: int, inp: int, out: int, max_new: int | None = None) -> SimRequest:
    return SimRequest(rid, 0.0, inp, out, max_new if max_new is not None else out)


def scenario(model: str = "llama-3-8b", gpu: str = "h100", **settings: object) -> Scenario:
    g = load_gpu(gpu)
    return Scenario(load_model(model), g, load_calibration(g.key), ServerSettings(**settings))
