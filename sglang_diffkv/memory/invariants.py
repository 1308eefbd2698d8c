"""Host-side check of every PageManager invariant (tests and debugging; it syncs).

Every page is in exactly one of: the free ring (once); one row's private region; the shared
regions of rows and the live handles, where its reference count equals the number of those
holders. Shared pages are full (the row's token count covers them) and only DECODING rows
have them; a handle's tier t holds exactly ceil(n_t / N_t) pages.

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
    shared = m.shared.cpu().numpy().astype(np.int64)
    phase = m.phase.cpu().numpy()[:, None, None]
    n_hi, n_lo, p_hi, p_lo = np.moveaxis(counts, -1, 0)
    s_hi, s_lo = np.moveaxis(shared, -1, 0)
    n_hi_page, n_lo_page = s.tokens_per_page
    count_rules = (
        ("negative counts", counts.min(-1) < 0),
        (f"high + low pages exceed row_len={R}", p_hi + p_lo > R),
        (f"more high tokens than high_pages * {n_hi_page}", n_hi > p_hi * n_hi_page),
        (f"more low tokens than low_pages * {n_lo_page}", n_lo > p_lo * n_lo_page),
        (f"more tokens than max_context={s.max_context}", n_hi + n_lo > s.max_context),
        ("FREE slot with non-zero counts", (phase == Phase.FREE) & counts.any(-1)),
        ("PREFILLED slot with low-tier counts", (phase == Phase.PREFILLED) & (n_lo + p_lo > 0)),
        ("negative shared pages", shared.min(-1) < 0),
        ("more shared pages than pages", (s_hi > p_hi) | (s_lo > p_lo)),
        ("a shared page is not full", (n_hi < s_hi * n_hi_page) | (n_lo < s_lo * n_lo_page)),
        ("shared pages outside DECODING", (phase != Phase.DECODING) & shared.any(-1)),
    )
    for what, bad in count_rules:
        hit = _first(bad)
        if hit is not None:
            raise AssertionError(f"{_where(hit)}: {what}; counts={counts[hit].tolist()}, "
                                 f"shared={shared[hit].tolist()}")

    pos = np.arange(R)
    owned = (pos < p_hi[..., None]) | (pos >= R - p_lo[..., None])
    hit = _first(~owned & (table != -1))
    if hit is not None:
        raise AssertionError(
            f"{_where(hit)}: row position {hit[3]} should be -1 but holds page {table[hit]} "
            f"(counts={counts[hit[:3]].tolist()})"
        )
    in_shared = (pos < s_hi[..., None]) | (pos >= R - s_lo[..., None])
    handle_ids = [_handle_pages(m, h) for h in m.handles.values()]

    private_ids = table[owned & ~in_shared]
    shared_ids = np.concatenate([table[owned & in_shared], *handle_ids])
    ids = np.concatenate([ring_ids, private_ids, shared_ids])
    refs = m._refs_buf.cpu().numpy().astype(np.int64)
    if refs[P] != 0:
        raise AssertionError(f"the reference counts' sink holds {refs[P]}, not 0")
    if ((ids < 0) | (ids >= P)).any():
        _explain_ownership(m, ring_counters, ring_ids, table, owned, in_shared, counts)
    ring_uses = np.bincount(ring_ids, minlength=P)
    private_uses = np.bincount(private_ids, minlength=P)
    shared_uses = np.bincount(shared_ids, minlength=P)
    holders = ring_uses + private_uses + (shared_uses > 0)
    if (holders != 1).any() or (ring_uses > 1).any() or (private_uses > 1).any():
        _explain_ownership(m, ring_counters, ring_ids, table, owned, in_shared, counts)
    bad = np.flatnonzero(refs[:P] != shared_uses)
    if bad.size:
        p = int(bad[0])
        raise AssertionError(
            f"page {p}: reference count {refs[p]} but {shared_uses[p]} shared holder(s) "
            f"(rows' shared regions and handles); {bad.size} page(s) disagree"
        )


def _handle_pages(m: PageManager, h) -> np.ndarray:
    """A live handle's page ids, after checking its layout: tier t holds exactly
    ceil(n_t / N_t) pages, then -1."""
    pages = h.pages.cpu().numpy().astype(np.int64)
    n_tok = h.n_tokens.cpu().numpy().astype(np.int64)
    per_page = np.array(m.spec.tokens_per_page)
    k = -(-n_tok // per_page)
    j = np.arange(pages.shape[-1])
    holds = j < k[..., None]
    if (k > pages.shape[-1]).any() or (n_tok < 0).any():
        raise AssertionError(f"handle {h.key}: token counts {n_tok.tolist()} do not fit its "
                             f"{pages.shape[-1]} pages per tier")
    if (n_tok.sum(-1) > h.num_tokens).any():
        raise AssertionError(f"handle {h.key}: a row holds more than num_tokens="
                             f"{h.num_tokens} tokens")
    hit = _first(holds != (pages != -1))
    if hit is not None:
        raise AssertionError(f"handle {h.key}: layer {hit[0]}, head {hit[1]}, tier {hit[2]} "
                             f"page {hit[3]} is {pages[hit]} but the tier holds {k[hit[:3]]} "
                             "pages")
    return pages[holds]


def _explain_ownership(
    m: PageManager,
    ring_counters: np.ndarray,
    ring_ids: np.ndarray,
    table: np.ndarray,
    owned: np.ndarray,
    in_shared: np.ndarray,
    counts: np.ndarray,
) -> None:
    P, R = m.spec.num_pages, m.spec.row_len
    holders: dict[int, list[str]] = {}
    for c, page in zip(ring_counters.tolist(), ring_ids.tolist(), strict=True):
        holders.setdefault(page, []).append(f"free ring counter {c} (slot {c % P})")
    for idx in map(tuple, np.argwhere(owned).tolist()):
        j = idx[3]
        tier, k = ("high", j) if j < counts[idx[:3]][2] else ("low", R - 1 - j)
        kind = "shared" if in_shared[idx] else "private"
        holders.setdefault(int(table[idx]), []).append(
            f"table[{_where(idx)}, {kind} {tier} page {k} at position {j}]"
        )
    for h in m.handles.values():
        pages = h.pages.cpu().numpy().astype(np.int64)
        for idx in map(tuple, np.argwhere(pages != -1).tolist()):
            holders.setdefault(int(pages[idx]), []).append(
                f"handle {h.key}[layer {idx[0]}, head {idx[1]}, tier {idx[2]}, page {idx[3]}]"
            )
    for page, who in sorted(holders.items()):
        if not 0 <= page < P:
            raise AssertionError(f"{who[0]} holds page id {page}, outside [0, num_pages={P})")
        exclusive = [w for w in who if " shared " not in w and not w.startswith("handle")]
        if len(exclusive) > 1 or (exclusive and len(who) > 1):
            raise AssertionError(f"page {page} is owned {len(who)} times: " + "; ".join(who))
    missing = sorted(set(range(P)) - holders.keys())
    raise AssertionError(f"{len(missing)} page(s) leaked (owned by nobody), first: {missing[:8]}")
