"""Reference decode attention over the compressed paged cache: the oracle of the kernels.

Gathers each (request, KV head)'s high and low tokens through the bidirectional page table,
dequantises them and attends with the whole GQA group. Besides the output it returns, for
every cached token, the max over the group of its softmax probability: the amount the
decode step adds to that token's score.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.pages import TokenData, gather_tokens, token_locations


class DecodeAttention(NamedTuple):
    out: torch.Tensor  # fp32 [B, Hq, D]
    prob_high: torch.Tensor  # fp32 [B, Hkv, C_high]: max-over-group probability, 0 where masked
    prob_low: torch.Tensor  # fp32 [B, Hkv, C_low]
    lse: torch.Tensor  # fp32 [B, Hq]: natural-log log-sum-exp of the scaled logits


class GatheredCache(NamedTuple):
    high: TokenData
    low: TokenData
    mask_high: torch.Tensor  # bool [B, Hkv, C_high]
    mask_low: torch.Tensor


def gather_cache(
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
) -> GatheredCache:
    """Dequantised tokens of both tiers for one layer; table/counts as in the memory manager."""
    rows = table[req_idx.long(), layer]
    cnt = counts[req_idx.long(), layer]
    tiers = []
    for t, layout in enumerate(geometry.tiers):
        n = cnt[..., t]
        cap = int(n.max()) if n.numel() else 0
        loc = token_locations(rows, n, layout.tokens_per_page, low=t == 1, capacity=cap)
        tiers.append((gather_tokens(pages, layout, loc), loc.mask))
    return GatheredCache(tiers[0][0], tiers[1][0], tiers[0][1], tiers[1][1])


def masked_group_attention(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, D]; key/value [B, Hkv, C, D]; mask [B, Hkv, C].
    Returns out [B, Hq, D], probabilities [B, Hq, C] and lse [B, Hq] (fp32)."""
    b, hq, d = q.shape
    hkv = key.shape[1]
    g = hq // hkv
    qg = q.float().reshape(b, hkv, g, d)
    # masked slots hold whatever bytes the page had (possibly NaN): zero them, not just mask
    key = torch.where(mask[..., None], key.float(), 0.0)
    value = torch.where(mask[..., None], value.float(), 0.0)
    logits = torch.einsum("bhgd,bhcd->bhgc", qg, key.float()) * sm_scale
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    prob = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhgc,bhcd->bhgd", prob, value.float())
    return out.reshape(b, hq, d), prob.reshape(b, hq, -1), lse.reshape(b, hq)


def paged_decode_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
) -> DecodeAttention:
    """One decode query per request (q: [B, Hq, D]) over that request's compressed cache."""
    cache = gather_cache(pages, geometry, table, counts, req_idx, layer)
    key = torch.cat([cache.high.key, cache.low.key], dim=2)
    value = torch.cat([cache.high.value, cache.low.value], dim=2)
    mask = torch.cat([cache.mask_high, cache.mask_low], dim=2)
    out, prob, lse = masked_group_attention(q, key, value, mask, sm_scale)
    hkv = key.shape[1]
    group_prob = prob.unflatten(1, (hkv, -1)).amax(dim=2) * mask
    c_high = cache.mask_high.shape[-1]
    return DecodeAttention(out, group_prob[..., :c_high], group_prob[..., c_high:], lse)
