"""Route a transformers model's attention through KV backends.

We register an attention function named ``diffkv`` with transformers' AttentionInterface
(and sdpa's mask builder under the same name) and point the model's config at it. The
model then computes Q/K/V, RoPE, norms and everything else itself; our function only sees
``query [B, Hq, L, D]`` and the RoPE'd, un-repeated ``key/value [B, Hkv, L, D]``:

- mode ``off``: plain sdpa (the uncompressed model, bit-identical to not hooking);
- mode ``prefill``: exact attention on the fresh K/V (sdpa, as DiffKV's prefill), and every
  backend receives its rows' copy of the prompt K/V to store/compress;
- mode ``decode``: one token per row; the batch is the concatenation of the backends' rows
  and each backend stores the token and attends over its own cache. Nothing else reads
  the K/V, so decode logits depend only on what the compressed cache holds.

The model must be called with ``use_cache=False`` (the backends are the cache) and, in
decode, explicit ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from sglang_diffkv.eval.backend import KVBackend

ATTN_NAME = "diffkv"


class Router:
    """Holds the backends and the current mode; the registered function dispatches here."""

    def __init__(self, backends: Sequence[KVBackend]) -> None:
        self.backends = list(backends)
        self.mode = "off"
        self.num_prompts = 0

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.backends)

    def source_rows(self) -> torch.Tensor:
        """For each decode row, the prompt index it continues."""
        return torch.cat([b.source for b in self.backends])

    def prefill(self, module, query, key, value) -> None:
        layer = module.layer_idx
        for b in self.backends:
            idx = b.source
            b.prefill(layer, query[idx], key[idx], value[idx])

    def decode(self, module, query, key, value) -> torch.Tensor:
        if query.shape[2] != 1:
            raise RuntimeError(f"decode mode feeds one token per row, got {query.shape[2]}")
        if query.shape[0] != self.rows:
            raise RuntimeError(f"decode batch {query.shape[0]} != backend rows {self.rows}")
        layer = module.layer_idx
        outs, start = [], 0
        for b in self.backends:
            sl = slice(start, start + b.rows)
            outs.append(b.decode(layer, query[sl, :, 0], key[sl, :, 0], value[sl, :, 0]))
            start += b.rows
        return torch.cat(outs).to(query.dtype)  # [B, Hq, D]


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def diffkv_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The function registered as ``diffkv``; returns ([B, L, Hq, D], None) like sdpa."""
    router: Router | None = getattr(module, "_diffkv_router", None)
    if router is None or router.mode == "off":
        return _sdpa()(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if scaling is not None and abs(scaling - module.head_dim**-0.5) > 1e-9:
        raise RuntimeError(f"attention scaling {scaling} differs from head_dim**-0.5")
    if router.mode == "prefill":
        out = _sdpa()(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        router.prefill(module, query, key, value)
        return out
    if router.mode == "decode":
        return router.decode(module, query, key, value)[:, None], None
    raise RuntimeError(f"unknown router mode {router.mode!r}")


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, diffkv_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that call the attention interface: the ones with a ``layer_idx`` and q/k/v."""
    mods = [
        m for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "head_dim")
    ]
    if not mods:
        raise RuntimeError(
            f"{type(model).__name__} has no Llama/Qwen-style attention modules (layer_idx, "
            "k_proj, head_dim); the harness cannot hook it"
        )
    return mods


@contextmanager
def hooked(model: torch.nn.Module, router: Router) -> Iterator[Router]:
    """Install the router for the duration of the block; restores the model afterwards."""
    _register()
    mods = attention_modules(model)
    old_impl = model.config._attn_implementation
    for m in mods:
        m._diffkv_router = router
    model.config._attn_implementation = ATTN_NAME
    try:
        yield router
    finally:
        model.config._attn_implementation = old_impl
        for m in mods:
            del m._diffkv_router
        router.mode = "off"
