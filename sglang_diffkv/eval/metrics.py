"""Quality and memory summaries of teacher-forced runs against the uncompressed model."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from sglang_diffkv.eval.runner import BackendScores


@dataclass(frozen=True)
class QualitySummary:
    """One configuration over all scored tokens (pooled over windows)."""

    name: str
    tokens: int
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1: float  # fraction of positions with the reference's argmax
    ppl: float
    ref_ppl: float
    ppl_delta: float
    ppl_delta_se: float  # standard error of the mean per-token NLL difference, in ppl units
    bytes_per_token: float  # physical, per token per KV head, metadata included
    bf16_bytes_per_token: int
    high: float
    low: float
    pruned: float

    @property
    def ratio_vs_bf16(self) -> float:
        return self.bytes_per_token / self.bf16_bytes_per_token

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio_vs_bf16"] = self.ratio_vs_bf16
        return d


def summarise(scores: BackendScores, rows: torch.Tensor | None = None, name: str | None = None):
    """Pool the given rows (default: all) of a backend into a QualitySummary."""
    idx = torch.arange(scores.kl.shape[0]) if rows is None else torch.as_tensor(rows)
    kl = scores.kl[idx].flatten()
    nll = scores.nll[idx].flatten()
    ref = scores.ref_nll[idx].flatten()
    diff = nll - ref
    n = kl.numel()
    ppl, ref_ppl = math.exp(nll.mean()), math.exp(ref.mean())
    # delta-method SE of exp(mean nll) - exp(mean ref nll) from the paired differences
    se = float(diff.std() / math.sqrt(max(n, 1))) * ppl if n > 1 else float("nan")
    frac = scores.memory.fractions[idx].double().mean(dim=(0, 1, 2))
    return QualitySummary(
        name=name or scores.name,
        tokens=n,
        kl_mean=float(kl.mean()),
        kl_median=float(kl.median()),
        kl_p99=float(torch.quantile(kl, 0.99)),
        kl_max=float(kl.max()),
        top1=float(scores.top1[idx].float().mean()),
        ppl=ppl,
        ref_ppl=ref_ppl,
        ppl_delta=ppl - ref_ppl,
        ppl_delta_se=se,
        bytes_per_token=float(scores.memory.bytes_per_token[idx].mean()),
        bf16_bytes_per_token=scores.memory.bf16_bytes_per_token,
        high=float(frac[0]),
        low=float(frac[1]),
        pruned=float(frac[2]),
    )


def per_layer_head(scores: BackendScores, rows: torch.Tensor | None = None) -> list:
    """[layers][heads] = [high, low, pruned] fractions, averaged over the given rows."""
    idx = torch.arange(scores.kl.shape[0]) if rows is None else torch.as_tensor(rows)
    f = scores.memory.fractions[idx].double().mean(dim=0)
    return [[[round(float(x), 4) for x in head] for head in layer] for layer in f]


@dataclass(frozen=True)
class GreedySummary:
    name: str
    prompts: int
    new_tokens: int
    exact_match: float  # fraction of prompts whose continuation equals the reference's
    first_divergence_mean: float  # mean index of the first differing token (new_tokens if none)
    first_divergence_min: int


def greedy_agreement(name: str, got: torch.Tensor, ref: torch.Tensor) -> GreedySummary:
    """got/ref: [prompts, new_tokens] token ids."""
    if got.shape != ref.shape:
        raise ValueError(f"greedy outputs {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    n = got.shape[1]
    diff = got != ref
    first = torch.where(diff.any(1), diff.float().argmax(1), torch.full((got.shape[0],), n))
    return GreedySummary(
        name, got.shape[0], n, float((~diff.any(1)).float().mean()),
        float(first.float().mean()), int(first.min()),
    )
