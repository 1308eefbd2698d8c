"""Host-side check of every PageManager invariant (tests and debugging; it syncs).

Vectorised with numpy so property tests can call it after every step; the slow per-page
descriptions are built only once something is already wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sglang_diffkv.memory.inputs import Phase

if TYPE_CHECKING:
    from sglang_diffkv.memory.manager import PageManager


def _first(mask: np.ndarray) -> tuple[int, ...] | None:
    if not mask.any():
        return None
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _where(idx: tuple[int, ...]) -> str:
    return f"request slot {idx[0]}, layer {idx[1]}, head {idx[2]}"


def check_invariants(m: PageManager) -> None:
    s = m.spec
    P, R = s.num_pages, s.row_len
    head, tail = int(m.head), int(m.tail)
    if not 0 <= head <= tail <= head + P:
        raise AssertionError(
            f"free-list counters out of order: head={head}, tail={tail}, num_pages={P}"
        )
    ring_counters = np.arange(head, tail)
    ring_ids = m.free_pages.cpu().numpy()[ring_counters % P].astype(np.int64)

    table = m.table.cpu().numpy().astype(np.int64)
    counts = m.counts.cpu().numpy().astype(np.int64)
    phase = m.phase.cpu().numpy()[:, None, None]
    n_hi, n_lo, p_hi, p_lo = np.moveaxis(counts, -1, 0)
    n_hi_page, n_lo_page = s.tokens_per_page
    count_rules = (
        ("negative counts", counts.min(-1) < 0),
        (f"high + low pages exceed row_len={R}", p_hi + p_lo > R),
        (f"more high tokens than high_pages * {n_hi_page}", n_hi > p_hi * n_hi_page),
        (f"more low tokens than low_pages * {n_lo_page}", n_lo > p_lo * n_lo_page),
        (f"more tokens than max_context={s.max_context}", n_hi + n_lo > s.max_context),
        ("FREE slot with non-zero counts", (phase == Phase.FREE) & counts.any(-1)),
        ("PREFILLED slot with low-tier counts", (phase == Phase.PREFILLED) & (n_lo + p_lo > 0)),
    )
    for what, bad in count_rules:
        hit = _first(bad)
        if hit is not None:
            raise AssertionError(f"{_where(hit)}: {what}; counts={counts[hit].tolist()}")

    pos = np.arange(R)
    owned = (pos < p_hi[..., None]) | (pos >= R - p_lo[..., None])
    hit = _first(~owned & (table != -1))
    if hit is not None:
        raise AssertionError(
            f"{_where(hit)}: row position {hit[3]} should be -1 but holds page {table[hit]} "
            f"(counts={counts[hit[:3]].tolist()})"
        )

    ids = np.concatenate([ring_ids, table[owned]])
    out_of_range = (ids < 0) | (ids >= P)
    uses = np.bincount(ids[~out_of_range], minlength=P)
    if out_of_range.any() or (uses != 1).any():
        _explain_ownership(ring_counters, ring_ids, table, owned, counts, P, R)


def _explain_ownership(
    ring_counters: np.ndarray,
    ring_ids: np.ndarray,
    table: np.ndarray,
    owned: np.ndarray,
    counts: np.ndarray,
    P: int,
    R: int,
) -> None:
    holders: dict[int, list[str]] = {}
    for c, page in zip(ring_counters.tolist(), ring_ids.tolist(), strict=True):
        holders.setdefault(page, []).append(f"free ring counter {c} (slot {c % P})")
    for idx in map(tuple, np.argwhere(owned).tolist()):
        j = idx[3]
        tier, k = ("high", j) if j < counts[idx[:3]][2] else ("low", R - 1 - j)
        holders.setdefault(int(table[idx]), []).append(
            f"table[{_where(idx)}, {tier} page {k} at position {j}]"
        )
    for page, who in sorted(holders.items()):
        if not 0 <= page < P:
            raise AssertionError(f"{who[0]} holds page id {page}, outside [0, num_pages={P})")
        if len(who) > 1:
            raise AssertionError(f"page {page} is owned {len(who)} times: " + "; ".join(who))
    missing = sorted(set(range(P)) - holders.keys())
    raise AssertionError(f"{len(missing)} page(s) leaked (owned by nobody), first: {missing[:8]}")
