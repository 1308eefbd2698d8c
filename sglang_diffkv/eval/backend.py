"""The KV-backend interface the hooked attention drives, and the exact (uncompressed) one.

A backend owns the KV cache of ``rows`` requests. Row r holds a copy of prompt
``source[r]`` of the prefill batch, so one prefill feeds several configurations (e.g. a
threshold grid) and their decode steps run together as one model batch.

Lifecycle (the one of :class:`sglang_diffkv.cache.CompressedKVCache`):
``start(prompt_len)`` -> ``prefill(layer, q, k, v)`` for every layer -> ``end_prefill()``;
per decode step ``begin_step(position)`` -> ``decode(layer, q, k, v)`` for every layer.
Prefill attention itself is exact on the fresh K/V (computed by the hook, not here), as in
DiffKV; a backend only stores (and, if it compresses, compresses) the prompt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sglang_diffkv.attention import masked_group_attention
from sglang_diffkv.eval.model import ModelShape
from sglang_diffkv.layout import fp16_bytes_per_token


@dataclass(frozen=True)
class MemoryUse:
    """Physical KV bytes per token and per KV head, and what each (layer, head) kept.

    fractions: fp64 [rows, layers, kv_heads, 3] = (high, low, pruned) fraction of the
    sequence; for single-precision baselines "high" is every kept token.
    """

    bytes_per_token: torch.Tensor  # fp64 [rows]
    fractions: torch.Tensor
    bf16_bytes_per_token: int

    @property
    def ratio_vs_bf16(self) -> torch.Tensor:
        return self.bytes_per_token / self.bf16_bytes_per_token


class KVBackend(ABC):
    """One cache configuration for ``rows`` requests (see the module docstring)."""

    def __init__(self, name: str, shape: ModelShape, source: list[int]) -> None:
        if not source:
            raise ValueError(f"backend {name!r} needs at least one row")
        self.name = name
        self.shape = shape
        self.source = torch.as_tensor(source, dtype=torch.long)
        self.position = -1  # position of the token being decoded

    @property
    def rows(self) -> int:
        return int(self.source.shape[0])

    @abstractmethod
    def start(self, prompt_len: int, max_len: int) -> None:
        """Allocate for prompts of ``prompt_len`` tokens growing to ``max_len``."""

    @abstractmethod
    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [rows, Hq, L, D], k/v [rows, Hkv, L, D] (RoPE applied), already row-expanded."""

    def end_prefill(self) -> None:  # noqa: B027 - optional hook
        """Called once every layer is prefilled."""

    def begin_step(self, position: int) -> None:
        self.position = position

    @abstractmethod
    def decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store the new token (k/v [rows, Hkv, D]) then attend with q [rows, Hq, D] over
        the cache; returns fp32 [rows, Hq, D]."""

    @abstractmethod
    def memory(self, seq_len: int) -> MemoryUse:
        """Memory in use now, for sequences of ``seq_len`` tokens."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the cache."""


class DenseBackend(KVBackend):
    """K/V of every token in dense fp32 buffers, optionally transformed on the way in
    (``store``) and with a keep-mask (pruning baselines override ``after_*``).
    The plain class is the exact, uncompressed cache (the bf16 reference)."""

    def __init__(self, name: str, shape: ModelShape, source: list[int]) -> None:
        super().__init__(name, shape, source)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.keep: list[torch.Tensor] = []
        self.n = 0

    def start(self, prompt_len: int, max_len: int) -> None:
        s = self.shape
        dims = (self.rows, s.num_kv_heads, max_len, s.head_dim)
        dev = s.device
        self.k = [torch.zeros(dims, device=dev) for _ in range(s.num_layers)]
        self.v = [torch.zeros(dims, device=dev) for _ in range(s.num_layers)]
        self.keep = [
            torch.zeros(dims[:3], dtype=torch.bool, device=dev) for _ in range(s.num_layers)
        ]
        self.n = prompt_len
        self.max_len = max_len

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens [start, start + len) of a layer (subclasses quantise here)."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k.float()
        self.v[layer][:, :, start:end] = v.float()

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        length = k.shape[2]
        self.store(layer, 0, k, v)
        self.keep[layer][:, :, :length] = True
        self.after_prefill(layer, q, length)

    def after_prefill(self, layer: int, q: torch.Tensor, length: int) -> None:  # noqa: B027
        """Hook for prompt-phase pruning."""

    def decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        p = self.position
        if p >= self.max_len:
            raise RuntimeError(f"{self.name}: position {p} is past max_len {self.max_len}")
        self.before_store(layer, p)
        self.store(layer, p, k[:, :, None], v[:, :, None])
        self.keep[layer][:, :, p] = True
        n = p + 1
        out, prob, _ = masked_group_attention(
            q, self.k[layer][:, :, :n], self.v[layer][:, :, :n], self.keep[layer][:, :, :n],
            self.shape.sm_scale,
        )
        self.after_attend(layer, prob, n)
        return out

    def before_store(self, layer: int, p: int) -> None:  # noqa: B027
        """Hook for decode-time eviction (runs before the new token is stored)."""

    def after_attend(self, layer: int, prob: torch.Tensor, n: int) -> None:  # noqa: B027
        """Hook for score accumulation; prob fp32 [rows, Hq, n]."""

    def kept_fractions(self, seq_len: int) -> torch.Tensor:
        kept = torch.stack([m[:, :, :seq_len].sum(-1) for m in self.keep], 1).double().cpu()
        hi = kept / seq_len
        return torch.stack([hi, torch.zeros_like(hi), 1 - hi], -1)

    def bytes_per_kept_token(self) -> float:
        return float(fp16_bytes_per_token(self.shape.head_dim))

    def memory(self, seq_len: int) -> MemoryUse:
        frac = self.kept_fractions(seq_len)
        per_row = frac[..., 0].mean(dim=(1, 2)) * self.bytes_per_kept_token()
        return MemoryUse(per_row, frac, fp16_bytes_per_token(self.shape.head_dim))

    def close(self) -> None:
        self.k, self.v, self.keep = [], [], []
