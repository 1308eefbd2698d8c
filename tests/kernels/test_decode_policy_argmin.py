"""Parallel eligible argmin (``_argmin_kernel`` + the policy kernel's PARALLEL path) against
the torch reference and the scanning path: random states, ties, empty tiers, a window no
token is old enough for, benchmark mode, both page geometries, several decode steps."""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache, _tier_scores
from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED, DiffKVConfig
from sglang_diffkv.kernels.decode_policy import (
    argmin_partials,
    argmin_splits,
    decode_policy_step,
    decode_policy_step_reference,
    unpack_keys,
)
from sglang_diffkv.kernels.testing import random_decode_case
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.policy import _eligible_argmin

GEOMETRIES = {"K8V4/K4V2": (K8V4, K4V2), "grouped": (K8V4_GROUPED, K4V2_GROUPED)}
# (block, programs): the defaults, and tiny blocks with many splits so that a program loops
# over several blocks, blocks straddle pages and splits exceed a row's blocks
LAUNCH = [(512, 8192), (16, 64), (32, 5)]


def state(geo: PageGeometry, seed: int, *, ties: bool = False, empty: bool = False,
          young: bool = False, hkv: int = 2):
    """A random decoded state (random_decode_case) with room for one decode step, at
    positions where most tokens are eligible. ties: scores and positions drawn from a few
    values (many equal avg); empty: some rows with an empty tier; young: positions so
    recent that no token is old enough for the window."""
    g = torch.Generator().manual_seed(seed)
    contexts = [int(x) for x in torch.randint(1, 300, (4,), generator=g)]
    case = random_decode_case(geo, contexts, hkv, num_layers=2, high_frac=0.35,
                              low_frac=0.45, jitter=True, spare_reqs=2, max_context=320,
                              seed=seed)
    c = case.counts
    hi_n, lo_n = geo.high.tokens_per_page, geo.low.tokens_per_page
    if empty:
        c[..., 0] = torch.where(torch.rand(c.shape[:3], generator=g) < 0.3, 0, c[..., 0])
        c[..., 1] = torch.where(torch.rand(c.shape[:3], generator=g) < 0.3, 0, c[..., 1])
    # room for the step's writes inside allocated pages: the new high token at slot n_hi
    # and a demoted one at slot n_lo (ensure_decode_room's job in the real cache); the
    # counts' page columns are not read by either side
    for t, n in ((0, hi_n), (1, lo_n)):
        c[..., t] -= ((c[..., t] % n == 0) & (c[..., t] > 0)).int()
    # a tier without pages gets a fresh one (appended to the pool: no page is shared)
    missing = [(idx, 0) for idx in torch.nonzero(case.table[..., 0] < 0).tolist()]
    missing += [(idx, -1) for idx in torch.nonzero(case.table[..., -1] < 0).tolist()]
    first = case.pages.shape[0]
    for k, ((r, lyr, h), col) in enumerate(missing):
        case.table[r, lyr, h, col] = first + k
    extra = torch.randint(0, 256, (len(missing), geo.page_bytes), generator=g,
                          dtype=torch.uint8)
    case.pages = torch.cat([case.pages, extra])
    f32, i32 = case.pages.view(torch.float32), case.pages.view(torch.int32)
    for tier, layout in enumerate(geo.tiers):
        n = layout.tokens_per_page
        s0, p0 = layout.score_offset // 4, layout.pos_offset // 4
        ids = tier_pages(case, tier)
        if ties:
            f32[ids, s0:s0 + n] = torch.randint(0, 3, (len(ids), n), generator=g).float()
            i32[ids, p0:p0 + n] = torch.randint(0, 3, (len(ids), n), generator=g,
                                                dtype=torch.int32) * 7
        else:
            i32[ids, p0:p0 + n] = torch.randint(0, 1000, (len(ids), n), generator=g,
                                                dtype=torch.int32)
    b = len(contexts)
    positions = torch.full((b,), 1000 if not young else 0) + torch.randint(0, 40, (b,),
                                                                           generator=g)
    return case, positions


def tier_pages(case, tier: int) -> torch.Tensor:
    """Ids of the pages one tier's tokens (and the step's next slot) live in. The tiers'
    score/position fields sit at different offsets of a page, so a test that edits them
    must edit each page with its own tier's layout only."""
    geo, row_len = case.geometry, case.table.shape[-1]
    n_per = geo.tiers[tier].tokens_per_page
    ids = []
    for r, lyr, h in torch.nonzero(case.table[..., 0] > -2).tolist():
        used = max(-(-int(case.counts[r, lyr, h, tier] + 1) // n_per), 1)
        cols = range(used) if tier == 0 else range(row_len - used, row_len)
        ids += [int(case.table[r, lyr, h, col]) for col in cols]
    return torch.tensor(sorted({i for i in ids if i >= 0}))


def reference_argmin(case, layer, positions, window):
    rows = case.table[case.req_idx.long(), layer]
    cnt = case.counts[case.req_idx.long(), layer].long()
    out = []
    for tier in (0, 1):
        _, score, pos = _tier_scores(case.pages, case.geometry, rows, cnt[..., tier], tier)
        out += _eligible_argmin(score, pos, cnt[..., tier], positions.long(), window)
    return out


@pytest.mark.parametrize("geo_name", list(GEOMETRIES))
@pytest.mark.parametrize("kind", ["random", "ties", "empty", "young"])
def test_argmin_partials_match_reference(geo_name, kind):
    geo = PageGeometry.build(64, *GEOMETRIES[geo_name])
    for seed in range(2):
        case, positions = state(geo, seed + 10 * len(kind), ties=kind == "ties",
                                empty=kind == "empty", young=kind == "young")
        window = 64 if kind != "ties" else 5
        for layer in (0, 1):
            want = reference_argmin(case, layer, positions, window)
            for block, programs in LAUNCH:
                n_split = argmin_splits(len(positions), case.table.shape[2],
                                        case.table.shape[-1], geo, block, programs)
                poison = torch.randint(-(1 << 62), 1 << 62, (len(positions),
                                       case.table.shape[2], n_split, 2))
                part = argmin_partials(case.pages, geo, case.table, case.counts, case.req_idx,
                                       layer, positions, window, block, programs,
                                       out=poison.clone())
                got = unpack_keys(part)
                for g_, w_ in zip(got, want, strict=True):
                    assert torch.equal(g_, w_.to(g_.dtype)), (kind, block, programs)
            if kind == "young":
                assert (want[1] == -1).all() and (want[3] == -1).all()
            if kind == "empty":
                n = case.counts[case.req_idx.long(), layer]
                assert ((n[..., 0] == 0) | (n[..., 1] == 0)).any()


def test_ties_pick_first_slot():
    """Equal avg everywhere: the lowest eligible slot of each tier wins."""
    geo = PageGeometry.build(64, K8V4, K4V2)
    case, positions = state(geo, 3)
    f32, i32 = case.pages.view(torch.float32), case.pages.view(torch.int32)
    for tier, layout in enumerate(geo.tiers):
        n, ids = layout.tokens_per_page, tier_pages(case, tier)
        f32[ids, layout.score_offset // 4:layout.score_offset // 4 + n] = 1.0
        i32[ids, layout.pos_offset // 4:layout.pos_offset // 4 + n] = 0
    positions = torch.full_like(positions, 500)
    for block, programs in LAUNCH:
        h_avg, hmin, l_avg, lmin = unpack_keys(argmin_partials(
            case.pages, geo, case.table, case.counts, case.req_idx, 0, positions, 64, block,
            programs))
        n = case.counts[case.req_idx.long(), 0]
        assert torch.equal(hmin, torch.where(n[..., 0] > 0, 0, -1).long())
        assert torch.equal(lmin, torch.where(n[..., 1] > 0, 0, -1).long())
        assert torch.equal(h_avg[n[..., 0] > 0], torch.full_like(h_avg[n[..., 0] > 0], 1 / 500))


def cache_pair(geo_name, lengths, hkv, d, seed):
    tiers = GEOMETRIES[geo_name]
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 6.0, "alpha_l": 1.5,
                                  "window": 4, "score_queries": 8,
                                  "high": {"key_bits": 8, "value_bits": 4,
                                           "key_groups": tiers[0].key_groups,
                                           "value_groups": tiers[0].value_groups},
                                  "low": {"key_bits": 4, "value_bits": 2,
                                          "key_groups": tiers[1].key_groups,
                                          "value_groups": tiers[1].value_groups}})
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(3):  # reference, parallel, scan
        c = CompressedKVCache(cfg, head_dim=d, num_layers=2, num_kv_heads=hkv,
                              num_pages=400, max_reqs=4, max_context=160, device="cpu")
        caches.append(c)
    caches[0].pages.copy_(torch.randint(0, 256, caches[0].pages.shape, generator=g,
                                        dtype=torch.uint8))
    req = torch.tensor([2, 0, 3][: len(lengths)])
    lens = torch.tensor(lengths)
    a = caches[0]
    a.begin_prefill(req, lens).raise_if_failed()
    lmax = max(lengths)
    for layer in range(2):
        q = torch.randn(len(lengths), 2 * hkv, lmax, d, generator=g)
        k = torch.randn(len(lengths), hkv, lmax, d, generator=g)
        v = torch.randn(len(lengths), hkv, lmax, d, generator=g)
        a.prefill_layer(layer, req, lens, q, k, v, d**-0.5)
    a.end_prefill(req)
    for c in caches[1:]:
        c.copy_state_from(a)
    return cfg, caches, req, lens


@pytest.mark.parametrize("geo_name", list(GEOMETRIES))
@pytest.mark.parametrize("bench", [None, (0.3, 0.4, 0.3)])
def test_steps_parallel_scan_reference(geo_name, bench):
    """Several decode steps from a prefilled cache: the parallel path (tiny blocks and the
    defaults, alternating) and the scan path equal the reference at every step."""
    hkv, d = 2, 64
    cfg, (ref, par, scan), req, lens = cache_pair(geo_name, [40, 23, 61], hkv, d, seed=21)
    g = torch.Generator().manual_seed(22)
    seeds = torch.tensor([5, 9, 1 << 40])
    seen = set()
    for step in range(4):
        for c in (ref, par, scan):
            c.begin_decode(req).raise_if_failed()
        positions = lens + step
        alpha = ref.alpha[req]
        for layer in range(2):
            key = torch.randn(len(lens), hkv, d, generator=g).bfloat16()
            value = torch.randn(len(lens), hkv, d, generator=g).bfloat16()
            bm = None if bench is None else (seeds, bench)
            want = decode_policy_step_reference(ref.pages, ref.geometry, ref.manager.table,
                                                ref.manager.counts, req, layer, positions,
                                                alpha, cfg.window, key, value, bench=bm)
            block, programs = LAUNCH[(step + layer) % len(LAUNCH)]
            for c, how in ((par, "parallel"), (scan, "scan")):
                got = decode_policy_step(c.pages, c.geometry, c.manager.table,
                                         c.manager.counts, req, layer, positions, alpha,
                                         cfg.window, key, value, bench=bm, argmin=how,
                                         argmin_block=block, argmin_programs=programs)
                assert torch.equal(got.action, want.action.to(torch.int8)), how
                assert torch.equal(got.hmin, want.hmin) and torch.equal(got.lmin, want.lmin)
                assert torch.equal(c.manager.counts, ref.manager.counts), how
                assert torch.equal(c.pages, ref.pages), how
            seen.update(want.action.flatten().tolist())
    assert len(seen) >= 3, f"actions seen: {seen}"


@pytest.mark.parametrize("geo_name", list(GEOMETRIES))
@pytest.mark.parametrize("kind", ["random", "ties", "empty", "young"])
def test_step_on_random_states(geo_name, kind):
    """One full step on the random states: parallel == scan == reference, outputs (and
    the pages' unused bytes) random before the call, with and without benchmark mode."""
    geo = PageGeometry.build(64, *GEOMETRIES[geo_name])
    case, positions = state(geo, 7 + len(kind), ties=kind == "ties", empty=kind == "empty",
                            young=kind == "young")
    g = torch.Generator().manual_seed(8)
    b, hkv = len(positions), case.table.shape[2]
    alpha = torch.rand(b, 2, generator=g) * torch.tensor([400.0, 100.0])
    key = torch.randn(b, hkv, 64, generator=g).bfloat16()
    value = torch.randn(b, hkv, 64, generator=g).bfloat16()
    window = 64 if kind != "ties" else 5
    for bm in (None, (torch.arange(b) * 3, (0.2, 0.5, 0.3))):
        states = [(case.pages.clone(), case.counts.clone()) for _ in range(3)]
        want = decode_policy_step_reference(states[0][0], geo, case.table, states[0][1],
                                            case.req_idx, 1, positions, alpha, window, key,
                                            value, bench=bm)
        for (pages, counts), how in zip(states[1:], ("parallel", "scan"), strict=True):
            got = decode_policy_step(pages, geo, case.table, counts, case.req_idx, 1,
                                     positions, alpha, window, key, value, bench=bm,
                                     argmin=how, argmin_block=32, argmin_programs=16)
            assert torch.equal(got.action, want.action.to(torch.int8)), (how, bm)
            assert torch.equal(got.hmin, want.hmin) and torch.equal(got.lmin, want.lmin)
            assert torch.equal(pages, states[0][0]) and torch.equal(counts, states[0][1])


def test_splits_from_shapes_only():
    geo = PageGeometry.build(128, K8V4, K4V2)
    row_len = geo.row_len(4096)
    assert argmin_splits(305, 8, row_len, geo) == 4  # ~8192 programs in all
    assert argmin_splits(4096, 8, row_len, geo) == 1
    # never more splits than blocks the longest row can have
    assert argmin_splits(1, 1, row_len, geo) == -(-row_len * 58 // 512) + 2
    with pytest.raises(ValueError):
        argmin_splits(1, 1, row_len, geo, block=100)
    with pytest.raises(ValueError):
        decode_policy_step(*[None] * 11, argmin="fast")


def random_shared(case, g: torch.Generator) -> torch.Tensor:
    """PageManager.shared-shaped bounds: per row and tier a random number of the tier's
    full pages (a shared page is always full), zero for about a third of the rows."""
    geo = case.geometry
    per = torch.tensor([geo.high.tokens_per_page, geo.low.tokens_per_page])
    full = case.counts[..., :2].long() // per
    pick = (torch.rand(full.shape, generator=g) * (full + 1).float()).long()
    keep = torch.rand(full.shape[:-1], generator=g) < 0.65
    return (pick * keep[..., None]).clamp(max=full).to(torch.int32)


@pytest.mark.parametrize("geo_name", list(GEOMETRIES))
def test_shared_bounds_in_every_argmin(geo_name):
    """Shared-prefix bounds (``shared=``): the parallel argmin's keys, and a whole step by
    the scan and the parallel path, equal ``policy.decode_step(shared_tokens=)``'s through
    the reference; outputs poisoned, normal and benchmark mode."""
    geo = PageGeometry.build(64, *GEOMETRIES[geo_name])
    case, positions = state(geo, 41)
    g = torch.Generator().manual_seed(42)
    shared = random_shared(case, g)
    assert bool((shared > 0).any())
    b, hkv = len(positions), case.table.shape[2]
    per = torch.tensor([geo.high.tokens_per_page, geo.low.tokens_per_page])
    for layer in (0, 1):
        rows = case.table[case.req_idx.long(), layer]
        cnt = case.counts[case.req_idx.long(), layer].long()
        first = shared[case.req_idx.long(), layer].long() * per
        want = []
        for tier in (0, 1):
            _, score, pos = _tier_scores(case.pages, geo, rows, cnt[..., tier], tier)
            want += _eligible_argmin(score, pos, cnt[..., tier], positions.long(), 64,
                                     first[..., tier])
        for block, programs in LAUNCH:
            n_split = argmin_splits(b, hkv, case.table.shape[-1], geo, block, programs)
            poison = torch.randint(-(1 << 62), 1 << 62, (b, hkv, n_split, 2), generator=g)
            got = unpack_keys(argmin_partials(case.pages, geo, case.table, case.counts,
                                              case.req_idx, layer, positions, 64, block,
                                              programs, out=poison, shared=shared))
            for g_, w_ in zip(got, want, strict=True):
                assert torch.equal(g_, w_.to(g_.dtype)), (layer, block)
    alpha = torch.rand(b, 2, generator=g) * torch.tensor([400.0, 100.0])
    key = torch.randn(b, hkv, 64, generator=g).bfloat16()
    value = torch.randn(b, hkv, 64, generator=g).bfloat16()
    for bm in (None, (torch.arange(b) * 5, (0.2, 0.5, 0.3))):
        ref = (case.pages.clone(), case.counts.clone())
        want = decode_policy_step_reference(ref[0], geo, case.table, ref[1], case.req_idx, 1,
                                            positions, alpha, 64, key, value, bench=bm,
                                            shared=shared)
        for how, blk in (("parallel", 32), ("scan", 16), ("scan", 512)):
            pages, counts = case.pages.clone(), case.counts.clone()
            got = decode_policy_step(pages, geo, case.table, counts, case.req_idx, 1,
                                     positions, alpha, 64, key, value, bench=bm, argmin=how,
                                     argmin_block=blk, argmin_programs=16, scan_block=blk,
                                     shared=shared)
            assert torch.equal(got.action, want.action.to(torch.int8)), (how, bm)
            assert torch.equal(got.hmin, want.hmin) and torch.equal(got.lmin, want.lmin)
            assert torch.equal(pages, ref[0]) and torch.equal(counts, ref[1])
        # the bounds matter on this state: without them some victim is a shared slot
        plain = decode_policy_step_reference(case.pages.clone(), geo, case.table,
                                             case.counts.clone(), case.req_idx, 1, positions,
                                             alpha, 64, key, value, bench=bm)
        assert not (torch.equal(plain.hmin, want.hmin) and torch.equal(plain.lmin, want.lmin))
