"""Named cache configurations of an evaluation and how they map onto backends.

Spec strings (CLI ``--configs``):

- ``bf16``: the uncompressed cache (exact attention over unquantised K/V).
- ``uniform:K4V4`` (any tier name of :class:`TierConfig`, e.g. K8V8, K8V4, K4V2g24).
- ``kivi:2`` (bits; optional ``:residual=128:group=32``): KIVI-style with a full-precision window.
- ``prune:0.3`` (kept fraction) or ``prune:bytes=80`` (bytes/token budget, bf16 tokens).
- ``diffkv:default`` (a preset name or JSON path), optionally ``@alpha_h/alpha_l``.

DiffKV configs that differ only in thresholds share one reference cache (per-request
alphas): one prefill, one model batch, one set of cache calls per step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from sglang_diffkv.config import ALLOWED_BITS, ConfigError, DiffKVConfig, TierConfig
from sglang_diffkv.eval.backend import DenseBackend, KVBackend
from sglang_diffkv.eval.baselines import KIVIBackend, PruningBackend, UniformBackend
from sglang_diffkv.eval.diffkv_backend import DiffKVBackend
from sglang_diffkv.eval.model import ModelShape
from sglang_diffkv.layout import fp16_bytes_per_token


@dataclass(frozen=True)
class EvalConfig:
    name: str
    kind: str  # bf16 | uniform | kivi | prune | diffkv
    tier: TierConfig | None = None
    diffkv: DiffKVConfig | None = None
    bits: int = 2
    residual: int = 128
    group: int = 32
    keep_fraction: float | None = None
    budget_bytes: float | None = None
    params: dict = field(default_factory=dict, compare=False)

    @property
    def family(self) -> str:
        return self.kind


def _kv_options(parts: list[str], spec: str) -> dict[str, str]:
    opts = {}
    for p in parts:
        if "=" not in p:
            raise ConfigError(f"{spec!r}: option {p!r} must be key=value")
        k, v = p.split("=", 1)
        opts[k.strip()] = v.strip()
    return opts


SPEC_FORMS = ("bf16, uniform:K4V4, kivi:2[:residual=128:group=32], prune:0.3, prune:bytes=80 "
              "or diffkv:PRESET|FILE.json[@alpha_h/alpha_l]")


def _int_option(spec: str, what: str, text: str, low: int) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", text.strip(), re.ASCII) or int(text) < low:
        raise ConfigError(f"{spec!r}: {what}={text!r} must be an integer >= {low}")
    return int(text)


def _float_option(spec: str, what: str, text: str, low: float, high: float) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ConfigError(f"{spec!r}: {what}={text!r} is not a number") from None
    if not (low < x <= high and math.isfinite(x)):  # (NaN fails too)
        bound = f"> {low:g}" if math.isinf(high) else f"in ({low:g}, {high:g}]"
        raise ConfigError(f"{spec!r}: {what} {text!r} must be a finite number {bound}")
    return x


def parse(spec: str) -> EvalConfig:
    """One ``--configs`` entry; every bad spec raises ConfigError naming it."""
    try:
        return _parse(spec)
    except ConfigError as e:
        text = str(e)
        raise ConfigError(text if text.startswith(repr(spec)) else f"{spec!r}: {text}") from None


def _parse(spec: str) -> EvalConfig:
    s = spec.strip()
    kind, _, rest = s.partition(":")
    kind = kind.lower()
    if kind == "bf16" and not rest:
        return EvalConfig("bf16", "bf16")
    if kind == "uniform":
        tier = TierConfig.parse(rest, "uniform")
        return EvalConfig(f"uniform-{tier.name}", "uniform", tier=tier)
    if kind == "kivi":
        head, *opts = rest.split(":") if rest else ["2"]
        o = _kv_options(opts, s)
        bits = _int_option(spec, "bits", head or "2", 1)
        if bits not in ALLOWED_BITS:
            raise ConfigError(f"{spec!r}: KIVI bits={bits} is not one of {ALLOWED_BITS}")
        unknown = set(o) - {"residual", "group"}
        if unknown:
            raise ConfigError(f"{spec!r}: unknown KIVI option(s) {sorted(unknown)}")
        cfg = EvalConfig(
            f"kivi-{bits}bit", "kivi", bits=bits,
            residual=_int_option(spec, "residual", o.get("residual", "128"), 0),
            group=_int_option(spec, "group", o.get("group", "32"), 1),
        )
        if (cfg.residual, cfg.group) != (128, 32):
            cfg = EvalConfig(f"kivi-{bits}bit-r{cfg.residual}g{cfg.group}", "kivi", bits=bits,
                             residual=cfg.residual, group=cfg.group)
        return cfg
    if kind == "prune":
        if rest.startswith("bytes="):
            b = _float_option(spec, "byte budget", rest[6:], 0.0, math.inf)
            return EvalConfig(f"prune-{b:.0f}B", "prune", budget_bytes=b)
        f = _float_option(spec, "kept fraction", rest, 0.0, 1.0)
        return EvalConfig(f"prune-{f:.2f}", "prune", keep_fraction=f)
    if kind == "diffkv":
        base, _, th = rest.partition("@")
        cfg = DiffKVConfig.from_spec(base or "default")
        name = cfg.name if not base.endswith(".json") else base.rsplit("/", 1)[-1][:-5]
        if th:
            try:
                ah, al = (float(x) for x in th.split("/"))
            except ValueError as e:
                raise ConfigError(f"{spec!r}: thresholds must be '@alpha_h/alpha_l'") from e
            cfg = cfg.with_thresholds(ah, al)
            name = f"{name}@{ah:g}/{al:g}"
        return EvalConfig(f"diffkv-{name}", "diffkv", diffkv=cfg)
    raise ConfigError(f"unknown config spec {spec!r}; use {SPEC_FORMS}")


def parse_list(text: str) -> list[EvalConfig | str]:
    """A comma list of specs, parsed up front (before any model is loaded); ``prune:match``
    stays a string (it is resolved after the DiffKV configs ran)."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ConfigError(f"--configs {text!r} names no config; use {SPEC_FORMS}")
    return [s if s == "prune:match" else parse(s) for s in specs]


@dataclass
class Plan:
    """Backends for one batch of prompts and, per config name, (backend index, row slice)."""

    backends: list[KVBackend]
    rows: dict[str, tuple[int, list[int]]]


def build(configs: list[EvalConfig], shape: ModelShape, prompts: int) -> Plan:
    """One backend per config, except DiffKV configs sharing tiers/window: one cache."""
    src = list(range(prompts))
    backends: list[KVBackend] = []
    rows: dict[str, tuple[int, list[int]]] = {}
    names = [c.name for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"duplicate config names {sorted(dup)}")
    groups: dict[tuple, list[EvalConfig]] = {}
    for c in configs:
        if c.kind == "diffkv":
            d = c.diffkv
            groups.setdefault((d.high, d.low, d.window, d.score_queries), []).append(c)
            continue
        if c.kind == "bf16":
            b: KVBackend = DenseBackend(c.name, shape, src)
        elif c.kind == "uniform":
            b = UniformBackend(c.name, shape, src, c.tier)
        elif c.kind == "kivi":
            b = KIVIBackend(c.name, shape, src, c.bits, c.group, c.residual)
        else:
            frac = c.keep_fraction
            if frac is None:
                frac = min(1.0, c.budget_bytes / fp16_bytes_per_token(shape.head_dim))
            b = PruningBackend(c.name, shape, src, frac)
        rows[c.name] = (len(backends), list(range(prompts)))
        backends.append(b)
    for members in groups.values():
        alphas = [(c.diffkv.alpha_h, c.diffkv.alpha_l) for c in members for _ in src]
        base = members[0].diffkv
        b = DiffKVBackend(
            "+".join(c.name for c in members), shape, src * len(members), base, alphas
        )
        for i, c in enumerate(members):
            rows[c.name] = (len(backends), list(range(i * prompts, (i + 1) * prompts)))
        backends.append(b)
    return Plan(backends, rows)
