"""The model a preset was calibrated on, and the start-up guard comparing it with the served one.

DiffKV's thresholds are attention-score cut-offs measured on one model: the published
Llama-3-8B thresholds served on SmolLM2-135M found 17 of 96 needles where bf16 found 80
(docs/quality.md). A preset therefore records the model it was calibrated for
(``calibrated_for``: family, layers, query / KV heads, head_dim and, where the calibration
had the weights, a fingerprint of them), and the server compares that record with the model
it serves before it admits a request (``guard``):

- no record (``default``, ``no-compression``, a config written by hand): nothing to compare;
  a config that prunes nothing keeps every token, so it is safe on any model;
- a match: silent;
- a mismatch: a warning naming both models; and when the config prunes (``alpha_l > 0``,
  tokens are dropped for good) a refusal, unless the config opts in with
  ``"allow_other_model": true``;
- benchmark mode (``bench_mix``): tier decisions follow the mix, not the thresholds, so the
  record is not compared;
- dummy weights (``--load-format dummy``): attention over random weights means nothing, so a
  mismatch is a warning only (the GPU benchmarks run the paper's presets on dummy models) and
  the weights fingerprint is not compared.

This module is pure: the SGLang layer builds the served model's record from SGLang's model
config and acts on the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_diffkv.value_text import short_repr

# The setting that lets a pruning preset run on a model it was not calibrated for.
ALLOW_OTHER_MODEL = "allow_other_model"
# Embedding rows whose L2 norms fingerprint the weights: the first rows of every vocabulary,
# cheap to read from a GGUF, a safetensors file or a loaded model alike.
FINGERPRINT_ROWS = 8
# Relative tolerance on each norm: the same weights in bf16 and in fp32 (a GGUF dequantised
# by transformers vs the bf16 copy SGLang serves) differ by bf16 rounding (~0.4 % per
# element, less on a norm); different weights differ by far more.
FINGERPRINT_RTOL = 0.02
SHAPE_FIELDS = ("architecture", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")
RECORD_FIELDS = ("name", *SHAPE_FIELDS, "embedding_norms")


class ModelRecordError(ValueError):
    """A ``calibrated_for`` record is malformed (the config layer re-raises it as a
    ConfigError naming the field)."""


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelRecordError(f"{what}={short_repr(value)} must be a positive integer")
    return value


@dataclass(frozen=True)
class ModelRecord:
    """A model's attention shape and (optionally) a fingerprint of its weights.

    ``architecture`` is the Hugging Face ``model_type`` ('llama', 'qwen2', ...): present in
    every config.json and in GGUF metadata alike (a GGUF's config has no ``architectures``).
    ``name`` only labels messages; it is not compared (a model served from a local copy has
    another path)."""

    name: str
    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    embedding_norms: tuple[float, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        for what in ("name", "architecture"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value.strip() or not value.isprintable():
                raise ModelRecordError(f"{what}={short_repr(value)} must be a non-empty "
                                       "one-line string")
        for what in SHAPE_FIELDS[1:]:
            _positive_int(what, getattr(self, what))
        norms = self.embedding_norms
        if norms is not None:
            if (not isinstance(norms, (list, tuple)) or not norms
                    or any(isinstance(x, bool) or not isinstance(x, (int, float))
                           or not math.isfinite(x) or x < 0 for x in norms)):
                raise ModelRecordError(f"embedding_norms={short_repr(norms)} must be a "
                                       "non-empty list of finite non-negative numbers")
            object.__setattr__(self, "embedding_norms", tuple(float(x) for x in norms))

    @property
    def shape_text(self) -> str:
        return (f"{self.architecture}, {self.num_layers} layers, {self.num_q_heads} query / "
                f"{self.num_kv_heads} KV heads, head_dim {self.head_dim}")

    def describe(self) -> str:
        return f"{self.name} ({self.shape_text})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: getattr(self, k) for k in RECORD_FIELDS[:-1]}
        if self.embedding_norms is not None:
            d["embedding_norms"] = [round(x, 6) for x in self.embedding_norms]
        return d

    @classmethod
    def from_dict(cls, data: object) -> ModelRecord:
        if isinstance(data, ModelRecord):
            return data
        if not isinstance(data, Mapping):
            raise ModelRecordError(f"{short_repr(data)} must be an object with fields "
                                   f"{', '.join(RECORD_FIELDS)}")
        unknown = [k for k in data if k not in RECORD_FIELDS]
        if unknown:
            raise ModelRecordError(f"unknown field(s) {short_repr(unknown)}; allowed: "
                                   f"{', '.join(RECORD_FIELDS)}")
        missing = [k for k in RECORD_FIELDS[:-1] if k not in data]
        if missing:
            raise ModelRecordError(f"missing field(s) {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_hf_config(cls, config: Any, name: str,
                       embedding_norms: Sequence[float] | None = None) -> ModelRecord:
        """From a transformers ``PretrainedConfig`` (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(
            name=name,
            architecture=str(getattr(text, "model_type", "") or "unknown"),
            num_layers=text.num_hidden_layers,
            num_q_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            embedding_norms=None if embedding_norms is None else tuple(embedding_norms),
        )


def embedding_norms(weight: Any) -> tuple[float, ...]:
    """The weights fingerprint: L2 norms of the first FINGERPRINT_ROWS rows of the input
    embedding (a torch tensor [vocab, hidden]), computed in float32."""
    rows = weight[:FINGERPRINT_ROWS].detach().float()
    return tuple(float(x) for x in rows.norm(dim=-1).cpu())


def differences(recorded: ModelRecord, served: ModelRecord, *, compare_weights: bool = True
                ) -> list[str]:
    """What differs, as 'field recorded vs served' phrases; empty when the models match.
    The fingerprints are compared only when both records carry one of the same length."""
    out = [f"{f} {getattr(recorded, f)} vs {getattr(served, f)}"
           for f in SHAPE_FIELDS if getattr(recorded, f) != getattr(served, f)]
    a, b = recorded.embedding_norms, served.embedding_norms
    if compare_weights and a is not None and b is not None and len(a) == len(b):
        worst = max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))
        if worst > FINGERPRINT_RTOL:
            out.append(f"weights fingerprint (embedding row norms) differs by {worst:.1%}")
    return out


@dataclass(frozen=True)
class GuardVerdict:
    """``refusal``: the one-line start-up error, or None. ``warning``: a line to log loudly,
    or None. Both None: the model matches (or there is nothing to compare)."""

    refusal: str | None = None
    warning: str | None = None


def guard(config_name: str, recorded: ModelRecord | None, served: ModelRecord, *,
          alpha_l: float, allow_other_model: bool, bench_mode: bool, dummy_weights: bool
          ) -> GuardVerdict:
    """The start-up verdict for serving ``served`` under a config calibrated for
    ``recorded`` (the rules are in this module's docstring)."""
    if recorded is None or bench_mode:
        return GuardVerdict()
    diff = differences(recorded, served, compare_weights=not dummy_weights)
    if not diff:
        return GuardVerdict()
    what = (f"diffkv: preset {config_name!r} was calibrated for {recorded.describe()}, not the "
            f"served model {served.describe()} ({'; '.join(diff)})")
    prunes = alpha_l > 0
    if not prunes:
        return GuardVerdict(warning=f"{what}; its thresholds may demote the wrong tokens "
                                    "(nothing is pruned)")
    if dummy_weights:
        return GuardVerdict(warning=f"{what}; served with dummy weights, so not refused "
                                    "(output quality is meaningless)")
    if allow_other_model:
        return GuardVerdict(warning=f"{what}; it prunes (alpha_l={alpha_l:g}) and runs only "
                                    f"because {ALLOW_OTHER_MODEL} is set")
    preset = config_name.split("+", 1)[0]  # 'llama-3-8b+custom' was built on 'llama-3-8b'
    return GuardVerdict(refusal=(
        f"{what}: refused, because it prunes (alpha_l={alpha_l:g}) with thresholds measured on "
        f"another model; calibrate this one (diffkv-eval calibrate), use a preset that does "
        f"not prune (e.g. 'default'), or opt in with \"{ALLOW_OTHER_MODEL}\": true in "
        f"SGLANG_DIFFKV_CONFIG (e.g. '{{\"preset\": \"{preset}\", \"{ALLOW_OTHER_MODEL}\": "
        f"true}}')"))
