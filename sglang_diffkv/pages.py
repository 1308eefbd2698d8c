"""Reference reads and writes of tokens inside unified pages (the store the kernels mirror).

Inside a tier's segments tokens are stored token-major, so one page tile is contiguous:
key data ``[N, D * key_bits / 8]``, key meta ``[N, key_groups, (scale, zero)]`` fp16, value
data and value meta likewise, score ``[N]`` fp32, pos ``[N]`` int32. Offsets come from
:class:`sglang_diffkv.layout.TierLayout`. Pages are one ``uint8 [num_pages, page_bytes]``
tensor; a token is addressed by (page id, slot).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_diffkv.layout import META_BYTES_PER_GROUP, TierLayout
from sglang_diffkv.quant import dequantize, pack, quantize, unpack


class TokenData(NamedTuple):
    key: torch.Tensor  # fp32 [T, D] (dequantised)
    value: torch.Tensor  # fp32 [T, D]
    score: torch.Tensor  # fp32 [T]
    pos: torch.Tensor  # int32 [T]


def _byte_index(
    pages: torch.Tensor, page_ids: torch.Tensor, slots: torch.Tensor, offset: int, row_bytes: int
) -> torch.Tensor:
    """Flat byte indices [T, row_bytes] of each token's row in a token-major segment."""
    base = page_ids.long() * pages.shape[1] + offset + slots.long() * row_bytes
    return base[:, None] + torch.arange(row_bytes, device=pages.device)[None, :]


def _write(pages, page_ids, slots, offset, data: torch.Tensor) -> None:
    if data.shape[0] == 0:
        return
    rows = data.reshape(data.shape[0], -1).contiguous().view(torch.uint8)
    flat = pages.view(-1)
    flat[_byte_index(pages, page_ids, slots, offset, rows.shape[1])] = rows


def _read(pages, page_ids, slots, offset, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    flat = pages.view(-1)
    return flat[_byte_index(pages, page_ids, slots, offset, row_bytes)].contiguous().view(dtype)


def _check_slots(page_ids: torch.Tensor, slots: torch.Tensor) -> None:
    if page_ids.shape != slots.shape or page_ids.dim() != 1:
        raise ValueError(
            f"page_ids {tuple(page_ids.shape)} and slots {tuple(slots.shape)} must be "
            "equal 1-D shapes"
        )


def write_tokens(
    pages: torch.Tensor,
    layout: TierLayout,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score: torch.Tensor,
    pos: torch.Tensor,
) -> None:
    """Quantise T tokens' K/V ([T, D], any float dtype) to ``layout``'s tier and store them with
    their score and virtual position at (page_ids[t], slots[t])."""
    _check_slots(page_ids, slots)
    t = layout.tier
    if key.shape != (page_ids.shape[0], layout.head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [{page_ids.shape[0]}, {layout.head_dim}], got "
            f"{tuple(key.shape)} / {tuple(value.shape)}"
        )
    for data, bits, groups, off, meta_off in (
        (key, t.key_bits, t.key_groups, layout.key_offset, layout.key_meta_offset),
        (value, t.value_bits, t.value_groups, layout.value_offset, layout.value_meta_offset),
    ):
        q = quantize(data, bits, groups)
        _write(pages, page_ids, slots, off, pack(q.codes, bits))
        _write(pages, page_ids, slots, meta_off, torch.stack([q.scale, q.zero], dim=-1))
    _write(pages, page_ids, slots, layout.score_offset, score.float().reshape(-1, 1))
    _write(pages, page_ids, slots, layout.pos_offset, pos.int().reshape(-1, 1))


def read_tokens(
    pages: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor
) -> TokenData:
    """Dequantised K/V (fp32), scores and positions of the tokens at (page_ids, slots)."""
    _check_slots(page_ids, slots)
    t, d = layout.tier, layout.head_dim
    out = []
    for bits, groups, off, meta_off in (
        (t.key_bits, t.key_groups, layout.key_offset, layout.key_meta_offset),
        (t.value_bits, t.value_groups, layout.value_offset, layout.value_meta_offset),
    ):
        codes = unpack(_read(pages, page_ids, slots, off, d * bits // 8, torch.uint8), bits)
        meta = _read(
            pages, page_ids, slots, meta_off, groups * META_BYTES_PER_GROUP, torch.float16
        ).reshape(-1, groups, 2)
        out.append(dequantize(codes, meta[..., 0], meta[..., 1]))
    score = _read(pages, page_ids, slots, layout.score_offset, 4, torch.float32).reshape(-1)
    pos = _read(pages, page_ids, slots, layout.pos_offset, 4, torch.int32).reshape(-1)
    return TokenData(out[0], out[1], score, pos)


def _kv_segments(layout: TierLayout) -> tuple[tuple[int, int], ...]:
    """(offset, bytes per token) of a tier's key codes, key meta, value codes, value meta."""
    t, d = layout.tier, layout.head_dim
    return (
        (layout.key_offset, d * t.key_bits // 8),
        (layout.key_meta_offset, t.key_groups * META_BYTES_PER_GROUP),
        (layout.value_offset, d * t.value_bits // 8),
        (layout.value_meta_offset, t.value_groups * META_BYTES_PER_GROUP),
    )


def read_token_codes(
    pages: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor
) -> list[torch.Tensor]:
    """The stored K/V bytes (codes and metadata, not dequantised) of the tokens at
    (page_ids, slots): one uint8 [T, bytes] tensor per segment, for ``write_token_codes``."""
    _check_slots(page_ids, slots)
    return [_read(pages, page_ids, slots, off, n, torch.uint8)
            for off, n in _kv_segments(layout)]


def write_token_codes(
    pages: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor,
    codes: list[torch.Tensor],
) -> None:
    """Store K/V bytes read by ``read_token_codes`` (same tier) at (page_ids, slots): a
    token moved within its tier keeps its quantised values bit for bit. Score and position
    are left as they are."""
    _check_slots(page_ids, slots)
    for (off, _), data in zip(_kv_segments(layout), codes, strict=True):
        _write(pages, page_ids, slots, off, data)


def read_scores(
    pages: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(score fp32 [T], pos int32 [T]) without touching K/V: what the decode policy reads."""
    score = _read(pages, page_ids, slots, layout.score_offset, 4, torch.float32).reshape(-1)
    pos = _read(pages, page_ids, slots, layout.pos_offset, 4, torch.int32).reshape(-1)
    return score, pos


def add_scores(
    pages: torch.Tensor,
    layout: TierLayout,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    delta: torch.Tensor,
) -> None:
    """score += delta for each (page, slot); (page, slot) pairs must be distinct."""
    score, _ = read_scores(pages, layout, page_ids, slots)
    _write(pages, page_ids, slots, layout.score_offset, (score + delta.float()).reshape(-1, 1))


class TokenLocations(NamedTuple):
    page_ids: torch.Tensor  # int32 [B, H, C]; 0 where masked (a valid id, never read as data)
    slots: torch.Tensor  # int32 [B, H, C]
    mask: torch.Tensor  # bool [B, H, C]: slot c < the tier's token count


def token_locations(
    rows: torch.Tensor, n_tokens: torch.Tensor, tokens_per_page: int, low: bool, capacity: int
) -> TokenLocations:
    """Where tokens [0, capacity) of one tier live, from bidirectional page-table rows.

    rows: int32 [B, H, row_len]; n_tokens: [B, H]. Token s of a tier is in the tier's page
    s // N at slot s % N; high page j is ``row[j]``, low page j is ``row[row_len - 1 - j]``.
    """
    s = torch.arange(capacity, device=rows.device)
    page_index = s // tokens_per_page
    if low:
        page_index = rows.shape[-1] - 1 - page_index
    mask = s[None, None, :] < n_tokens[..., None]
    idx = page_index.clamp(0, rows.shape[-1] - 1).expand(*rows.shape[:2], capacity)
    page_ids = torch.gather(rows, -1, idx.long())
    page_ids = torch.where(mask, page_ids, torch.zeros_like(page_ids))
    slots = (s % tokens_per_page).int().expand(*rows.shape[:2], capacity)
    return TokenLocations(page_ids, slots, mask)


def gather_tokens(pages: torch.Tensor, layout: TierLayout, loc: TokenLocations) -> TokenData:
    """read_tokens over a [B, H, C] location grid; masked entries hold unspecified values."""
    shape = loc.page_ids.shape
    data = read_tokens(pages, layout, loc.page_ids.reshape(-1), loc.slots.reshape(-1))
    return TokenData(
        data.key.reshape(*shape, layout.head_dim),
        data.value.reshape(*shape, layout.head_dim),
        data.score.reshape(shape),
        data.pos.reshape(shape),
    )
