"""Property-based tests: random op sequences against an exact pure-Python reference.

The reference keeps the free list as a FIFO deque and each (request, layer, head) row as two
Python lists, so it predicts not just counts but the exact page id at every table position
and ring slot (the prefix-sum order is part of the contract: flat (request, layer, head,
tier) order, high pages walked from the left, low from the right).
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from sglang_diffkv.memory import (
    CircularFreeList,
    MemorySpec,
    OutOfPages,
    PageManager,
    PageTableRowFull,
    Phase,
)

LAYERS, HEADS = 2, 2
Key = tuple[int, int, int]


class Reference:
    """Exact model of PageManager state in plain Python."""

    def __init__(self, spec: MemorySpec) -> None:
        self.spec = spec
        self.ring: deque[int] = deque(range(spec.num_pages))
        self.phase = [Phase.FREE] * spec.max_reqs
        keys = itertools.product(range(spec.max_reqs), range(LAYERS), range(HEADS))
        self.pages: dict[Key, tuple[list[int], list[int]]] = {k: ([], []) for k in keys}
        self.tokens: dict[Key, list[int]] = {k: [0, 0] for k in self.pages}

    @staticmethod
    def keys(r: int) -> list[Key]:
        return [(r, l, h) for l in range(LAYERS) for h in range(HEADS)]

    def slots(self, *phases: Phase) -> list[int]:
        return [r for r, p in enumerate(self.phase) if p in phases]

    def room(self, key: Key, t: int) -> int:
        return len(self.pages[key][t]) * self.spec.tokens_per_page[t] - self.tokens[key][t]

    def take(self, n: int) -> list[int]:
        return [self.ring.popleft() for _ in range(n)]

    def prefill(self, reqs: list[int], lens: list[int]) -> bool:
        if self.spec.pages_needed_for_prefill(lens) > len(self.ring):
            return False
        for r, length in zip(reqs, lens, strict=True):
            for key in self.keys(r):
                self.pages[key] = (self.take(self.spec.prefill_pages(length)), [])
                self.tokens[key] = [length, 0]
            self.phase[r] = Phase.PREFILLED
        return True

    def reclaim(self, reqs: list[int], n_high: list[list[int]], n_low: list[list[int]]) -> None:
        n_hi_page, n_lo_page = self.spec.tokens_per_page
        for r, nh_row, nl_row in zip(reqs, n_high, n_low, strict=True):
            for key, nh, nl in zip(self.keys(r), nh_row, nl_row, strict=True):
                run = self.pages[key][0]
                hp, lp = -(-nh // n_hi_page), -(-nl // n_lo_page)
                self.pages[key] = (run[:hp], run[hp:hp + lp])
                self.ring.extend(run[hp + lp:])
                self.tokens[key] = [nh, nl]
            self.phase[r] = Phase.DECODING

    def decode_plan(self, reqs: list[int], tiers: list[list[bool]]) -> list[tuple[Key, int]]:
        return [
            (key, t)
            for r, want in zip(reqs, tiers, strict=True)
            for key in self.keys(r)
            for t in (0, 1)
            if want[t] and self.room(key, t) == 0
        ]

    def rows_fit(self, plan: list[tuple[Key, int]]) -> bool:
        extra: dict[Key, int] = {}
        for key, _ in plan:
            extra[key] = extra.get(key, 0) + 1
        return all(
            len(self.pages[k][0]) + len(self.pages[k][1]) + n <= self.spec.row_len
            for k, n in extra.items()
        )

    def decode(self, plan: list[tuple[Key, int]]) -> bool:
        if not self.rows_fit(plan) or len(plan) > len(self.ring):
            return False
        for key, t in plan:
            self.pages[key][t].extend(self.take(1))
        return True

    def free(self, reqs: list[int]) -> None:
        for r in reqs:
            for key in self.keys(r):
                high, low = self.pages[key]
                self.ring.extend(high + low)
                self.pages[key] = ([], [])
                self.tokens[key] = [0, 0]
            self.phase[r] = Phase.FREE

    def table(self) -> torch.Tensor:
        row_len, rows = self.spec.row_len, []
        for high, low in self.pages.values():  # dict order is (request, layer, head)
            rows.append(high + [-1] * (row_len - len(high) - len(low)) + low[::-1])
        shape = (self.spec.max_reqs, LAYERS, HEADS, row_len)
        return torch.tensor(rows, dtype=torch.int32).view(shape)

    def counts(self) -> torch.Tensor:
        rows = [[*self.tokens[k], len(hi), len(lo)] for k, (hi, lo) in self.pages.items()]
        return torch.tensor(rows, dtype=torch.int32).view(self.spec.max_reqs, LAYERS, HEADS, 4)


def ring_contents(m: PageManager) -> list[int]:
    ring, n = m.free_pages.tolist(), m.spec.num_pages
    return [ring[c % n] for c in range(int(m.head), int(m.tail))]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def draw_digits(data: st.DataObject, base: int, n: int, label: str) -> list[int]:
    """n numbers in [0, base) from one drawn integer: one choice for Hypothesis instead of
    one per element, which keeps 200 state-machine examples fast; it still shrinks to 0s."""
    x = data.draw(st.integers(0, base**n - 1), label=label)
    digits = []
    for _ in range(n):
        x, d = divmod(x, base)
        digits.append(d)
    return digits


def subset(data: st.DataObject, slots: list[int]) -> list[int]:
    """A non-empty batch of distinct slots, rotated so batch order differs from slot order
    (two draws: cheaper than st.permutations, which draws once per element)."""
    mask = data.draw(st.integers(1, 2 ** len(slots) - 1), label="batch mask")
    chosen = [r for i, r in enumerate(slots) if mask >> i & 1]
    shift = data.draw(st.integers(0, len(chosen) - 1), label="rotation")
    return chosen[shift:] + chosen[:shift]


class PageManagerMachine(RuleBasedStateMachine):
    device = "cpu"  # test_memory_gpu reruns the machine with "cuda"
    m: PageManager
    ref: Reference

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        spec = MemorySpec(
            num_pages=data.draw(st.integers(16, 32) | st.integers(16, 64), label="num_pages"),
            max_reqs=data.draw(st.integers(4, 6), label="max_reqs"),
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            high_tokens_per_page=data.draw(st.integers(1, 4), label="N_high"),
            low_tokens_per_page=data.draw(st.integers(1, 6), label="N_low"),
            max_context=data.draw(st.integers(2, 12), label="max_context"),
        )
        validate = data.draw(st.booleans(), label="validate")
        self.m = PageManager(spec, self.device, validate=validate)
        self.ref = Reference(spec)
        # False whenever the state may differ from the last one matches_reference accepted.
        # Failed ops assert the state is bit-identical, so they keep it True.
        self.verified = False

    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        if self.ref.slots(Phase.FREE):
            self.do_prefill(data, subset(data, self.ref.slots(Phase.FREE)))

    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        if self.ref.slots(Phase.PREFILLED):
            self.do_reclaim(data, subset(data, self.ref.slots(Phase.PREFILLED)))

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Prefill and reclaim back to back, as one prefill forward pass does."""
        if self.ref.slots(Phase.FREE):
            reqs = subset(data, self.ref.slots(Phase.FREE))
            if self.do_prefill(data, reqs):
                self.do_reclaim(data, reqs)

    @rule(data=st.data())
    def churn(self, data: st.DataObject) -> None:
        """Short requests through a whole prefill/reclaim/free cycle, several times: pushes
        head and tail around the ring many times."""
        if not self.ref.slots(Phase.FREE):
            return
        reqs = subset(data, self.ref.slots(Phase.FREE))
        for _ in range(data.draw(st.integers(1, 4), label="cycles")):
            if not self.do_prefill(data, reqs):
                return
            self.do_reclaim(data, reqs)
            self.do_free(reqs)

    def do_prefill(self, data: st.DataObject, reqs: list[int]) -> bool:
        # Half the prompts short, so prefills succeed often enough to reach decode.
        top = self.m.spec.max_context
        length = st.integers(1, min(4, top)) | st.integers(1, top)
        lens = data.draw(st.lists(length, min_size=len(reqs), max_size=len(reqs)), label="lens")
        before = self.m.snapshot()
        res = self.m.allocate_prefill(torch.tensor(reqs), torch.tensor(lens))
        assert int(res.needed) == self.m.pages_needed_for_prefill(lens)
        assert int(res.free) == len(self.ref.ring)
        assert bool(res.ok) == self.ref.prefill(reqs, lens)
        if not bool(res.ok):
            assert same(before, self.m.snapshot())
            with pytest.raises(OutOfPages):
                res.raise_if_failed()
            return False
        self.verified = False
        return True

    def do_reclaim(self, data: st.DataObject, reqs: list[int]) -> None:
        n_high, n_low = [], []
        for r in reqs:
            prompt = self.ref.tokens[(r, 0, 0)][0]
            split = draw_digits(data, prompt + 1, 2 * LAYERS * HEADS, "split")
            n_high.append(split[0::2])
            pairs = zip(split[0::2], split[1::2], strict=True)
            n_low.append([min(nl, prompt - nh) for nh, nl in pairs])  # n_high + n_low <= L
        shape = (len(reqs), LAYERS, HEADS)
        self.m.reclaim_prefill(reqs, torch.tensor(n_high).view(shape),
                               torch.tensor(n_low).view(shape))
        self.ref.reclaim(reqs, n_high, n_low)
        self.verified = False

    @rule(data=st.data())
    def decode_steps(self, data: st.DataObject) -> None:
        """A few decode steps of one batch (decode is what most of a request's life is);
        admits a batch first when nothing is decoding yet."""
        if not self.ref.slots(Phase.DECODING):
            self.admit(data)
        if not self.ref.slots(Phase.DECODING):
            return
        reqs = subset(data, self.ref.slots(Phase.DECODING))
        for _ in range(data.draw(st.integers(1, 6), label="steps")):
            if not self.decode_once(data, reqs):
                return
            self.matches_reference()

    def decode_once(self, data: st.DataObject, reqs: list[int]) -> bool:
        """ensure_decode_room, then a random valid token update per head (append high or low,
        demote, evict, nothing), as the decode policy would do. False if the op failed."""
        bits = draw_digits(data, 2, 2 * len(reqs), "tiers")
        tiers = [[bool(bits[2 * i]), bool(bits[2 * i + 1])] for i in range(len(reqs))]
        plan = self.ref.decode_plan(reqs, tiers)
        before = self.m.snapshot()
        if self.m.validate and not self.ref.rows_fit(plan):
            with pytest.raises(PageTableRowFull):
                self.m.ensure_decode_room(reqs, torch.tensor(tiers))
            assert same(before, self.m.snapshot())
            return False
        res = self.m.ensure_decode_room(reqs, torch.tensor(tiers))
        self.verified = False
        assert int(res.needed) == len(plan) <= self.m.pages_needed_for_decode(len(reqs))
        assert bool(res.ok) == self.ref.decode(plan)
        if not bool(res.ok):
            assert same(before, self.m.snapshot())
            with pytest.raises(OutOfPages if bool(res.rows_ok) else PageTableRowFull):
                res.raise_if_failed()
            return False
        deltas = []
        for r in reqs:
            picks = draw_digits(data, 6, LAYERS * HEADS, "token updates")
            # Per (layer, head): an index into that head's currently valid updates.
            for key, pick in zip(self.ref.keys(r), picks, strict=True):
                nh, nl = self.ref.tokens[key]
                grow = nh + nl < self.m.spec.max_context
                choices = [(0, 0)]
                choices += [(1, 0)] if grow and self.ref.room(key, 0) else []
                choices += [(0, 1)] if grow and self.ref.room(key, 1) else []
                choices += [(-1, 1)] if nh and self.ref.room(key, 1) else []
                choices += [(-1, 0)] if nh else []
                choices += [(0, -1)] if nl else []
                d = choices[pick % len(choices)]
                self.ref.tokens[key] = [nh + d[0], nl + d[1]]
                deltas.append(d)
        self.m.add_tokens(reqs, torch.tensor(deltas).view(len(reqs), LAYERS, HEADS, 2))
        return True

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """An op on a slot in the wrong phase: validate=True raises naming the phase, the
        sync-free manager skips the slot on the device. Either way nothing changes."""
        r = data.draw(st.integers(0, self.m.spec.max_reqs - 1), label="slot")
        phase = self.ref.phase[r]
        ones = torch.ones(1, LAYERS, HEADS, dtype=torch.int64)
        wrong = {
            "allocate": lambda: self.m.allocate_prefill([r], [1]),
            "reclaim": lambda: self.m.reclaim_prefill([r], ones * 0, ones * 0),
            "decode": lambda: self.m.ensure_decode_room([r], torch.tensor([[True, True]])),
            "add": lambda: self.m.add_tokens([r], torch.tensor([[0, 0]])),
        }
        allowed = {Phase.FREE: ("allocate",), Phase.PREFILLED: ("reclaim",),
                   Phase.DECODING: ("decode", "add")}[phase]
        op = data.draw(st.sampled_from(sorted(set(wrong) - set(allowed))), label="wrong op")
        before = self.m.snapshot()
        if self.m.validate:
            with pytest.raises(ValueError, match=f"slot {r} is {phase.name}"):
                wrong[op]()
        else:
            wrong[op]()
        assert same(before, self.m.snapshot())

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        busy = self.ref.slots(Phase.PREFILLED, Phase.DECODING)
        if busy:
            self.do_free(subset(data, busy))

    def do_free(self, reqs: list[int]) -> None:
        self.m.free_requests(torch.tensor(reqs))
        self.ref.free(reqs)
        self.verified = False

    @invariant()
    def matches_reference(self) -> None:
        """Every page owned exactly once, and the exact state the reference predicts."""
        if self.verified:
            return
        self.m.check_invariants()
        assert torch.equal(self.m.table.cpu(), self.ref.table())
        assert torch.equal(self.m.counts.cpu(), self.ref.counts())
        assert self.m.phase.tolist() == [int(p) for p in self.ref.phase]
        assert ring_contents(self.m) == list(self.ref.ring)
        assert int(self.m.num_free_pages()) == len(self.ref.ring)
        self.m.num_free_pages_host()  # on CUDA this only enqueues a copy; the value is stale
        if self.m.device.type == "cuda":
            torch.cuda.synchronize()
        assert self.m.num_free_pages_host() == len(self.ref.ring)
        self.verified = True

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        busy = self.ref.slots(Phase.PREFILLED, Phase.DECODING)
        if busy:
            self.m.free_requests(busy)
            self.ref.free(busy)
        self.m.check_invariants()
        assert int(self.m.num_free_pages()) == self.m.spec.num_pages
        assert sorted(ring_contents(self.m)) == list(range(self.m.spec.num_pages))
        assert ring_contents(self.m) == list(self.ref.ring)


PageManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=20, deadline=None
)
TestPageManagerMachine = PageManagerMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(
    num_pages=st.integers(1, 24),
    ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 6), max_size=5)), max_size=30),
)
def test_free_list_is_a_fifo_over_the_ring(num_pages: int, ops: list) -> None:
    """take/give on the ring behave like a deque popped left and extended right, all or
    nothing, however often the counters wrap."""
    fl, ref = CircularFreeList(num_pages, "cpu"), deque(range(num_pages))
    owned: list[int] = []
    for is_take, counts in ops:
        if is_take:
            t = fl.take(torch.tensor(counts, dtype=torch.int64))
            assert bool(t.ok) == (sum(counts) <= len(ref))
            got = [fl.ids_at(t.start[i] + k).item() for i in range(len(counts))
                   for k in range(int(t.count[i]))]
            expect = [ref.popleft() for _ in range(sum(counts))] if bool(t.ok) else []
            assert got == expect
            owned += got
        else:
            back = [owned.pop() for _ in range(min(len(owned), sum(counts)))]
            start = fl.give(torch.tensor([len(back)]))
            fl.write(start + torch.arange(len(back)), torch.tensor(back, dtype=torch.int32),
                     torch.ones(len(back), dtype=torch.bool))
            ref.extend(back)
        ring = fl.free_pages.tolist()
        assert [ring[c % num_pages] for c in range(int(fl.head), int(fl.tail))] == list(ref)


@settings(max_examples=200, deadline=None)
@given(
    n_pages=st.tuples(st.integers(1, 5), st.integers(1, 8)),
    prompt=st.integers(1, 24),
    data=st.data(),
)
def test_reclaim_layout_for_any_split(n_pages: tuple[int, int], prompt: int,
                                      data: st.DataObject) -> None:
    """After reclaim, high page j is the j-th allocated page and low page j (at row_len-1-j)
    is the (hp + j)-th: the in-place reversal preserves the compressor's write order."""
    spec = MemorySpec(200, 1, 1, 1, n_pages[0], n_pages[1], max_context=24)
    m = PageManager(spec)
    m.allocate_prefill([0], [prompt]).raise_if_failed()
    run = m.table[0, 0, 0, : spec.prefill_pages(prompt)].tolist()
    nh = data.draw(st.integers(0, prompt))
    nl = data.draw(st.integers(0, prompt - nh))
    m.reclaim_prefill([0], torch.tensor([[[nh]]]), torch.tensor([[[nl]]]))
    hp, lp = -(-nh // n_pages[0]), -(-nl // n_pages[1])
    row = m.table[0, 0, 0].tolist()
    assert row[:hp] == run[:hp]
    assert [row[spec.row_len - 1 - j] for j in range(lp)] == run[hp:hp + lp]
    assert row[hp:spec.row_len - lp] == [-1] * (spec.row_len - hp - lp)
    returned, ring = run[hp + lp:], ring_contents(m)
    assert ring[len(ring) - len(returned):] == returned  # returned at the tail, in order
    m.check_invariants()
