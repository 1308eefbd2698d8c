"""Model architecture specs, read from a Hugging Face ``config.json`` (or a bundled one).

Only what the memory formula and the cost model need: layer count, widths, head counts, the
vocabulary, tied embeddings and the context length. Parameter counts are computed from these,
so weights are never a separate input that could disagree with the architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.json_file import read_json
from simulator.errors import SimulatorInputError

BUNDLED = ("llama-3-8b", "llama-3-70b", "qwen2.5-7b", "qwen2.5-32b", "qwq-32b", "smollm2-135m")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_len: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    weight_bytes_per_param: float = 2.0  # bf16 weights

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "context_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimulatorInputError(f"model {self.name!r}: {f}={v!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise SimulatorInputError(
                f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if not self.weight_bytes_per_param > 0:
            raise SimulatorInputError(f"weight_bytes_per_param={self.weight_bytes_per_param} "
                                      "must be > 0")

    # ---- parameter counts --------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Linear weights of one decoder layer (q, k, v, o, gate, up, down) plus norms/bias."""
        h = self.hidden_size
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        mlp = 3 * h * self.intermediate_size
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attn + mlp + bias + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        head = 0 if self.tie_embeddings else self.lm_head_params
        return self.num_layers * self.layer_params + self.embed_params + head + self.hidden_size

    def weight_bytes(self, tp: int = 1) -> float:
        """Weights held by one tensor-parallel rank (embedding and head sharded by vocab)."""
        return self.total_params * self.weight_bytes_per_param / tp

    def kv_heads_per_rank(self, tp: int) -> int:
        """SGLang replicates KV heads when tp > num_kv_heads."""
        return max(1, self.num_kv_heads // tp)

    def check_tp(self, tp: int) -> None:
        if tp < 1 or (self.num_heads % tp):
            raise SimulatorInputError(
                f"tp={tp} must be >= 1 and divide num_heads={self.num_heads} of {self.name}"
            )

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelSpec:
        def need(key: str) -> Any:
            if key not in cfg:
                raise SimulatorInputError(f"config.json of {name!r} lacks {key!r}")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        arch = " ".join(cfg.get("architectures", []))
        return cls(
            name=name,
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            context_len=int(need("max_position_embeddings")),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", "Qwen2" in arch)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        p = Path(path)
        cfg = read_json(p, "model config", SimulatorInputError)
        name = p.parent.name if p.name == "config.json" else p.stem
        return cls.from_hf_config(cfg, name)


def load_model(spec: str) -> ModelSpec:
    """A bundled model name (see BUNDLED) or a path to a HF config.json."""
    key = spec.strip().lower()
    if key in BUNDLED:
        text = resources.files("simulator.specs").joinpath(f"models/{key}.json").read_text()
        return ModelSpec.from_hf_config(json.loads(text), key)
    if spec.endswith(".json") or Path(spec).is_file():
        return ModelSpec.from_file(spec)
    raise SimulatorInputError(
        f"unknown model {spec!r}; use one of {', '.join(BUNDLED)} or a path to a config.json"
    )
