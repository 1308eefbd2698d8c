"""The merge pass's fills of the fused argmin's records (``DecodeAttentionPlan.run(hints=,
hint_fill=)``, ``decode_attention.HINT_FILLS``) on fresh random states, without the policy
kernel: records armed by hand (random positions, windows and shared bounds, some rows
unarmed), out / lse / the unarmed records poisoned first. Each fill must leave, in every
armed row, exactly the torch reference argmin (``policy._eligible_argmin``: fp32
``score / max(p - pos, 1)``, first slot on ties) over the scores that pass stored, and
touch nothing else: the pages, out and lse equal the pass without records bit for bit, an
unarmed record keeps its stamp but DONE (-2), other slots' records keep every word, and
both fills leave the same armed records."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_diffkv import decode_hint
from sglang_diffkv.cache import _tier_scores
from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED
from sglang_diffkv.kernels.decode_attention import HINT_FILLS, DecodeAttentionPlan, hint_mode
from sglang_diffkv.kernels.testing import random_decode_case
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.policy import _eligible_argmin

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
GEOMETRIES = {"K8V4/K4V2": (K8V4, K4V2), "grouped": (K8V4_GROUPED, K4V2_GROUPED)}
MAX_CONTEXT = 640  # rows of up to ~2 blocks of the pass (128 tokens a block) per tier


def _state(geo: PageGeometry, seed: int, kind: str, hkv: int = 2):
    """A random decoded state (1 layer), its positions p (the record's P), per-row window,
    shared bounds in pages and armed-row mask. kind "ties": scores and positions from a
    few values (many equal avg, and the pass's additions below their ulp); "young": p so
    close to the newest positions that few or no tokens are old enough; "random": any."""
    g = torch.Generator().manual_seed(seed)
    contexts = [int(x) for x in torch.randint(1, MAX_CONTEXT - 20, (5,), generator=g)]
    case = random_decode_case(geo, contexts, hkv, high_frac=0.35, low_frac=0.45, jitter=True,
                              spare_reqs=2, max_context=MAX_CONTEXT, seed=seed)
    f32, i32 = case.pages.view(torch.float32), case.pages.view(torch.int32)
    row_len = case.table.shape[-1]
    for tier, layout in enumerate(geo.tiers):
        n = layout.tokens_per_page
        # this tier's pages only (the other tier's fields sit elsewhere in a page)
        used = -(-case.counts[..., tier].long() // n)
        col = torch.arange(row_len)
        mine = col < used[..., None] if tier == 0 else col >= row_len - used[..., None]
        ids = torch.unique(case.table[mine & (case.table >= 0)])
        s0, p0 = layout.score_offset // 4, layout.pos_offset // 4
        if kind == "ties":
            # large enough that the pass's probabilities (< 1) leave them as they are; a
            # quarter of the tokens ties for the least avg
            vals = torch.tensor([1.0, 2.0]) * 2.0**30
            f32[ids, s0:s0 + n] = vals[torch.randint(0, 2, (len(ids), n), generator=g)]
            i32[ids, p0:p0 + n] = torch.randint(0, 2, (len(ids), n), generator=g,
                                                dtype=torch.int32) * 7
        else:
            f32[ids, s0:s0 + n] = torch.rand(len(ids), n, generator=g) * 50
            i32[ids, p0:p0 + n] = torch.randint(0, 1000, (len(ids), n), generator=g,
                                                dtype=torch.int32)
    b = len(contexts)
    base = 0 if kind == "young" else 1000
    p = torch.full((b,), base) + torch.randint(0, 40, (b,), generator=g)
    window = torch.randint(0, 70, (b,), generator=g)
    full = case.counts[case.req_idx, 0, :, :2].long() // torch.tensor(
        [geo.high.tokens_per_page, geo.low.tokens_per_page])
    shared = torch.zeros(*case.counts.shape[:3], 2, dtype=torch.int32)
    pick = (torch.rand(full.shape, generator=g) * (full + 1)).long()
    keep = torch.rand(full.shape[:-1], generator=g) < 0.4
    shared[case.req_idx, 0] = torch.minimum(pick * keep[..., None], full).int()
    armed = torch.rand(b, hkv, generator=g) < 0.8
    return case, p, window, shared, armed, g


def _arm(hints, case, p, window, shared, armed, geo):
    """The policy kernel's arming, by hand: keys none, stamp (P, NH, NL, FH, FL, LIMIT),
    DONE -1, for the armed rows; the others keep their (poisoned) words."""
    st = decode_hint.stamps(hints)
    per = torch.tensor([geo.high.tokens_per_page, geo.low.tokens_per_page])
    for bi, r in enumerate(case.req_idx.tolist()):
        for h in range(hints.shape[2]):
            if not armed[bi, h]:
                continue
            hints[r, 0, h, :2] = decode_hint.NONE_KEY
            row = st[r, 0, h]
            row[decode_hint.ST_P] = int(p[bi])
            row[decode_hint.ST_NH:decode_hint.ST_NL + 1] = case.counts[r, 0, h, :2]
            row[decode_hint.ST_FH:decode_hint.ST_FL + 1] = shared[r, 0, h] * per
            row[decode_hint.ST_LIMIT] = int(p[bi] - window[bi])
            row[decode_hint.ST_DONE] = -1


@pytest.mark.parametrize("geo_name", list(GEOMETRIES))
@pytest.mark.parametrize("kind", ["random", "ties", "young"])
def test_fills_leave_the_reference_argmin(geo_name, kind):
    geo = PageGeometry.build(64, *GEOMETRIES[geo_name])
    hkv, group = 2, 2
    # one partition per tier (target 1: a row's tokens loop through the pass's blocks, so
    # ties between a lane's blocks), or several (64: programs with no tokens, and one row's
    # tokens spread over programs that all min into one record); random states take both,
    # ties the first, young rows the second (each interpreted merge costs seconds on a CPU)
    targets = {"random": (1, 64), "ties": (1,), "young": (64,)}[kind]
    for seed, target in enumerate(targets):
        case, p, window, shared, armed, g = _state(geo, seed + 17 * len(kind), kind, hkv)
        b = len(p)
        q = torch.randn(b, hkv * group, 64, generator=g)
        poison = torch.randint(-(1 << 62), 1 << 62, (*case.counts.shape[:3],
                                                     decode_hint.HINT_WORDS), generator=g)
        results = {}
        for fill in (None, *HINT_FILLS):
            pages = case.pages.clone().to(DEV)
            hints = poison.clone()
            _arm(hints, case, p, window, shared, armed, geo)
            before = hints.clone()
            hints = hints.to(DEV)
            plan = DecodeAttentionPlan.build(geo, hkv * group, hkv, b, MAX_CONTEXT, DEV,
                                             target_programs=target)
            # poisoned with different bits per run: equal bits after it mean written
            out = torch.randint(-(1 << 31), 1 << 31, (b, hkv * group, 64), generator=g,
                                dtype=torch.int32).view(torch.float32).to(DEV)
            lse = torch.randint(-(1 << 31), 1 << 31, (b, hkv * group), generator=g,
                                dtype=torch.int32).view(torch.float32).to(DEV)
            plan.run(q.to(DEV), pages, case.table.to(DEV), case.counts.to(DEV),
                     case.req_idx.to(DEV), 0, 64**-0.5, out=out, lse=lse,
                     shared=shared.to(DEV), hints=None if fill is None else hints,
                     hint_fill=fill or "loop")
            results[fill] = (pages.cpu(), out.cpu().view(torch.int32),
                             lse.cpu().view(torch.int32), hints.cpu(), before)
        pages0, out0, lse0, _, _ = results[None]
        # the reference argmin for P over the scores the pass stored
        rows = case.table[case.req_idx, 0]
        cnt = case.counts[case.req_idx, 0].long()
        first = shared[case.req_idx, 0].long() * torch.tensor(
            [geo.high.tokens_per_page, geo.low.tokens_per_page])
        want = []
        for tier in (0, 1):
            _, score, pos = _tier_scores(pages0, geo, rows, cnt[..., tier], tier)
            # per-row window: the reference takes one window, so row by row
            avg = torch.full(cnt.shape[:2], float("inf"))
            slot = torch.full(cnt.shape[:2], -1, dtype=torch.long)
            for bi in range(b):
                a, s_ = _eligible_argmin(score[bi:bi + 1], pos[bi:bi + 1],
                                         cnt[bi:bi + 1, :, tier], p[bi:bi + 1],
                                         int(window[bi]), first[bi:bi + 1, :, tier])
                avg[bi], slot[bi] = a[0], s_[0]
            want.append((avg, slot))
        found = 0
        for fill in HINT_FILLS:
            pages, out, lse, hints, before = results[fill]
            assert torch.equal(pages, pages0), fill
            assert torch.equal(out, out0) and torch.equal(lse, lse0), fill
            rec = hints[case.req_idx, 0]
            st = decode_hint.stamps(rec)
            for tier, (w_avg, w_slot) in enumerate(want):
                g_avg, g_slot = decode_hint.unpack_key(rec[..., tier])
                assert torch.equal(g_slot[armed], w_slot[armed]), (fill, tier, seed)
                fin = armed & (w_slot >= 0)
                assert torch.equal(g_avg[fin], w_avg[fin]), (fill, tier, seed)
                found += int(fin.sum())
            assert bool((st[..., decode_hint.ST_DONE][armed] == p[:, None].expand_as(
                armed)[armed]).all()), fill
            # an unarmed record is marked (DONE -2), its stamp otherwise kept; its keys take
            # mins from a garbage stamp (never used: the stamp does not match)
            unarmed = ~armed
            old = decode_hint.stamps(before[case.req_idx, 0])
            assert torch.equal(st[unarmed][:, :decode_hint.ST_DONE],
                               old[unarmed][:, :decode_hint.ST_DONE]), fill
            assert bool((st[..., decode_hint.ST_DONE][unarmed] == -2).all()), fill
            # rows of other slots: untouched
            others = torch.ones(hints.shape[0], dtype=torch.bool)
            others[case.req_idx] = False
            assert torch.equal(hints[others], before[others]), fill
        loop, pas = (results[f][3][case.req_idx, 0] for f in ("loop", "pass"))
        assert torch.equal(loop[armed], pas[armed])
        if kind != "young":
            assert found > 0


def test_hint_mode_names():
    assert hint_mode("loop") == 1 and hint_mode("pass") == 2
    with pytest.raises(ValueError, match="hint_fill"):
        hint_mode("fast")
