"""Threshold calibration: a grid over (alpha_h, alpha_l) on calibration windows, choosing
the most compressive point (fewest physical bytes/token) whose quality is within a stated
tolerance of the uncompressed model, written as a preset the backend and simulator read.

All grid points share one reference cache (per-request thresholds) and one model batch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from sglang_diffkv.config import ConfigError, DiffKVConfig
from sglang_diffkv.eval.configs import EvalConfig
from sglang_diffkv.eval.model import LoadedModel
from sglang_diffkv.eval.pipeline import teacher_forcing

log = logging.getLogger(__name__)

DEFAULT_ALPHA_H = (0.5, 1.0, 2.0, 4.0, 8.0)
DEFAULT_ALPHA_L = (0.0, 0.05, 0.2)


def grid_points(alpha_h: list[float], alpha_l: list[float]) -> list[tuple[float, float]]:
    pts = [(h, lo) for h in alpha_h for lo in alpha_l if lo <= h]
    if not pts:
        raise ConfigError(f"no grid point has alpha_l <= alpha_h: {alpha_h} x {alpha_l}")
    return pts


def point_name(ah: float, al: float) -> str:
    return f"diffkv@{ah:g}/{al:g}"


def choose(
    results: dict[str, dict], points: list[tuple[float, float]], max_kl: float, min_top1: float
) -> tuple[float, float] | None:
    """Fewest bytes/token among points with kl_mean <= max_kl and top1 >= min_top1
    (ties: lower KL). None if no point qualifies."""
    ok = []
    for ah, al in points:
        s = results[point_name(ah, al)]["summary"]
        if s["kl_mean"] <= max_kl and s["top1"] >= min_top1:
            ok.append((s["bytes_per_token"], s["kl_mean"], ah, al))
    if not ok:
        return None
    _, _, ah, al = min(ok)
    return ah, al


def calibrate(
    lm: LoadedModel,
    base: DiffKVConfig,
    windows: torch.Tensor,
    prompt_len: int,
    points: list[tuple[float, float]],
    max_kl: float,
    min_top1: float,
) -> dict:
    configs = [
        EvalConfig(point_name(ah, al), "diffkv", diffkv=base.with_thresholds(ah, al))
        for ah, al in points
    ]
    results = teacher_forcing(lm, configs, windows, prompt_len)
    pick = choose(results, points, max_kl, min_top1)
    if pick is None:
        log.warning("no grid point meets mean KL <= %g and top-1 >= %g", max_kl, min_top1)
    else:
        s = results[point_name(*pick)]["summary"]
        log.info(
            "chose alpha_h=%g alpha_l=%g: KL %.4f, top1 %.3f, %.1f B/token (%.1f%% of bf16)",
            *pick, s["kl_mean"], s["top1"], s["bytes_per_token"], 100 * s["ratio_vs_bf16"],
        )
    return {
        "grid": [{"alpha_h": ah, "alpha_l": al, **results[point_name(ah, al)]["summary"]}
                 for ah, al in points],
        "chosen": None if pick is None else {"alpha_h": pick[0], "alpha_l": pick[1]},
        "tolerance": {"max_kl_mean": max_kl, "min_top1": min_top1},
    }


def preset_dict(base: DiffKVConfig, alpha_h: float, alpha_l: float, name: str) -> dict:
    """The preset file content: exactly the fields ``DiffKVConfig.from_dict`` accepts."""
    cfg = replace(base.with_thresholds(alpha_h, alpha_l), name=name)
    d = cfg.to_dict()
    d["high"] = cfg.high.name
    d["low"] = cfg.low.name
    DiffKVConfig.from_dict(d)  # the file must load back
    return d


def write_preset(path: Path, preset: dict, provenance: dict) -> tuple[Path, Path]:
    """Write ``path`` (loadable by DiffKVConfig.from_json) and ``<stem>.provenance.json``
    beside it (from_dict rejects unknown keys, so provenance cannot live in the preset)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(preset, indent=2) + "\n")
    loaded = DiffKVConfig.from_json(path)
    if (loaded.alpha_h, loaded.alpha_l) != (preset["alpha_h"], preset["alpha_l"]):
        raise RuntimeError(f"{path} does not load back to the chosen thresholds")
    prov = path.with_name(path.stem + ".provenance.json")
    prov.write_text(json.dumps(provenance, indent=2) + "\n")
    return path, prov
