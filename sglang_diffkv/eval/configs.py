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

from dataclasses import dataclass, field

from sglang_diffkv.config import ConfigError, DiffKVConfig, TierConfig
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


def parse(spec: str) -> EvalConfig:
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
        bits = int(head or 2)
        unknown = set(o) - {"residual", "group"}
        if unknown:
            raise ConfigError(f"{spec!r}: unknown KIVI option(s) {sorted(unknown)}")
        cfg = EvalConfig(
            f"kivi-{bits}bit", "kivi", bits=bits,
            residual=int(o.get("residual", 128)), group=int(o.get("group", 32)),
        )
        if (cfg.residual, cfg.group) != (128, 32):
            cfg = EvalConfig(f"kivi-{bits}bit-r{cfg.residual}g{cfg.group}", "kivi", bits=bits,
                             residual=cfg.residual, group=cfg.group)
        return cfg
    if kind == "prune":
        if rest.startswith("bytes="):
            b = float(rest[6:])
            if b <= 0:
                raise ConfigError(f"{spec!r}: byte budget must be positive")
            return EvalConfig(f"prune-{b:.0f}B", "prune", budget_bytes=b)
        f = float(rest)
        if not 0 < f <= 1:
            raise ConfigError(f"{spec!r}: kept fraction {f} must be in (0, 1]")
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
    raise ConfigError(
        f"unknown config spec {spec!r}; use bf16, uniform:K4V4, kivi:2, prune:0.3, "
        "prune:bytes=80 or diffkv:PRESET[@alpha_h/alpha_l]"
    )


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
