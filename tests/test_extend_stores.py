"""The kernel path's chunk and prompt-end stores (``sglang_diffkv.sglang.extend_ops``,
``kernels.extend_store``) against the torch reference, through the ops seam
(``DiffKVOps.begin_prefill_step`` / ``extend_layer`` / ``end_prefill_step``, no SGLang),
under TRITON_INTERPRET=1.

Two caches start equal (their free pages filled with 0xFF, so a byte read before it is
written shows) and run the same extend steps, one per path, with several requests per step:
chunked prompts whose last chunk is shorter and longer than score_queries, whole prompts,
first chunks, and radix hits whose suffix comes in one chunk and in several (the last one
shorter than score_queries), with and without benchmark mode. After every step: the page
tables, counters and phases equal; every stored token's K/V bytes and virtual position
equal, its score within fp32 rounding (the kernels sum the significance in another order);
the rows' kept counts and every exported prompt's cut counts equal; the extend outputs
within bf16 rounding. The kernel path's scratch is poisoned (NaN, 0x7F) before every step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from extend_case import CFG, HKV, LAYERS, SCALE, D, qkv

from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.pages import read_scores, read_token_codes, token_locations
from sglang_diffkv.prompt_sharing import PromptSharing
from sglang_diffkv.sglang.ops import DiffKVOps

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1 (the GPU runs "
    "them in tests/sglang/test_extend_gpu.py)")

CUT = 8
BENCH = CFG.__class__.from_dict({**CFG.to_dict(), "bench_mix": [0.4, 0.35, 0.25]})


@dataclass
class Prompt:
    q: torch.Tensor  # [layers, n, Hq, D] bf16: the whole prompt's
    k: torch.Tensor
    v: torch.Tensor
    hit: tuple[str, int] | None = None  # (exporter, cut): attach its first cut positions
    alpha: tuple[float, float] | None = None  # its thresholds (None: the config's)


def prompt(n: int, seed: int, alpha: tuple[float, float] | None = None,
           far: bool = False) -> Prompt:
    """``far``: keys far from zero relative to their spread (250 +- 0.5), where
    re-quantising a stored token's dequantised K8 values is often not the identity (its
    bytes must be kept)."""
    q, k, v = qkv(n, seed)
    if far:
        k = 250 + k / 3
    return Prompt(q.bfloat16(), k.bfloat16(), v.bfloat16(), alpha=alpha)


def hit(of: Prompt, exporter: str, cut: int, suffix: int, seed: int,
        far: bool = False) -> Prompt:
    """A prompt sharing ``of``'s first ``cut`` positions (their q / k / v are never fed:
    the attached tokens are the exporter's), under its thresholds."""
    s = prompt(suffix, seed, far=far)
    return Prompt(*(torch.cat([a[:, :cut], b], 1) for a, b in
                    ((of.q, s.q), (of.k, s.k), (of.v, s.v))), hit=(exporter, cut),
                  alpha=of.alpha)


class Run:
    """One cache driven through the ops seam as the SGLang pool and backend drive it."""

    def __init__(self, config, kernels: bool) -> None:
        self.c = CompressedKVCache(config, head_dim=D, num_layers=LAYERS, num_kv_heads=HKV,
                                   num_pages=400, max_reqs=8, max_context=256)
        self.c.pages.fill_(0xFF)  # poison: every byte a path reads it must have written
        self.c.radix = PromptSharing(self.c, CUT, copy_attach=True)
        self.ops = DiffKVOps(self.c, kernels, fused_argmin=False)
        self.kernels = kernels
        self.slots: dict[str, int] = {}
        self.stored: dict[str, int] = {}
        self.handles: dict[str, object] = {}

    def step(self, prompts: dict[str, Prompt], chunks: list[tuple[str, int]]
             ) -> list[torch.Tensor]:
        """One extend step of ``chunks`` (rid, fresh tokens); returns each layer's output."""
        c, r = self.c, self.c.radix
        cfg = c.config
        for rid, _ in chunks:
            self.slots.setdefault(rid, 1 + len(self.slots))
        slots = [self.slots[rid] for rid, _ in chunks]
        totals = [prompts[rid].q.shape[1] for rid, _ in chunks]
        alphas = [prompts[rid].alpha or (cfg.alpha_h, cfg.alpha_l) for rid, _ in chunks]
        prefix = []
        for (rid, _), slot, total, alpha in zip(chunks, slots, totals, alphas, strict=True):
            p = prompts[rid]
            if rid not in self.stored and p.hit is not None:  # the tree hit, attached
                exporter, cut = p.hit
                res, room = r.attach(slot, self.handles[exporter], cut, total - cut, alpha)
                res.raise_if_failed()
                room.raise_if_failed()
                self.stored[rid] = cut
            prefix.append(self.stored.get(rid, 0))
        new = [i for i, p in enumerate(prefix) if p == 0]
        if new:
            res = c.begin_prefill([slots[i] for i in new], [chunks[i][1] for i in new],
                                  [alphas[i][0] for i in new], [alphas[i][1] for i in new],
                                  reserve=[totals[i] for i in new])
            res.raise_if_failed()
        done = [i for i, ((_, n), p, t) in enumerate(zip(chunks, prefix, totals, strict=True))
                if p + n == t]
        r.begin_prompts([slots[i] for i in done], [totals[i] for i in done], keep_free=0)
        req = torch.tensor(slots)
        fresh = [n for _, n in chunks]
        ext = ExtendRequests.build(req, slots, fresh, prefix, totals)
        step = self.ops.begin_prefill_step(req, fresh, ext=ext)
        if self.kernels and step.stores is not None:
            poison(step.stores)
        outs = []
        for layer in range(LAYERS):
            q, k, v = (torch.cat([getattr(prompts[rid], x)[layer, p:p + n]
                                  for (rid, n), p in zip(chunks, prefix, strict=True)])
                       for x in "qkv")
            outs.append(self.ops.extend_layer(layer, step, q, k, v, SCALE))
        self.ops.end_prefill_step(step)
        for (rid, n), p in zip(chunks, prefix, strict=True):
            self.stored[rid] = p + n
        for i in done:
            rid = chunks[i][0]
            self.handles[rid] = r.take_export(slots[i])
            assert self.handles[rid] is not None
        return outs


def poison(stores) -> None:
    """Every scratch buffer a kernel writes before it is read, filled with garbage."""
    for part in (stores.chunks, stores.ends):
        if part is None:
            continue
        for name, x in vars(part).items():
            if isinstance(x, torch.Tensor) and name in (
                    "packed_k", "packed_v", "raw", "key_first", "sig", "tier", "block_counts",
                    "totals"):
                x.fill_(float("nan") if x.is_floating_point() else 0x7F)


def assert_same_state(kr: Run, rr: Run) -> None:
    ck, cr = kr.c, rr.c
    for name in ("table", "counts", "phase", "shared"):
        assert torch.equal(getattr(ck.manager, name), getattr(cr.manager, name)), name
    assert torch.equal(ck._prompt_kept, cr._prompt_kept)
    for rid, slot in kr.slots.items():
        for layer in range(LAYERS):
            for t, layout in enumerate(ck.geometry.tiers):
                n = ck.counts[slot, layer, :, t].long()
                if not n.any():
                    continue
                loc = token_locations(ck.manager.table[slot, layer][None], n[None],
                                      layout.tokens_per_page, low=t == 1,
                                      capacity=int(n.max()))
                ids, sl = loc.page_ids[loc.mask], loc.slots[loc.mask]
                for a, b in zip(read_token_codes(ck.pages, layout, ids, sl),
                                read_token_codes(cr.pages, layout, ids, sl), strict=True):
                    assert torch.equal(a, b), (rid, layer, t)
                (sk, pk), (sr, pr) = (read_scores(x.pages, layout, ids, sl) for x in (ck, cr))
                assert torch.equal(pk, pr), (rid, layer, t)
                torch.testing.assert_close(sk, sr, rtol=1e-4, atol=1e-6)
    assert kr.handles.keys() == rr.handles.keys()
    for rid in kr.handles:
        hk, hr = kr.handles[rid], rr.handles[rid]
        assert torch.equal(hk.cuts, hr.cuts), rid
        assert torch.equal(hk.n_tokens, hr.n_tokens), rid
    ck.manager.check_invariants()


def run_both(config, prompts: dict[str, Prompt], steps: list[list[tuple[str, int]]]) -> Run:
    kr, rr = Run(config, kernels=True), Run(config, kernels=False)
    for chunks in steps:
        ok, orr = kr.step(prompts, chunks), rr.step(prompts, chunks)
        for a, b in zip(ok, orr, strict=True):
            w = b.double()
            assert float(torch.linalg.norm(a.double() - w) / torch.linalg.norm(w)) < 2e-2
        assert_same_state(kr, rr)
    return kr


@pytest.mark.parametrize("config", [CFG, BENCH], ids=["scores", "bench-mix"])
def test_kernel_stores_match_the_reference(config) -> None:
    x = prompt(40, 1)
    prompts = {
        "x": x,  # whole, exported: the tree the hits attach to
        "p": prompt(50, 2),  # chunks 20, 25, 5: a last chunk shorter than score_queries
        "r": prompt(30, 3),  # chunks 10, 20: a last chunk longer than score_queries
        "w": prompt(12, 4),  # whole, sharing a step with chunks
        "h1": hit(x, "x", 32, 10, 5),  # its suffix in one chunk
        "h2": hit(x, "x", 16, 20, 6),  # its suffix in chunks 15, 5 (< score_queries)
        "h3": hit(x, "x", 8, 30, 7),  # its suffix in one chunk longer than score_queries
    }
    steps = [
        [("x", 40), ("p", 20)],
        [("p", 25), ("h1", 10), ("h2", 15)],
        [("p", 5), ("h2", 5), ("w", 12), ("r", 10)],
        [("r", 20), ("h3", 30)],
    ]
    kr = run_both(config, prompts, steps)
    assert kr.c.counts[kr.slots["p"], ..., 1].any()  # (every tier in use)


def test_kernel_stores_keep_bytes_and_grow_low_pages() -> None:
    """Rows where the stores' rarer branches decide the bytes: stored tokens that stay
    high with keys far from zero (their bytes are copied back, a re-quantisation would
    differ), in a chunked prompt and in a radix suffix over an all-high prefix; and a suffix
    whose low tokens fill the attached prefix's last low page and take new ones (low page
    m >= the row's low pages: a column of the high run)."""
    keep, low = (0.0, 0.0), (50.0, 0.0)  # every token high; every one low but the window
    xl, xk = prompt(100, 11, low), prompt(40, 12, keep, far=True)
    prompts = {
        "xl": xl, "xk": xk,
        "hl": hit(xl, "xl", 64, 60, 13),  # 60 attached low tokens (2 low pages), 56 more
        "hk": hit(xk, "xk", 32, 30, 14, far=True),
        "pk": prompt(50, 15, keep, far=True),
    }
    steps = [[("xl", 100), ("xk", 40)], [("hl", 30), ("hk", 20), ("pk", 30)],
             [("hl", 30), ("hk", 10), ("pk", 20)]]
    kr = run_both(CFG, prompts, steps)
    per_page = kr.c.geometry.low.tokens_per_page
    assert int(kr.c.counts[kr.slots["hl"], ..., 1].min()) > 2 * per_page
