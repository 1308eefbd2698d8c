"""Calibration: a search over tier pairs and thresholds on calibration windows, reporting the
bytes/KL Pareto frontier and choosing the most compressive point (fewest physical
bytes/token) whose quality is within a stated tolerance of the uncompressed model, written
as a preset (with the model it was calibrated on) that the backend and simulator read.

The search covers, for every tier pair (high / low), the (alpha_h, alpha_l) grid, and for
every high tier pruning alone (alpha_h == alpha_l: no token is demoted, the low tier is
unused). Tier pairs without 4-bit keys (a K8V2 low tier) and grouped metadata are in the
default pairs: on a GQA 7:1 model every pair with a K4 low tier missed the tolerance while
uniform K8V4 met it (docs/quality.md), so the search must be able to find such points.

Candidates sharing tiers / window share one reference cache (per-request thresholds): one
model batch per tier pair.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sglang_diffkv.config import ConfigError, DiffKVConfig, TierConfig
from sglang_diffkv.eval.configs import EvalConfig
from sglang_diffkv.eval.model import LoadedModel
from sglang_diffkv.eval.pipeline import teacher_forcing
from sglang_diffkv.eval.report import pareto_front
from sglang_diffkv.model_record import ModelRecord

log = logging.getLogger(__name__)

DEFAULT_ALPHA_H = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
DEFAULT_ALPHA_L = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8)
# DiffKV's pair (one group and grouped metadata) and the same high tier over a low tier
# that keeps 8-bit keys (values at 2 bits)
DEFAULT_TIER_PAIRS = ("K8V4/K4V2", "K8V4g12/K4V2g24", "K8V4/K8V2", "K8V4g12/K8V2g12")


@dataclass(frozen=True)
class TierPair:
    high: TierConfig
    low: TierConfig

    @property
    def name(self) -> str:
        return f"{self.high.name}/{self.low.name}"

    @classmethod
    def parse(cls, text: str) -> TierPair:
        """'K8V4/K8V2' (high/low tier names); the low tier may not be more precise."""
        high, sep, low = text.strip().partition("/")
        if not sep:
            raise ConfigError(f"tier pair {text!r} must be HIGH/LOW, e.g. 'K8V4/K8V2'")
        pair = cls(TierConfig.parse(high, "high"), TierConfig.parse(low, "low"))
        DiffKVConfig(high=pair.high, low=pair.low)  # the kernels' bits, low <= high
        return pair


def parse_tier_pairs(text: str) -> list[TierPair]:
    pairs = [TierPair.parse(t) for t in text.split(",") if t.strip()]
    if not pairs:
        raise ConfigError(f"--tiers {text!r} names no tier pair; use e.g. "
                          f"{','.join(DEFAULT_TIER_PAIRS)}")
    return list(dict.fromkeys(pairs))


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a full DiffKV config and how it was built."""

    name: str
    config: DiffKVConfig

    @property
    def pruning_only(self) -> bool:
        return not self.config.has_low_tier

    @property
    def tiers(self) -> str:
        return self.config.high.name if self.pruning_only else (
            f"{self.config.high.name}/{self.config.low.name}")


def grid_points(alpha_h: list[float], alpha_l: list[float]) -> list[tuple[float, float]]:
    pts = [(h, lo) for h in alpha_h for lo in alpha_l if lo <= h]
    if not pts:
        raise ConfigError(f"no grid point has alpha_l <= alpha_h: {alpha_h} x {alpha_l}")
    return pts


def point_name(tiers: str, ah: float, al: float) -> str:
    return f"{tiers}@{ah:g}/{al:g}"


def candidates(base: DiffKVConfig, pairs: list[TierPair], alpha_h: list[float],
               alpha_l: list[float]) -> list[Candidate]:
    """The (alpha_h, alpha_l) grid for each tier pair, then pruning alone (alpha_h ==
    alpha_l > 0) once per high tier; window and score_queries come from ``base``."""
    out: dict[str, Candidate] = {}
    for pair in pairs:
        tiered = replace(base, high=pair.high, low=pair.low, bench_mix=None,
                         calibrated_for=None, allow_other_model=False)
        for ah, al in grid_points(alpha_h, alpha_l):
            if ah == al > 0:
                continue  # pruning alone: added below, once per high tier
            cfg = tiered.with_thresholds(ah, al)
            name = point_name(pair.name, ah, al)
            out[name] = Candidate(name, replace(cfg, name=name))
        for al in alpha_l:
            if al > 0:
                cfg = tiered.with_thresholds(al, al)
                name = f"{pair.high.name}+prune@{al:g}"
                out.setdefault(name, Candidate(name, replace(cfg, name=name)))
    return list(out.values())


def meets(summary: dict, max_kl: float, min_top1: float) -> bool:
    return summary["kl_mean"] <= max_kl and summary["top1"] >= min_top1


def choose(rows: list[dict], max_kl: float, min_top1: float) -> dict | None:
    """Fewest bytes/token among rows with kl_mean <= max_kl and top1 >= min_top1 (ties:
    lower KL). None if no row qualifies."""
    ok = [r for r in rows if meets(r, max_kl, min_top1)]
    return min(ok, key=lambda r: (r["bytes_per_token"], r["kl_mean"])) if ok else None


def frontier(rows: list[dict]) -> list[dict]:
    """The rows on the bytes/KL Pareto frontier, fewest bytes first."""
    names = set(pareto_front([(r["bytes_per_token"], r["kl_mean"], r["name"]) for r in rows]))
    return sorted((r for r in rows if r["name"] in names), key=lambda r: r["bytes_per_token"])


def no_point_message(front: list[dict], max_kl: float, min_top1: float) -> str:
    """Why no preset is written, and the frontier point closest to the tolerance."""
    def shortfall(r: dict) -> float:  # how far past the tolerance, relative to it
        return (max(r["kl_mean"] - max_kl, 0.0) / max(max_kl, 1e-12)
                + max(min_top1 - r["top1"], 0.0) / max(min_top1, 1e-12))

    best = min(front, key=shortfall)
    return (f"no searched point meets mean KL <= {max_kl:g} and top-1 >= {min_top1:g}; "
            f"closest on the frontier: {best['name']} (KL {best['kl_mean']:.4f}, top-1 "
            f"{best['top1']:.3f}, {100 * best['ratio_vs_bf16']:.1f}% of bf16 bytes). No preset "
            "written: loosen --max-kl / --min-top1, search more tier pairs (--tiers) or "
            "thresholds, or serve this model with bf16 / a uniform cache")


def check_tolerance(max_kl: float, min_top1: float) -> None:
    if not max_kl >= 0:
        raise ConfigError(f"--max-kl {max_kl} must be a mean KL >= 0 (nats/token)")
    if not 0 <= min_top1 <= 1:
        raise ConfigError(f"--min-top1 {min_top1} must be a top-1 agreement in [0, 1]")


def calibrate(
    lm: LoadedModel,
    cands: list[Candidate],
    windows: torch.Tensor,
    prompt_len: int,
    max_kl: float,
    min_top1: float,
) -> dict:
    """Teacher-forced quality of every candidate; the frontier, the choice and, when none
    meets the tolerance, the message saying so."""
    configs = [EvalConfig(c.name, "diffkv", diffkv=c.config) for c in cands]
    results = teacher_forcing(lm, configs, windows, prompt_len)
    rows = [{**results[c.name]["summary"], "name": c.name, "tiers": c.tiers,
             "high": c.config.high.name, "low": c.config.low.name,
             "alpha_h": c.config.alpha_h, "alpha_l": c.config.alpha_l,
             "pruning_only": c.pruning_only} for c in cands]
    front = frontier(rows)
    pick = choose(rows, max_kl, min_top1)
    if pick is None:
        message = no_point_message(front, max_kl, min_top1)
        log.warning(message)
    else:
        message = (f"chose {pick['name']}: KL {pick['kl_mean']:.4f}, top-1 {pick['top1']:.3f}, "
                   f"{pick['bytes_per_token']:.1f} B/token ({100 * pick['ratio_vs_bf16']:.1f}% "
                   "of bf16)")
        log.info(message)
    return {
        "grid": rows,
        "frontier": [r["name"] for r in front],
        "chosen": None if pick is None else pick["name"],
        "message": message,
        "tolerance": {"max_kl_mean": max_kl, "min_top1": min_top1},
    }


def frontier_table(res: dict, needles: dict[str, dict] | None = None) -> str:
    """Markdown table of the frontier (fewest bytes first); the chosen point is starred,
    points within the tolerance are marked."""
    tol = res["tolerance"]
    by_name = {r["name"]: r for r in res["grid"]}
    lines = ["| point | vs bf16 | KL mean | top-1 | needles | within tolerance |",
             "|---|---|---|---|---|---|"]
    for name in res["frontier"]:
        r = by_name[name]
        star = " *" if name == res["chosen"] else ""
        n = "" if not needles or name not in needles else f"{needles[name]['pass_rate']:.2f}"
        ok = "yes" if meets(r, tol["max_kl_mean"], tol["min_top1"]) else "no"
        lines.append(f"| {name}{star} | {100 * r['ratio_vs_bf16']:.1f}% | {r['kl_mean']:.4f} | "
                     f"{r['top1']:.3f} | {n} | {ok} |")
    return "\n".join(lines)


def preset_dict(config: DiffKVConfig, name: str, model: ModelRecord | None) -> dict:
    """The preset file content: exactly the fields ``DiffKVConfig.from_dict`` accepts, with
    the model it was calibrated on."""
    cfg = replace(config, name=name, calibrated_for=model, bench_mix=None,
                  allow_other_model=False)
    d = cfg.to_dict()
    d["high"] = cfg.high.name
    d["low"] = cfg.low.name
    for key in ("bench_mix", "allow_other_model"):
        del d[key]
    if model is None:
        del d["calibrated_for"]
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
