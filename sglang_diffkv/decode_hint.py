"""The fused eligible argmin's per-row record (``decode_policy`` / ``decode_attention``).

The decode policy step needs, per (request, layer, KV head) row, the eligible argmin of
``avg = score / (p - pos)`` of each tier. The merge pass of the previous step already visits
every token's score (it adds the step's probability to it), so it can produce that argmin
one step ahead; the policy then skips its scan. The record that carries it between the two
kernels is 48 bytes per row, int64 [max_reqs, layers, Hkv, HINT_WORDS]:

- int64 words 0, 1: the high and low tier's packed key (``kernels/_keys.py``: avg's order
  bits over the slot, so a signed int64 min is the argmin with ties to the first slot);
- int32 words 4..11 (the stamp, ``ST_*`` below, as offsets from word 4):
  ``P`` the position the record is for (the policy step's p + 1), ``NH`` / ``NL`` the tier
  counts after that policy step, ``FH`` / ``FL`` the shared-prefix bounds (tokens) it saw,
  ``LIMIT`` = P - window (a token is eligible iff pos <= LIMIT), ``DONE`` the merge's mark.

Protocol (each row; every write is by the one program of the row, or idempotent):

1. The policy step at position p reads the record. It is *valid* iff P == DONE == p,
   NH / NL equal the row's counts, FH / FL its shared bounds and LIMIT == p - window. Valid:
   the keys are the argmin (no scan). Otherwise it scans, exactly as without the record.
2. Then (live rows only) it *arms* the record for p + 1: keys := none, the stamp := its
   post-step counts and bounds, DONE := -1.
3. The merge pass of the same layer and step atomically mins every eligible token's key
   (with the score it just stored) into the keys; its program 0 of the row sets
   DONE := P if DONE == -1 and the row's counts still equal NH / NL, else DONE := -2.

So the keys are used only when exactly one merge ran between the arming policy step and the
consuming one and nothing changed the row's counts, bounds, window or position in between.
A merge that did not run leaves DONE == -1; a second one sets -2; a step taken by the torch
reference path does not arm, so the next p does not match P. Slot lifecycle ops
(``PageManager.allocate_prefill``, ``attach_prefix``, ``free_requests``) fill the slot's
records with -1 (:func:`invalidate`), so a slot's new request never sees its predecessor's
record even at an equal position and counts. What the record cannot see is a row's scores or
positions written by anything else between the two steps (nothing in the serving path does).
"""

from __future__ import annotations

import torch

HINT_WORDS = 6  # int64 per row: 2 keys + 8 int32 stamp fields
STAMP_OFFSET = 4  # int32 word where the stamp starts
ST_P, ST_NH, ST_NL, ST_FH, ST_FL, ST_LIMIT, ST_DONE = range(7)
STAMP_FIELDS = 8  # (the 8th is padding)

NONE_KEY = 0x7F800000FFFFFFFF  # +inf's order bits over slot 0xFFFFFFFF: "no eligible token"


def allocate(max_reqs: int, num_layers: int, num_kv_heads: int,
             device: torch.device | str) -> torch.Tensor:
    """Records for every row, all invalid (every word -1)."""
    return torch.full((max_reqs, num_layers, num_kv_heads, HINT_WORDS), -1,
                      dtype=torch.int64, device=device)


def invalidate(hints: torch.Tensor | None, req: torch.Tensor) -> None:
    """Every record of these request slots -1 (no host sync: index_fill_)."""
    if hints is not None and req.numel():
        hints.index_fill_(0, req.to(device=hints.device, dtype=torch.int64), -1)


def stamps(hints: torch.Tensor) -> torch.Tensor:
    """int32 [..., STAMP_FIELDS] view of the records' stamps."""
    return hints.view(torch.int32)[..., STAMP_OFFSET:STAMP_OFFSET + STAMP_FIELDS]


def unpack_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int64 keys -> (avg fp32, slot int64 with -1 for none)."""
    ordered = (key >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    slot = key & 0xFFFFFFFF
    return bits.view(torch.float32), torch.where(slot == 0xFFFFFFFF, -1, slot)


def valid(hints: torch.Tensor, counts: torch.Tensor, first: torch.Tensor,
          positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool [B, Hkv]: which of these rows' records (hints [B, Hkv, HINT_WORDS], counts
    [B, Hkv, >=2], first [B, Hkv, 2], positions [B]) the policy step would use (the torch
    side of the kernel's test, for tests and diagnostics)."""
    st = stamps(hints).long()
    p = positions.long()[:, None]
    return ((p >= 0) & (st[..., ST_P] == p) & (st[..., ST_DONE] == p)
            & (st[..., ST_NH] == counts[..., 0].long()) & (st[..., ST_NL] == counts[..., 1].long())
            & (st[..., ST_FH] == first[..., 0].long()) & (st[..., ST_FL] == first[..., 1].long())
            & (st[..., ST_LIMIT] == p - window))
