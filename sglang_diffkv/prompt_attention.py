"""Exact causal attention over one prefill step's whole prompts, packed as SGLang passes
them ([T, H, D]: prompt b is rows starts[b] .. starts[b] + lengths[b] - 1).

Two implementations, one chosen per backend by :func:`choose_prompt_attention`:

- ``varlen``: flash attention on the packed tokens (``aten._flash_attention_forward`` with
  cumulative lengths; CUDA only). Work is sum(L_b^2), GQA is native, and it returns every
  query's LSE, which the scoring kernel then reuses instead of running its own LSE pass.
- ``padded``: right-pad to [B, H, Lmax, D] and torch SDPA (causal): any device, no LSE.
  Its work is B * Lmax^2 and its copies are per layer: a batch of mixed prompt lengths
  pays for the longest one B times (ShareGPT-shaped prefill batches ran ~1.7x slower).

``varlen`` is used only after a probe on the device agrees with ``padded`` (output and
LSE) on a small GQA batch of uneven prompts; otherwise the backend logs why and pads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (o [T, Hq, Dv], lse [T, Hq] natural-log fp32 or None)
AttentionOut = tuple[torch.Tensor, torch.Tensor | None]


@dataclass
class PackedPrompts:
    """Where one step's prompts sit in its packed token tensors; built once per step and
    read by every layer. ``max_len`` / ``num_tokens`` are the host's (reading them off the
    device would synchronise)."""

    lengths: torch.Tensor  # int32 [B]
    starts: torch.Tensor  # int64 [B]: prompt b's first row
    cu_seqlens: torch.Tensor  # int32 [B + 1]: starts, then T
    max_len: int
    num_tokens: int

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str,
                     lengths_dev: torch.Tensor | None = None) -> PackedPrompts:
        """``lengths_dev``: the same lengths already on the device (SGLang's
        ``extend_seq_lens``), to skip a host-to-device copy."""
        ls = [int(n) for n in lengths]
        if not ls or min(ls) < 1:
            raise ValueError(f"prompt lengths must be >= 1, got {ls}")
        if lengths_dev is None:
            lengths_dev = torch.tensor(ls, dtype=torch.int32, device=device)
        elif lengths_dev.shape != (len(ls),):
            raise ValueError(f"lengths_dev {tuple(lengths_dev.shape)} != [{len(ls)}]")
        lengths_i = lengths_dev.to(device=device, dtype=torch.int32)
        cu = torch.zeros(len(ls) + 1, dtype=torch.int32, device=device)
        torch.cumsum(lengths_i, 0, out=cu[1:])
        return cls(lengths_i, cu[:-1].long(), cu, max(ls), sum(ls))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @functools.cached_property
    def padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt, position) of every packed token: where it sits in [B, Lmax]."""
        token_b = torch.repeat_interleave(
            torch.arange(self.batch, device=self.lengths.device), self.lengths.long(),
            output_size=self.num_tokens)
        token_i = torch.arange(self.num_tokens, device=self.lengths.device) - self.starts[token_b]
        return token_b, token_i

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [B, H, Lmax, D] (zeros past each prompt's end)."""
        token_b, token_i = self.padded_index
        out = x.new_zeros(self.batch, self.max_len, x.shape[1], x.shape[2])
        out[token_b, token_i] = x[: self.num_tokens]
        return out.transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, Lmax, D] -> [T, H, D]."""
        token_b, token_i = self.padded_index
        return x.transpose(1, 2)[token_b, token_i]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                ) -> torch.Tensor:
    """SDPA over right-padded prompts [B, H, Lmax, D]: a causal mask alone keeps every real
    query on real keys (padded query rows are dropped by ``unpad``), so SDPA can take its
    flash / efficient path."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=True)


def attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: PackedPrompts,
                  scale: float) -> AttentionOut:
    out = causal_sdpa(prompts.pad(q), prompts.pad(k), prompts.pad(v), scale)
    return prompts.unpad(out), None


def attend_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: PackedPrompts,
                  scale: float) -> AttentionOut:
    n = prompts.num_tokens
    cu = prompts.cu_seqlens
    out, lse = torch.ops.aten._flash_attention_forward(
        q[:n], k[:n], v[:n], cu, cu, prompts.max_len, prompts.max_len, 0.0, True, False,
        scale=scale,
    )[:2]
    return out, lse.transpose(0, 1)  # flash's LSE is [Hq, T]


@dataclass(frozen=True)
class PromptAttention:
    name: str  # "varlen" | "padded"
    run: Callable[..., AttentionOut]
    reason: str  # why this one (the probe's outcome), for the start-up log


def _probe_varlen(device: torch.device) -> str | None:
    """None if ``attend_varlen`` matches ``attend_padded`` and the exact LSE on the device,
    else what went wrong."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = [37, 5, 70]
    t, hq, hkv, d = sum(lens), 4, 2, 64
    q, k, v = (torch.randn(t, h, d, generator=g).to(device=device, dtype=torch.bfloat16)
               for h in (hq, hkv, hkv))
    prompts = PackedPrompts.from_lengths(lens, device)
    try:
        out, lse = attend_varlen(q, k, v, prompts, 0.125)
    except Exception as e:  # (an op missing from this torch build, an unsupported GPU, ...)
        return f"{type(e).__name__}: {e}"
    ref, _ = attend_padded(q, k, v, prompts, 0.125)
    if out.shape != ref.shape or not torch.allclose(out.float(), ref.float(), atol=2e-2,
                                                    rtol=2e-2):
        return "its output differs from padded SDPA"
    s = prompts.pad(q).float() @ prompts.pad(k).float().repeat_interleave(hq // hkv, 1
                                                                         ).transpose(-1, -2)
    causal = torch.ones(prompts.max_len, prompts.max_len, dtype=torch.bool,
                        device=device).tril()
    exact = prompts.unpad(
        torch.logsumexp((s * 0.125).masked_fill(~causal, float("-inf")), -1).unsqueeze(-1)
    ).squeeze(-1)
    if lse.shape != exact.shape or not torch.allclose(lse, exact, atol=1e-2, rtol=1e-3):
        return "its LSE differs from the exact one"
    return None


def choose_prompt_attention(device: torch.device | str) -> PromptAttention:
    device = torch.device(device)
    if device.type != "cuda":
        return PromptAttention("padded", attend_padded, f"flash varlen needs CUDA ({device})")
    problem = _probe_varlen(device)
    if problem is not None:
        return PromptAttention("padded", attend_padded, f"flash varlen probe failed: {problem}")
    return PromptAttention("varlen", attend_varlen, "flash varlen agrees with padded SDPA")
