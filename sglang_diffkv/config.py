"""DiffKVConfig: the two precision tiers, the pruning/demotion thresholds and the windows.

A config is immutable and validated when built, whatever it was built from (a preset, a
dict, inline JSON, a JSON file or the environment variable ``SGLANG_DIFFKV_CONFIG``): every
error is a ConfigError of one line naming the field, the bad value and what is allowed.
The bounds are those the whole path can take, the Triton/CUDA kernels included, so a config
that builds also starts a server and serves (docs/backend.md, "What is validated").
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sglang_diffkv.model_record import (
    ALLOW_OTHER_MODEL,
    ModelRecord,
    ModelRecordError,
)
from sglang_diffkv.serving_io.json_file import parse_json, read_json
from sglang_diffkv.value_text import short_repr

ALLOWED_BITS = (1, 2, 4, 8)  # what the reference quantiser (quant.py) packs
KERNEL_BITS = (2, 4, 8)  # what the kernels unpack: a DiffKV cache's tiers use these
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head dims the page layout and the kernels take
# Quantisation groups split head_dim into equal power-of-two parts (the kernels index a
# group with tl.arange, which needs a power of two); at most one per element.
MAX_GROUPS = max(SUPPORTED_HEAD_DIMS)
# The kernels hold positions, lengths and token counts as int32: a window beyond it cannot
# be compared with a token's age.
MAX_WINDOW = 2**31 - 1
# The prefill scoring kernels (kernels/prefill.py, _lse_kernel / _colsum_kernel) keep the
# last score_queries queries, rounded up to a power of two, and a 64-key tile of head_dim
# bf16 values in shared memory: (QB + 64) * head_dim * 2 bytes, which sm_90 compiles
# measured as 160 KiB at QB 256 / head_dim 256 and 288 KiB at QB 512 / head_dim 256 (or
# QB 1024 / head_dim 128), past the 227 KiB an H100 / H200 block can have.
MAX_SCORE_QUERIES = 256
# Thresholds live in float32 tensors (CompressedKVCache.alpha, the kernels' alpha arguments):
# the largest finite float32. (alpha / L is clamped to 1, so any alpha >= the context length
# already means "every token outside the window is demoted".)
MAX_ALPHA = 3.4028234663852886e38
ENV_VAR = "SGLANG_DIFFKV_CONFIG"
BENCH_MIX_TOLERANCE = 1e-6  # how far from 1 the three bench_mix fractions may sum
PRESET_DIR = Path(__file__).parent / "presets"
# --attention-backend diffkv's --cuda-graph-max-bs when the user leaves it (and
# --cuda-graph-bs) unset: DiffKV holds several times the requests of a bf16 cache, and
# SGLang's GPU-memory default (256 on an 80 GB GPU) would leave its large decode batches
# eager. Read by the server-args fix-ups and by the simulator.
DEFAULT_CUDA_GRAPH_MAX_BS = 512
TIER_FIELDS = ("key_bits", "value_bits", "key_groups", "value_groups")
CONFIG_FIELDS = ("preset", "name", "high", "low", "alpha_h", "alpha_l", "window",
                 "score_queries", "bench_mix", "calibrated_for", ALLOW_OTHER_MODEL)
# fields that say how a preset is used, not what it is: setting only these keeps its name
USE_FIELDS = ("preset", ALLOW_OTHER_MODEL)
# 'K8V4' or 'K4V2g24' (groups as two single digits; larger group counts need the dict form)
_TIER_NAME = re.compile(r"K([0-9]{1,3})V([0-9]{1,3})(?:G([0-9])([0-9]))?", re.ASCII)


class ConfigError(ValueError):
    """A DiffKV configuration value is out of range or unknown."""


def checked_number(what: str, value: object, low: float, high: float) -> float:
    """``value`` as a float in [low, high]: a real number (not a bool or a string), finite.
    ``what`` names the field in the error (e.g. 'alpha_h')."""
    allowed = f"a number in [{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what}={short_repr(value)} is not a number; expected {allowed}")
    try:
        x = float(value)
    except OverflowError:  # an int past the float range
        x = math.inf
    if math.isnan(x) or not low <= x <= high:
        raise ConfigError(f"{what}={short_repr(value)} is out of range; expected {allowed}")
    return x


def checked_int(what: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in [low, high] (not a bool, not a float)."""
    allowed = f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what}={short_repr(value)} is not an integer; expected {allowed}")
    if not low <= value <= high:
        raise ConfigError(f"{what}={short_repr(value)} is out of range; expected {allowed}")
    return value


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
            if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ALLOWED_BITS:
                raise ConfigError(f"{name}={short_repr(bits)} is not allowed; choose one of "
                                  f"{ALLOWED_BITS}")
        for name in ("key_groups", "value_groups"):
            groups = checked_int(name, getattr(self, name), 1, MAX_GROUPS)
            if groups & (groups - 1):
                raise ConfigError(f"{name}={groups} is not a power of two; expected 1, 2, 4, "
                                  f"... up to {MAX_GROUPS} (a divisor of head_dim)")

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
    def parse(cls, value: object, tier: str) -> TierConfig:
        """Accepts a TierConfig, a dict of its fields, or a string such as 'K8V4' / 'K4V2g24'.
        Errors name the tier ('high: key_bits=3 ...')."""
        if isinstance(value, TierConfig):
            return value
        try:
            if isinstance(value, Mapping):
                return cls._from_mapping(value)
            if isinstance(value, str):
                return cls._parse_name(value)
        except ConfigError as e:
            raise ConfigError(f"{tier}: {e}") from None
        raise ConfigError(f"{tier}={short_repr(value)} must be a tier name like 'K8V4' or a "
                          f"dict with fields {', '.join(TIER_FIELDS)}")

    @classmethod
    def _from_mapping(cls, value: Mapping[Any, Any]) -> TierConfig:
        unknown = [k for k in value if k not in TIER_FIELDS]
        if unknown:
            raise ConfigError(f"unknown field(s) {short_repr(unknown)}; allowed: "
                              f"{', '.join(TIER_FIELDS)}")
        missing = [k for k in ("key_bits", "value_bits") if k not in value]
        if missing:
            raise ConfigError(f"missing field(s) {', '.join(missing)}; key_bits and "
                              "value_bits are required")
        return cls(**value)

    @classmethod
    def _parse_name(cls, text: str) -> TierConfig:
        m = _TIER_NAME.fullmatch(text.strip().upper())
        if m is None:
            raise ConfigError(f"{short_repr(text)} is not a tier name; expected e.g. 'K8V4' "
                              "or 'K4V2g24' (groups as two digits)")
        k, v, kg, vg = m.groups()
        groups = (1, 1) if kg is None else (int(kg), int(vg))
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
    meaningless in this mode.

    ``calibrated_for`` records the model the thresholds were measured on (None: made for no
    model in particular); the server compares it with the model it serves and refuses a
    pruning config on another model unless ``allow_other_model`` (sglang_diffkv.model_record).

    Fields are normalised when built: thresholds become floats, window and score_queries
    ints, bench_mix a tuple of three floats, calibrated_for a ModelRecord."""

    high: TierConfig = K8V4_GROUPED
    low: TierConfig = K4V2_GROUPED
    alpha_h: float = 1.0
    alpha_l: float = 0.0
    window: int = 64
    score_queries: int = 64
    bench_mix: tuple[float, float, float] | None = None
    name: str = field(default="custom", compare=False)
    calibrated_for: ModelRecord | None = None
    allow_other_model: bool = False

    def __post_init__(self) -> None:
        def put(fname: str, value: Any) -> None:
            object.__setattr__(self, fname, value)

        for fname in ("alpha_h", "alpha_l"):
            put(fname, checked_number(fname, getattr(self, fname), 0.0, MAX_ALPHA))
        if self.alpha_l > self.alpha_h:
            raise ConfigError(
                f"alpha_l={self.alpha_l} > alpha_h={self.alpha_h}; the pruning threshold must "
                "not exceed the demotion threshold (alpha_l <= alpha_h)"
            )
        put("window", checked_int("window", self.window, 1, MAX_WINDOW))
        put("score_queries",
            checked_int("score_queries", self.score_queries, 1, MAX_SCORE_QUERIES))
        for tier in ("high", "low"):
            t = getattr(self, tier)
            if not isinstance(t, TierConfig):
                put(tier, TierConfig.parse(t, tier))
            self._check_kernel_bits(tier, getattr(self, tier))
        high_bits = (self.high.key_bits, self.high.value_bits)
        low_bits = (self.low.key_bits, self.low.value_bits)
        if low_bits[0] > high_bits[0] or low_bits[1] > high_bits[1]:
            raise ConfigError(
                f"low tier {self.low.name} is more precise than high tier {self.high.name}; "
                "the low tier must use no more bits than the high tier"
            )
        if not isinstance(self.name, str) or not self.name.strip() or not self.name.isprintable():
            raise ConfigError(f"name={short_repr(self.name)} must be a non-empty one-line "
                              "string")
        if self.bench_mix is not None:
            put("bench_mix", self._checked_bench_mix(self.bench_mix))
        if self.calibrated_for is not None:
            try:
                put("calibrated_for", ModelRecord.from_dict(self.calibrated_for))
            except ModelRecordError as e:
                raise ConfigError(f"calibrated_for: {e}") from None
        if not isinstance(self.allow_other_model, bool):
            raise ConfigError(f"{ALLOW_OTHER_MODEL}={short_repr(self.allow_other_model)} must "
                              "be true or false")

    @staticmethod
    def _check_kernel_bits(tier: str, t: TierConfig) -> None:
        for what, bits in (("key_bits", t.key_bits), ("value_bits", t.value_bits)):
            if bits not in KERNEL_BITS:
                raise ConfigError(f"{tier}.{what}={bits} is not allowed in a DiffKV cache; its "
                                  f"kernels unpack {KERNEL_BITS} bits")

    def _checked_bench_mix(self, mix: Any) -> tuple[float, float, float]:
        allowed = (
            "three fractions [high, low, pruned], each in [0, 1], summing to 1, high > 0"
        )
        if not isinstance(mix, (list, tuple)) or len(mix) != 3:
            shown = list(mix) if isinstance(mix, (list, tuple)) else mix
            raise ConfigError(f"bench_mix={short_repr(shown)} is not allowed; expected "
                              f"{allowed}")
        high, low, pruned = (
            checked_number(f"bench_mix {what}", value, 0.0, 1.0)
            for what, value in zip(("high", "low", "pruned"), mix, strict=True)
        )
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
        d["calibrated_for"] = (None if self.calibrated_for is None
                               else self.calibrated_for.to_dict())
        return d

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DiffKVConfig:
        """Fields override the preset named by ``preset`` (default: 'default')."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a DiffKV config must be a JSON object, got {type(data).__name__}")
        unknown = [k for k in data if k not in CONFIG_FIELDS]
        if unknown:
            raise ConfigError(
                f"unknown config field(s) {short_repr(unknown)}; allowed: "
                f"{', '.join(CONFIG_FIELDS)}"
            )
        name = data.get("preset", "default")
        if not isinstance(name, str):
            raise ConfigError(f"preset={short_repr(name)} must be a preset name; available: "
                              f"{', '.join(PRESETS)}")
        base = preset(name)
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k != "preset"}
        for tier in ("high", "low"):
            if tier in kwargs:
                kwargs[tier] = TierConfig.parse(kwargs[tier], tier)
        if "name" not in kwargs:
            kwargs["name"] = (base.name if set(data) <= set(USE_FIELDS)
                              else f"{base.name}+custom")
        return replace(base, **kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> DiffKVConfig:
        return cls.from_dict(read_json(path, "DiffKV config file", ConfigError))

    @classmethod
    def from_spec(cls, spec: str) -> DiffKVConfig:
        """A preset name, inline JSON (starts with '{'), or a path to a JSON file."""
        if not isinstance(spec, str):
            raise ConfigError(f"a DiffKV config spec must be a string, got "
                              f"{short_repr(spec)}")
        s = spec.strip()
        if s.startswith("{"):
            return cls.from_dict(parse_json(s, "inline JSON DiffKV config", ConfigError))
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
            raise ConfigError(f"{ENV_VAR}={short_repr(spec)}: {e}") from e


# The models DiffKV's paper calibrated its thresholds on, as their config.json files give
# them (Llama-3.1 has Llama-3's shapes; QwQ-32B has Qwen2.5-32B's). No weights fingerprint:
# the paper's thresholds hold for the model family, fine-tunes included.
PAPER_MODELS: dict[str, ModelRecord] = {
    "llama-3-8b": ModelRecord("Llama-3-8B", "llama", 32, 32, 8, 128),
    "llama-3-70b": ModelRecord("Llama-3-70B", "llama", 80, 64, 8, 128),
    "qwen2.5-7b": ModelRecord("Qwen2.5-7B", "qwen2", 28, 28, 4, 128),
    "qwen2.5-32b": ModelRecord("Qwen2.5-32B", "qwen2", 64, 40, 8, 128),
    "qwq-32b": ModelRecord("QwQ-32B", "qwen2", 64, 40, 8, 128),
}


def _preset(name: str, alpha_l: float, alpha_h: float, grouped: bool) -> DiffKVConfig:
    """A preset with DiffKV's published thresholds, recording the model they are for (none
    for the model-agnostic presets)."""
    high, low = (K8V4_GROUPED, K4V2_GROUPED) if grouped else (K8V4, K4V2)
    return DiffKVConfig(high=high, low=low, alpha_h=alpha_h, alpha_l=alpha_l, name=name,
                        calibrated_for=PAPER_MODELS.get(name))


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
        _preset("llama-3-8b", 0.02, 1.0, grouped=False), bench_mix=(0.3, 0.5, 0.2),
        name="bench-30-50-20",
    ),
}


def preset(name: str) -> DiffKVConfig:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {short_repr(name)}; available presets: "
                          f"{', '.join(PRESETS)}")
    return PRESETS[key]


# ... and the mix measured on a real model by the quality harness (its base is read through
# from_dict, which needs the presets above).
PRESETS["bench-measured"] = _measured_bench_preset("bench-measured")

