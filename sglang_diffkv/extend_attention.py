"""Reference extend attention over a compressed prefix: the oracle of ``kernels.extend_attention``.

With chunked prefill or a radix-cache hit, an extend step's request already has its first
tokens stored in DiffKV pages (high and low tier, pruned tokens absent) and ``n_new`` fresh
tokens arrive unquantised, packed as SGLang passes them: request b's fresh tokens are rows
``extend_start_loc[b] .. extend_start_loc[b] + extend_seq_lens[b] - 1`` of q [T, Hq, D] and
k / v [T, Hkv, D]. Every fresh query attends over

- (a) every token the request's row holds for this layer and KV head: exactly what
  ``attention.paged_decode_attention`` reads (``gather_cache``: both tiers, dequantised), and
- (b) the fresh tokens causally (fresh query i sees fresh keys 0..i),

with one softmax over both, i.e. the two parts merged by their log-sum-exp. The fresh tokens
must not be in the pages yet (the pages are the prefix only); nothing here writes pages (no
score accumulation: the prompt's scores come from the scoring step of its last chunk).

:func:`paged_extend_attention` returns each fresh query's output and natural-log LSE over
prefix + fresh keys; :func:`paged_extend_probs` returns the softmax probabilities of each
request's last fresh queries over prefix and fresh tokens (what prompt scoring needs when
the prompt's last queries arrive in a later chunk than most of its keys).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_diffkv.attention import GatheredCache, gather_cache
from sglang_diffkv.layout import PageGeometry


class ExtendAttention(NamedTuple):
    out: torch.Tensor  # [T, Hq, D] (q's dtype): rows outside every request are left as given
    lse: torch.Tensor  # fp32 [T, Hq]: natural-log LSE of the scaled logits, prefix + fresh


class ExtendProbs(NamedTuple):
    """Probabilities of each request's last nq_b = min(num_queries, n_b) fresh queries; query
    row r is fresh token n_b - nq_b + r (rows r >= nq_b are all zero). Over a query's keys
    (prefix high, prefix low, fresh) they sum to 1."""

    prob_high: torch.Tensor  # fp32 [B, Hq, Q, C_high]: over the row's high tokens, in order
    prob_low: torch.Tensor  # fp32 [B, Hq, Q, C_low]
    prob_fresh: torch.Tensor  # fp32 [B, Hq, Q, Nmax]: over fresh tokens 0..n_b - 1
    rows: torch.Tensor  # int64 [B, Q]: the packed row of each query, -1 where r >= nq_b
    lse: torch.Tensor  # fp32 [B, Hq, Q]: natural-log LSE (-inf where r >= nq_b)


def _gather_prefix(
    pages: torch.Tensor, geometry: PageGeometry, table: torch.Tensor, counts: torch.Tensor,
    req_idx: torch.Tensor, layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Dequantised prefix keys / values [B, Hkv, C, D] (high tokens, then low), mask [B, Hkv,
    C] and C_high; masked slots are zeroed (their bytes may be anything, NaN included)."""
    cache: GatheredCache = gather_cache(pages, geometry, table, counts, req_idx, layer)
    key = torch.cat([cache.high.key, cache.low.key], dim=2)
    value = torch.cat([cache.high.value, cache.low.value], dim=2)
    mask = torch.cat([cache.mask_high, cache.mask_low], dim=2)
    key = torch.where(mask[..., None], key.float(), 0.0)
    value = torch.where(mask[..., None], value.float(), 0.0)
    return key, value, mask, cache.mask_high.shape[-1]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
           lens: torch.Tensor, req_idx: torch.Tensor, table: torch.Tensor,
           geometry: PageGeometry) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"q [T, Hq, D], k and v [T, Hkv, D] expected, got {tuple(q.shape)} / "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if hq % hkv or d != geometry.head_dim or k.shape[2] != d or table.shape[2] != hkv:
        raise ValueError(f"heads / head_dim do not match: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, table {tuple(table.shape)}, geometry head_dim "
                         f"{geometry.head_dim}")
    b = req_idx.shape[0]
    if starts.shape != (b,) or lens.shape != (b,):
        raise ValueError(f"extend_start_loc and extend_seq_lens must be [{b}], got "
                         f"{tuple(starts.shape)} / {tuple(lens.shape)}")


def _request_logits(
    qb: torch.Tensor, kb: torch.Tensor, pkey: torch.Tensor, pmask: torch.Tensor,
    q_pos: torch.Tensor, sm_scale: float,
) -> torch.Tensor:
    """Scaled logits [Hkv, G, nq, C + n] of fresh queries qb [nq, Hq, D] (at fresh positions
    q_pos [nq]) over one request's prefix (pkey [Hkv, C, D], pmask [Hkv, C]) and its fresh
    keys kb [n, Hkv, D]; -inf where masked."""
    nq, hq, d = qb.shape
    hkv = kb.shape[1]
    qg = qb.float().reshape(nq, hkv, hq // hkv, d)
    pre = torch.einsum("qhgd,hcd->hgqc", qg, pkey) * sm_scale
    pre = pre.masked_fill(~pmask[:, None, None, :], float("-inf"))
    fresh = torch.einsum("qhgd,khd->hgqk", qg, kb.float()) * sm_scale
    causal = torch.arange(kb.shape[0], device=qb.device)[None, :] <= q_pos[:, None]
    fresh = fresh.masked_fill(~causal[None, None], float("-inf"))
    return torch.cat([pre, fresh], dim=-1)


def paged_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> ExtendAttention:
    """Fresh queries q [T, Hq, D] over their request's compressed prefix (layer ``layer`` of
    table / counts rows ``req_idx[b]``) and, causally, over the fresh k / v [T, Hkv, D].
    Returns out (q's dtype unless ``out`` is given) and the natural-log LSE fp32 [T, Hq]."""
    _check(q, k, v, extend_start_loc, extend_seq_lens, req_idx, table, geometry)
    if out is None:
        out = torch.zeros_like(q)
    if lse is None:
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    pkey, pval, pmask, _ = _gather_prefix(pages, geometry, table, counts, req_idx, layer)
    for b, (s, n) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist(),
                                   strict=True)):
        if n == 0:
            continue
        rows = slice(s, s + n)
        logits = _request_logits(q[rows], k[rows], pkey[b], pmask[b],
                                 torch.arange(n, device=q.device), sm_scale)
        row_lse = torch.logsumexp(logits, dim=-1)  # [Hkv, G, n]
        prob = torch.exp(logits - row_lse[..., None])
        vals = torch.cat([pval[b], v[rows].float().transpose(0, 1)], dim=1)  # [Hkv, C + n, D]
        o = torch.einsum("hgqc,hcd->qhgd", prob, vals)
        out[rows] = o.reshape(n, q.shape[1], -1).to(out.dtype)
        lse[rows] = row_lse.permute(2, 0, 1).reshape(n, -1)
    return ExtendAttention(out, lse)


def paged_extend_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
    num_queries: int,
) -> ExtendProbs:
    """Softmax probabilities of each request's last min(num_queries, n_b) fresh queries over
    its prefix tokens (per tier, in the row's token order) and its fresh tokens (causal), on
    the same logits as :func:`paged_extend_attention`."""
    _check(q, k, k, extend_start_loc, extend_seq_lens, req_idx, table, geometry)
    b, hq = req_idx.shape[0], q.shape[1]
    dev = q.device
    pkey, _, pmask, c_high = _gather_prefix(pages, geometry, table, counts, req_idx, layer)
    c = pkey.shape[2]
    lens = extend_seq_lens.tolist()
    nmax = max(lens, default=0)
    prob = torch.zeros(b, hq, num_queries, c + nmax, device=dev)
    lse = torch.full((b, hq, num_queries), float("-inf"), device=dev)
    rows = torch.full((b, num_queries), -1, dtype=torch.int64, device=dev)
    for i, (s, n) in enumerate(zip(extend_start_loc.tolist(), lens, strict=True)):
        nq = min(num_queries, n)
        if nq == 0:
            continue
        q_pos = torch.arange(n - nq, n, device=dev)
        logits = _request_logits(q[s + q_pos], k[s:s + n], pkey[i], pmask[i], q_pos, sm_scale)
        row_lse = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - row_lse[..., None]).flatten(0, 1)  # [Hq, nq, C + n]
        prob[i, :, :nq, :c + n] = p
        lse[i, :, :nq] = row_lse.flatten(0, 1)
        rows[i, :nq] = s + q_pos
    return ExtendProbs(prob[..., :c_high], prob[..., c_high:c], prob[..., c:], rows, lse)


def stored_logits(
    q: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scaled logits fp32 [Hkv, G, nq, C] of queries q [nq, Hq, D] over every token one
    request (``req_idx``, one element) has stored in ``layer`` (high slots, then low), the
    stored mask [Hkv, C] and the high tier's column count; the callers mask by position."""
    pkey, _, pmask, c_high = _gather_prefix(pages, geometry, table, counts,
                                            req_idx.reshape(1), layer)
    key, mask = pkey[0], pmask[0]  # [Hkv, C, D], [Hkv, C]
    nq, hq, d = q.shape
    hkv = key.shape[0]
    qg = q.float().reshape(nq, hkv, hq // hkv, d)
    return torch.einsum("qhgd,hcd->hgqc", qg, key) * sm_scale, mask, c_high


def paged_prefix_probs(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
) -> torch.Tensor:
    """Softmax probabilities fp32 [Hq, nq, C] of queries q [nq, Hq, D] that sit inside one
    request's stored prefix, at positions q_pos [nq], over that prefix's tokens 0..q_pos
    (causal). Slot s of the row's high tier must hold position s and the low tier nothing:
    a chunked prompt before its last chunk (``PageManager.advance_prefill``). Chunked
    prefill scores a prompt whose last chunk is shorter than ``score_queries`` with these
    earlier queries, kept from the chunk before (``CompressedKVCache``)."""
    logits, mask, _ = stored_logits(q, pages, geometry, table, counts, req_idx, layer,
                                    sm_scale)
    slot = torch.arange(mask.shape[1], device=q.device)
    visible = mask[:, None, None, :] & (slot[None, None, None, :]
                                        <= q_pos.to(q.device)[None, None, :, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).flatten(0, 1)
