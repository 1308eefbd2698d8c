"""Every kernel against its torch reference on the GPU at real sizes, in one go.

Fresh random inputs per check, outputs and scratch poisoned before each run. Prints one
table row per check (PASS/FAIL, the error measured, the time the check took) and exits
non-zero if any check fails.

    python -m sglang_diffkv.kernels.gpu_check [--quick]
"""

from __future__ import annotations

import argparse
import re
import time
import traceback
from collections.abc import Callable

import torch

from sglang_diffkv import decode_hint
from sglang_diffkv.cache import CompressedKVCache, _tier_scores
from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED, DiffKVConfig
from sglang_diffkv.kernels import (
    DecodeAttentionPlan,
    compaction_backend,
    compress_prefill,
    compress_prefill_reference,
    decode_attention_reference,
    decode_compaction,
    decode_compaction_reference,
    decode_policy_step,
    decode_policy_step_reference,
    extend_attention,
    extend_attention_reference,
    prefill_scores,
    prefill_scores_reference,
    store_tokens,
    store_tokens_reference,
)
from sglang_diffkv.kernels.decode_attention import VARIANTS
from sglang_diffkv.kernels.decode_policy import (
    argmin_partials,
    argmin_splits,
    unpack_keys,
)
from sglang_diffkv.kernels.decode_split_cuda import geometry_reason
from sglang_diffkv.kernels.extend_attention import default_splits, scratch_elements, tile_shape
from sglang_diffkv.kernels.testing import random_decode_case, random_extend_case, rel_err
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import MemorySpec, PageManager
from sglang_diffkv.policy import _eligible_argmin
from sglang_diffkv.prompt_attention import PackedPrompts, choose_prompt_attention

DEV = "cuda"
ROWS: list[tuple[str, str, str, bool, float]] = []


ONLY: list[str] = []


def check(name: str, config: str, fn: Callable[[], tuple[str, bool]]) -> None:
    if ONLY and not any(o in name for o in ONLY):
        return
    t0 = time.perf_counter()
    try:
        metric, ok = fn()
    except Exception as e:  # a crashing check is a failed check; keep going
        traceback.print_exc()
        metric, ok = f"error: {type(e).__name__}: {str(e)[:80]}", False
    torch.cuda.synchronize()
    ROWS.append((name, config, metric, ok, time.perf_counter() - t0))
    print(f"{'PASS' if ok else 'FAIL'}  {name:22s} {config:44s} {metric}", flush=True)


def decode_attention_check(geo, contexts, hkv, group, mix, seed, variant="base"):
    def run():
        case = random_decode_case(geo, contexts, hkv, num_layers=2, high_frac=mix[0],
                                  low_frac=mix[1], jitter=True, spare_reqs=3, device=DEV,
                                  seed=seed)
        b, d = len(contexts), geo.head_dim
        q = torch.randn(b, hkv * group, d, device=DEV).bfloat16()
        plan = DecodeAttentionPlan.build(geo, hkv * group, hkv, b, case.max_context, DEV,
                                         variant=variant)
        for buf in (plan.acc, plan.ml, plan.mit, plan.pbuf):
            buf.fill_(float("nan"))
        out = torch.full((b, hkv * group, d), float("nan"), device=DEV)
        lse = torch.full((b, hkv * group), float("nan"), device=DEV)
        ref_pages = case.pages.clone()
        plan.run(q, case.pages, case.table, case.counts, case.req_idx, 1, d**-0.5, out=out,
                 lse=lse)
        ro, rl = decode_attention_reference(q, ref_pages, geo, case.table, case.counts,
                                            case.req_idx, 1, d**-0.5)
        s, sr = case.pages.view(torch.float32), ref_pages.view(torch.float32)
        moved = (s != sr) & ~(torch.isnan(s) & torch.isnan(sr))
        changed = (case.pages != ref_pages).view(-1, 4).any(-1).view_as(s)
        e_out, e_lse = rel_err(out, ro.float()), rel_err(lse, rl)
        e_score = rel_err(s[moved], sr[moved]) if moved.any() else 0.0
        ok = (e_out < 5e-3 and e_lse < 1e-5 and e_score < 2e-3
              and torch.equal(changed, moved))
        return f"out {e_out:.1e} lse {e_lse:.1e} score {e_score:.1e}", ok
    return run


def extend_attention_check(geo, prefix_tokens, new_lens, hkv, group, mix, seed, splits=None):
    """Fresh tokens (bf16) over compressed prefixes of ``prefix_tokens`` prompt tokens each,
    kept high / low per head at ``mix`` (jittered x U(0.5, 1.5); the rest pruned)."""
    def run():
        g = torch.Generator().manual_seed(seed)
        prefix = []
        for total in prefix_tokens:
            heads = []
            for _ in range(hkv):
                hi = min(total, int(total * mix[0] * (0.5 + torch.rand(1, generator=g).item())))
                lo = int(total * mix[1] * (0.5 + torch.rand(1, generator=g).item()))
                heads.append((hi, min(lo, total - hi)))
            prefix.append(heads)
        case = random_extend_case(geo, prefix, new_lens, group, dtype=torch.bfloat16,
                                  device=DEV, seed=seed)
        c, d = case.cache, geo.head_dim
        bm, qt = tile_shape(group, case.max_new)
        tiles = len(new_lens) * -(-case.max_new // qt)
        n_split = splits or default_splits(tiles * hkv, torch.device(DEV))
        scratch = tuple(torch.full((n,), float("nan"), device=DEV)
                        for n in scratch_elements(tiles, hkv, n_split, bm, d))
        out = torch.full_like(case.q, float("nan"))
        lse = torch.full(case.q.shape[:2], float("nan"), device=DEV)
        pages = c.pages.clone()
        extend_attention(case.q, case.k, case.v, case.starts, case.lens, c.pages, geo,
                         c.table, c.counts, c.req_idx, 1, d**-0.5, out, lse,
                         max_new=case.max_new, splits=n_split, scratch=scratch)
        ref = extend_attention_reference(case.q, case.k, case.v, case.starts, case.lens,
                                         c.pages, geo, c.table, c.counts, c.req_idx, 1,
                                         d**-0.5)
        n = int(case.lens.sum())
        e_out, e_lse = rel_err(out[:n], ref.out[:n].float()), rel_err(lse[:n], ref.lse[:n])
        untouched = bool(torch.isnan(out[n:]).all()) and torch.equal(pages, c.pages)
        return (f"splits {n_split}; out {e_out:.1e} lse {e_lse:.1e}",
                e_out < 1e-2 and e_lse < 1e-5 and untouched)
    return run


def store_check(d, tiers, dtype):
    def run():
        geo = PageGeometry.build(d, *tiers)
        worst = 0
        for layout in geo.tiers:
            n_pages, t = 4000, 50_000
            flat = torch.randperm(n_pages * layout.tokens_per_page, device=DEV)[:t]
            ids = (flat // layout.tokens_per_page).int()
            slots = (flat % layout.tokens_per_page).int()
            k = (torch.randn(t, d, device=DEV) * 3).to(dtype)
            v = torch.randn(t, d, device=DEV).to(dtype)
            score, pos = torch.rand(t, device=DEV), torch.randint(0, 1 << 20, (t,), device=DEV)
            pages = torch.randint(0, 256, (n_pages, geo.page_bytes), dtype=torch.uint8,
                                  device=DEV)
            # the reference runs on the CPU: torch's CUDA division by a scalar multiplies by
            # the reciprocal, so the GPU reference can differ from the CPU one by an ulp
            ref = pages.cpu()
            store_tokens(pages, layout, ids, slots, k, v, score, pos.int())
            store_tokens_reference(ref, layout, *(x.cpu() for x in (ids, slots, k, v, score,
                                                                     pos.int())))
            worst = max(worst, int((pages.cpu() != ref).sum()))
        return f"{worst} differing bytes (50k tokens per tier)", worst == 0
    return run


def prefill_check(lengths, hq, hkv, d):
    def run():
        b, lmax = len(lengths), max(lengths)
        q = torch.randn(b, lmax, hq, d, device=DEV).bfloat16().transpose(1, 2)
        k = torch.randn(b, lmax, hkv, d, device=DEV).bfloat16().transpose(1, 2)
        lens = torch.tensor(lengths, device=DEV)
        sig = prefill_scores(q, k, lens, d**-0.5, 64)
        ref = prefill_scores_reference(q, k, lens, d**-0.5, 64)
        e = rel_err(sig, ref)
        return f"significance rel err {e:.1e}", e < 1e-4
    return run


def prefill_packed_check(lengths, hq, hkv, d):
    """The server's prefill: packed prompts, flash varlen attention's LSE into the scoring."""
    def run():
        t = sum(lengths)
        q = torch.randn(t, hq, d, device=DEV).bfloat16()
        k = torch.randn(t, hkv, d, device=DEV).bfloat16()
        p = PackedPrompts.from_lengths(lengths, DEV)
        chosen = choose_prompt_attention(DEV)
        _, lse = chosen.run(q, k, k, p, d**-0.5)
        sig = prefill_scores(q, k, p.lengths, d**-0.5, 64, lse=lse, starts=p.starts,
                             max_len=p.max_len)
        ref = prefill_scores_reference(p.pad(q), p.pad(k), p.lengths.long(), d**-0.5, 64)
        e = rel_err(sig, ref)
        return f"{chosen.name} attention; significance rel err {e:.1e}", (
            e < 1e-3 and chosen.name == "varlen")
    return run


def prefill_stored_check(lengths, attached, hq, hkv, d):
    """The prompt-end scoring (``sglang.extend_ops``): fp32 keys as the gather dequantises
    them (K8 codes, fp16 scale and zero), the last 64 queries in rows of their own, per-head
    ``key_first``, column sums from ``score_from`` on; against a float64 oracle. bf16
    queries take the tensor-core split of the keys (``prefill._qk``), fp32 queries the IEEE
    dot: both within fp32 rounding of the oracle."""
    def run():
        g = torch.Generator().manual_seed(7)
        b, t, nq = len(lengths), sum(lengths), 64
        codes = torch.randint(0, 256, (t, hkv, d), generator=g).float()
        scale = (torch.rand(t, hkv, 1, generator=g) * 0.05).half().float()
        zero = (torch.randn(t, hkv, 1, generator=g) * 3).half().float()
        k = codes * scale + zero
        q = (torch.randn(b * nq, hq, d, generator=g) * 1.5).bfloat16()
        first = torch.randint(0, 9, (b, hkv), generator=g, dtype=torch.int32)
        starts = torch.tensor([sum(lengths[:i]) for i in range(b)])
        q_starts = torch.tensor([i * nq - (n - nq) for i, n in enumerate(lengths)])
        frm = torch.tensor(attached, dtype=torch.int32)
        ref = torch.zeros(b, hkv, max(lengths), dtype=torch.float64)
        for i, n in enumerate(lengths):
            kb = k[starts[i]:starts[i] + n].double()
            qb = q[i * nq:(i + 1) * nq].double().view(nq, hkv, hq // hkv, d)
            s = torch.einsum("qhgd,khd->hgqk", qb, kb) * d**-0.5
            kpos, qpos = torch.arange(n), torch.arange(n - nq, n)
            hide = (kpos[None, None, :] > qpos[None, :, None]) | (
                kpos[None, None, :] < first[i][:, None, None].long())
            p = torch.softmax(s.masked_fill(hide[:, None], float("-inf")), -1)
            ref[i, :, :n] = p.sum(2).amax(1)
        errs = []
        for qd in (torch.bfloat16, torch.float32):
            out = torch.zeros(b, hkv, max(lengths), device=DEV)
            prefill_scores(q.to(DEV, qd), k.to(DEV), torch.tensor(lengths, dtype=torch.int32,
                                                                  device=DEV),
                           d**-0.5, nq, starts=starts.to(DEV), max_len=max(lengths), out=out,
                           q_starts=q_starts.to(DEV), key_first=first.to(DEV),
                           num_queries=torch.full((b,), nq, dtype=torch.int32, device=DEV),
                           score_from=frm.to(DEV),
                           score_len=max(n - a for n, a in zip(lengths, attached,
                                                               strict=True)))
            got = out.double().cpu()
            for i, a in enumerate(attached):
                got[i, :, :a] = ref[i, :, :a]  # (not written: score_from)
            errs.append(rel_err(got, ref))
        return (f"significance rel err bf16 q (split keys) {errs[0]:.1e}, fp32 q (IEEE) "
                f"{errs[1]:.1e}", max(errs) < 1e-5)
    return run


def compress_check(lengths, hkv, d):
    def run():
        config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 1.0,
                                         "alpha_l": 0.1})
        b, lmax = len(lengths), max(lengths)
        q = torch.randn(b, lmax, 4 * hkv, d, device=DEV).bfloat16().transpose(1, 2)
        k = torch.randn(b, lmax, hkv, d, device=DEV).bfloat16().transpose(1, 2)
        v = torch.randn(b, lmax, hkv, d, device=DEV).bfloat16().transpose(1, 2)
        lens = torch.tensor(lengths, device=DEV)
        sig = prefill_scores(q, k, lens, d**-0.5, 64)
        caches, cls = [], []
        poison = None
        for fn, dev in ((compress_prefill, DEV), (compress_prefill_reference, "cpu")):
            c = CompressedKVCache(config, head_dim=d, num_layers=1, num_kv_heads=hkv,
                                  num_pages=3 * b * hkv * (lmax // 32 + 2), max_reqs=b + 2,
                                  max_context=lmax, device=dev, validate=False)
            if poison is None:
                poison = torch.randint(0, 256, c.pages.shape, dtype=torch.uint8)
            c.pages.copy_(poison)
            req = torch.arange(b, device=dev) + 1
            c.begin_prefill(req, lens.to(dev))
            a = c.alpha[req]
            cls.append(fn(c.pages, c.geometry, c.manager.table, req, 0, k.to(dev), v.to(dev),
                          sig.to(dev), lens.to(dev), a[:, 0], a[:, 1], config.window,
                          config.score_queries))
            c.manager.reclaim_prefill(req, cls[-1].n_high.view(b, 1, hkv),
                                      cls[-1].n_low.view(b, 1, hkv))
            caches.append(c)
        same = (torch.equal(caches[0].pages.cpu(), caches[1].pages)
                and torch.equal(caches[0].manager.table.cpu(), caches[1].manager.table)
                and torch.equal(caches[0].manager.counts.cpu(), caches[1].manager.counts))
        kept = cls[0].n_high.sum().item(), cls[0].n_low.sum().item()
        return f"pages/table/counts equal={same}; kept hi/lo {kept}", same
    return run


def policy_check(lengths, hkv, d, steps, bench=None):
    """Steps from a prefilled cache: the reference (CPU), the parallel-argmin kernel path
    and the scanning one (GPU), all from the same state, compared at every step."""
    def run():
        config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 6.0,
                                         "alpha_l": 1.5, "window": 8, "score_queries": 16})
        g = torch.Generator(device="cpu").manual_seed(5)
        caches = []
        lens = torch.tensor(lengths)
        poison = None
        # reference on the CPU (see store_check), kernels on the GPU from the same state
        for dev in ("cpu", DEV, DEV):
            c = CompressedKVCache(config, head_dim=d, num_layers=1, num_kv_heads=hkv,
                                  num_pages=4 * len(lengths) * hkv * (max(lengths) // 32 + 8),
                                  max_reqs=len(lengths), max_context=max(lengths) + steps,
                                  device=dev, validate=False)
            if poison is None:
                poison = torch.randint(0, 256, c.pages.shape, dtype=torch.uint8)
            c.pages.copy_(poison)
            c.begin_prefill(torch.arange(len(lengths), device=dev), lens.to(dev))
            caches.append(c)
        lmax = max(lengths)
        q = torch.randn(len(lengths), 2 * hkv, lmax, d, generator=g)
        k = torch.randn(len(lengths), hkv, lmax, d, generator=g)
        v = torch.randn(len(lengths), hkv, lmax, d, generator=g)
        a = caches[0]
        req_a = torch.arange(len(lengths))
        req = req_a.to(DEV)
        a.prefill_layer(0, req_a, lens, q, k, v, d**-0.5)
        a.end_prefill(req_a)
        for b in caches[1:]:
            b.pages.copy_(a.pages)
            for name in ("table", "counts", "phase"):
                getattr(b.manager, name).copy_(getattr(a.manager, name))
            b.manager.free_list._buf.copy_(a.manager.free_list._buf)
            b.manager.free_list.head.copy_(a.manager.free_list.head)
            b.manager.free_list.tail.copy_(a.manager.free_list.tail)
            b.alpha.copy_(a.alpha)
        seeds = torch.arange(len(lengths)) * 7 + 1
        seen, same = set(), {"parallel": True, "scan": True}
        for step in range(steps):
            for c in caches:
                c.begin_decode(req_a if c is a else req)
            pos = lens + step
            key = torch.randn(len(lengths), hkv, d, generator=g).bfloat16()
            val = torch.randn(len(lengths), hkv, d, generator=g).bfloat16()
            alpha = a.alpha[req_a]
            r = decode_policy_step_reference(a.pages, a.geometry, a.manager.table,
                                             a.manager.counts, req_a, 0, pos, alpha,
                                             config.window, key, val,
                                             bench=None if bench is None else (seeds, bench))
            for b, how in zip(caches[1:], same, strict=True):
                o = decode_policy_step(b.pages, b.geometry, b.manager.table, b.manager.counts,
                                       req, 0, pos.to(DEV), alpha.to(DEV), config.window,
                                       key.to(DEV), val.to(DEV),
                                       bench=None if bench is None else (seeds.to(DEV), bench),
                                       argmin=how)
                same[how] &= (torch.equal(o.action.cpu(), r.action.to(torch.int8))
                              and torch.equal(o.hmin.cpu(), r.hmin)
                              and torch.equal(o.lmin.cpu(), r.lmin)
                              and torch.equal(a.pages, b.pages.cpu())
                              and torch.equal(a.manager.counts, b.manager.counts.cpu()))
            seen |= set(r.action.flatten().tolist())
        return (f"{steps} steps equal: parallel={same['parallel']} scan={same['scan']}; "
                f"actions seen {sorted(seen)}", all(same.values()))
    return run


def _serving_decode_case(batch, ctx_lo, ctx_hi, hkv, seed):
    """(geometry, the seeded CPU generator, the contexts drawn in [ctx_lo, ctx_hi], a random
    decoded K8V4 / K4V2 state of ``batch`` requests at them, 30/50/20 jittered, on DEV)."""
    geo = PageGeometry.build(128, K8V4, K4V2)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ctx = torch.randint(ctx_lo, ctx_hi + 1, (batch,), generator=g).tolist()
    case = random_decode_case(geo, ctx, hkv, high_frac=0.3, low_frac=0.5, jitter=True,
                              spare_reqs=5, device=DEV, seed=seed)
    return geo, g, ctx, case


def policy_large_check(batch, ctx_lo, ctx_hi, hkv, seed):
    """A random decoded state at serving size (30/50/20 jittered, contexts in
    [ctx_lo, ctx_hi]): the parallel argmin's keys against the reference argmin (CPU), and
    one whole step, normal and benchmark mode, parallel vs scan vs the reference."""
    def run():
        geo, g, ctx, case = _serving_decode_case(batch, ctx_lo, ctx_hi, hkv, seed)
        c = case.counts
        for t, n in ((0, geo.high.tokens_per_page), (1, geo.low.tokens_per_page)):
            c[..., t] -= ((c[..., t] % n == 0) & (c[..., t] > 0)).int()  # room for the step
        window = 64
        # p just past the positions' range [0, 2^20): the newest ~100 tokens are too young
        pos = ((1 << 20) + torch.randint(-100, 100, (batch,), generator=g)).to(DEV)
        # part poisoned: every entry must be written
        s = argmin_splits(batch, hkv, case.table.shape[-1], geo)
        part = torch.randint(-(1 << 62), 1 << 62, (batch, hkv, s, 2), device=DEV)
        got = unpack_keys(argmin_partials(case.pages, geo, case.table, c, case.req_idx, 0, pos,
                                          window, out=part))
        pages_cpu, rows = case.pages.cpu(), case.table[case.req_idx, 0].cpu()
        cnt = c[case.req_idx, 0].long().cpu()
        want = []
        for tier in (0, 1):
            _, score, spos = _tier_scores(pages_cpu, geo, rows, cnt[..., tier], tier)
            want += _eligible_argmin(score, spos, cnt[..., tier], pos.cpu(), window)
        keys_ok = all(torch.equal(x.cpu(), y.to(x.dtype)) for x, y in zip(got, want,
                                                                          strict=True))
        alpha = torch.rand(batch, 2, generator=g) * torch.tensor([3000.0, 800.0])
        key = torch.randn(batch, hkv, 128, generator=g).bfloat16()
        val = torch.randn(batch, hkv, 128, generator=g).bfloat16()
        steps_ok, seen = True, set()
        for bm in (None, (torch.arange(batch) * 3 + 1, (0.3, 0.5, 0.2))):
            ref_pages, ref_counts = pages_cpu.clone(), c.cpu().clone()
            r = decode_policy_step_reference(ref_pages, geo, case.table.cpu(), ref_counts,
                                             case.req_idx.cpu(), 0, pos.cpu(), alpha, window,
                                             key, val, bench=bm)
            seen |= set(r.action.flatten().tolist())
            for how in ("parallel", "scan"):
                pages, counts = case.pages.clone(), c.clone()
                o = decode_policy_step(pages, geo, case.table, counts, case.req_idx, 0, pos,
                                       alpha.to(DEV), window, key.to(DEV), val.to(DEV),
                                       bench=None if bm is None else (bm[0].to(DEV), bm[1]),
                                       argmin=how)
                steps_ok &= (torch.equal(o.action.cpu(), r.action.to(torch.int8))
                             and torch.equal(o.hmin.cpu(), r.hmin)
                             and torch.equal(o.lmin.cpu(), r.lmin)
                             and torch.equal(pages.cpu(), ref_pages)
                             and torch.equal(counts.cpu(), ref_counts))
                del pages
        none = int((want[1] < 0).sum() + (want[3] < 0).sum())
        return (f"argmin keys equal={keys_ok} (S={s}, {none} rows w/o victim); steps "
                f"equal={steps_ok}, actions {sorted(seen)}", keys_ok and steps_ok)
    return run


def fused_argmin_check(batch, ctx_lo, ctx_hi, hkv, group, steps, seed, fill="loop"):
    """The fused argmin (``decode_hint``) at serving size: a random 30/50/20 state, then
    ``steps`` decode steps of one layer (policy step, then decode attention) run three
    ways from the same state: the reference policy step (CPU) on the fused path's own
    state, the scan path (no records) and the fused path (records poisoned before the first
    step, shared bounds on some rows). Decisions must equal the reference at every step,
    the scan and fused paths' pages and counters stay identical, every armed record's keys
    equal the reference argmin for the next position on the pages the merge wrote, and
    from the second step on every row must take its record. ``fill``: how the merge pass
    fills the records (``decode_attention.HINT_FILLS``)."""
    def run():
        geo, g, ctx, case = _serving_decode_case(batch, ctx_lo, ctx_hi, hkv, seed)
        c = case.counts
        per = torch.tensor([geo.high.tokens_per_page, geo.low.tokens_per_page], device=DEV)
        c[..., :2] = torch.minimum(c[..., :2], (c[..., 2:] * per - steps).clamp(min=0))
        full = c[..., :2].long() // per
        pick = (torch.rand(full.shape, generator=g).to(DEV) * (full + 1)).long()
        keep = (torch.rand(full.shape[:-1], generator=g) < 0.3).to(DEV)[..., None]
        shared = torch.minimum(pick * keep, full).to(torch.int32)
        hints = decode_hint.allocate(*c.shape[:3], DEV)
        hints.copy_(torch.randint(-(1 << 62), 1 << 62, hints.shape, generator=g))
        window = 64
        pos = ((1 << 20) + torch.randint(-100, 100, (batch,), generator=g)).to(DEV)
        alpha = torch.rand(batch, 2, generator=g) * torch.tensor([3000.0, 800.0])
        plan = DecodeAttentionPlan.build(geo, hkv * group, hkv, batch, max(ctx) + steps, DEV)
        scan = (case.pages.clone(), c.clone())
        req = case.req_idx
        ok, used, rows, seen = True, 0, 0, set()
        for t in range(steps):
            key = torch.randn(batch, hkv, 128, generator=g).bfloat16()
            val = torch.randn(batch, hkv, 128, generator=g).bfloat16()
            q = torch.randn(batch, hkv * group, 128, generator=g).bfloat16().to(DEV)
            first = shared[req, 0].long() * per
            valid = decode_hint.valid(hints[req, 0], c[req, 0], first, pos, window)
            used += int(valid.sum())
            rows += valid.numel()
            if t > 0:
                ok &= bool(valid.all())
            ref_pages, ref_counts = case.pages.cpu().clone(), c.cpu().clone()
            r = decode_policy_step_reference(ref_pages, geo, case.table.cpu(), ref_counts,
                                             req.cpu(), 0, pos.cpu(), alpha, window, key, val,
                                             shared=shared.cpu())
            seen |= set(r.action.flatten().tolist())
            for pages, counts, h in ((case.pages, c, hints), (*scan, None)):
                o = decode_policy_step(pages, geo, case.table, counts, req, 0, pos,
                                       alpha.to(DEV), window, key.to(DEV), val.to(DEV),
                                       shared=shared, hints=h)
                ok &= (torch.equal(o.action.cpu(), r.action.to(torch.int8))
                       and torch.equal(o.hmin.cpu(), r.hmin)
                       and torch.equal(o.lmin.cpu(), r.lmin)
                       and torch.equal(pages.cpu(), ref_pages)
                       and torch.equal(counts.cpu(), ref_counts))
                plan.run(q, pages, case.table, counts, req, 0, 128**-0.5, shared=shared,
                         hints=h, hint_fill=fill)
            ok &= torch.equal(case.pages, scan[0]) and torch.equal(c, scan[1])
            nxt = pos + 1
            pages_cpu, tab = case.pages.cpu(), case.table[req, 0].cpu()
            cnt = c[req, 0].long().cpu()
            fst = first.cpu()
            for tier in (0, 1):
                _, score, spos = _tier_scores(pages_cpu, geo, tab, cnt[..., tier], tier)
                w_avg, w_slot = _eligible_argmin(score, spos, cnt[..., tier], nxt.cpu(),
                                                 window, fst[..., tier])
                avg, slot = decode_hint.unpack_key(hints[req, 0, :, tier].cpu())
                fin = w_slot >= 0
                ok &= torch.equal(slot, w_slot) and torch.equal(avg[fin], w_avg[fin].float())
            pos = nxt
        return (f"{steps} steps equal={ok}; rows from the record {used}/{rows}; actions "
                f"{sorted(seen)}; {int((shared > 0).any(-1).sum())} rows with shared pages",
                ok and used >= rows * (steps - 1) // steps)
    return run


def compaction_check(batch, layers, heads, cooperative):
    def run():
        spec = MemorySpec(num_pages=batch * layers * heads * 8, max_reqs=batch,
                          num_layers=layers, num_kv_heads=heads, high_tokens_per_page=32,
                          low_tokens_per_page=60, max_context=4096)
        g = torch.Generator(device="cpu").manual_seed(1)
        req = torch.randperm(batch, generator=g)
        lengths = torch.randint(1, 200, (batch,), generator=g)
        shape = (batch, layers, heads)
        n_hi = (lengths.view(-1, 1, 1) * torch.rand(shape, generator=g) * 0.6).long()
        n_lo = ((lengths.view(-1, 1, 1) - n_hi) * torch.rand(shape, generator=g)).long()
        full = torch.rand(*shape, 2, generator=g) < 0.5
        tiers = (torch.rand(batch, 2, generator=g) < 0.8).to(DEV)
        ms = []
        for _ in range(2):
            m = PageManager(spec, DEV, validate=False)
            m.allocate_prefill(req, lengths)
            m.reclaim_prefill(req, n_hi, n_lo)
            c = m.counts[req.to(DEV)].long()
            cap = c[..., 2:] * torch.tensor([32, 60], device=DEV)
            m.set_counts(req, torch.where(full.to(DEV), cap, c[..., :2]))
            ms.append(m)
        r = decode_compaction_reference(ms[0], req.to(DEV), tiers)
        # the launcher falls back to the single-block kernel silently when a cooperative
        # launch is refused: the profiler says which kernel actually ran
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            k = decode_compaction(ms[1], req.to(DEV), tiers, cooperative=cooperative)
            torch.cuda.synchronize()
        ran = sorted({m for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA
                      for m in re.findall(r"decode_room\w*kernel", e.name)})
        sa, sb = ms[0].snapshot(), ms[1].snapshot()
        same = all(torch.equal(sa[x], sb[x]) for x in sa) and all(
            torch.equal(getattr(r, f), getattr(k, f)) for f in ("ok", "needed", "free",
                                                              "rows_ok"))
        want_kernel = "decode_room_coop_kernel" if cooperative else "decode_room_kernel"
        if want_kernel not in ran:
            return f"state equal={same}, but ran {ran}, not {want_kernel}", False
        return (f"state equal={same}, pages taken {int(r.needed)} ({compaction_backend()}: "
                f"{','.join(ran)})", same)
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--only", default="", help="comma-separated substrings of check names")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="decode attention variants to check (DecodeAttentionPlan.variant)")
    args = ap.parse_args()
    ONLY.extend(x for x in args.only.split(",") if x)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    long_ctx = 1024 if args.quick else 4096
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    for d, tiers, name in ((128, (K8V4, K4V2), "K8V4/K4V2"),
                           (128, (K8V4_GROUPED, K4V2_GROUPED), "K8V4g12/K4V2g24"),
                           (64, (K8V4, K4V2), "K8V4/K4V2")):
        geo = PageGeometry.build(d, *tiers)
        for variant in variants:
            # the cuda pass serves one geometry (K8V4 / K4V2, D128); elsewhere "auto" picks
            # a Triton variant, so there is nothing of its to check
            why = geometry_reason(geo, 4, 1) if variant == "cuda" else None
            if why is not None:
                print(f"SKIP  decode_attention[cuda] D{d} {name}: {why}", flush=True)
                continue
            for mix in ((0.98, 0.01), (0.01, 0.98), (0.3, 0.5)):
                ctx = [long_ctx, 1000, 3001, 17, 2048, 513, 64, long_ctx - 5]
                check(f"decode_attention[{variant}]", f"D{d} {name} hi/lo {mix} B8 <= {long_ctx}",
                      decode_attention_check(geo, ctx, 8, 4, mix, seed=d + int(mix[0] * 100),
                                             variant=variant))
    ext_ctx = [0, 1, 700, long_ctx]
    ext_new = [300, 1, 1000, 1024 if args.quick else 2048]
    for d, tiers, name in ((128, (K8V4, K4V2), "K8V4/K4V2"),
                           (128, (K8V4_GROUPED, K4V2_GROUPED), "K8V4g12/K4V2g24"),
                           (64, (K8V4, K4V2), "K8V4/K4V2")):
        geo = PageGeometry.build(d, *tiers)
        for mix, splits in (((0.98, 0.01), None), ((0.3, 0.5), None), ((0.3, 0.5), 4)):
            check("extend_attention", f"D{d} {name} hi/lo {mix} prefix <= {long_ctx} "
                  f"new <= {max(ext_new)} splits {splits or 'auto'}",
                  extend_attention_check(geo, ext_ctx, ext_new, 8, 4, mix, seed=d + 1,
                                         splits=splits))
    for d in (64, 128, 256):
        for tiers in ((K8V4, K4V2), (K8V4_GROUPED, K4V2_GROUPED)):
            for dtype in (torch.float16, torch.bfloat16):
                check("store_tokens", f"D{d} {tiers[0].name}/{tiers[1].name} {dtype}",
                      store_check(d, tiers, dtype))
    plens = [1000, 3000] if args.quick else [1000, 4096, 16384]
    for n in plens:
        check("prefill_scores", f"L={n} Hq32 Hkv8 D128 Q64", prefill_check([n, n // 3 + 1],
                                                                            32, 8, 128))
    check("prefill_scores(packed)", "L=(1000, 17, 1, 4096, 300) Hq32 Hkv8 D128 Q64",
          prefill_packed_check([1000, 17, 1, 4096, 300], 32, 8, 128))
    check("prefill_scores(stored keys)", "L=(6144, 2600) from (4096, 0) Hq32 Hkv8 D128 Q64",
          prefill_stored_check([6144, 2600], [4096, 0], 32, 8, 128))
    check("compress_prefill", "L=(1000, 4096) Hkv8 D128", compress_check([1000, 4096], 8, 128))
    check("decode_policy", "B3 Hkv8 D128, 24 steps", policy_check([300, 150, 513], 8, 128, 24))
    check("decode_policy", "B3 Hkv8 D128, 12 steps, bench (.3,.5,.2)",
          policy_check([300, 150, 513], 8, 128, 12, bench=(0.3, 0.5, 0.2)))
    check("decode_policy", "B305 Hkv8 D128 ctx 1k-3k, random state",
          policy_large_check(305, 1000, 3000, 8, seed=3))
    check("decode_policy", "B7 Hkv8 D128 ctx 20-200, random state",
          policy_large_check(7, 20, 200, 8, seed=4))
    for fill in ("loop", "pass"):
        check(f"decode_policy[fused {fill}]",
              "B369 Hkv8 G4 D128 ctx 2k-4k, 4 steps, shared rows",
              fused_argmin_check(369, 2000, 4000, 8, 4, 4, seed=54, fill=fill))
        check(f"decode_policy[fused {fill}]", "B7 Hkv8 G4 D128 ctx 20-300, 6 steps, shared rows",
              fused_argmin_check(7, 20, 300, 8, 4, 6, seed=55, fill=fill))
    check("compaction(cuda)", "B128 x 32 layers x 8 heads",
          compaction_check(128, 32, 8, cooperative=False))
    check("compaction(cuda)", "B7 x 3 layers x 2 heads",
          compaction_check(7, 3, 2, cooperative=False))
    for b, lyr, h in ((128, 32, 8), (7, 3, 2), (1, 1, 1), (300, 32, 8)):
        check("compaction(coop)", f"B{b} x {lyr} layers x {h} heads",
              compaction_check(b, lyr, h, cooperative=True))

    print("\n| check | config | result | pass | s |\n|---|---|---|---|---|")
    for name, cfg, metric, ok, sec in ROWS:
        print(f"| {name} | {cfg} | {metric} | {'PASS' if ok else 'FAIL'} | {sec:.1f} |")
    failed = sum(not r[3] for r in ROWS)
    print(f"\n{len(ROWS) - failed}/{len(ROWS)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
