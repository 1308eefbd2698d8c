"""Baselines in the same harness: uniform quantisation, KIVI-style 2-bit, pruning-only.

All reuse the project's quantiser (``sglang_diffkv.quant``) and, for pruning, the
prompt significance of ``sglang_diffkv.policy``; memory comes from ``sglang_diffkv.layout``.

- ``UniformBackend``: every token at one tier (K8V8, K4V4, K8V4, ...), per token and group
  as in the DiffKV pages; bytes/token = a page sized for that tier alone divided by its
  tokens (so metadata, score/pos and page tail count, exactly as for DiffKV's tiers).
- ``KIVIBackend``: KIVI (Liu et al. 2024): keys quantised per channel over blocks of
  ``group`` tokens, values per token in groups of ``group`` channels, and the most recent
  ``residual`` tokens (at least) kept in full precision; older tokens are quantised once a
  whole block of ``group`` tokens has left the window.
- ``PruningBackend``: SnapKV-style prompt selection (the same observation-window significance
  DiffKV uses) plus H2O-style decode eviction (lowest accumulated attention, outside the
  recent window), keeping a fixed fraction of the sequence in bf16: the byte budget.
"""

from __future__ import annotations

import math

import torch

from sglang_diffkv.config import ConfigError, TierConfig
from sglang_diffkv.eval.backend import DenseBackend, MemoryUse
from sglang_diffkv.eval.model import ModelShape
from sglang_diffkv.layout import (
    META_BYTES_PER_GROUP,
    TierLayout,
    fp16_bytes_per_token,
    search_page_bytes,
)
from sglang_diffkv.policy import contributing_queries, group_max, prompt_attention_mass
from sglang_diffkv.quant import fake_quantize


def uniform_layout(tier: TierConfig, head_dim: int) -> TierLayout:
    """The page layout of a cache holding only ``tier``."""
    return TierLayout.build(tier, head_dim, search_page_bytes(head_dim, (tier,)))


class UniformBackend(DenseBackend):
    def __init__(self, name: str, shape: ModelShape, source: list[int], tier: TierConfig):
        tier.check_head_dim(shape.head_dim, name)
        super().__init__(name, shape, source)
        self.tier = tier
        self.layout = uniform_layout(tier, shape.head_dim)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = self.tier
        super().store(
            layer,
            start,
            fake_quantize(k, t.key_bits, t.key_groups),
            fake_quantize(v, t.value_bits, t.value_groups),
        )

    def bytes_per_kept_token(self) -> float:
        return self.layout.bytes_per_token


class KIVIBackend(DenseBackend):
    def __init__(
        self,
        name: str,
        shape: ModelShape,
        source: list[int],
        bits: int = 2,
        group: int = 32,
        residual: int = 128,
    ) -> None:
        if shape.head_dim % group:
            raise ConfigError(f"KIVI group={group} must divide head_dim={shape.head_dim}")
        if residual < 0 or group < 1:
            raise ConfigError(f"KIVI residual={residual} / group={group} out of range")
        super().__init__(name, shape, source)
        self.bits, self.group, self.residual = bits, group, residual
        self.n_quant = [0] * shape.num_layers

    def _flush(self, layer: int, n: int) -> None:
        """Quantise whole blocks of ``group`` tokens that are older than the window."""
        g = self.group
        start = self.n_quant[layer]
        end = start + max(0, (n - self.residual - start) // g) * g
        if end <= start:
            return
        k = self.k[layer][:, :, start:end]  # [R, H, T, D]
        blocks = k.unflatten(2, (-1, g)).transpose(-1, -2)  # [R, H, T/g, D, g]: per channel
        kq = fake_quantize(blocks, self.bits, 1).transpose(-1, -2).flatten(2, 3)
        self.k[layer][:, :, start:end] = kq
        v = self.v[layer][:, :, start:end]
        self.v[layer][:, :, start:end] = fake_quantize(v, self.bits, self.shape.head_dim // g)
        self.n_quant[layer] = end

    def start(self, prompt_len: int, max_len: int) -> None:
        super().start(prompt_len, max_len)
        self.n_quant = [0] * self.shape.num_layers

    def after_prefill(self, layer: int, q: torch.Tensor, length: int) -> None:
        self._flush(layer, length)

    def before_store(self, layer: int, p: int) -> None:
        # the window is measured including the token about to be stored
        self._flush(layer, p + 1)

    def memory(self, seq_len: int) -> MemoryUse:
        d = self.shape.head_dim
        quant_bytes = (
            2 * d * self.bits / 8  # key + value codes
            + d * META_BYTES_PER_GROUP / self.group  # key: one (scale, zero) per channel/block
            + (d // self.group) * META_BYTES_PER_GROUP  # value: groups of channels per token
        )
        nq = torch.tensor(self.n_quant, dtype=torch.float64)  # [layers]
        per_layer = (nq * quant_bytes + (seq_len - nq) * fp16_bytes_per_token(d)) / seq_len
        frac = self.kept_fractions(seq_len)
        per_row = per_layer.mean().expand(self.rows).clone()
        return MemoryUse(per_row, frac, fp16_bytes_per_token(d))


class PruningBackend(DenseBackend):
    def __init__(
        self,
        name: str,
        shape: ModelShape,
        source: list[int],
        keep_fraction: float,
        window: int = 64,
        score_queries: int = 64,
    ) -> None:
        if not 0 < keep_fraction <= 1:
            raise ConfigError(f"keep_fraction={keep_fraction} must be in (0, 1]")
        super().__init__(name, shape, source)
        self.keep_fraction = keep_fraction
        self.window, self.score_queries = window, score_queries
        self.score: list[torch.Tensor] = []

    def budget(self, length: int) -> int:
        return max(min(self.window, length), math.ceil(self.keep_fraction * length))

    def start(self, prompt_len: int, max_len: int) -> None:
        super().start(prompt_len, max_len)
        s = self.shape
        self.score = [
            torch.zeros(self.rows, s.num_kv_heads, max_len, device=s.device)
            for _ in range(s.num_layers)
        ]

    def after_prefill(self, layer: int, q: torch.Tensor, length: int) -> None:
        hkv = self.shape.num_kv_heads
        sig = torch.stack(
            [
                group_max(
                    prompt_attention_mass(
                        q[r], self.k[layer][r, :, :length], self.shape.sm_scale,
                        self.score_queries,
                    ),
                    hkv,
                )
                for r in range(self.rows)
            ]
        )  # [R, H, L]: summed attention from the observation window
        dev = self.shape.device
        count = contributing_queries(
            torch.tensor([length], device=dev), length, self.score_queries)
        mean = sig / count.clamp_min(1)[:, None, :]
        self.score[layer][:, :, :length] = sig
        recent = torch.arange(length, device=dev) >= length - self.window
        ranked = torch.where(recent, float("inf"), mean)
        k = self.budget(length)
        top = ranked.topk(k, dim=-1).indices
        keep = torch.zeros(self.rows, hkv, length, dtype=torch.bool, device=dev)
        keep.scatter_(-1, top, True)
        self.keep[layer][:, :, :length] = keep

    def before_store(self, layer: int, p: int) -> None:
        keep = self.keep[layer][:, :, :p]
        over = keep.sum(-1) + 1 > self.budget(p + 1)  # [R, H]
        if not bool(over.any()):
            return
        old = torch.arange(p, device=keep.device) < p + 1 - self.window
        cand = torch.where(keep & old, self.score[layer][:, :, :p], float("inf"))
        val, idx = cand.min(-1)
        evict = over & torch.isfinite(val)
        r, h = evict.nonzero(as_tuple=True)
        self.keep[layer][r, h, idx[r, h]] = False

    def after_attend(self, layer: int, prob: torch.Tensor, n: int) -> None:
        self.score[layer][:, :, :n] += group_max(prob, self.shape.num_kv_heads)
