"""Page-manager ops behind radix prefix sharing: a prompt exported as a copy with its cut
counts, attached at a cut (shared or copied), and a suffix stored over the attached prefix
(``reserve_extend`` / ``reclaim_extend``). Random sequences check every invariant after each
op, the boundary rule page by page, and that every page is free at the end."""

from __future__ import annotations

import random

import pytest
import torch
from test_memory_properties import ring_contents

from sglang_diffkv.memory import MemorySpec, PageManager, Phase

LAYERS, HEADS = 2, 2


def _spec(num_pages: int = 400, n_high: int = 3, n_low: int = 5, ctx: int = 48) -> MemorySpec:
    return MemorySpec(num_pages=num_pages, max_reqs=6, num_layers=LAYERS, num_kv_heads=HEADS,
                      high_tokens_per_page=n_high, low_tokens_per_page=n_low,
                      max_context=ctx)


def _prefill(m: PageManager, r: int, length: int, rng: random.Random
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt of ``length`` tokens, each row split at random: returns (tiers [L, H,
    length] with 0 high / 1 low / 2 pruned, counts [L, H, 2])."""
    m.allocate_prefill([r], [length]).raise_if_failed()
    tiers = torch.tensor([[[rng.choice((0, 0, 1, 2)) for _ in range(length)]
                           for _ in range(HEADS)] for _ in range(LAYERS)])
    counts = torch.stack(((tiers == 0).sum(-1), (tiers == 1).sum(-1)), -1)
    m.reclaim_prefill([r], counts[None, ..., 0], counts[None, ..., 1])
    return tiers, counts


def _cuts(tiers: torch.Tensor, cut_len: int) -> torch.Tensor:
    """[L, H, C, 2]: each tier's tokens before every cut."""
    c = tiers.shape[-1] // cut_len
    hi = (tiers == 0).cumsum(-1)[..., cut_len - 1::cut_len][..., :c]
    lo = (tiers == 1).cumsum(-1)[..., cut_len - 1::cut_len][..., :c]
    return torch.stack((hi, lo), -1)


def _tier_pages(m: PageManager, r: int) -> list[list[tuple[list[int], list[int]]]]:
    c = m.counts[r]
    out = []
    for l in range(LAYERS):
        row = []
        for h in range(HEADS):
            t = m.table[r, l, h].tolist()
            hp, lp = int(c[l, h, 2]), int(c[l, h, 3])
            row.append((t[:hp], t[::-1][:lp]))
        out.append(row)
    return out


def test_copy_export_leaves_the_exporter_alone_and_copies_its_private_pages() -> None:
    rng = random.Random(0)
    m = PageManager(_spec())
    tiers, counts = _prefill(m, 0, 40, rng)
    before = m.snapshot()
    (h,), res, copies = m.export_prefix([0], [40], copy=True,
                                        cuts=_cuts(tiers, 8)[None], cut_len=8)
    res.raise_if_failed()
    for name in ("table", "counts", "shared", "phase"):
        assert torch.equal(before[name], getattr(m, name)), name
    assert torch.equal(h.n_tokens, counts.int())
    rows = _tier_pages(m, 0)
    src, dst = copies.src[copies.mask].tolist(), copies.dst[copies.mask].tolist()
    expect = [p for l in range(LAYERS) for hd in range(HEADS) for t in (0, 1)
              for p in rows[l][hd][t]]
    assert src == expect  # every page that holds tokens, in (layer, head, tier, page) order
    got = [p for l in range(LAYERS) for hd in range(HEADS) for t in (0, 1)
           for p in h.pages[l, hd, t].tolist() if p >= 0]
    assert got == dst
    assert int(res.needed) == len(dst)
    assert h.cuts.shape == (LAYERS, HEADS, 5, 2) and h.cut_len == 8
    assert torch.equal(h.cut_counts(40), counts.int())
    with pytest.raises(ValueError, match="no cut at position 12"):
        h.cut_counts(12)
    m.check_invariants()
    m.free_requests([0])
    m.release_prefix([h])
    m.check_invariants()
    assert int(m.num_free_pages()) == m.spec.num_pages


def test_an_export_that_would_eat_the_reserve_changes_nothing() -> None:
    rng = random.Random(1)
    m = PageManager(_spec(num_pages=60), validate=False)
    _prefill(m, 0, 40, rng)
    free = int(m.num_free_pages())
    before = m.snapshot()
    (h,), res, copies = m.export_prefix([0], [40], copy=True, keep_free=free)
    assert not bool(res.ok) and not bool(copies.mask.any())
    assert all(torch.equal(before[k], v) for k, v in m.snapshot().items())
    m.release_prefix([h])
    m.check_invariants()


@pytest.mark.parametrize("copy", [False, True])
def test_attach_at_a_cut_shares_its_full_pages_and_copies_the_boundary(copy: bool) -> None:
    rng = random.Random(2)
    m = PageManager(_spec())
    tiers, _ = _prefill(m, 0, 40, rng)
    (h,), res, _ = m.export_prefix([0], [40], copy=True, cuts=_cuts(tiers, 8)[None],
                                   cut_len=8)
    res.raise_if_failed()
    m.free_requests([0])
    for cut in (8, 16, 24, 40):
        n = h.cut_counts(cut)
        res, copies = m.attach_prefix([1], [h], n[None].long(), copy=copy)
        res.raise_if_failed()
        m.check_invariants()
        assert torch.equal(m.counts[1, ..., :2], n)
        srcs = iter(copies.src[copies.mask].tolist())
        dsts = iter(copies.dst[copies.mask].tolist())
        for l in range(LAYERS):
            for hd in range(HEADS):
                for t, per in enumerate(m.spec.tokens_per_page):
                    k, full = -(-int(n[l, hd, t]) // per), int(n[l, hd, t]) // per
                    mine = _tier_pages(m, 1)[l][hd][t]
                    theirs = h.pages[l, hd, t].tolist()[:k]
                    assert len(mine) == k
                    shared = 0 if copy else full
                    assert mine[:shared] == theirs[:shared]
                    for j in range(shared, k):  # copies, in page order
                        assert (next(srcs), next(dsts)) == (theirs[j], mine[j])
                    assert int(m.shared[1, l, hd, t]) == shared
        m.free_requests([1])
        m.check_invariants()
    m.release_prefix([h])
    assert int(m.num_free_pages()) == m.spec.num_pages


def test_reserve_and_reclaim_extend_lay_out_a_suffix_after_an_attached_prefix() -> None:
    rng = random.Random(3)
    spec = _spec()
    m = PageManager(spec)
    tiers, _ = _prefill(m, 0, 24, rng)
    (h,), res, _ = m.export_prefix([0], [24], copy=True, cuts=_cuts(tiers, 8)[None],
                                   cut_len=8)
    m.free_requests([0])
    n = h.cut_counts(16)
    m.attach_prefix([1], [h], n[None].long()).__getitem__(0).raise_if_failed()
    before = _tier_pages(m, 1)
    counts = m.counts[1].clone()
    free = int(m.num_free_pages())
    m.reserve_extend([1], [20]).raise_if_failed()
    k = spec.prefill_pages(20)
    assert int(m.num_free_pages()) == free - k * LAYERS * HEADS
    assert torch.equal(m.counts[1, ..., 2], counts[..., 2] + k)
    run = _tier_pages(m, 1)
    for l in range(LAYERS):
        for hd in range(HEADS):
            assert run[l][hd][0][:len(before[l][hd][0])] == before[l][hd][0]
            assert run[l][hd][1] == before[l][hd][1]
    m.check_invariants()
    # the suffix splits 20 tokens per row at random; reclaim keeps what they need
    add = torch.tensor([[[rng.randint(0, 20) for _ in range(2)] for _ in range(HEADS)]
                        for _ in range(LAYERS)])
    add[..., 1] = torch.minimum(add[..., 1], 20 - add[..., 0])
    nh, nl = n[..., 0].long() + add[..., 0], n[..., 1].long() + add[..., 1]
    m.reclaim_extend([1], nh[None], nl[None])
    m.check_invariants()
    after = _tier_pages(m, 1)
    for l in range(LAYERS):
        for hd in range(HEADS):
            hp = -(-int(nh[l, hd]) // spec.high_tokens_per_page)
            lp = -(-int(nl[l, hd]) // spec.low_tokens_per_page)
            old_lp = len(before[l][hd][1])
            high, low = after[l][hd]
            assert high == run[l][hd][0][:hp]
            # new low page i is the high run's page hp + i (where the store wrote it)
            assert low == before[l][hd][1] + run[l][hd][0][hp:hp + lp - old_lp]
    assert torch.equal(m.counts[1, ..., 0], nh.int()) and torch.equal(m.counts[1, ..., 1],
                                                                       nl.int())
    m.free_requests([1])
    m.release_prefix([h])
    m.check_invariants()
    assert sorted(ring_contents(m)) == list(range(spec.num_pages))


@pytest.mark.parametrize("seed", range(6))
def test_random_prompts_cut_attach_extend_release(seed: int) -> None:
    """Random prefills exported with cuts, attached at random cuts (shared or copied),
    suffixes reserved and reclaimed at random splits, some of them exported again (a handle
    over an attached prefix), handles truncated to an earlier cut, frees and releases in
    random order: invariants after every op, and every page free once everything is let
    go."""
    rng = random.Random(seed)
    cut_len = rng.choice((4, 8))
    spec = _spec(num_pages=rng.choice((150, 400)), n_high=rng.randint(2, 5),
                 n_low=rng.randint(3, 7))
    m = PageManager(spec, validate=rng.random() < 0.5)
    live: dict[int, object] = {}
    tiers_of: dict[int, torch.Tensor] = {}  # handle key -> its tiers in position order
    for _ in range(40):
        free_slots = [r for r in range(1, spec.max_reqs) if int(m.phase[r]) == Phase.FREE]
        busy = [r for r in range(1, spec.max_reqs) if int(m.phase[r]) == Phase.DECODING]
        op = rng.random()
        if free_slots and (op < 0.3 or not live):
            r = rng.choice(free_slots)
            length = rng.randint(1, 40)
            if spec.pages_needed_for_prefill([length]) > int(m.num_free_pages()):
                continue
            tiers, _ = _prefill(m, r, length, rng)
            (h,), res, copies = m.export_prefix([r], [length], copy=True,
                                                cuts=_cuts(tiers, cut_len)[None],
                                                cut_len=cut_len)
            if bool(res.ok):
                live[h.key], tiers_of[h.key] = h, tiers
            else:
                m.release_prefix([h])
        elif free_slots and op < 0.65:
            key = rng.choice(sorted(live))
            h = live[key]
            if h.num_tokens < cut_len:
                continue
            cut = cut_len * rng.randint(1, h.num_tokens // cut_len)
            r = rng.choice(free_slots)
            res, _ = m.attach_prefix([r], [h], h.cut_counts(cut)[None].long(),
                                     copy=rng.random() < 0.3)
            m.check_invariants()
            if not bool(res.ok):
                continue
            suffix = rng.randint(1, spec.max_context - cut)
            res = m.reserve_extend([r], [suffix])
            if not bool(res.ok):
                m.free_requests([r])
                continue
            # the suffix's tiers, appended to the cut's
            tail = torch.tensor([[[rng.choice((0, 1, 2)) for _ in range(suffix)]
                                  for _ in range(HEADS)] for _ in range(LAYERS)])
            tiers = torch.cat((tiers_of[key][..., :cut], tail), -1)
            nh, nl = (tiers == 0).sum(-1), (tiers == 1).sum(-1)
            m.reclaim_extend([r], nh[None], nl[None])
            m.check_invariants()
            if rng.random() < 0.5:  # export it too: a handle over an attached prefix
                (h2,), res, _ = m.export_prefix([r], [cut + suffix], copy=True,
                                                cuts=_cuts(tiers, cut_len)[None],
                                                cut_len=cut_len)
                if bool(res.ok):
                    live[h2.key], tiers_of[h2.key] = h2, tiers
                else:
                    m.release_prefix([h2])
        elif live and op < 0.72:  # a tree evicted a prompt's deeper part: truncate it
            key = rng.choice(sorted(live))
            h = live[key]
            if h.num_tokens // cut_len >= 2:
                keep = cut_len * rng.randint(1, h.num_tokens // cut_len - 1)
                free = int(m.num_free_pages())
                short = m.truncate_prefix(h, keep)
                assert short.key == key and short.num_tokens == keep
                assert torch.equal(short.n_tokens, h.cut_counts(keep))
                assert int(m.num_free_pages()) >= free
                live[key] = short
        elif busy and op < 0.85:
            m.free_requests(rng.sample(busy, rng.randint(1, len(busy))))
        elif live:
            gone = rng.sample(sorted(live), rng.randint(1, len(live)))
            m.release_prefix([live.pop(k) for k in gone])
        m.check_invariants()
    busy = [r for r in range(spec.max_reqs) if int(m.phase[r]) != Phase.FREE]
    if busy:
        m.free_requests(busy)
    m.release_prefix(list(live.values()))
    m.check_invariants()
    assert int(m.num_free_pages()) == spec.num_pages
    assert not m.refs.any() and not m.handles
