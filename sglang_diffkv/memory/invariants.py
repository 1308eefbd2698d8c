"""Host-side check of every PageManager invariant (tests and debugging; it syncs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sglang_diffkv.memory.inputs import Phase

if TYPE_CHECKING:
    from sglang_diffkv.memory.manager import PageManager


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_invariants(m: PageManager) -> None:
    s = m.spec
    P, R = s.num_pages, s.row_len
    head, tail = int(m.head), int(m.tail)
    if not 0 <= head <= tail <= head + P:
        _fail(f"free-list counters out of order: head={head}, tail={tail}, num_pages={P}")

    owners: list[tuple[int, str]] = []  # (page id, who holds it)
    ring = m.free_pages.cpu().numpy()
    for c in range(head, tail):
        owners.append((int(ring[c % P]), f"free ring counter {c} (slot {c % P})"))

    table = m.table.cpu().numpy()
    counts = m.counts.cpu().numpy().astype(np.int64)
    phase = m.phase.cpu().numpy()
    tpp = np.array(s.tokens_per_page)
    for r, l, h in np.ndindex(*table.shape[:3]):
        where = f"request slot {r}, layer {l}, head {h}"
        n_hi, n_lo, p_hi, p_lo = counts[r, l, h]
        row = table[r, l, h]
        if min(n_hi, n_lo, p_hi, p_lo) < 0:
            _fail(f"{where}: negative counts {counts[r, l, h].tolist()}")
        if p_hi + p_lo > R:
            _fail(f"{where}: {p_hi} high + {p_lo} low pages exceed row_len={R}")
        for t, (n, p) in enumerate(((n_hi, p_hi), (n_lo, p_lo))):
            if n > p * tpp[t]:
                _fail(f"{where}: tier {t} holds {n} tokens in {p} pages of {tpp[t]}")
        if n_hi + n_lo > s.max_context:
            _fail(f"{where}: {n_hi}+{n_lo} tokens exceed max_context={s.max_context}")
        if phase[r] == Phase.FREE and counts[r, l, h].any():
            _fail(f"{where}: FREE slot has counts {counts[r, l, h].tolist()}")
        if phase[r] == Phase.PREFILLED and (n_lo or p_lo):
            _fail(f"{where}: PREFILLED slot has low counts {counts[r, l, h].tolist()}")
        owned = np.zeros(R, dtype=bool)
        owned[:p_hi] = True
        owned[R - p_lo:] = True
        empty_bad = np.flatnonzero(~owned & (row != -1))
        if empty_bad.size:
            j = int(empty_bad[0])
            _fail(f"{where}: row position {j} should be -1 but holds page {row[j]}")
        for j in np.flatnonzero(owned):
            tier, k = ("high", j) if j < p_hi else ("low", R - 1 - j)
            owners.append((int(row[j]), f"table[{where}, {tier} page {k} at position {j}]"))

    holders: dict[int, list[str]] = {}
    for page, who in owners:
        if not 0 <= page < P:
            _fail(f"{who} holds page id {page}, outside [0, num_pages={P})")
        holders.setdefault(page, []).append(who)
    for page, who in holders.items():
        if len(who) > 1:
            _fail(f"page {page} is owned {len(who)} times: " + "; ".join(who))
    missing = sorted(set(range(P)) - holders.keys())
    if missing:
        _fail(f"{len(missing)} page(s) leaked (owned by nobody), first: {missing[:8]}")
