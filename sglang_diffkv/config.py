"""DiffKVConfig: the two precision tiers, the pruning/demotion thresholds and the windows.

A config is immutable and validated when built; every error names the field, the bad
value and what is allowed. Configs come from a named preset, a dict, a JSON file, or the
environment variable ``SGLANG_DIFFKV_CONFIG`` (a preset name, inline JSON, or a JSON path).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ALLOWED_BITS = (1, 2, 4, 8)
ENV_VAR = "SGLANG_DIFFKV_CONFIG"
BENCH_MIX_TOLERANCE = 1e-6  # how far from 1 the three bench_mix fractions may sum
PRESET_DIR = Path(__file__).parent / "presets"
# --attention-backend diffkv's --cuda-graph-max-bs when the user leaves it (and
# --cuda-graph-bs) unset: DiffKV holds several times the requests of a bf16 cache, and
# SGLang's GPU-memory default (256 on an 80 GB GPU) would leave its large decode batches
# eager. Read by the server-args fix-ups and by the simulator.
DEFAULT_CUDA_GRAPH_MAX_BS = 512


class ConfigError(ValueError):
    """A DiffKV configuration value is out of range or unknown."""


@dataclass(frozen=True)
class TierConfig:
    """Bit widths and quantisation groups (per token, per head) of one precision tier."""

    key_bits: int
    value_bits: int
    key_groups: int = 1
    value_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if not isinstance(bits, int) or bits not in ALLOWED_BITS:
                raise ConfigError(f"{name}={bits!r} is not allowed; choose one of {ALLOWED_BITS}")
        for name in ("key_groups", "value_groups"):
            groups = getattr(self, name)
            if not isinstance(groups, int) or groups < 1:
                raise ConfigError(f"{name}={groups!r} must be a positive integer")

    @property
    def name(self) -> str:
        base = f"K{self.key_bits}V{self.value_bits}"
        if (self.key_groups, self.value_groups) == (1, 1):
            return base
        return f"{base}g{self.key_groups}{self.value_groups}"

    def check_head_dim(self, head_dim: int, tier: str = "tier") -> None:
        """Groups must split head_dim into equal parts that pack into whole bytes."""
        for what, groups, bits in (
            ("key", self.key_groups, self.key_bits),
            ("value", self.value_groups, self.value_bits),
        ):
            if head_dim % groups:
                raise ConfigError(
                    f"{tier}.{what}_groups={groups} does not divide head_dim={head_dim}; "
                    f"use a divisor of {head_dim}"
                )
            if (head_dim // groups) * bits % 8:
                raise ConfigError(
                    f"{tier}.{what}_groups={groups} gives groups of {head_dim // groups} "
                    f"{bits}-bit elements, which do not fill whole bytes"
                )

    @classmethod
    def parse(cls, value: TierConfig | str | Mapping[str, Any], tier: str) -> TierConfig:
        """Accepts a TierConfig, a dict of its fields, or a string such as 'K8V4' / 'K4V2g24'."""
        if isinstance(value, TierConfig):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"key_bits", "value_bits", "key_groups", "value_groups"}
            if unknown:
                raise ConfigError(
                    f"{tier}: unknown field(s) {sorted(unknown)}; allowed: key_bits, value_bits, "
                    "key_groups, value_groups"
                )
            return cls(**value)
        if isinstance(value, str):
            return cls._parse_name(value, tier)
        raise ConfigError(f"{tier}={value!r} must be a tier name like 'K8V4' or a dict")

    @classmethod
    def _parse_name(cls, text: str, tier: str) -> TierConfig:
        s = text.strip().upper()
        groups = (1, 1)
        if "G" in s:
            s, g = s.split("G", 1)
            if len(g) != 2 or not g.isdigit():
                raise ConfigError(
                    f"{tier}={text!r}: groups suffix must be two digits, e.g. K4V2g24"
                )
            groups = (int(g[0]), int(g[1]))
        if not (s.startswith("K") and "V" in s):
            raise ConfigError(
                f"{tier}={text!r} is not a tier name; expected e.g. 'K8V4' or 'K4V2g24'"
            )
        k, v = s[1:].split("V", 1)
        if not (k.isdigit() and v.isdigit()):
            raise ConfigError(f"{tier}={text!r} is not a tier name; expected e.g. 'K8V4'")
        return cls(int(k), int(v), *groups)


K8V4 = TierConfig(8, 4)
K4V2 = TierConfig(4, 2)
K8V4_GROUPED = TierConfig(8, 4, 1, 2)
K4V2_GROUPED = TierConfig(4, 2, 2, 4)


@dataclass(frozen=True)
class DiffKVConfig:
    """Thresholds are alpha / L: a token whose mean attention is below alpha_l / L is pruned,
    below alpha_h / L it goes to the low tier, otherwise it stays high. The most recent
    ``window`` tokens are always high; prompt significance uses the last ``score_queries``.

    ``bench_mix`` = (high, low, pruned) fractions turns on benchmark mode (for random-weight
    models, whose attention means nothing): tier decisions follow the mix instead of the
    scores, everything else runs for real (``sglang_diffkv.bench_mix``). Output quality is
    meaningless in this mode."""

    high: TierConfig = K8V4_GROUPED
    low: TierConfig = K4V2_GROUPED
    alpha_h: float = 1.0
    alpha_l: float = 0.0
    window: int = 64
    score_queries: int = 64
    bench_mix: tuple[float, float, float] | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for fname in ("alpha_h", "alpha_l"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{fname}={value!r} must be a number >= 0")
            if not value >= 0 or value == float("inf"):
                raise ConfigError(f"{fname}={value!r} must be a finite number >= 0")
        if self.alpha_l > self.alpha_h:
            raise ConfigError(
                f"alpha_l={self.alpha_l} > alpha_h={self.alpha_h}; the pruning threshold must "
                "not exceed the demotion threshold (alpha_l <= alpha_h)"
            )
        for fname in ("window", "score_queries"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{fname}={value!r} must be a positive integer")
        high_bits = (self.high.key_bits, self.high.value_bits)
        low_bits = (self.low.key_bits, self.low.value_bits)
        if low_bits[0] > high_bits[0] or low_bits[1] > high_bits[1]:
            raise ConfigError(
                f"low tier {self.low.name} is more precise than high tier {self.high.name}; "
                "the low tier must use no more bits than the high tier"
            )
        if self.bench_mix is not None:
            object.__setattr__(self, "bench_mix", self._checked_bench_mix(self.bench_mix))

    def _checked_bench_mix(self, mix: Any) -> tuple[float, float, float]:
        allowed = (
            "three fractions [high, low, pruned], each in [0, 1], summing to 1, high > 0"
        )
        if not isinstance(mix, (list, tuple)) or len(mix) != 3:
            shown = list(mix) if isinstance(mix, (list, tuple)) else mix
            raise ConfigError(f"bench_mix={shown!r} is not allowed; expected {allowed}")
        for value in mix:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"bench_mix={list(mix)!r}: {value!r} is not a number; "
                                  f"expected {allowed}")
        high, low, pruned = (float(x) for x in mix)
        for what, value in (("high", high), ("low", low), ("pruned", pruned)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"bench_mix {what}={value} is outside [0, 1]; expected "
                                  f"{allowed}")
        if abs(high + low + pruned - 1.0) > BENCH_MIX_TOLERANCE:
            raise ConfigError(
                f"bench_mix={[high, low, pruned]} sums to {high + low + pruned}; the "
                f"fractions must sum to 1 (within {BENCH_MIX_TOLERANCE})"
            )
        if high <= 0:
            raise ConfigError(
                f"bench_mix high={high}: must be > 0 (the newest token always enters high)"
            )
        if low > 0 and not self.has_low_tier:
            raise ConfigError(
                f"bench_mix low={low} needs a low tier, but alpha_h={self.alpha_h} == "
                f"alpha_l={self.alpha_l} classifies nothing low; set alpha_h > alpha_l or "
                "low=0"
            )
        return (high, low, pruned)

    @property
    def bench_note(self) -> str | None:
        """The one sentence every start-up report shows in benchmark mode."""
        if self.bench_mix is None:
            return None
        high, low, pruned = self.bench_mix
        return (
            f"BENCHMARK MODE: tier decisions follow mix high {high:.4g} / low {low:.4g} / "
            f"pruned {pruned:.4g}, not attention scores (output quality is meaningless)"
        )

    @property
    def has_low_tier(self) -> bool:
        """With alpha_l == alpha_h no token classifies as low (tokens are high or pruned)."""
        return self.alpha_h > self.alpha_l

    def check_head_dim(self, head_dim: int) -> None:
        self.high.check_head_dim(head_dim, "high")
        self.low.check_head_dim(head_dim, "low")

    def with_thresholds(self, alpha_h: float, alpha_l: float) -> DiffKVConfig:
        return replace(self, alpha_h=alpha_h, alpha_l=alpha_l)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["high"] = asdict(self.high)
        d["low"] = asdict(self.low)
        return d

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DiffKVConfig:
        """Fields override the preset named by ``preset`` (default: 'default')."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a DiffKV config must be a JSON object, got {type(data).__name__}")
        allowed = {"preset", "name", "high", "low", "alpha_h", "alpha_l", "window",
                   "score_queries", "bench_mix"}
        unknown = set(data) - allowed
        if unknown:
            raise ConfigError(
                f"unknown config field(s) {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        base = preset(data.get("preset", "default"))
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k != "preset"}
        for tier in ("high", "low"):
            if tier in kwargs:
                kwargs[tier] = TierConfig.parse(kwargs[tier], tier)
        if isinstance(kwargs.get("bench_mix"), list):
            kwargs["bench_mix"] = tuple(kwargs["bench_mix"])
        if "name" not in kwargs:
            kwargs["name"] = base.name if set(data) <= {"preset"} else f"{base.name}+custom"
        return replace(base, **kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> DiffKVConfig:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read DiffKV config file {str(p)!r}: {e.strerror}") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: line {e.lineno}: invalid JSON ({e.msg})") from e
        return cls.from_dict(data)

    @classmethod
    def from_spec(cls, spec: str) -> DiffKVConfig:
        """A preset name, inline JSON (starts with '{'), or a path to a JSON file."""
        s = spec.strip()
        if s.startswith("{"):
            try:
                return cls.from_dict(json.loads(s))
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"invalid inline JSON DiffKV config: {e.msg} at char {e.pos}"
                ) from e
        if s.endswith(".json") or os.sep in s:
            return cls.from_json(s)
        return preset(s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DiffKVConfig:
        """Reads SGLANG_DIFFKV_CONFIG; unset or empty means the 'default' preset."""
        env = os.environ if environ is None else environ
        spec = env.get(ENV_VAR, "").strip()
        if not spec:
            return preset("default")
        try:
            return cls.from_spec(spec)
        except ConfigError as e:
            raise ConfigError(f"{ENV_VAR}={spec!r}: {e}") from e


def _preset(name: str, alpha_l: float, alpha_h: float, grouped: bool) -> DiffKVConfig:
    high, low = (K8V4_GROUPED, K4V2_GROUPED) if grouped else (K8V4, K4V2)
    return DiffKVConfig(high=high, low=low, alpha_h=alpha_h, alpha_l=alpha_l, name=name)


def _measured_bench_preset(name: str) -> DiffKVConfig:
    """The calibrated SmolLM2-135M preset with, as bench_mix, the tier mix the quality
    harness measured for it (its provenance file, eval split; docs/quality.md), rounded to
    four decimals: the mix a real model produced under the calibrated thresholds."""
    base = DiffKVConfig.from_json(PRESET_DIR / "smollm2-135m.json")
    provenance = json.loads((PRESET_DIR / "smollm2-135m.provenance.json").read_text())
    measured = provenance["eval_split_metrics"]
    high = round(measured["high"], 4)
    pruned = round(max(measured["pruned"], 0.0), 4)  # recorded as ~1e-18 when nothing is
    return replace(base, bench_mix=(high, round(1.0 - high - pruned, 4), pruned), name=name)


# Thresholds from DiffKV's calibration (benchmark_throughput.sh); one metadata group per head
# for the throughput presets, grouped metadata for the reasoning model and the default.
PRESETS: dict[str, DiffKVConfig] = {
    "default": _preset("default", 0.0, 1.0, grouped=True),
    "llama-3-8b": _preset("llama-3-8b", 0.02, 1.0, grouped=False),
    "qwen2.5-7b": _preset("qwen2.5-7b", 0.04, 0.04, grouped=False),
    "llama-3-70b": _preset("llama-3-70b", 0.0, 1.0, grouped=False),
    "qwen2.5-32b": _preset("qwen2.5-32b", 0.0, 3.0, grouped=False),
    "qwq-32b": _preset("qwq-32b", 0.0, 3.0, grouped=True),
    # Everything kept at the high tier: the "compression off" setting used for A/B checks.
    "no-compression": _preset("no-compression", 0.0, 0.0, grouped=False),
    # Benchmark mode (random-weight models): Llama-3-8B's tiers and thresholds with tier
    # decisions drawn 30 % high / 50 % low / 20 % pruned (issue #7's reference mix) ...
    "bench-30-50-20": replace(
        _preset("bench-30-50-20", 0.02, 1.0, grouped=False), bench_mix=(0.3, 0.5, 0.2)
    ),
}


def preset(name: str) -> DiffKVConfig:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return PRESETS[key]


# ... and the mix measured on a real model by the quality harness (its base is read through
# from_dict, which needs the presets above).
PRESETS["bench-measured"] = _measured_bench_preset("bench-measured")

