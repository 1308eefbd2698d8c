"""Reference DiffKV compression policy (DESIGN §2), vectorised over requests and KV heads.

Prompt phase: a token's significance is the attention mass it receives from the last
Q = min(score_queries, L) queries, summed per query head, maxed over the GQA group, and
divided by the number of those queries that can see it. Against thresholds alpha / L it is
kept high, demoted to the low tier, or pruned; the most recent ``window`` tokens stay high.

Decode step: before attention, per (request, KV head) the new token enters the high tier,
and at most one eviction and one demotion happen (see :func:`decode_step`). Attention then
adds, for every cached token, the max over the group of its softmax probability to its score.

Thresholds are clamped to [0, 1] (alpha / L exceeds 1 for short prompts); the policy never
asserts on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class Tier(IntEnum):
    HIGH = 0
    LOW = 1
    PRUNED = 2


class DecodeAction(IntEnum):
    APPEND_HIGH = 0  # new token appended to the high tier
    EVICT_HIGH = 1  # new token overwrites hmin's slot (hmin pruned)
    DEMOTE_APPEND = 2  # hmin re-quantised and appended to low; new token takes hmin's slot
    DEMOTE_REPLACE = 3  # hmin re-quantised into lmin's slot (lmin pruned); new token takes hmin's


def thresholds(alpha: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """alpha / length clamped to [0, 1]; broadcasts."""
    return (alpha.double() / length.double().clamp_min(1)).clamp(0.0, 1.0).float()


# ---- prompt phase ------------------------------------------------------------------------------


def prompt_attention_mass(
    q: torch.Tensor, k: torch.Tensor, sm_scale: float, score_queries: int
) -> torch.Tensor:
    """Per query head, the summed causal softmax probability each key receives from the last
    Q = min(score_queries, L) queries. q: [Hq, L, D], k: [Hkv, L, D] -> fp32 [Hq, L].

    This dense oracle materialises [Hq, Q, L]; the kernels compute the same sum from the
    prefill's log-sum-exp without that buffer.
    """
    hq, length, _ = q.shape
    group = hq // k.shape[0]
    nq = min(score_queries, length)
    kk = k.float().repeat_interleave(group, dim=0)  # [Hq, L, D]
    logits = torch.einsum("hqd,hkd->hqk", q[:, length - nq :].float(), kk) * sm_scale
    qpos = torch.arange(length - nq, length, device=q.device)
    kpos = torch.arange(length, device=q.device)
    logits = logits.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=1)


def group_max(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., Hq, N] -> [..., Hkv, N]: max over each KV head's GQA group of query heads."""
    hq = per_query_head.shape[-2]
    return per_query_head.unflatten(-2, (num_kv_heads, hq // num_kv_heads)).amax(dim=-2)


def contributing_queries(length: torch.Tensor, max_len: int, score_queries: int) -> torch.Tensor:
    """[B, max_len]: how many of the last min(Q, L) queries see token i, i.e. min(Q, L - i)."""
    i = torch.arange(max_len, device=length.device)
    return (length[:, None] - i[None, :]).clamp(min=0, max=score_queries)


def virtual_positions(length: torch.Tensor, max_len: int, score_queries: int) -> torch.Tensor:
    """pos_i = i + (L - i - min(Q, L - i)) = L - min(Q, L - i), so that at decode position p
    ``p - pos_i`` counts exactly the queries accumulated into token i's score.
    int32 [B, max_len]."""
    return (length[:, None] - contributing_queries(length, max_len, score_queries)).int()


@dataclass(frozen=True)
class PromptClassification:
    tier: torch.Tensor  # int8 [B, Hkv, Lmax] (Tier); padding positions are PRUNED
    # score fp32 [B, Hkv, Lmax] (the summed significance s_i) and pos int32 [B, Lmax] (virtual
    # positions); None only from kernels.compress_prefill(scores=False), the serving path,
    # which reads neither (classify_prompt always fills them)
    score: torch.Tensor | None
    pos: torch.Tensor | None
    n_high: torch.Tensor  # int32 [B, Hkv]
    n_low: torch.Tensor  # int32 [B, Hkv]


def classify_prompt(
    significance_sum: torch.Tensor,
    length: torch.Tensor,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    window: int,
    score_queries: int,
) -> PromptClassification:
    """Classify every prompt token of every (request, KV head).

    significance_sum: fp32 [B, Hkv, Lmax], already maxed over the GQA group; entries past a
    request's length are ignored. length, alpha_h, alpha_l: [B].
    """
    b, _, lmax = significance_sum.shape
    if length.shape != (b,) or alpha_h.shape != (b,) or alpha_l.shape != (b,):
        raise ValueError("length, alpha_h and alpha_l must have shape [B] matching significance")
    dev = significance_sum.device
    count = contributing_queries(length.to(dev), lmax, score_queries)  # [B, L]
    mean = significance_sum.float() / count.clamp_min(1)[:, None, :]
    t_h = thresholds(alpha_h.to(dev), length.to(dev))[:, None, None]
    t_l = thresholds(alpha_l.to(dev), length.to(dev))[:, None, None]
    i = torch.arange(lmax, device=dev)
    valid = (i[None, :] < length.to(dev)[:, None])[:, None, :]
    recent = (i[None, :] >= (length.to(dev) - window)[:, None])[:, None, :]
    tier = torch.full_like(mean, Tier.PRUNED, dtype=torch.int8)
    tier = torch.where(mean >= t_l, torch.full_like(tier, Tier.LOW), tier)
    tier = torch.where((mean >= t_h) | recent, torch.full_like(tier, Tier.HIGH), tier)
    tier = torch.where(valid, tier, torch.full_like(tier, Tier.PRUNED))
    return PromptClassification(
        tier=tier,
        score=significance_sum.float() * valid,
        pos=virtual_positions(length.to(dev), lmax, score_queries),
        n_high=(tier == Tier.HIGH).sum(-1, dtype=torch.int32),
        n_low=(tier == Tier.LOW).sum(-1, dtype=torch.int32),
    )


# ---- decode step -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeDecision:
    action: torch.Tensor  # int8 [B, Hkv] (DecodeAction)
    hmin: torch.Tensor  # int64 [B, Hkv]: slot of the eligible high token with the least avg (-1)
    lmin: torch.Tensor  # int64 [B, Hkv]: same for the low tier (-1 if none)


def _eligible_argmin(
    score: torch.Tensor, pos: torch.Tensor, n: torch.Tensor, p: torch.Tensor, window: int,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min avg, argmin slot) over slots [first, n) with p - pos >= window; (inf, -1) if
    none. ``first`` [B, Hkv] (default 0): the row's shared slots before it are never
    victims."""
    slots = torch.arange(score.shape[-1], device=score.device)
    age = p[:, None, None] - pos.long()
    eligible = (slots[None, None, :] < n[..., None]) & (age >= window)
    if first is not None:
        eligible &= slots[None, None, :] >= first[..., None]
    avg = torch.where(eligible, score.float() / age.clamp_min(1).float(), float("inf"))
    if avg.shape[-1] == 0:
        empty = torch.full(n.shape, float("inf"), device=score.device)
        return empty, torch.full(n.shape, -1, dtype=torch.long, device=score.device)
    value, idx = avg.min(dim=-1)
    return value, torch.where(torch.isfinite(value), idx, -1)


def decode_step(
    score_high: torch.Tensor,
    pos_high: torch.Tensor,
    n_high: torch.Tensor,
    score_low: torch.Tensor,
    pos_low: torch.Tensor,
    n_low: torch.Tensor,
    p: torch.Tensor,
    alpha_h: torch.Tensor,
    alpha_l: torch.Tensor,
    window: int,
    forced: torch.Tensor | None = None,
    shared_tokens: torch.Tensor | None = None,
) -> DecodeDecision:
    """Decide, per (request, KV head), where the new token at position p goes.

    score_*/pos_*: [B, Hkv, C_tier] per-slot score (fp32 sum) and virtual position of each
    tier's cached tokens, valid in slots [0, n_tier); n_*: [B, Hkv]; p, alpha_*: [B].
    avg = score / (p - pos); a token is an eligible victim only if p - pos >= window.

    ``forced`` (benchmark mode, ``bench_mix.forced_actions``): int8 [B, Hkv] actions taken
    instead of the thresholds' verdict wherever the window is full and an eligible high
    victim exists (the victim is still the argmin); elsewhere APPEND_HIGH.

    ``shared_tokens`` [B, Hkv, 2]: each tier's leading slots that belong to a shared prefix
    (``PageManager.shared`` pages times tokens per page); they are never evicted, demoted or
    replaced, so a row's eligible range is [shared, n) in each tier.
    """
    first_h = first_l = None
    if shared_tokens is not None:
        first_h, first_l = shared_tokens[..., 0], shared_tokens[..., 1]
    h_avg, hmin = _eligible_argmin(score_high, pos_high, n_high, p, window, first_h)
    l_avg, lmin = _eligible_argmin(score_low, pos_low, n_low, p, window, first_l)
    t_h = thresholds(alpha_h, p)[:, None]
    t_l = thresholds(alpha_l, p)[:, None]
    window_full = (n_high + n_low + 1) > window
    if forced is not None:
        usable = window_full & (hmin >= 0)
        action = torch.where(usable, forced.to(torch.int8), int(DecodeAction.APPEND_HIGH))
        return DecodeDecision(action=action.to(torch.int8), hmin=hmin, lmin=lmin)
    evict = window_full & (h_avg < t_l) & (h_avg < l_avg)
    demote = window_full & ~evict & (h_avg < t_h)
    replace = demote & (l_avg < t_l)
    action = torch.full(n_high.shape, DecodeAction.APPEND_HIGH, dtype=torch.int8, device=p.device)
    action = torch.where(evict, torch.full_like(action, DecodeAction.EVICT_HIGH), action)
    action = torch.where(demote, torch.full_like(action, DecodeAction.DEMOTE_APPEND), action)
    action = torch.where(replace, torch.full_like(action, DecodeAction.DEMOTE_REPLACE), action)
    return DecodeDecision(action=action, hmin=hmin, lmin=lmin)


def tier_growth(action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens each tier gains from an action: (high +1 on APPEND_HIGH, low +1 on DEMOTE_APPEND)."""
    return (
        (action == DecodeAction.APPEND_HIGH).int(),
        (action == DecodeAction.DEMOTE_APPEND).int(),
    )
