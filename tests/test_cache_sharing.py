"""Shared prefixes through the reference cache: a request attached to an exported prefix
attends exactly like the request that produced it, decode steps of requests sharing a prefix
never change a shared page's bytes, and the policy never picks a shared token."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.policy import DecodeAction, decode_step

D, HKV, GROUP, LAYERS = 64, 2, 3, 2
SCALE = D**-0.5
CFG = {"preset": "qwq-32b", "alpha_h": 2.0, "alpha_l": 0.6, "window": 4, "score_queries": 4}


def _cache(max_reqs: int = 4) -> CompressedKVCache:
    return CompressedKVCache(DiffKVConfig.from_dict(CFG), head_dim=D, num_layers=LAYERS,
                             num_kv_heads=HKV, num_pages=600, max_reqs=max_reqs,
                             max_context=256)


def _prefill(cache: CompressedKVCache, r: int, length: int, g: torch.Generator) -> None:
    req, lengths = torch.tensor([r]), torch.tensor([length])
    cache.begin_prefill(req, lengths).raise_if_failed()
    for layer in range(LAYERS):
        q = torch.randn(1, HKV * GROUP, length, D, generator=g)
        k = torch.randn(1, HKV, length, D, generator=g)
        v = torch.randn(1, HKV, length, D, generator=g)
        cache.prefill_layer(layer, req, lengths, q, k, v, SCALE)
    cache.end_prefill(req)


def _attend_all(cache: CompressedKVCache, reqs: list[int], q: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    """Each layer's output for every request of ``reqs`` on the same query per layer."""
    b = len(reqs)
    return [cache.decode_layer_attend(layer, reqs, q[layer].expand(b, -1, -1), SCALE).out
            for layer in range(LAYERS)]


class SharedBytes:
    """The bytes of every shared page (refs > 0), to check they never change while shared: a
    page with refs > 0 at two consecutive checks was shared throughout, since a count only
    falls back to zero when the page goes back to the free list."""

    def __init__(self, cache: CompressedKVCache) -> None:
        self.cache = cache
        self.take()

    def take(self) -> None:
        self.ids = torch.nonzero(self.cache.manager.refs).view(-1)
        self.bytes = self.cache.pages[self.ids].clone()

    def check(self) -> int:
        still = self.cache.manager.refs[self.ids] > 0
        assert torch.equal(self.cache.pages[self.ids[still]], self.bytes[still])
        self.take()
        return int(still.sum())


def _decode(cache: CompressedKVCache, reqs: list[int], pos: int, g: torch.Generator,
            seen: set[int]) -> None:
    """One decode step of ``reqs`` (all at position ``pos``) with checks: no decision names
    a shared slot, and every row keeps its shared tokens."""
    b = len(reqs)
    cache.begin_decode(reqs).raise_if_failed()
    positions = torch.full((b,), pos)
    for layer in range(LAYERS):
        k = torch.randn(b, HKV, D, generator=g) * 3
        v = torch.randn(b, HKV, D, generator=g)
        shared = cache.shared_tokens(layer, reqs)
        d = cache.decode_layer_store(layer, reqs, positions, k, v)
        moves = d.action != DecodeAction.APPEND_HIGH
        assert bool((~moves | (d.hmin >= shared[..., 0])).all())
        replace = d.action == DecodeAction.DEMOTE_REPLACE
        assert bool((~replace | (d.lmin >= shared[..., 1])).all())
        seen.update(d.action.view(-1).tolist())
        cache.decode_layer_attend(layer, reqs, torch.randn(b, HKV * GROUP, D, generator=g),
                                  SCALE)
    cnt = cache.counts[reqs].long()[..., :2]
    per_page = torch.tensor(cache.spec.tokens_per_page)
    assert bool((cnt >= cache.manager.shared[reqs].long() * per_page).all())


def test_attached_prefix_attends_like_its_exporter_and_shared_pages_never_change() -> None:
    cache = _cache()
    g = torch.Generator().manual_seed(11)
    prompt, steps = 150, 3
    _prefill(cache, 0, prompt, g)
    seen: set[int] = set()
    for s in range(steps):  # the exporter's own decode tokens enter the prefix too
        _decode(cache, [0], prompt + s, g, seen)
    length = prompt + steps
    q = [torch.randn(1, HKV * GROUP, D, generator=g) for _ in range(LAYERS)]
    before = _attend_all(cache, [0], q)

    (handle,), res = cache.export_prefix([0], [length])
    res.raise_if_failed()
    assert bool(cache.manager.shared[0].any())  # full pages shared in some row
    cache.attach_prefix([1, 2], [handle, handle]).raise_if_failed()
    cache.manager.check_invariants()
    for layer, out in enumerate(_attend_all(cache, [0, 1, 2], q)):
        assert torch.equal(out[1], out[0]) and torch.equal(out[2], out[0])
        torch.testing.assert_close(out[:1], before[layer], rtol=1e-6, atol=1e-6)
    # the same tokens (the exporter may hold a spare empty page from its decode room)
    assert torch.equal(cache.counts[1, ..., :2], cache.counts[0, ..., :2])
    assert torch.equal(cache.manager.shared[1], cache.manager.shared[0])

    shared = SharedBytes(cache)
    live = [0, 1, 2]
    for s in range(24):
        _decode(cache, live, length + s, g, seen)
        assert shared.check() > 0
        cache.manager.check_invariants()
        if s == 8:  # the exporter finishes: the handle and slots 1, 2 still hold the prefix
            cache.free([0])
            live = [1, 2]
        if s == 12:  # tree eviction while two requests still read the prefix
            cache.release_prefix([handle])
    # an attached request exports again: the new handle nests the old shared pages
    n = length + 24
    (again,), res = cache.export_prefix([1], [n])
    res.raise_if_failed()
    cache.attach_prefix([0], [again]).raise_if_failed()
    for out in _attend_all(cache, [1, 0], q):
        assert torch.equal(out[1], out[0])
    for s in range(6):
        _decode(cache, [0, 1, 2], n + s, g, seen)
        assert shared.check() > 0
        cache.manager.check_invariants()
    # compression ran on the private tokens all along
    assert {DecodeAction.DEMOTE_APPEND, DecodeAction.EVICT_HIGH} <= seen
    cache.free([0, 1, 2])
    cache.release_prefix([again])
    cache.manager.check_invariants()
    assert int(cache.manager.num_free_pages()) == cache.spec.num_pages
    assert not cache.manager.refs.any()


def test_copy_state_from_carries_the_sharing_state() -> None:
    a, b = _cache(), _cache()
    g = torch.Generator().manual_seed(3)
    _prefill(a, 0, 21, g)
    (h,), _ = a.export_prefix([0], [21])
    a.attach_prefix([1], [h]).raise_if_failed()
    b.copy_state_from(a)
    b.manager.check_invariants()
    b.free([0, 1])
    b.release_prefix([h])  # the handle's key is live in the copy too
    assert int(b.manager.num_free_pages()) == b.spec.num_pages


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_policy_with_shared_slots_acts_as_if_they_were_too_young(data: st.DataObject) -> None:
    """decode_step with shared_tokens s equals decode_step on the same row where the first
    s slots of each tier are inside the window (age 0): shared tokens are exactly never
    eligible, and everything else is decided as before."""
    b, h, c = 2, 2, 6
    window = data.draw(st.integers(1, 4), label="window")
    p = torch.tensor(data.draw(st.lists(st.integers(8, 20), min_size=b, max_size=b)))

    def tier(label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = torch.tensor(data.draw(st.lists(st.integers(0, c), min_size=b * h,
                                            max_size=b * h), label=f"n {label}")).view(b, h)
        shared = torch.tensor([data.draw(st.integers(0, int(x)), label=f"shared {label}")
                               for x in n.view(-1)]).view(b, h)
        score = torch.tensor(data.draw(st.lists(st.floats(0, 4, width=32), min_size=b * h * c,
                                                max_size=b * h * c), label=f"score {label}"))
        pos = torch.tensor(data.draw(st.lists(st.integers(0, 7), min_size=b * h * c,
                                              max_size=b * h * c), label=f"pos {label}"))
        return n, shared, score.view(b, h, c), pos.view(b, h, c).int()

    n_h, s_h, score_h, pos_h = tier("high")
    n_l, s_l, score_l, pos_l = tier("low")
    alpha_h = torch.tensor([data.draw(st.floats(0, 8), label="alpha_h")] * b)
    alpha_l = alpha_h * data.draw(st.floats(0, 1), label="alpha_l / alpha_h")
    slots = torch.arange(c)
    young_h = torch.where(slots < s_h[..., None], p[:, None, None].int(), pos_h)
    young_l = torch.where(slots < s_l[..., None], p[:, None, None].int(), pos_l)
    got = decode_step(score_h, pos_h, n_h, score_l, pos_l, n_l, p, alpha_h, alpha_l, window,
                      shared_tokens=torch.stack((s_h, s_l), -1))
    want = decode_step(score_h, young_h, n_h, score_l, young_l, n_l, p, alpha_h, alpha_l,
                       window)
    for name in ("action", "hmin", "lmin"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
