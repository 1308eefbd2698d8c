"""DiffKV inside the model: a thin adapter over the reference CompressedKVCache.

Every decision, the quantiser and the paged storage are the reference cache's
(``sglang_diffkv.cache``); this file only maps the hook's calls onto its lifecycle and
reads memory use from ``sglang_diffkv.layout``. Rows may carry their own (alpha_h,
alpha_l) -- per-request thresholds are a feature of the cache -- so a calibration grid is
one cache and one model batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.eval.backend import KVBackend, MemoryUse
from sglang_diffkv.eval.model import ModelShape
from sglang_diffkv.layout import PageGeometry, fp16_bytes_per_token


class DiffKVBackend(KVBackend):
    def __init__(
        self,
        name: str,
        shape: ModelShape,
        source: list[int],
        config: DiffKVConfig,
        alphas: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        super().__init__(name, shape, source)
        config.check_head_dim(shape.head_dim)
        self.config = config
        if alphas is None:
            alphas = [(config.alpha_h, config.alpha_l)] * self.rows
        if len(alphas) != self.rows:
            raise ValueError(f"{name}: {len(alphas)} (alpha_h, alpha_l) pairs for {self.rows} rows")
        for ah, al in alphas:
            config.with_thresholds(ah, al)  # validates (alpha_l <= alpha_h, finite, >= 0)
        self.alphas = [(float(a), float(b)) for a, b in alphas]
        self.geometry = PageGeometry.for_config(config, shape.head_dim)
        self.cache: CompressedKVCache | None = None
        self.req = torch.arange(self.rows, device=shape.device)

    def start(self, prompt_len: int, max_len: int) -> None:
        s = self.shape
        # Worst case: every token of every (row, layer, head) high, plus the decode slack of
        # one page per tier and a low page per row.
        per_row = math.ceil(max_len / self.geometry.high.tokens_per_page) + 3
        pages = self.rows * s.num_layers * s.num_kv_heads * per_row
        self.cache = CompressedKVCache(
            self.config,
            head_dim=s.head_dim,
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            num_pages=pages,
            max_reqs=self.rows,
            max_context=max_len + 1,
            device=s.device,
            validate=False,
        )
        self.lengths = torch.full((self.rows,), prompt_len, dtype=torch.long, device=s.device)
        ok = self.cache.begin_prefill(
            self.req, self.lengths, [a for a, _ in self.alphas], [b for _, b in self.alphas]
        ).ok
        if not bool(torch.as_tensor(ok).all()):
            raise RuntimeError(f"{self.name}: {pages} pages cannot hold {prompt_len}-token prompts")
        self.n = prompt_len

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.cache is not None
        self.cache.prefill_layer(
            layer, self.req, self.lengths, q.float(), k.float(), v.float(), self.shape.sm_scale
        )

    def end_prefill(self) -> None:
        assert self.cache is not None
        self.cache.end_prefill(self.req)

    def begin_step(self, position: int) -> None:
        super().begin_step(position)
        assert self.cache is not None
        if not bool(torch.as_tensor(self.cache.begin_decode(self.req).ok).all()):
            raise RuntimeError(f"{self.name}: page pool exhausted at position {position}")
        self.n = position + 1

    def decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert self.cache is not None
        positions = torch.full((self.rows,), self.position, dtype=torch.long, device=k.device)
        self.cache.decode_layer_store(layer, self.req, positions, k.float(), v.float())
        return self.cache.decode_layer_attend(layer, self.req, q.float(), self.shape.sm_scale).out

    def memory(self, seq_len: int) -> MemoryUse:
        assert self.cache is not None
        frac = self.cache.tier_fractions(self.req, torch.full((self.rows,), seq_len)).cpu().double()
        g = self.geometry
        per_head = frac[..., 0] * g.high.bytes_per_token + frac[..., 1] * g.low.bytes_per_token
        return MemoryUse(
            per_head.mean(dim=(1, 2)), frac, fp16_bytes_per_token(self.shape.head_dim)
        )

    def close(self) -> None:
        if self.cache is not None:
            self.cache.free(self.req)
        self.cache = None
