"""Prefill attention over packed prompts: the padded fallback against per-prompt SDPA, the
packing bookkeeping, and (GPU) the flash varlen path and its LSE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_diffkv.prompt_attention import (
    PackedPrompts,
    attend_padded,
    attend_varlen,
    choose_prompt_attention,
)


def packed_qkv(lens, hq, hkv, d, device, seed, extra=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lens) + extra  # rows past the prompts' tokens: padding SGLang may add
    return tuple(torch.randn(t, h, d, generator=g).to(device=device, dtype=torch.bfloat16)
                 for h in (hq, hkv, hkv))


def per_prompt_sdpa(q, k, v, lens, scale):
    outs, s = [], 0
    for n in lens:
        x = [t[s:s + n].transpose(0, 1).float() for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*x, is_causal=True, scale=scale,
                                                   enable_gqa=True).transpose(0, 1))
        s += n
    return torch.cat(outs)


def test_packing_bookkeeping():
    p = PackedPrompts.from_lengths([3, 1, 4], "cpu")
    assert p.starts.tolist() == [0, 3, 4] and p.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert (p.max_len, p.num_tokens, p.batch) == (4, 8, 3)
    assert p.lengths.dtype == torch.int32 and p.starts.dtype == torch.int64
    x = torch.randn(8, 2, 5)
    padded = p.pad(x)
    assert padded.shape == (3, 2, 4, 5)
    assert torch.equal(padded[1, :, 1:], torch.zeros(2, 3, 5))  # zeros past a prompt's end
    assert torch.equal(p.unpad(padded), x)
    same = PackedPrompts.from_lengths([3, 1, 4], "cpu", torch.tensor([3, 1, 4]))
    assert torch.equal(same.cu_seqlens, p.cu_seqlens)


@pytest.mark.parametrize("lengths", [[], [3, 0], [2, -1]])
def test_bad_lengths_are_refused(lengths):
    with pytest.raises(ValueError, match="prompt lengths must be >= 1"):
        PackedPrompts.from_lengths(lengths, "cpu")


def test_padded_attention_matches_per_prompt_sdpa():
    lens = [37, 5, 70]
    q, k, v = packed_qkv(lens, 4, 2, 32, "cpu", seed=1)
    out, lse = attend_padded(q, k, v, PackedPrompts.from_lengths(lens, "cpu"), 0.2)
    assert lse is None
    torch.testing.assert_close(out.float(), per_prompt_sdpa(q, k, v, lens, 0.2), atol=2e-2,
                               rtol=2e-2)


def test_off_cuda_the_padded_path_is_chosen_and_says_why():
    chosen = choose_prompt_attention("cpu")
    assert chosen.name == "padded" and "CUDA" in chosen.reason


@pytest.mark.gpu
def test_varlen_attention_and_its_lse_on_the_gpu():
    chosen = choose_prompt_attention("cuda")
    assert chosen.name == "varlen", chosen.reason
    lens = [1000, 17, 1, 2500, 300]
    q, k, v = packed_qkv(lens, 32, 8, 128, "cuda", seed=2, extra=3)
    out = torch.full((sum(lens), 32, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    p = PackedPrompts.from_lengths(lens, "cuda")
    got, lse = attend_varlen(q, k, v, p, 128**-0.5)
    out.copy_(got)
    torch.testing.assert_close(out.float(), per_prompt_sdpa(q, k, v, lens, 128**-0.5),
                               atol=2e-2, rtol=2e-2)
    s = 0
    for n in lens:
        qs = q[s:s + n].float().transpose(0, 1)
        ks = k[s:s + n].float().transpose(0, 1).repeat_interleave(4, 0)
        logits = (qs @ ks.transpose(-1, -2)) * 128**-0.5
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1),
                                    float("-inf"))
        torch.testing.assert_close(lse[s:s + n], torch.logsumexp(logits, -1).t(), atol=2e-3,
                                   rtol=1e-4)
        s += n
