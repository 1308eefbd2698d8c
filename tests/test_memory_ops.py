"""Hand-made cases for the page manager: exact row layouts, decode page rules, errors."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import (
    MemorySpec,
    OutOfPages,
    PageManager,
    PageTableRowFull,
    Phase,
    alloc_page_storage,
)

# N_high = 2, N_low = 3, max_context 12 -> row_len = ceil(12 / 2) + 2 = 8.
SPEC = MemorySpec(
    num_pages=40, max_reqs=4, num_layers=2, num_kv_heads=2,
    high_tokens_per_page=2, low_tokens_per_page=3, max_context=12,
)


def heads(*per_head: int) -> torch.Tensor:
    """[1, layers=2, heads=2] from four numbers in (layer, head) order."""
    return torch.tensor(per_head).view(1, 2, 2)


def snapshot_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def m() -> PageManager:
    return PageManager(SPEC)


# -- spec -------------------------------------------------------------------------------


def test_spec_from_geometry_takes_tokens_per_page_and_row_len_from_layout() -> None:
    geom = PageGeometry.for_config(DiffKVConfig(), 128)
    spec = MemorySpec.from_geometry(
        geom, num_pages=100, max_reqs=8, num_layers=4, num_kv_heads=2, max_context=4096
    )
    assert spec.tokens_per_page == (geom.high.tokens_per_page, geom.low.tokens_per_page)
    assert spec.row_len == geom.row_len(4096)


@pytest.mark.parametrize("field", ["num_pages", "max_reqs", "low_tokens_per_page"])
def test_spec_rejects_non_positive_fields(field: str) -> None:
    kwargs = {**SPEC.__dict__, field: 0}
    with pytest.raises(ValueError, match=f"{field}=0"):
        MemorySpec(**kwargs)


@pytest.mark.parametrize("n_hi_page,n_lo_page", [(2, 3), (3, 2), (4, 7), (32, 60), (32, 52)])
def test_prefill_pages_cover_every_high_low_split(n_hi_page: int, n_lo_page: int) -> None:
    spec = MemorySpec(64, 1, 1, 1, n_hi_page, n_lo_page, max_context=130)
    for length in range(1, 131):
        worst = max(
            math.ceil(h / n_hi_page) + math.ceil(lo / n_lo_page)
            for h in range(length + 1)
            for lo in range(length - h + 1)
        ) if length <= 40 else math.ceil(length / n_hi_page) + 1
        assert worst <= spec.prefill_pages(length) <= spec.row_len


def test_host_page_bounds() -> None:
    assert SPEC.pages_needed_for_prefill([5, 12]) == (4 + 7) * 4
    assert SPEC.pages_needed_for_decode(3) == 3 * 4 * 2
    with pytest.raises(ValueError, match="prompt length 13 is outside"):
        SPEC.pages_needed_for_prefill([13])


def test_alloc_page_storage() -> None:
    pages = alloc_page_storage(5, 6784)
    assert pages.shape == (5, 6784) and pages.dtype == torch.uint8
    with pytest.raises(ValueError, match="page_bytes=0"):
        alloc_page_storage(5, 0)


# -- prefill, reclaim, decode layouts -----------------------------------------------------


def test_prefill_takes_a_contiguous_run_into_the_left_of_each_row(m: PageManager) -> None:
    res = m.allocate_prefill([2], [5])  # ceil(5 / 2) + 1 = 4 pages per (layer, head)
    res.raise_if_failed()
    assert bool(res.ok) and int(res.needed) == 16 and int(res.free) == 40
    expected = torch.arange(16, dtype=torch.int32).view(2, 2, 4)
    assert torch.equal(m.table[2, ..., :4], expected)
    assert (m.table[2, ..., 4:] == -1).all()
    assert m.counts[2].tolist() == [[[5, 0, 4, 0]] * 2] * 2
    assert int(m.num_free_pages()) == 24 and m.num_free_pages_host() == 24
    assert m.num_free_pages().dim() == 0
    m.check_invariants()


def test_reclaim_reverses_low_pages_to_the_right_end(m: PageManager) -> None:
    m.allocate_prefill([1], [12]).raise_if_failed()  # 7 pages per row, ids 0..27
    # (layer 0, head 0): 3 high tokens -> 2 pages, 7 low tokens -> 3 pages, 2 returned.
    n_high, n_low = heads(3, 12, 0, 0), heads(7, 0, 4, 0)
    m.reclaim_prefill([1], n_high, n_low)
    # Row 0 held [0..6]: high [0, 1], low pages written after them [2, 3, 4], return [5, 6].
    assert m.table[1, 0, 0].tolist() == [0, 1, -1, -1, -1, 4, 3, 2]
    # Low page j is at row_len - 1 - j, in the order the compressor wrote them.
    assert m.table[1, 0, 0, -1] == 2 and m.table[1, 0, 0, -3] == 4
    assert m.table[1, 0, 1].tolist() == [7, 8, 9, 10, 11, 12, -1, -1]  # all high
    assert m.table[1, 1, 0].tolist() == [-1] * 6 + [15, 14]  # all low: 4 tokens -> 2 pages
    assert m.table[1, 1, 1].tolist() == [-1] * 8  # everything pruned
    assert m.counts[1].tolist() == [[[3, 7, 2, 3], [12, 0, 6, 0]], [[0, 4, 0, 2], [0, 0, 0, 0]]]
    # Returned pages go to the tail in (layer, head, position) order.
    ring = m.free_pages.tolist()
    assert [ring[c % 40] for c in range(40, 40 + 2 + 1 + 5 + 7)] == [
        5, 6, 13, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
    ]
    m.check_invariants()


def test_chunked_prefill_reserves_the_whole_prompt_and_advances(m: PageManager) -> None:
    """A prompt of 11 tokens in chunks of 4, 4, 3: its first chunk takes the whole prompt's
    all-high pages (ceil(11 / 2) + 1 = 7 per row), later chunks take none and only count
    their tokens, and the last is reclaimed as a whole prompt."""
    res = m.allocate_prefill([3], [4], reserve_lens=[11])
    assert bool(res.ok) and int(res.needed) == 28
    assert m.counts[3].tolist() == [[[4, 0, 7, 0]] * 2] * 2
    assert m.phase[3] == Phase.PREFILLED
    before = m.table.clone()
    m.advance_prefill([3], [4])
    m.advance_prefill([3], [3])
    assert torch.equal(m.table, before) and int(m.num_free_pages()) == 40 - 28
    assert m.counts[3].tolist() == [[[11, 0, 7, 0]] * 2] * 2
    m.check_invariants()
    m.reclaim_prefill([3], heads(5, 11, 0, 2), heads(6, 0, 3, 0))
    assert m.counts[3, 0, 0].tolist() == [5, 6, 3, 2]
    m.check_invariants()
    m.free_requests([3])
    assert int(m.num_free_pages()) == 40
    m.check_invariants()


def test_chunked_prefill_errors(m: PageManager) -> None:
    with pytest.raises(ValueError, match="prompt length 5 exceeds its reserve 4"):
        m.allocate_prefill([0], [5], reserve_lens=[4])
    with pytest.raises(ValueError, match="outside"):
        m.allocate_prefill([0], [4], reserve_lens=[13])
    with pytest.raises(ValueError, match="advance_prefill: request slot 0 is FREE"):
        m.advance_prefill([0], [1])
    m.allocate_prefill([0], [2], reserve_lens=[3])  # 3 pages of 2 high tokens per row
    with pytest.raises(ValueError, match="7 high tokens do not fit its 3 reserved pages"):
        m.advance_prefill([0], [5])
    m.reclaim_prefill([0], heads(2, 2, 2, 2), heads(0, 0, 0, 0))
    with pytest.raises(ValueError, match="advance_prefill: request slot 0 is DECODING"):
        m.advance_prefill([0], [1])
    m.check_invariants()


def test_decode_takes_one_page_only_when_a_tier_is_exactly_full(m: PageManager) -> None:
    m.allocate_prefill([0], [12]).raise_if_failed()
    # heads: (l0h0) high full 4/2 pages, low 2/1 page not full; (l0h1) high 3/2 not full,
    # low full 3/1; (l1h0) nothing at all (0 == 0 pages: full); (l1h1) both not full.
    m.reclaim_prefill([0], heads(4, 3, 0, 1), heads(2, 3, 0, 1))
    free = int(m.num_free_pages())
    before = m.counts[0].clone()
    res = m.ensure_decode_room([0], torch.tensor([[True, True]]))
    res.raise_if_failed()
    got = m.counts[0, ..., 2:] - before[..., 2:]
    assert got.tolist() == [[[1, 0], [0, 1]], [[1, 1], [0, 0]]]
    assert int(res.needed) == 4 and int(m.num_free_pages()) == free - 4
    assert torch.equal(m.counts[0, ..., :2], before[..., :2])  # token counts untouched
    m.check_invariants()
    # Nothing is full any more after the new pages: a second call takes nothing.
    res = m.ensure_decode_room([0], torch.tensor([[True, True]]))
    assert int(res.needed) == 0 and int(m.num_free_pages()) == free - 4


def test_decode_respects_the_tier_mask(m: PageManager) -> None:
    m.allocate_prefill([0, 3], [4, 4]).raise_if_failed()
    zeros = heads(0, 0, 0, 0)
    m.reclaim_prefill([0, 3], torch.cat([zeros, zeros]), torch.cat([zeros, zeros]))
    res = m.ensure_decode_room([0, 3], torch.tensor([[True, False], [False, True]]))
    assert int(res.needed) == 8
    assert (m.counts[0, ..., 2:].reshape(-1, 2) == torch.tensor([1, 0])).all()
    assert (m.counts[3, ..., 2:].reshape(-1, 2) == torch.tensor([0, 1])).all()
    m.check_invariants()


def test_row_layout_after_prefill_reclaim_decode_and_appends(m: PageManager) -> None:
    m.allocate_prefill([3], [6]).raise_if_failed()  # 4 pages per row: rows [0-3] [4-7] ...
    m.reclaim_prefill([3], heads(2, 2, 2, 2), heads(3, 3, 3, 3))  # hp 1, lp 1, 2 returned
    assert m.table[3, 0, 0].tolist() == [0, -1, -1, -1, -1, -1, -1, 1]
    m.ensure_decode_room([3], torch.tensor([[True, True]])).raise_if_failed()
    # Both tiers full: high page 1 at position 1, low page 1 at position row_len - 2. The
    # ring gave back 2,3 | 6,7 | 10,11 | 14,15 after the 16 initial ids, so new pages are
    # 16.. in (layer, head, tier) order.
    assert m.table[3, 0, 0].tolist() == [0, 16, -1, -1, -1, -1, 17, 1]
    assert m.table[3, 1, 1].tolist() == [12, 22, -1, -1, -1, -1, 23, 13]
    m.add_tokens([3], torch.tensor([[1, 1]]))
    assert m.counts[3, 0, 0].tolist() == [3, 4, 2, 2]
    m.check_invariants()
    m.free_requests([3])
    assert (m.table[3] == -1).all() and (m.counts[3] == 0).all()
    assert int(m.num_free_pages()) == 40
    # Freed in (layer, head) order: high from the left, then low from the right.
    ring = m.free_pages.tolist()
    tail = int(m.tail)
    assert [ring[c % 40] for c in range(tail - 16, tail - 12)] == [0, 16, 1, 17]
    m.check_invariants()


def test_counters_wrap_the_ring_many_times() -> None:
    spec = MemorySpec(16, 2, 2, 2, 2, 3, max_context=6)
    m = PageManager(spec)
    for step in range(30):
        m.allocate_prefill([step % 2], [2 + step % 5]).raise_if_failed()
        m.reclaim_prefill([step % 2], heads(1, 0, 1, 1), heads(0, 1, 1, 0))
        m.ensure_decode_room([step % 2], torch.tensor([[True, True]])).raise_if_failed()
        m.check_invariants()
        m.free_requests([step % 2])
    assert int(m.head) > 10 * 16 and int(m.tail) - int(m.head) == 16
    assert sorted(m.free_pages.tolist()) == list(range(16))
    m.check_invariants()


# -- running out ----------------------------------------------------------------------------


def test_out_of_pages_is_a_no_op_and_names_needed_and_free(m: PageManager) -> None:
    m.allocate_prefill([0], [12]).raise_if_failed()  # 28 of 40
    before = m.snapshot()
    res = m.allocate_prefill([1, 2], [1, 1])  # 2 pages x 4 rows x 2 requests = 16 > 12
    assert not bool(res.ok)
    assert snapshot_equal(before, m.snapshot())
    with pytest.raises(OutOfPages, match="needed 16 pages but only 12 are free") as err:
        res.raise_if_failed()
    assert isinstance(err.value, RuntimeError) and (err.value.needed, err.value.free) == (16, 12)
    assert m.phase.tolist() == [Phase.PREFILLED, 0, 0, 0]
    m.check_invariants()


def test_decode_out_of_pages_is_a_no_op(m: PageManager) -> None:
    m.allocate_prefill([0], [12]).raise_if_failed()  # 7 pages per row
    m.reclaim_prefill([0], heads(12, 12, 12, 12), heads(0, 0, 0, 0))  # 6 kept, 16 free
    m.allocate_prefill([1], [5]).raise_if_failed()  # 4 pages per row: 0 free
    # High tiers are full and empty low tiers count as full: 8 pages needed.
    before = m.snapshot()
    res = m.ensure_decode_room([0], torch.tensor([[True, True]]))
    assert not bool(res.ok) and int(res.needed) == 8 and int(res.free) == 0
    assert snapshot_equal(before, m.snapshot())
    with pytest.raises(OutOfPages):
        res.raise_if_failed()


def test_row_full_raises_and_leaves_state_unchanged() -> None:
    spec = MemorySpec(64, 2, 2, 2, 2, 3, max_context=12)
    m = PageManager(spec)
    m.allocate_prefill([0], [2]).raise_if_failed()
    m.reclaim_prefill([0], heads(2, 2, 2, 2), heads(0, 0, 0, 0))
    for _ in range(5):  # 6 high pages holding 12 tokens
        m.ensure_decode_room([0], torch.tensor([[True, False]])).raise_if_failed()
        m.add_tokens([0], torch.tensor([[2, 0]]))
    m.ensure_decode_room([0], torch.tensor([[False, True]])).raise_if_failed()  # 1 low page
    m.add_tokens([0], torch.tensor([[-3, 3]]))  # demote 3: low full, 7 pages in the row
    m.ensure_decode_room([0], torch.tensor([[False, True]])).raise_if_failed()  # 8 == row_len
    m.add_tokens([0], torch.tensor([[-3, 3]]))
    assert m.counts[0, 0, 0].tolist() == [6, 6, 6, 2]
    before = m.snapshot()
    with pytest.raises(PageTableRowFull, match="row_len=8"):
        m.ensure_decode_room([0], torch.tensor([[False, True]]))
    assert snapshot_equal(before, m.snapshot())
    m.validate = False  # the sync-free path reports it through the result instead
    res = m.ensure_decode_room([0], torch.tensor([[False, True]]))
    assert not bool(res.ok) and not bool(res.rows_ok)
    assert snapshot_equal(before, m.snapshot())
    with pytest.raises(PageTableRowFull):
        res.raise_if_failed()
    m.check_invariants()


# -- boundary validation -------------------------------------------------------------------


def test_rejects_bad_request_slots(m: PageManager) -> None:
    with pytest.raises(ValueError, match=r"req_idx 4 is outside \[0, max_reqs=4\)"):
        m.allocate_prefill([4], [3])
    with pytest.raises(ValueError, match="req_idx 1 appears more than once"):
        m.allocate_prefill([1, 1], [3, 3])
    with pytest.raises(ValueError, match="must be 1-D"):
        m.allocate_prefill([[1]], [3])


def test_rejects_bad_lengths_and_phases(m: PageManager) -> None:
    with pytest.raises(ValueError, match=r"prompt length 13 is outside \[1, max_context=12\]"):
        m.allocate_prefill([0], [13])
    m.allocate_prefill([0], [5]).raise_if_failed()
    with pytest.raises(ValueError, match="slot 0 is PREFILLED, expected FREE"):
        m.allocate_prefill([0], [5])
    with pytest.raises(ValueError, match="slot 0 is PREFILLED, expected DECODING"):
        m.ensure_decode_room([0], torch.tensor([[True, True]]))
    with pytest.raises(ValueError, match="slot 2 is FREE"):
        m.free_requests([2])
    with pytest.raises(ValueError, match=r"n_high \+ n_low > prompt length .* layer 1, head 0"):
        m.reclaim_prefill([0], heads(1, 1, 5, 1), heads(0, 0, 1, 0))
    with pytest.raises(ValueError, match=r"n_high has shape \(1, 4\)"):
        m.reclaim_prefill([0], torch.zeros(1, 4), heads(0, 0, 0, 0))
    m.reclaim_prefill([0], heads(1, 1, 1, 1), heads(3, 0, 0, 0))
    with pytest.raises(ValueError, match="more tokens than its pages hold .* low tier: n=4"):
        m.add_tokens([0], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="negative token count"):
        m.add_tokens([0], torch.tensor([[-2, 0]]))
    m.check_invariants()


def test_set_counts_per_head(m: PageManager) -> None:
    m.allocate_prefill([0], [5]).raise_if_failed()
    m.reclaim_prefill([0], heads(2, 2, 2, 2), heads(3, 3, 3, 3))
    m.set_counts([0], torch.stack((heads(1, 2, 0, 1), heads(3, 0, 1, 2)), -1))
    assert m.counts[0, ..., :2].reshape(-1, 2).tolist() == [[1, 3], [2, 0], [0, 1], [1, 2]]
    m.check_invariants()


def test_sync_free_mode_matches_validated_mode() -> None:
    a, b = PageManager(SPEC), PageManager(SPEC, validate=False)
    for m in (a, b):
        m.allocate_prefill(torch.tensor([2, 0]), torch.tensor([7, 3]))
        m.reclaim_prefill([2, 0], torch.cat([heads(2, 5, 0, 7), heads(1, 1, 1, 1)]),
                          torch.cat([heads(5, 0, 3, 0), heads(2, 1, 0, 1)]))
        for _ in range(3):
            m.ensure_decode_room([0, 2], torch.tensor([[True, True], [True, False]]))
            m.add_tokens([0, 2], torch.tensor([[1, 0], [1, 0]]))
        m.free_requests([2])
    assert all(torch.equal(x, y) for x, y in zip(a.snapshot().values(), b.snapshot().values(),
                                                   strict=True))
    b.check_invariants()


def test_sync_free_mode_skips_slots_in_the_wrong_phase() -> None:
    m = PageManager(SPEC, validate=False)
    m.allocate_prefill([0], [12]).raise_if_failed()
    m.reclaim_prefill([0], heads(1, 1, 1, 1), heads(1, 1, 1, 1))
    assert not m.allocate_prefill([1, 2], [12, 12]).ok  # 56 pages > 32 free: slots stay FREE
    before = m.snapshot()
    m.reclaim_prefill([1, 0], torch.ones(2, 2, 2), torch.ones(2, 2, 2))  # neither PREFILLED
    m.ensure_decode_room([1], torch.tensor([[True, True]]))  # FREE: empty tiers look full
    m.add_tokens([1], torch.tensor([[1, 0]]))
    m.free_requests([2])
    assert m.allocate_prefill([0], [1]).ok  # ok, but slot 0 is busy: nothing taken
    assert snapshot_equal(before, m.snapshot())
    m.check_invariants()


def test_check_invariants_catches_corruption(m: PageManager) -> None:
    m.allocate_prefill([0], [5]).raise_if_failed()
    m.table[0, 1, 1, 0] = m.table[0, 0, 0, 0]
    with pytest.raises(AssertionError, match="page 0 is owned 2 times"):
        m.check_invariants()
    m = PageManager(SPEC)
    m.free_list.head += 1
    with pytest.raises(AssertionError, match="leaked"):
        m.check_invariants()
    m = PageManager(SPEC)
    m.table[1, 0, 0, 3] = 5
    with pytest.raises(AssertionError, match="position 3 should be -1"):
        m.check_invariants()

