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

``test_gpu_step_is_sync_free`` (``gpu``): the same on CUDA at the Llama-3-8B head shape,
with ``torch.cuda.set_sync_debug_mode("error")`` around every layer of the kernel path (any
host sync raises), and the syncs of each step's per-step work counted and printed.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import pytest
import torch
from extend_case import CFG, HKV, LAYERS, D, G

from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.pages import read_scores, read_token_codes, token_locations
from sglang_diffkv.prompt_sharing import PromptSharing
from sglang_diffkv.sglang.ops import DiffKVOps

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1 (on a GPU: "
    "test_gpu_step_is_sync_free)")

CUT = 8
BENCH = CFG.__class__.from_dict({**CFG.to_dict(), "bench_mix": [0.4, 0.35, 0.25]})


@dataclass(frozen=True)
class Shape:
    head_dim: int = D
    kv_heads: int = HKV
    group: int = G
    layers: int = LAYERS

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


SMALL = Shape()  # extend_case's
LLAMA = Shape(128, 8, 4, 2)  # Llama-3-8B's heads (per layer), two layers


def qkv(n: int, seed: int, shape: Shape) -> tuple[torch.Tensor, ...]:
    """q [layers, n, Hq, D], k / v [layers, n, Hkv, D], fp32, seeded (extend_case.qkv's
    distribution: attention sharp enough to use all three tiers)."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = shape.kv_heads, shape.head_dim
    q = torch.randn(shape.layers, n, hkv * shape.group, d, generator=g) * 1.5
    k = torch.randn(shape.layers, n, hkv, d, generator=g) * 1.5
    v = torch.randn(shape.layers, n, hkv, d, generator=g)
    return q, k, v


@dataclass
class Prompt:
    q: torch.Tensor  # [layers, n, Hq, D] bf16: the whole prompt's
    k: torch.Tensor
    v: torch.Tensor
    hit: tuple[str, int] | None = None  # (exporter, cut): attach its first cut positions
    alpha: tuple[float, float] | None = None  # its thresholds (None: the config's)


def prompt(n: int, seed: int, alpha: tuple[float, float] | None = None,
           far: bool = False, shape: Shape = SMALL) -> Prompt:
    """``far``: keys far from zero relative to their spread (250 +- 0.5), where
    re-quantising a stored token's dequantised K8 values is often not the identity (its
    bytes must be kept)."""
    q, k, v = qkv(n, seed, shape)
    if far:
        k = 250 + k / 3
    return Prompt(q.bfloat16(), k.bfloat16(), v.bfloat16(), alpha=alpha)


def hit(of: Prompt, exporter: str, cut: int, suffix: int, seed: int,
        far: bool = False, shape: Shape = SMALL) -> Prompt:
    """A prompt sharing ``of``'s first ``cut`` positions (their q / k / v are never fed:
    the attached tokens are the exporter's), under its thresholds."""
    s = prompt(suffix, seed, far=far, shape=shape)
    return Prompt(*(torch.cat([a[:, :cut], b], 1) for a, b in
                    ((of.q, s.q), (of.k, s.k), (of.v, s.v))), hit=(exporter, cut),
                  alpha=of.alpha)


class Run:
    """One cache driven through the ops seam as the SGLang pool and backend drive it."""

    def __init__(self, config, kernels: bool, shape: Shape = SMALL,
                 device: str = "cpu", max_context: int = 256, num_pages: int = 400) -> None:
        self.shape = shape
        self.c = CompressedKVCache(config, head_dim=shape.head_dim, num_layers=shape.layers,
                                   num_kv_heads=shape.kv_heads, num_pages=num_pages, max_reqs=8,
                                   max_context=max_context, device=device)
        self.c.pages.fill_(0xFF)  # poison: every byte a path reads it must have written
        self.c.radix = PromptSharing(self.c, CUT, copy_attach=True)
        self.ops = DiffKVOps(self.c, kernels, fused_argmin=False)
        self.kernels = kernels
        self.device = torch.device(device)
        # CUDA, kernel path: syncs per step outside the layers (set_sync_debug_mode warns)
        self.step_syncs: list[int] = []
        self.slots: dict[str, int] = {}
        self.stored: dict[str, int] = {}
        self.handles: dict[str, object] = {}

    def begin(self, prompts: dict[str, Prompt], chunks: list[tuple[str, int]]
              ) -> tuple[torch.Tensor, list[int], ExtendRequests, list[int],
                         tuple[list[torch.Tensor], ...]]:
        """The start of ``step`` before the ops seam: radix hits attached, new prompts'
        pages allocated, the completed prompts announced to the exporter. Returns (req,
        fresh lengths, the step's ExtendRequests, the completed prompts' indices in
        ``chunks``, the step's packed (q, k, v) per layer)."""
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
        req = torch.tensor(slots, device=self.device)
        fresh = [n for _, n in chunks]
        ext = ExtendRequests.build(req, slots, fresh, prefix, totals)
        layers = range(self.shape.layers)
        qkv = tuple([torch.cat([getattr(prompts[rid], x)[layer, p:p + n]
                                for (rid, n), p in zip(chunks, prefix, strict=True)]
                               ).to(self.device) for layer in layers] for x in "qkv")
        return req, fresh, ext, done, qkv

    def step(self, prompts: dict[str, Prompt], chunks: list[tuple[str, int]]
             ) -> list[torch.Tensor]:
        """One extend step of ``chunks`` (rid, fresh tokens); returns each layer's output."""
        r = self.c.radix
        req, fresh, ext, done, (q, k, v) = self.begin(prompts, chunks)
        slots = [self.slots[rid] for rid, _ in chunks]
        prefix = list(ext.prefix)
        layers = range(self.shape.layers)
        on_gpu = self.kernels and self.device.type == "cuda"
        with sync_debug("warn" if on_gpu else None) as seen:
            step = self.ops.begin_prefill_step(req, fresh, ext=ext)
        if self.kernels and step.stores is not None:
            poison(step.stores)
        outs = []
        with sync_debug("error" if on_gpu else None):  # (no sync inside a layer)
            for layer in layers:
                outs.append(self.ops.extend_layer(layer, step, q[layer], k[layer], v[layer],
                                                  self.shape.scale))
        with sync_debug("warn" if on_gpu else None) as seen_end:
            self.ops.end_prefill_step(step)
        self.step_syncs.append(len(seen) + len(seen_end))
        for (rid, n), p in zip(chunks, prefix, strict=True):
            self.stored[rid] = p + n
        for i in done:
            rid = chunks[i][0]
            self.handles[rid] = r.take_export(slots[i])
            assert self.handles[rid] is not None
        return outs


class sync_debug:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside (None: nothing); with "warn", the
    sync warnings it raised are the context's value."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode
        self.seen: list = []

    def __enter__(self) -> list:
        if self.mode is not None:
            self._catch = warnings.catch_warnings(record=True)
            self.seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)
        return self.seen

    def __exit__(self, *exc) -> None:
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
            self.seen[:] = [w for w in self.seen if "synchroniz" in str(w.message)]


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
        for layer in range(kr.shape.layers):
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


def run_both(config, prompts: dict[str, Prompt], steps: list[list[tuple[str, int]]],
             **kw) -> Run:
    kr, rr = Run(config, kernels=True, **kw), Run(config, kernels=False, **kw)
    for chunks in steps:
        ok, orr = kr.step(prompts, chunks), rr.step(prompts, chunks)
        for a, b in zip(ok, orr, strict=True):
            w = b.double()
            assert float(torch.linalg.norm(a.double() - w) / torch.linalg.norm(w)) < 2e-2
        assert_same_state(kr, rr)
    return kr


@interpreted
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


@interpreted
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


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="on the GPU, not the interpreter")
def test_gpu_step_is_sync_free() -> None:
    """On CUDA at the Llama-3-8B head shape: steps mixing a chunked prompt's last chunk
    (shorter than score_queries), radix hits with suffixes in one and two chunks, a whole
    prompt and a first chunk, against the reference path; every layer of the kernel path
    runs under set_sync_debug_mode("error"). Prints each step's per-step syncs (begin and
    end of the step: the attach, the uploads, the reclaim and export) for the record."""
    s = LLAMA
    x = prompt(600, 1, shape=s)
    prompts = {
        "x": x,
        "p": prompt(700, 2, shape=s),  # chunks 300, 395, 5
        "w": prompt(200, 3, shape=s),
        "h1": hit(x, "x", 512, 150, 4, shape=s),  # suffix in one chunk
        "h2": hit(x, "x", 256, 400, 5, shape=s),  # suffix in chunks 300, 100
    }
    steps = [[("x", 600), ("p", 300)], [("p", 395), ("h1", 150), ("h2", 300)],
             [("p", 5), ("h2", 100), ("w", 200)]]
    kr = run_both(CFG, prompts, steps, shape=s, device="cuda", max_context=1024,
                  num_pages=4000)
    print(f"per-step syncs of the kernel path (begin + end of each step): {kr.step_syncs}")
