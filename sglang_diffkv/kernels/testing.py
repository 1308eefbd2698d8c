"""Random cache states for the kernel tests, the GPU check and the benchmark.

A state is what the memory manager would hold after prefill and some decode steps: a
bidirectional table (high pages on the left of each row, low pages on the right), counts
(n_high, n_low, high_pages, low_pages) and pages whose used slots hold valid quantised
data (random codes, sane fp16 metadata, random scores and positions). Unused bytes are
random too, so a kernel that reads outside the counted tokens is caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sglang_diffkv.layout import META_BYTES_PER_GROUP, PageGeometry, TierLayout


@dataclass
class DecodeCase:
    geometry: PageGeometry
    pages: torch.Tensor  # uint8 [P, page_bytes]
    table: torch.Tensor  # int32 [max_reqs, layers, Hkv, row_len]
    counts: torch.Tensor  # int32 [max_reqs, layers, Hkv, 4]
    req_idx: torch.Tensor  # int64 [B]
    max_context: int

    def stored_bytes(self, layer: int) -> int:
        """Page bytes of the tokens one layer's attention reads, at page granularity
        (metadata, score, position and the unused tail of each used page included)."""
        c = self.counts[self.req_idx.long(), layer].long()
        return int((c[..., 2] + c[..., 3]).sum()) * self.geometry.page_bytes


def _fill_meta(pages: torch.Tensor, ids: torch.Tensor, layout: TierLayout,
               gen: torch.Generator) -> None:
    """Sane (scale, zero) metadata, scores and positions in pages ``ids`` of one tier."""
    if ids.numel() == 0:
        return
    n, t = layout.tokens_per_page, layout.tier
    dev = pages.device
    for off, groups, bits, span in (
        (layout.key_meta_offset, t.key_groups, t.key_bits, 2.0),
        (layout.value_meta_offset, t.value_groups, t.value_bits, 2.0),
    ):
        nbytes = n * groups * META_BYTES_PER_GROUP
        shape = (ids.numel(), n, groups)
        rng = span * (0.5 + torch.rand(shape, generator=gen, device=dev))
        scale = (rng / (2**bits - 1)).half()
        zero = (-rng / 2 + 0.2 * torch.randn(shape, generator=gen, device=dev)).half()
        meta = torch.stack([scale, zero], -1).reshape(ids.numel(), -1).view(torch.uint8)
        pages[ids, off:off + nbytes] = meta
    score = torch.rand(ids.numel(), n, generator=gen, device=dev) * 4
    pages[ids, layout.score_offset:layout.score_offset + 4 * n] = score.view(torch.uint8)
    pos = torch.randint(0, 1 << 20, (ids.numel(), n), generator=gen, device=dev,
                        dtype=torch.int32)
    pages[ids, layout.pos_offset:layout.pos_offset + 4 * n] = pos.view(torch.uint8)


def random_decode_case(
    geometry: PageGeometry,
    contexts: list[int],
    num_kv_heads: int,
    *,
    num_layers: int = 1,
    high_frac: float = 1.0,
    low_frac: float = 0.0,
    jitter: bool = False,
    spare_reqs: int = 0,
    max_context: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> DecodeCase:
    """Every (request b, layer, head) keeps round(high_frac * L_b) high and
    round(low_frac * L_b) low tokens (with ``jitter``: random per head, each fraction
    scaled by U(0.5, 1.5) within the row's capacity). Request b lives in table slot
    ``req_idx[b]`` (slots shuffled among ``B + spare_reqs``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b = len(contexts)
    max_context = max_context or max(contexts)
    max_reqs = b + spare_reqs
    hi_n, lo_n = geometry.high.tokens_per_page, geometry.low.tokens_per_page
    rng = np.random.default_rng(seed)
    counts = np.zeros((max_reqs, num_layers, num_kv_heads, 4), dtype=np.int64)
    req = torch.randperm(max_reqs, generator=gen)[:b]
    for i, length in enumerate(contexts):
        for lyr in range(num_layers):
            for h in range(num_kv_heads):
                fh, fl = high_frac, low_frac
                if jitter:
                    fh *= rng.uniform(0.5, 1.5)
                    fl *= rng.uniform(0.5, 1.5)
                nh = min(length, round(fh * length))
                nl = min(length - nh, round(fl * length))
                counts[int(req[i]), lyr, h] = (nh, nl, math.ceil(nh / hi_n), math.ceil(nl / lo_n))
    return _case_from_counts(geometry, counts, req, max_context, gen, device, seed)


def _case_from_counts(geometry: PageGeometry, counts: np.ndarray, req: torch.Tensor,
                      max_context: int, gen: torch.Generator, device: torch.device | str,
                      seed: int) -> DecodeCase:
    """Table and pages for ``counts`` (int64 [max_reqs, layers, Hkv, 4]: n_high, n_low,
    high pages, low pages): distinct random page ids, high pages from the left of each row
    and low pages from the right, used slots with sane metadata."""
    max_reqs, num_layers, num_kv_heads, _ = counts.shape
    row_len = geometry.row_len(max_context)
    total = int(counts[..., 2:].sum())
    ids = torch.randperm(total + 3, generator=gen)[:total].numpy().astype(np.int32)
    num_pages = total + 3
    table = np.full((max_reqs, num_layers, num_kv_heads, row_len), -1, dtype=np.int32)
    tier_of = np.zeros(num_pages, dtype=np.int8)
    cur = 0
    for r, lyr, h in np.ndindex(max_reqs, num_layers, num_kv_heads):
        hp, lp = counts[r, lyr, h, 2:]
        table[r, lyr, h, :hp] = ids[cur:cur + hp]
        cur += hp
        if lp:
            table[r, lyr, h, row_len - lp:] = ids[cur:cur + lp][::-1]  # low page j at R-1-j
            tier_of[ids[cur:cur + lp]] = 1
        cur += lp
    dev = torch.device(device)
    tgen = torch.Generator(device=dev).manual_seed(seed + 1)
    pages = torch.randint(0, 256, (num_pages, geometry.page_bytes), generator=tgen,
                          dtype=torch.uint8, device=dev)
    tier_t = torch.from_numpy(tier_of).to(dev)
    for t, layout in enumerate(geometry.tiers):
        _fill_meta(pages, torch.nonzero(tier_t == t).flatten(), layout, tgen)
    return DecodeCase(
        geometry,
        pages,
        torch.from_numpy(table).to(dev),
        torch.from_numpy(counts.astype(np.int32)).to(dev),
        req.to(dev),
        max_context,
    )


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN anywhere gives inf)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass
class ExtendCase:
    """A compressed prefix per request (``cache``) and the packed fresh tokens of one extend
    step: request b's at rows starts[b] + [0, lens[b]) of q / k / v (two spare rows at the
    end belong to no request)."""

    cache: DecodeCase
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    starts: torch.Tensor  # int64 [B]
    lens: torch.Tensor  # int32 [B]

    @property
    def max_new(self) -> int:
        return int(self.lens.max()) if self.lens.numel() else 0


def random_extend_case(
    geometry: PageGeometry,
    prefix: list[list[tuple[int, int]]],
    new_lens: list[int],
    group: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int = 2,
    spare_reqs: int = 2,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> ExtendCase:
    """``prefix[b][h] = (n_high, n_low)``: the tokens request b's row keeps for KV head h, in
    every layer (the prompt tokens a prefix held beyond them count as pruned); ``new_lens``:
    its fresh tokens. Pages hold random codes (``random_decode_case``'s filling)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, hkv = len(prefix), len(prefix[0])
    hi_n, lo_n = geometry.high.tokens_per_page, geometry.low.tokens_per_page
    counts = np.zeros((b + spare_reqs, num_layers, hkv, 4), dtype=np.int64)
    req = torch.randperm(b + spare_reqs, generator=gen)[:b]
    for i, heads in enumerate(prefix):
        for h, (nh, nl) in enumerate(heads):
            counts[int(req[i]), :, h] = (nh, nl, math.ceil(nh / hi_n), math.ceil(nl / lo_n))
    max_context = max(1, int(counts[..., :2].sum(-1).max()))
    case = _case_from_counts(geometry, counts, req, max_context, gen, device, seed)
    t = sum(new_lens) + 2
    d = geometry.head_dim
    q, k, v = (torch.randn(t, n, d, generator=gen).to(device=device, dtype=dtype)
               for n in (hkv * group, hkv, hkv))
    lens = torch.tensor(new_lens, dtype=torch.int32)
    starts = torch.cumsum(lens, 0) - lens
    return ExtendCase(case, q, k, v, starts.to(device=device, dtype=torch.int64),
                      lens.to(device))
