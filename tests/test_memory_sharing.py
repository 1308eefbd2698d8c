"""Shared prefixes in the page manager: random sequences of admit / decode / export / attach /
free / release against an exact pure-Python model, with every invariant checked after each
step and every page free at the end.

The model predicts the exact page id at every table position and handle entry, the reference
count of every page and the exact ring order: fresh copy-on-write pages are taken in flat
(request, layer, head, tier) order; a free returns private pages first (per row, high pages
left to right past the shared ones, then low pages), then the shared pages whose count reached
zero in page-id order.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_memory_properties import draw_digits, ring_contents, same, subset

from sglang_diffkv.memory import MemorySpec, PageManager, PageTableRowFull, Phase

LAYERS, HEADS = 2, 2
Key = tuple[int, int, int]
Row = tuple[int, int]  # (layer, head)


class SharingModel:
    """Rows as two page lists each plus token and shared-page counts; handles as per-row
    page lists; reference counts derived from who holds what."""

    def __init__(self, spec: MemorySpec) -> None:
        self.spec = spec
        self.ring: deque[int] = deque(range(spec.num_pages))
        self.phase = [Phase.FREE] * spec.max_reqs
        keys = list(itertools.product(range(spec.max_reqs), range(LAYERS), range(HEADS)))
        self.pages: dict[Key, tuple[list[int], list[int]]] = {k: ([], []) for k in keys}
        self.tokens: dict[Key, list[int]] = {k: [0, 0] for k in keys}
        self.shared: dict[Key, list[int]] = {k: [0, 0] for k in keys}
        # handle key -> (num_tokens, {(layer, head): ((high pages, low pages), (n_hi, n_lo))})
        self.handles: dict[int, tuple[int, dict[Row, tuple[tuple[list[int], list[int]],
                                                          tuple[int, int]]]]] = {}

    @staticmethod
    def keys(r: int) -> list[Key]:
        return [(r, l, h) for l in range(LAYERS) for h in range(HEADS)]

    def slots(self, *phases: Phase) -> list[int]:
        return [r for r, p in enumerate(self.phase) if p in phases]

    def room(self, key: Key, t: int) -> int:
        return len(self.pages[key][t]) * self.spec.tokens_per_page[t] - self.tokens[key][t]

    def floor(self, key: Key, t: int) -> int:
        """Tokens of tier t the row can never lose: those of its shared pages."""
        return self.shared[key][t] * self.spec.tokens_per_page[t]

    def take(self, n: int) -> list[int]:
        return [self.ring.popleft() for _ in range(n)]

    def refs(self) -> list[int]:
        refs = [0] * self.spec.num_pages
        for key, (high, low) in self.pages.items():
            for t, run in enumerate((high, low)):
                for page in run[: self.shared[key][t]]:
                    refs[page] += 1
        for _, rows in self.handles.values():
            for (high, low), _ in rows.values():
                for page in high + low:
                    refs[page] += 1
        return refs

    # -- ops (each returns whether it succeeded, as the manager's ``ok``) --------------------

    def admit(self, reqs: list[int], lens: list[int], splits: list[list[tuple[int, int]]]
              ) -> bool:
        if self.spec.pages_needed_for_prefill(lens) > len(self.ring):
            return False
        for r, length, split in zip(reqs, lens, splits, strict=True):
            for key, (nh, nl) in zip(self.keys(r), split, strict=True):
                run = self.take(self.spec.prefill_pages(length))
                hp = -(-nh // self.spec.high_tokens_per_page)
                lp = -(-nl // self.spec.low_tokens_per_page)
                self.pages[key] = (run[:hp], run[hp:hp + lp])
                self.ring.extend(run[hp + lp:])
                self.tokens[key] = [nh, nl]
            self.phase[r] = Phase.DECODING
        return True

    def _parts(self, rows: list[tuple[int, ...]]) -> list[tuple[int, int]]:
        """(row index, tier) of every partial tier page, in flat order."""
        return [(i, t) for i, n in enumerate(rows) for t in (0, 1)
                if n[t] % self.spec.tokens_per_page[t]]

    def export(self, reqs: list[int], lens: list[int], keys: list[int]) -> bool:
        rows = [tuple(self.tokens[k]) for r in reqs for k in self.keys(r)]
        parts = self._parts(rows)
        ok = len(parts) <= len(self.ring)
        fresh = dict(zip(parts, self.take(len(parts)), strict=True)) if ok else {}
        i = 0
        for r, n, hkey in zip(reqs, lens, keys, strict=True):
            held = {}
            for key in self.keys(r):
                pages, toks = ([], []), (0, 0)
                if ok:
                    toks = tuple(self.tokens[key])
                    for t in (0, 1):
                        full = toks[t] // self.spec.tokens_per_page[t]
                        pages[t].extend(self.pages[key][t][:full])
                        pages[t].extend([fresh[i, t]] if (i, t) in fresh else [])
                        self.shared[key][t] = full
                held[key[1:]] = (pages, toks)
                i += 1
            self.handles[hkey] = (n, held)
        return ok

    def attach(self, reqs: list[int], hkeys: list[int]) -> bool:
        rows = [self.handles[hk][1][key[1:]][1] for r, hk in zip(reqs, hkeys, strict=True)
                for key in self.keys(r)]
        parts = self._parts(rows)
        if len(parts) > len(self.ring):
            return False
        fresh = dict(zip(parts, self.take(len(parts)), strict=True))
        i = 0
        for r, hk in zip(reqs, hkeys, strict=True):
            for key in self.keys(r):
                (high, low), toks = self.handles[hk][1][key[1:]]
                new = ([], [])
                for t, run in enumerate((high, low)):
                    full = toks[t] // self.spec.tokens_per_page[t]
                    new[t].extend(run[:full])
                    new[t].extend([fresh[i, t]] if (i, t) in fresh else [])
                    self.shared[key][t] = full
                self.pages[key] = new
                self.tokens[key] = list(toks)
                i += 1
            self.phase[r] = Phase.DECODING
        return True

    def _return_unheld(self, before: list[int]) -> None:
        after = self.refs()
        self.ring.extend(p for p in range(self.spec.num_pages) if before[p] and not after[p])

    def release(self, hkeys: list[int]) -> None:
        before = self.refs()
        for hk in hkeys:
            del self.handles[hk]
        self._return_unheld(before)

    def decode_plan(self, reqs: list[int], tiers: list[list[bool]]) -> list[tuple[Key, int]]:
        return [(key, t) for r, want in zip(reqs, tiers, strict=True) for key in self.keys(r)
                for t in (0, 1) if want[t] and self.room(key, t) == 0]

    def rows_fit(self, plan: list[tuple[Key, int]]) -> bool:
        extra: dict[Key, int] = {}
        for key, _ in plan:
            extra[key] = extra.get(key, 0) + 1
        return all(len(self.pages[k][0]) + len(self.pages[k][1]) + n <= self.spec.row_len
                   for k, n in extra.items())

    def decode(self, plan: list[tuple[Key, int]]) -> bool:
        if not self.rows_fit(plan) or len(plan) > len(self.ring):
            return False
        for key, t in plan:
            self.pages[key][t].extend(self.take(1))
        return True

    def free(self, reqs: list[int]) -> None:
        before = self.refs()
        for r in reqs:
            for key in self.keys(r):
                (high, low), (sh, sl) = self.pages[key], self.shared[key]
                self.ring.extend(high[sh:] + low[sl:])
                self.pages[key], self.tokens[key], self.shared[key] = ([], []), [0, 0], [0, 0]
            self.phase[r] = Phase.FREE
        self._return_unheld(before)

    # -- expected tensors ------------------------------------------------------------------

    def table(self) -> torch.Tensor:
        row_len, rows = self.spec.row_len, []
        for high, low in self.pages.values():  # dict order is (request, layer, head)
            rows.append(high + [-1] * (row_len - len(high) - len(low)) + low[::-1])
        return torch.tensor(rows, dtype=torch.int32).view(self.spec.max_reqs, LAYERS, HEADS,
                                                          row_len)

    def counts(self) -> torch.Tensor:
        rows = [[*self.tokens[k], len(hi), len(lo)] for k, (hi, lo) in self.pages.items()]
        return torch.tensor(rows, dtype=torch.int32).view(self.spec.max_reqs, LAYERS, HEADS, 4)

    def shared_table(self) -> torch.Tensor:
        return torch.tensor(list(self.shared.values()), dtype=torch.int32).view(
            self.spec.max_reqs, LAYERS, HEADS, 2)


class SharingMachine(RuleBasedStateMachine):
    device = "cpu"  # test_memory_gpu reruns the machine with "cuda"
    m: PageManager
    model: SharingModel

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        spec = MemorySpec(
            num_pages=data.draw(st.integers(20, 40) | st.integers(20, 80), label="num_pages"),
            max_reqs=data.draw(st.integers(4, 6), label="max_reqs"),
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            high_tokens_per_page=data.draw(st.integers(1, 4), label="N_high"),
            low_tokens_per_page=data.draw(st.integers(1, 6), label="N_low"),
            max_context=data.draw(st.integers(2, 14), label="max_context"),
        )
        self.m = PageManager(spec, self.device,
                             validate=data.draw(st.booleans(), label="validate"))
        self.model = SharingModel(spec)
        self.live: dict[int, object] = {}  # handle key -> the manager's handle

    def _admit(self, data: st.DataObject, reqs: list[int]) -> bool:
        top = self.m.spec.max_context
        lens = data.draw(st.lists(st.integers(1, min(5, top)) | st.integers(1, top),
                                  min_size=len(reqs), max_size=len(reqs)), label="lens")
        splits = []
        for length in lens:
            digits = draw_digits(data, length + 1, 2 * LAYERS * HEADS, "split")
            splits.append([(nh, min(nl, length - nh))
                           for nh, nl in zip(digits[0::2], digits[1::2], strict=True)])
        res = self.m.allocate_prefill(reqs, lens)
        assert bool(res.ok) == self.model.admit(reqs, lens, splits)
        if bool(res.ok):
            shape = (len(reqs), LAYERS, HEADS)
            nh = torch.tensor([[s[0] for s in row] for row in splits]).view(shape)
            nl = torch.tensor([[s[1] for s in row] for row in splits]).view(shape)
            self.m.reclaim_prefill(reqs, nh, nl)
        return bool(res.ok)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        if self.model.slots(Phase.FREE):
            self._admit(data, subset(data, self.model.slots(Phase.FREE)))

    @rule(data=st.data())
    def decode_steps(self, data: st.DataObject) -> None:
        """ensure_decode_room and random token updates that never drop below a row's
        shared tokens (the policy's guarantee); attaches first when nothing is decoding."""
        if not self.model.slots(Phase.DECODING):
            self.attach(data)
        if not self.model.slots(Phase.DECODING):
            return
        reqs = subset(data, self.model.slots(Phase.DECODING))
        for _ in range(data.draw(st.integers(1, 3), label="steps")):
            bits = draw_digits(data, 2, 2 * len(reqs), "tiers")
            tiers = [[bool(bits[2 * i]), bool(bits[2 * i + 1])] for i in range(len(reqs))]
            plan = self.model.decode_plan(reqs, tiers)
            before = self.m.snapshot()
            if self.m.validate and not self.model.rows_fit(plan):
                with pytest.raises(PageTableRowFull):
                    self.m.ensure_decode_room(reqs, torch.tensor(tiers))
                assert same(before, self.m.snapshot())
                return
            res = self.m.ensure_decode_room(reqs, torch.tensor(tiers))
            if not self.model.decode(plan):
                assert not bool(res.ok) and same(before, self.m.snapshot())
                return
            assert bool(res.ok)
            deltas = []
            picks = draw_digits(data, 6, len(reqs) * LAYERS * HEADS, "token updates")
            keys = [k for r in reqs for k in self.model.keys(r)]
            for key, pick in zip(keys, picks, strict=True):
                nh, nl = self.model.tokens[key]
                grow = nh + nl < self.m.spec.max_context
                high_down = nh > self.model.floor(key, 0)
                choices = [(0, 0)]
                choices += [(1, 0)] if grow and self.model.room(key, 0) else []
                choices += [(0, 1)] if grow and self.model.room(key, 1) else []
                choices += [(-1, 1)] if high_down and self.model.room(key, 1) else []
                choices += [(-1, 0)] if high_down else []
                choices += [(0, -1)] if nl > self.model.floor(key, 1) else []
                d = choices[pick % len(choices)]
                self.model.tokens[key] = [nh + d[0], nl + d[1]]
                deltas.append(d)
            self.m.add_tokens(reqs, torch.tensor(deltas).view(len(reqs), LAYERS, HEADS, 2))
            self.matches_model()

    @rule(data=st.data())
    def export(self, data: st.DataObject) -> None:
        """Admits a batch first when nothing is decoding (rules chain, so most examples reach
        sharing)."""
        if not self.model.slots(Phase.DECODING) and self.model.slots(Phase.FREE):
            self._admit(data, subset(data, self.model.slots(Phase.FREE)))
        if not self.model.slots(Phase.DECODING):
            return
        reqs = subset(data, self.model.slots(Phase.DECODING))
        lens = []
        for r in reqs:
            held = max(sum(self.model.tokens[k]) for k in self.model.keys(r))
            lens.append(data.draw(st.integers(held, self.m.spec.max_context), label="num"))
        handles, res, copies = self.m.export_prefix(reqs, lens)
        keys = [h.key for h in handles]
        assert bool(res.ok) == self.model.export(reqs, lens, keys)
        assert int(copies.mask.sum()) == (int(res.needed) if bool(res.ok) else 0)
        assert int(res.needed) <= self.m.spec.pages_needed_for_sharing(len(reqs))
        self.live.update(zip(keys, handles, strict=True))

    @rule(data=st.data())
    def attach(self, data: st.DataObject) -> None:
        if not self.live:
            self.export(data)
        if not self.live or not self.model.slots(Phase.FREE):
            return
        reqs = subset(data, self.model.slots(Phase.FREE))
        hkeys = [data.draw(st.sampled_from(sorted(self.live)), label="handle") for _ in reqs]
        before = self.m.snapshot()
        res, copies = self.m.attach_prefix(reqs, [self.live[k] for k in hkeys])
        ok = self.model.attach(reqs, hkeys)
        assert bool(res.ok) == ok
        assert int(res.needed) <= self.m.spec.pages_needed_for_sharing(len(reqs))
        if not ok:
            assert same(before, self.m.snapshot()) and not bool(copies.mask.any())

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.live:
            hkeys = subset(data, sorted(self.live))
            self.m.release_prefix([self.live.pop(k) for k in hkeys])
            self.model.release(hkeys)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        busy = self.model.slots(Phase.DECODING)
        if busy:
            reqs = subset(data, busy)
            self.m.free_requests(reqs)
            self.model.free(reqs)

    @rule(data=st.data())
    def evict_while_attached(self, data: st.DataObject) -> None:
        """Export, attach, evict the handle while its rows hold it, then finish some of the
        holders: the last holder's free returns the shared pages."""
        self.attach(data)
        if self.live:
            self.release(data)
        self.finish(data)

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """A released handle is refused whatever ``validate`` says (a host registry lookup);
        attach to a busy slot raises with validate and is skipped on the device without."""
        if self.live and self.model.slots(Phase.FREE):
            k = data.draw(st.sampled_from(sorted(self.live)), label="handle")
            gone = self.live.pop(k)
            self.m.release_prefix([gone])
            self.model.release([k])
            before = self.m.snapshot()
            with pytest.raises(ValueError, match="not a live shared prefix"):
                self.m.attach_prefix(self.model.slots(Phase.FREE)[:1], [gone])
            with pytest.raises(ValueError, match="not a live shared prefix"):
                self.m.release_prefix([gone])
            assert same(before, self.m.snapshot())
        busy = self.model.slots(Phase.DECODING)
        if self.live and busy:
            handle = self.live[min(self.live)]
            before = self.m.snapshot()
            if self.m.validate:
                with pytest.raises(ValueError, match="is DECODING, expected FREE"):
                    self.m.attach_prefix(busy[:1], [handle])
            else:
                res, copies = self.m.attach_prefix(busy[:1], [handle])
                assert not bool(copies.mask.any())
            assert same(before, self.m.snapshot())

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "m"):
            return
        m, model = self.m, self.model
        m.check_invariants()
        assert torch.equal(m.table.cpu(), model.table())
        assert torch.equal(m.counts.cpu(), model.counts())
        assert torch.equal(m.shared.cpu(), model.shared_table())
        assert m.refs.tolist() == model.refs()
        assert m.phase.tolist() == [int(p) for p in model.phase]
        assert ring_contents(m) == list(model.ring)
        assert sorted(m.handles) == sorted(model.handles)
        for key, (n, rows) in model.handles.items():
            h = m.handles[key]
            assert h.num_tokens == n
            for (layer, head), (pages, toks) in rows.items():
                assert tuple(h.n_tokens[layer, head].tolist()) == toks
                for t in (0, 1):
                    got = h.pages[layer, head, t].tolist()
                    assert got[:len(pages[t])] == pages[t]
                    assert set(got[len(pages[t]):]) <= {-1}

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        busy = self.model.slots(Phase.DECODING)
        if busy:
            self.m.free_requests(busy)
            self.model.free(busy)
        self.m.release_prefix(list(self.live.values()))
        self.model.release(list(self.live))
        self.matches_model()
        assert int(self.m.num_free_pages()) == self.m.spec.num_pages
        assert sorted(ring_contents(self.m)) == list(range(self.m.spec.num_pages))
        assert not self.m.refs.any() and not self.m.handles


SharingMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=20,
                                            deadline=None)
TestSharingMachine = SharingMachine.TestCase


def test_boundary_rule_on_one_row() -> None:
    """Tier by tier: full pages shared, the partial page copied (at export into the
    handle's page, at attach into the row's), counts and shared regions as documented."""
    spec = MemorySpec(num_pages=40, max_reqs=3, num_layers=1, num_kv_heads=1,
                      high_tokens_per_page=3, low_tokens_per_page=4, max_context=16)
    m = PageManager(spec)
    m.allocate_prefill([0], [15]).raise_if_failed()
    m.reclaim_prefill([0], torch.tensor([[[7]]]), torch.tensor([[[8]]]))  # 3+3+1 | 4+4
    high, low = m.table[0, 0, 0, :3].tolist(), m.table[0, 0, 0, -2:].flip(0).tolist()
    (h,), res, copies = m.export_prefix([0], [15])
    res.raise_if_failed()
    (copy_src,), (copy_dst,) = copies.src[copies.mask].tolist(), copies.dst[copies.mask].tolist()
    assert copy_src == high[2]  # only the high tier has a partial page (7 = 2 * 3 + 1)
    assert h.pages[0, 0, 0].tolist()[:3] == [*high[:2], copy_dst]
    assert h.pages[0, 0, 1].tolist()[:2] == low
    assert m.shared[0, 0, 0].tolist() == [2, 2]
    res, copies = m.attach_prefix([1], [h])
    res.raise_if_failed()
    assert copies.src[copies.mask].tolist() == [copy_dst]
    row = m.table[1, 0, 0].tolist()
    assert row[:2] == high[:2] and row[2] == copies.dst[copies.mask].item()
    assert row[-2:] == low[::-1]
    assert m.counts[1, 0, 0].tolist() == [7, 8, 3, 2]
    assert m.shared[1, 0, 0].tolist() == [2, 2]
    assert [m.refs[p].item() for p in high[:2] + low] == [3] * 4
    m.check_invariants()
    # a decode step appends after the partial page: nothing shared moves
    with pytest.raises(ValueError, match="fewer tokens than its shared pages hold"):
        m.add_tokens([1], torch.tensor([[-2, 0]]))
    m.free_requests([0, 1])
    assert [m.refs[p].item() for p in high[:2] + low] == [1] * 4  # the handle's alone
    m.release_prefix([h])
    m.check_invariants()
    assert int(m.num_free_pages()) == spec.num_pages


def test_export_that_does_not_fit_changes_nothing_and_yields_an_empty_handle() -> None:
    spec = MemorySpec(num_pages=8, max_reqs=2, num_layers=1, num_kv_heads=2,
                      high_tokens_per_page=2, low_tokens_per_page=2, max_context=6)
    m = PageManager(spec, validate=False)
    m.allocate_prefill([0], [5]).raise_if_failed()  # 4 pages per row: all 8 taken
    m.reclaim_prefill([0], torch.tensor([[[3, 3]]]), torch.tensor([[[1, 1]]]))  # 3 kept
    assert int(m.num_free_pages()) == 2
    before = m.snapshot()
    (h,), res, copies = m.export_prefix([0], [5])  # a partial page per row and tier: 4
    assert not bool(res.ok) and int(res.needed) == 4 and not bool(copies.mask.any())
    assert same(before, m.snapshot())
    assert not h.n_tokens.any() and bool((h.pages == -1).all())
    m.check_invariants()
    res, copies = m.attach_prefix([1], [h])  # an empty handle: an empty DECODING row
    assert bool(res.ok) and not bool(copies.mask.any()) and not m.counts[1].any()
    m.free_requests([0, 1])
    m.release_prefix([h])
    m.check_invariants()
    assert int(m.num_free_pages()) == spec.num_pages
