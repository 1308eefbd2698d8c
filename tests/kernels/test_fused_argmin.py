"""The fused eligible argmin (``decode_hint``): the decode merge pass leaves each row's argmin
for the next step and the policy kernel takes it where the record's stamp is valid.

Two kernel-path caches run the same scripted serving life (``DiffKVOps`` with and without
``fused_argmin``, the latter with each of the merge pass's fills, "loop" and "pass"):
prefill, decode steps, a shared prefix exported mid-decode and attached
to a fresh slot, a retraction whose slot is reused by a prompt that starts decoding at the
very position the old record was armed for, a step taken by the torch reference path, and
prompts shorter than the window. At every policy step both paths' decisions must equal the
torch reference's (``policy.decode_step`` through ``decode_policy_step_reference``, shared
bounds included) on the same state, and the two caches' pages and counters stay identical;
after every merge pass each armed record's keys must equal the reference argmin for the
next position on the pages the merge just wrote. The records are poisoned (random words)
before the first step, and the test counts the rows whose record the kernel used, so a
path that always fell back to the scan would fail.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_diffkv import decode_hint
from sglang_diffkv.cache import CompressedKVCache, _tier_scores
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.kernels.decode_policy import decode_policy_step, decode_policy_step_reference
from sglang_diffkv.policy import _eligible_argmin
from sglang_diffkv.sglang.ops import DiffKVOps, fused_argmin_fill

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
D, HKV, GROUP, LAYERS, MAX_REQS = 64, 2, 2, 2, 6
SCALE = D**-0.5


def config(bench: tuple[float, float, float] | None) -> DiffKVConfig:
    cfg = {"preset": "llama-3-8b", "alpha_h": 1.2, "alpha_l": 0.6, "window": 4,
           "score_queries": 4}
    if bench is not None:
        cfg["bench_mix"] = list(bench)
    return DiffKVConfig.from_dict(cfg)


def per_page(cache: CompressedKVCache) -> torch.Tensor:
    return torch.tensor(cache.spec.tokens_per_page, device=cache.device)


class Pair:
    """The scan path and the fused path on copies of one state, driven identically."""

    def __init__(self, bench, seed: int, fill: str = "loop") -> None:
        self.cfg = config(bench)
        self.g = torch.Generator().manual_seed(seed)
        self.caches = [CompressedKVCache(self.cfg, head_dim=D, num_layers=LAYERS,
                                         num_kv_heads=HKV, num_pages=900, max_reqs=MAX_REQS,
                                         max_context=400, device=DEV) for _ in range(2)]
        noise = torch.randint(0, 256, self.caches[0].pages.shape, generator=self.g,
                              dtype=torch.uint8)
        for c in self.caches:
            c.pages.copy_(noise)
        self.scan = DiffKVOps(self.caches[0], use_kernels=True, fused_argmin=False)
        self.fused = DiffKVOps(self.caches[1], use_kernels=True, fused_argmin=fill)
        assert self.scan.hints is None and self.fused.hints is not None
        assert self.fused.hint_fill == fill
        # records start as garbage: only the protocol may make one valid
        self.fused.hints.copy_(torch.randint(-(1 << 62), 1 << 62, self.fused.hints.shape,
                                             generator=self.g).to(DEV))
        self.used = 0  # rows whose record the fused policy step took
        self.rows = 0
        self.seen: set[int] = set()

    @property
    def fc(self) -> CompressedKVCache:
        return self.caches[1]

    def same_state(self) -> None:
        a, b = self.caches
        assert torch.equal(a.pages, b.pages)
        assert torch.equal(a.manager.counts, b.manager.counts)
        assert torch.equal(a.manager.table, b.manager.table)

    def prefill(self, slots: list[int], lengths: list[int]) -> None:
        req, lens = torch.tensor(slots, device=DEV), torch.tensor(lengths, device=DEV)
        lmax = max(lengths)
        qkv = [[torch.randn(len(slots), h, lmax, D, generator=self.g).to(DEV) for h in
                (HKV * GROUP, HKV, HKV)] for _ in range(LAYERS)]
        for c in self.caches:
            c.begin_prefill(req, lens).raise_if_failed()
            for layer in range(LAYERS):
                c.prefill_layer(layer, req, lens, *qkv[layer], SCALE)
            c.end_prefill(req)
        self.same_state()

    def reference_argmin(self, req: torch.Tensor, layer: int, p: torch.Tensor):
        """(h_avg, hmin, l_avg, lmin) for position p over the fused cache's state."""
        c = self.fc
        rows, cnt = c.manager.table[req, layer], c.counts[req, layer].long()
        first = c.manager.shared[req, layer].long() * per_page(c)
        out = []
        for tier in (0, 1):
            _, score, pos = _tier_scores(c.pages, c.geometry, rows, cnt[..., tier], tier)
            out += _eligible_argmin(score, pos, cnt[..., tier], p, self.cfg.window,
                                    first[..., tier])
        return out

    def decode(self, slots: list[int], positions: list[int], expect_valid=None) -> None:
        """One kernel-path decode step of every layer on both caches, checked.
        ``expect_valid``: per batch row, whether its records must be valid (None: any)."""
        req, pos = torch.tensor(slots, device=DEV), torch.tensor(positions, device=DEV)
        b = len(slots)
        for c in self.caches:
            c.begin_decode(req).raise_if_failed()
        seq = int(pos.max()) + 1
        steps = [o.begin_decode_step(req, pos, seq) for o in (self.scan, self.fused)]
        mix = self.cfg.bench_mix
        for layer in range(LAYERS):
            k, v, q = (torch.randn(b, h, D, generator=self.g).bfloat16().to(DEV)
                       for h in (HKV, HKV, HKV * GROUP))
            fc = self.fc
            ref_pages, ref_counts = fc.pages.clone(), fc.manager.counts.clone()
            want = decode_policy_step_reference(
                ref_pages, fc.geometry, fc.manager.table, ref_counts, req, layer, pos,
                fc.alpha[req], self.cfg.window, k, v,
                bench=None if mix is None else (fc.bench_seed[req], mix),
                shared=fc.manager.shared)
            first = fc.manager.shared[req, layer].long() * per_page(fc)
            valid = decode_hint.valid(self.fused.hints[req, layer], fc.counts[req, layer],
                                      first, pos, self.cfg.window)
            if expect_valid is not None:
                exp = torch.tensor(expect_valid, device=DEV)[:, None].expand_as(valid)
                assert torch.equal(valid, exp), (layer, valid, exp)
            self.used += int(valid.sum())
            self.rows += valid.numel()
            for ops, step in zip((self.scan, self.fused), steps, strict=True):
                ops.decode_store(layer, req, pos, k, v, step=step)
                got = step.policy
                assert torch.equal(got.action, want.action.to(torch.int8)), layer
                assert torch.equal(got.hmin, want.hmin) and torch.equal(got.lmin, want.lmin)
                assert torch.equal(ops.cache.pages, ref_pages)
                assert torch.equal(ops.cache.manager.counts, ref_counts)
            self.seen.update(want.action.flatten().tolist())
            outs = [o.decode_attend(layer, req, q, SCALE, step=s)
                    for o, s in zip((self.scan, self.fused), steps, strict=True)]
            assert torch.equal(outs[0], outs[1])
            self.same_state()
            # the merge pass left, per armed row, the reference argmin for p + 1
            st = decode_hint.stamps(self.fused.hints[req, layer])
            assert torch.equal(st[..., decode_hint.ST_P].long(), (pos + 1)[:, None].expand(b, HKV))
            assert torch.equal(st[..., decode_hint.ST_DONE], st[..., decode_hint.ST_P])
            h_avg, hmin, l_avg, lmin = self.reference_argmin(req, layer, pos + 1)
            kh, kl = self.fused.hints[req, layer, :, 0], self.fused.hints[req, layer, :, 1]
            for (avg, slot), (w_avg, w_slot) in zip(
                    (decode_hint.unpack_key(kh), decode_hint.unpack_key(kl)),
                    ((h_avg, hmin), (l_avg, lmin)), strict=True):
                assert torch.equal(slot, w_slot), layer
                fin = w_slot >= 0
                assert torch.equal(avg[fin], w_avg[fin].float()), layer

    def reference_step(self, slots: list[int], positions: list[int]) -> None:
        """One decode step through the torch reference path on both caches (no record is
        armed or filled)."""
        req, pos = torch.tensor(slots, device=DEV), torch.tensor(positions, device=DEV)
        b = len(slots)
        for c in self.caches:
            c.begin_decode(req).raise_if_failed()
        for layer in range(LAYERS):
            k, v, q = (torch.randn(b, h, D, generator=self.g).to(DEV)
                       for h in (HKV, HKV, HKV * GROUP))
            for c in self.caches:
                c.decode_layer_store(layer, req, pos, k, v)
                c.decode_layer_attend(layer, req, q, SCALE)
        self.same_state()


@pytest.mark.parametrize("fill", ["loop", "pass"])
@pytest.mark.parametrize("bench", [None, (0.3, 0.5, 0.2)])
def test_fused_argmin_through_a_serving_life(bench, fill):
    pair = Pair(bench, seed=31 if bench is None else 32, fill=fill)
    # three prompts, one shorter than the window (nothing eligible, append only)
    slots, lens = [3, 0, 1], [70, 160, 2]
    pair.prefill(slots, lens)
    pos = list(lens)
    for t in range(3):
        pair.decode(slots, pos, expect_valid=[t > 0] * 3)
        pos = [p + 1 for p in pos]

    # slot 0 exports its rows mid-decode (its shared bounds grow: its records go stale where
    # a tier gained shared pages) and a fresh slot 2 attaches the prefix
    handles = []
    for c in pair.caches:
        (h,), res = c.export_prefix([0], [pos[1]])
        res.raise_if_failed()
        c.attach_prefix([2], [h]).raise_if_failed()
        handles.append(h)
    assert bool(pair.fc.manager.shared[0].any()) and bool(pair.fc.manager.shared[2].any())
    slots, pos = slots + [2], pos + [pos[1]]
    shared_ids = torch.nonzero(pair.fc.manager.refs).view(-1)
    shared_bytes = pair.fc.pages[shared_ids].clone()
    for t in range(3):
        pair.decode(slots, pos, expect_valid=None if t == 0 else [True] * 4)
        pos = [p + 1 for p in pos]
    # the kernel path leaves a shared prefix's bytes (scores included) as they are
    assert torch.equal(pair.fc.pages[shared_ids], shared_bytes)

    # slot 1 is retracted; a new prompt reuses the slot and starts decoding at the position
    # its old record was armed for (only the slot invalidation tells them apart)
    armed = decode_hint.stamps(pair.fused.hints[1])[..., decode_hint.ST_P]
    assert bool((armed == pos[2]).all())
    for c in pair.caches:
        c.free([1])
    assert bool((decode_hint.stamps(pair.fused.hints[1]) == -1).all())
    pair.prefill([1], [pos[2]])
    pair.decode(slots, pos, expect_valid=[True, True, False, True])
    pos = [p + 1 for p in pos]

    # a step taken by the torch reference path: the next kernel step scans everywhere
    pair.reference_step(slots, pos)
    pos = [p + 1 for p in pos]
    pair.decode(slots, pos, expect_valid=[False] * 4)
    pos = [p + 1 for p in pos]
    pair.decode(slots, pos, expect_valid=[True] * 4)
    # a request leaves the batch: the others' records are indexed by slot, not batch row
    pos = [p + 1 for p in pos]
    pair.decode([slots[0], slots[3], slots[2]], [pos[0], pos[3], pos[2]],
                expect_valid=[True] * 3)

    assert pair.used > pair.rows // 2, (pair.used, pair.rows)
    if bench is None:
        assert len(pair.seen) >= 3, pair.seen


def _one_policy_step(cache, req, pos, hints, g):
    b = req.shape[0]
    k = torch.randn(b, HKV, D, generator=g).bfloat16().to(DEV)
    v = torch.randn(b, HKV, D, generator=g).bfloat16().to(DEV)
    return decode_policy_step(cache.pages, cache.geometry, cache.manager.table,
                              cache.manager.counts, req, 0, pos, cache.alpha[req],
                              cache.config.window, k, v, shared=cache.manager.shared,
                              hints=hints)


@pytest.mark.parametrize("fill", ["loop", "pass"])
def test_valid_record_is_what_the_policy_takes_and_a_missing_merge_is_caught(fill):
    """A valid record's keys decide (a tampered slot shows up in hmin), and a record whose
    merge never ran (two policy steps in a row) is not used."""
    pair = Pair(None, seed=5, fill=fill)
    slots, lens = [4, 1], [90, 120]
    pair.prefill(slots, lens)
    pair.decode(slots, lens)
    pair.decode(slots, [n + 1 for n in lens], expect_valid=[True, True])
    c, hints = pair.fc, pair.fused.hints
    req, pos = (torch.tensor(slots, device=DEV),
                torch.tensor([n + 2 for n in lens], device=DEV))
    c.begin_decode(req).raise_if_failed()
    first = c.manager.shared[req, 0].long() * per_page(c)
    assert bool(decode_hint.valid(hints[req, 0], c.counts[req, 0], first, pos, 4).all())
    # tamper: the high key of row (slot 4, head 0) names slot 0 with avg 0
    hints[4, 0, 0, 0] = 0
    g = torch.Generator().manual_seed(6)
    d = _one_policy_step(c, req, pos, hints, g)
    assert int(d.hmin[0, 0]) == 0 and int(d.hmin[1, 0]) >= -1
    # the record is re-armed for pos + 1 (DONE -1): a second policy step with no merge pass
    # between matches it in every field but DONE, so it must scan, and equal the reference
    pos2 = pos + 1
    c.begin_decode(req).raise_if_failed()
    first = c.manager.shared[req, 0].long() * per_page(c)
    st = decode_hint.stamps(hints[req, 0])
    assert bool((st[..., decode_hint.ST_DONE] == -1).all())
    assert bool((st[..., decode_hint.ST_P].long() == pos2[:, None]).all())
    assert torch.equal(st[..., decode_hint.ST_NH], c.counts[req, 0, :, 0])
    assert not bool(decode_hint.valid(hints[req, 0], c.counts[req, 0], first, pos2, 4).any())
    ref_pages, ref_counts = c.pages.clone(), c.manager.counts.clone()
    g1, g2 = (torch.Generator().manual_seed(7) for _ in range(2))
    d = _one_policy_step(c, req, pos2, hints, g1)
    kk = torch.randn(2, HKV, D, generator=g2).bfloat16().to(DEV)
    vv = torch.randn(2, HKV, D, generator=g2).bfloat16().to(DEV)
    want = decode_policy_step_reference(ref_pages, c.geometry, c.manager.table, ref_counts,
                                        req, 0, pos2, c.alpha[req], 4, kk, vv,
                                        shared=c.manager.shared)
    assert torch.equal(d.hmin, want.hmin) and torch.equal(d.lmin, want.lmin)
    assert torch.equal(d.action, want.action.to(torch.int8))
    assert torch.equal(c.pages, ref_pages) and torch.equal(c.manager.counts, ref_counts)


def test_switch_reads_the_environment():
    assert fused_argmin_fill({}) is None
    with pytest.raises(ValueError):
        fused_argmin_fill({"SGLANG_DIFFKV_FUSED_ARGMIN": "maybe"})
    for v, fill in (("1", "loop"), ("on", "loop"), ("loop", "loop"), ("2", "pass"),
                    ("pass", "pass"), ("0", None), ("off", None)):
        assert fused_argmin_fill({"SGLANG_DIFFKV_FUSED_ARGMIN": v}) == fill
    # the reference path never allocates records
    cache = CompressedKVCache(config(None), head_dim=D, num_layers=1, num_kv_heads=HKV,
                              num_pages=50, max_reqs=2, max_context=64)
    assert DiffKVOps(cache, use_kernels=False, fused_argmin=True).hints is None
    assert DiffKVOps(cache, use_kernels=False, fused_argmin="pass").hints is None
    with pytest.raises(ValueError, match="fused_argmin"):
        DiffKVOps(cache, use_kernels=False, fused_argmin="fast")
    with pytest.raises(ValueError, match="argmin must be 'scan'"):
        decode_policy_step(cache.pages, cache.geometry, cache.manager.table,
                           cache.manager.counts, torch.tensor([0]), 0, torch.tensor([5]),
                           torch.ones(1, 2), 4, torch.zeros(1, HKV, D), torch.zeros(1, HKV, D),
                           argmin="parallel", hints=cache.manager.enable_decode_hints())
