"""Drive a hooked model: uncompressed reference, teacher forcing and greedy decoding.

Scoring reads the compressed cache: the prompt is prefilled (exact attention, then each
backend compresses it), and every scored position is a *decode* step whose attention is the
backend's output over its cache. For a sequence s of P + T + 1 tokens, decode step j feeds
s[P + j] at position P + j and its logits predict s[P + j + 1]; the reference is the plain
model's logits at the same positions from one full forward pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_diffkv.eval.backend import KVBackend, MemoryUse
from sglang_diffkv.eval.hook import Router, hooked

log = logging.getLogger(__name__)
PROGRESS_EVERY = 8  # decode steps between progress lines


@dataclass
class BackendScores:
    """Per-row, per-step teacher-forced statistics of one backend."""

    name: str
    kl: torch.Tensor  # fp64 [rows, T]: KL(reference || backend)
    top1: torch.Tensor  # bool [rows, T]: same argmax as the reference
    nll: torch.Tensor  # fp64 [rows, T]: -log p(target) under the backend
    ref_nll: torch.Tensor  # fp64 [rows, T]: -log p(target) under the reference
    memory: MemoryUse


@torch.inference_mode()
def reference_logprobs(model, ids: torch.Tensor, last: int) -> torch.Tensor:
    """log-softmax of the plain model's logits at the last ``last`` positions: [R, last, V]."""
    out = model(input_ids=ids, use_cache=False, logits_to_keep=last)
    return torch.log_softmax(out.logits.float(), dim=-1)


def _prefill(model, router: Router, prompt: torch.Tensor, max_len: int) -> torch.Tensor:
    """Prefill every backend with the prompts; returns the last position's logits [R, V]."""
    for b in router.backends:
        b.start(prompt.shape[1], max_len)
    router.mode = "prefill"
    out = model(input_ids=prompt, use_cache=False, logits_to_keep=1)
    for b in router.backends:
        b.end_prefill()
    return out.logits[:, -1].float()


def _decode(model, router: Router, tokens: torch.Tensor, position: int) -> torch.Tensor:
    """One decode step for every row: tokens [rows]; returns logits [rows, V]."""
    router.mode = "decode"
    for b in router.backends:
        b.begin_step(position)
    pos = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
    out = model(input_ids=tokens[:, None], position_ids=pos, use_cache=False)
    return out.logits[:, -1].float()


@torch.inference_mode()
def teacher_force(
    model, backends: Sequence[KVBackend], ids: torch.Tensor, prompt_len: int
) -> list[BackendScores]:
    """ids [R, P + T + 1] (equal lengths, no padding); scores T decode steps per row."""
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    r, total = ids.shape
    steps = total - 1 - prompt_len
    if steps < 1:
        raise ValueError(f"sequence of {total} tokens leaves nothing to score after {prompt_len}")
    ref = reference_logprobs(model, ids[:, : prompt_len + steps], steps)  # [R, T, V]
    targets = ids[:, prompt_len + 1 :]  # [R, T]
    ref_nll_all = -ref.gather(-1, targets[..., None])[..., 0].double().cpu()
    router = Router(backends)
    src = router.source_rows()
    rows = router.rows
    kl = torch.zeros(rows, steps, dtype=torch.float64)
    top1 = torch.zeros(rows, steps, dtype=torch.bool)
    nll = torch.zeros(rows, steps, dtype=torch.float64)
    t0 = time.perf_counter()
    with hooked(model, router):
        _prefill(model, router, ids[:, :prompt_len], prompt_len + steps)
        t1 = time.perf_counter()
        for j in range(steps):
            p = prompt_len + j
            logp = torch.log_softmax(_decode(model, router, ids[src, p], p), dim=-1)
            rl = ref[src, j]
            kl[:, j] = (rl.exp() * (rl - logp)).sum(-1).double().cpu()
            top1[:, j] = (logp.argmax(-1) == rl.argmax(-1)).cpu()
            nll[:, j] = -logp.gather(-1, targets[src, j, None])[:, 0].double().cpu()
            if (j + 1) % PROGRESS_EVERY == 0:
                el = time.perf_counter() - t1
                done, start = [], 0
                for b in backends[:4]:
                    mean_kl = float(kl[start : start + b.rows, : j + 1].mean())
                    done.append(f"{b.name[:16]}={mean_kl:.3f}")
                    start += b.rows
                log.info("step %d/%d, %.2f s/step, mean KL so far: %s", j + 1, steps,
                         el / (j + 1), " ".join(done))
        mems = [b.memory(prompt_len + steps) for b in backends]
    t2 = time.perf_counter()
    log.info(
        "teacher forcing: %d prompts x %d tokens prefill %.1fs; %d rows x %d steps in %.1fs "
        "(%.1f row-tokens/s)",
        r, prompt_len, t1 - t0, rows, steps, t2 - t1, rows * steps / max(t2 - t1, 1e-9),
    )
    out, start = [], 0
    for b, mem in zip(backends, mems, strict=True):
        sl = slice(start, start + b.rows)
        out.append(
            BackendScores(b.name, kl[sl], top1[sl], nll[sl], ref_nll_all[b.source], mem)
        )
        start += b.rows
        b.close()
    return out


@torch.inference_mode()
def greedy(
    model, backends: Sequence[KVBackend], prompt: torch.Tensor, new_tokens: int
) -> tuple[list[torch.Tensor], list[MemoryUse]]:
    """Greedy continuation of prompts [R, P] through every backend: per backend a tensor
    [rows, new_tokens]. The first token comes from the (exact) prefill logits."""
    router = Router(backends)
    src = router.source_rows()
    p0 = prompt.shape[1]
    dev = next(model.parameters()).device
    prompt = prompt.to(dev)
    toks = torch.zeros(router.rows, new_tokens, dtype=torch.long, device=dev)
    with hooked(model, router):
        first = _prefill(model, router, prompt, p0 + new_tokens).argmax(-1)
        toks[:, 0] = first[src]
        for j in range(1, new_tokens):
            toks[:, j] = _decode(model, router, toks[:, j - 1], p0 + j - 1).argmax(-1)
        mems = [b.memory(p0 + new_tokens - 1) for b in backends]
    out, start = [], 0
    for b in backends:
        out.append(toks[start : start + b.rows].cpu())
        start += b.rows
        b.close()
    return out, mems
