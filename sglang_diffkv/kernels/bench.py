"""Kernel benchmarks on the GPU (issue 5): decode attention, prefill scoring + compression,
decode-step compaction, the decode policy step (``--only policy``: scan vs parallel
argmin; ``--only fused``: scan vs the argmin fused into the merge pass, issue 54).
Prints markdown tables and writes them (and JSON) under --out.

Decode attention: batch x context x tier mix, 32 query / 8 KV heads, head_dim 128. Bytes
are the page bytes the step's tokens occupy (whole pages: metadata, score, position and the
unused tail included), bandwidth is relative to a measured device-to-device copy (bytes read
+ written). Baseline: SGLang 0.5.10's Triton decode kernel (decode_attention_fwd) on a bf16
cache of the same context, loaded from the wheel in .whl/ when present; otherwise torch
SDPA on bf16 (the table says which).

    python -m sglang_diffkv.kernels.bench --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import time
import types
import zipfile
from functools import partial
from pathlib import Path

import torch
import triton

from sglang_diffkv import decode_hint
from sglang_diffkv.config import K4V2, K8V4
from sglang_diffkv.kernels import (
    DecodeAttentionPlan,
    PrefillBuffers,
    compaction_backend,
    compress_prefill,
    decode_compaction,
    decode_compaction_reference,
    prefill_scores,
)
from sglang_diffkv.kernels.decode_attention import VARIANTS, resolve_variant
from sglang_diffkv.kernels.decode_policy import (
    ARGMIN_BLOCK,
    ARGMIN_PROGRAMS,
    SCAN_BLOCK,
    argmin_partials,
    argmin_splits,
    decode_policy_step,
)
from sglang_diffkv.kernels.testing import random_decode_case
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import MemorySpec, PageManager
from sglang_diffkv.prompt_attention import PackedPrompts, choose_prompt_attention

DEV = "cuda"
HQ, HKV, D = 32, 8, 128
LAYERS = 32  # Llama-3-8B


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds (CUDA events, triton.testing.do_bench): eager launches, so the
    host's launch overhead counts wherever the GPU work is shorter than it."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def capture_graph(fn, reps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` calls of ``fn``, warmed up first on the default and a side
    stream (compiles and allocator pools settle outside the capture)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def bench_graph(fn, reps: int = 20) -> float:
    """Median milliseconds per call of ``fn`` captured in a CUDA graph (``reps`` calls per
    graph, the way a decode step runs under CUDA graphs: no host launch overhead)."""
    g = capture_graph(fn, reps)
    return triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median") / reps


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus written."""
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(partial(dst.copy_, src))
    return 2 * n / (ms * 1e-3)


def sglang_decode():
    """SGLang's decode_attention_fwd from the carried wheel (only its module, no deps)."""
    wheels = sorted(glob.glob(".whl/sglang-*.whl"))
    if not wheels:
        return None, "no .whl/sglang-*.whl"
    try:
        with zipfile.ZipFile(wheels[-1]) as z:
            src = z.read("sglang/srt/layers/attention/triton_ops/decode_attention.py").decode()
        src = src.replace("from sglang.srt.utils import is_hip", "def is_hip():\n    return False")
        path = Path("/tmp/sglang_decode_attention.py")  # triton.jit needs a real source file
        path.write_text(src)
        mod = types.ModuleType("sglang_decode_attention")
        mod.__file__ = str(path)
        exec(compile(src, str(path), "exec"), mod.__dict__)
        return mod.decode_attention_fwd, Path(wheels[-1]).name
    except Exception as e:  # noqa: BLE001 - any failure means: fall back to SDPA
        return None, f"{type(e).__name__}: {e}"


def baseline_time(fwd, b: int, ctx: int) -> float:
    """Decode over a bf16 cache of the same context (all tokens kept)."""
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    if fwd is not None:
        k = torch.randn(b * ctx, HKV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(b * ctx, HKV, D, device=DEV, dtype=torch.bfloat16)
        o = torch.empty(b, HQ, D, device=DEV, dtype=torch.bfloat16)
        indptr = torch.arange(b + 1, device=DEV, dtype=torch.int32) * ctx
        indices = torch.arange(b * ctx, device=DEV, dtype=torch.int64)
        splits = 16
        logits = torch.empty(b, HQ, splits, D, device=DEV, dtype=torch.float32)
        lse = torch.empty(b, HQ, splits, device=DEV, dtype=torch.float32)
        nsplit = torch.full((b,), splits, device=DEV, dtype=torch.int32)
        ms = bench_graph(partial(fwd, q, k, v, o, indptr, indices, logits, lse, nsplit,
                                 splits, D**-0.5, 1.0, 1.0))
    else:
        k = torch.randn(b, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(b, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)
        qq = q.unsqueeze(2)
        ms = bench_graph(partial(torch.nn.functional.scaled_dot_product_attention, qq, k, v,
                                 enable_gqa=True))
    return ms


MIXES = {"K8V4": (1.0, 0.0), "K4V2": (0.0, 1.0), "30/50/20": (0.3, 0.5)}


def decode_rows(copy_bw: float, quick: bool, variants: list[str],
                batches: tuple[int, ...] | None = None,
                contexts: tuple[int, ...] | None = None) -> tuple[list[dict], str]:
    fwd, base_name = sglang_decode()
    base_label = f"SGLang Triton decode ({base_name})" if fwd else f"torch SDPA ({base_name})"
    geo = PageGeometry.build(D, K8V4, K4V2)
    rows = []
    batches = batches or ((8, 32) if quick else (8, 32, 128))
    contexts = contexts or ((1024, 4096) if quick else (1024, 4096, 16384))
    base_cache: dict[tuple[int, int], float] = {}
    for b in batches:
        for ctx in contexts:
            try:
                base_cache[(b, ctx)] = baseline_time(fwd, b, ctx)
            except Exception as e:  # noqa: BLE001 - SGLang's kernel failed: use SDPA
                print(f"baseline failed ({type(e).__name__}: {e}); switching to SDPA",
                      flush=True)
                fwd, base_label = None, f"torch SDPA (SGLang kernel failed: {e})"
                base_cache[(b, ctx)] = baseline_time(fwd, b, ctx)
            torch.cuda.empty_cache()
            for mix, (fh, fl) in MIXES.items():
                try:
                    rows += decode_one(geo, b, ctx, mix, fh, fl, copy_bw, base_cache[(b, ctx)],
                                       variants)
                except Exception as e:  # noqa: BLE001 - report and keep benchmarking
                    print(f"decode B{b} ctx{ctx} {mix}: FAILED {type(e).__name__}: {e}",
                          flush=True)
                torch.cuda.empty_cache()
    return rows, base_label


# ``:<letter><N>`` options of a variant spec -> the plan keyword they set
VARIANT_OPTIONS = {"s": "num_stages", "p": "target_programs", "w": "merge_warps",
                   "t": "merge_tile"}


def serving_variant() -> str:
    """The split-K pass a served plan of the benchmark's shape runs here (``--variants
    auto``): what ``DecodeAttentionPlan``'s default resolves to, said once."""
    v = resolve_variant("auto", PageGeometry.build(D, K8V4, K4V2), HQ // HKV, 1,
                        torch.device(DEV))
    print(f"--variants auto: {v} (the split-K pass serving runs here)", flush=True)
    return v


def variant_plan(spec: str) -> dict:
    """Plan keywords of a variant spec: NAME (one of decode_attention.VARIANTS) with an
    optional ``@REGS`` register cap per thread (e.g. ``asm@112``: the asm loop spills at the
    default cap of 96, not at 112, but fits 4 instead of 5 programs per SM), an optional
    ``:sS`` pipeline depth (``cuda:s4``: four pages in flight per program; ``cuda:s0``:
    register prefetch), ``:pP`` programs per SM the split targets (``cuda:s4:p12``), and for
    the merge pass ``:wW`` warps per program and ``:tT`` score elements per tile."""
    head, *opts = spec.split(":")
    name, _, regs = head.partition("@")
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r} in {spec!r}; known: {sorted(VARIANTS)}")
    kw = {**TUNED, "variant": name}
    if regs:
        kw["maxnreg"] = int(regs) or None  # @0: no cap
    for opt in opts:
        key, value = opt[:1], opt[1:]
        if key not in VARIANT_OPTIONS or not value.isdigit():
            raise ValueError(f"variant option {opt!r} in {spec!r}: expected sN, pN, wN or tN")
        kw[VARIANT_OPTIONS[key]] = int(value)
        if key == "p":  # programs per SM -> programs
            kw["target_programs"] *= torch.cuda.get_device_properties(DEV).multi_processor_count
    if name == "cuda":
        kw.pop("maxnreg", None)  # (a Triton knob)
    return kw


def decode_one(geo, b, ctx, mix, fh, fl, copy_bw, base_ms, variants) -> list[dict]:
    """One case (one cache state and q), every variant on it; the first variant is also
    timed eagerly (host launch overhead included)."""
    case = random_decode_case(geo, [ctx] * b, HKV, high_frac=fh, low_frac=fl,
                              device=DEV, seed=b + ctx)
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    stored = case.stored_bytes(0)
    bf16 = b * ctx * HKV * D * 2 * 2
    ratio = bf16 / stored
    rows = []
    for i, variant in enumerate(variants):
        plan = DecodeAttentionPlan.build(geo, HQ, HKV, b, ctx, DEV, **variant_plan(variant))
        run = partial(plan.run, q, case.pages, case.table, case.counts, case.req_idx, 0,
                      D**-0.5)
        try:
            ms = bench_graph(run)
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
            print(f"decode B{b} ctx{ctx} {mix} [{variant}]: FAILED {type(e).__name__}: {e}",
                  flush=True)
            continue
        eager = bench(run) if i == 0 else float("nan")
        bw = stored / (ms * 1e-3)
        speedup = base_ms / ms
        rows.append(dict(variant=variant, batch=b, context=ctx, mix=mix, ms=ms,
                         stored_mb=stored / 1e6, bw_tbs=bw / 1e12, bw_frac=bw / copy_bw,
                         base_ms=base_ms, speedup=speedup, byte_ratio=ratio,
                         speedup_vs_ratio=speedup / ratio, tokens=b * ctx,
                         scratch_mb=plan.scratch_bytes() / 1e6, eager_ms=eager))
        print(f"decode B{b} ctx{ctx} {mix} [{variant}]: {ms * 1e3:.1f} us, "
              f"{bw / 1e12:.2f} TB/s ({bw / copy_bw:.0%} of copy), speedup {speedup:.2f}x "
              f"(byte ratio {ratio:.2f}, {speedup / ratio:.2f} of it)", flush=True)
        del plan
    return rows


def stage_rows(copy_bw: float, variants: list[str],
               cases: tuple[tuple[int, int], ...] = ((32, 16384),)) -> list[dict]:
    """Split-K pass and merge pass timed alone, per variant, on each (batch, context) of
    ``cases`` and each mix (where the time goes; the sum is a little more than the step: two
    graphs instead of one)."""
    geo = PageGeometry.build(D, K8V4, K4V2)
    rows = []
    for (b, ctx), mix in ((c, m) for c in cases for m in ("K8V4", "K4V2", "30/50/20")):
        fh, fl = MIXES[mix]
        case = random_decode_case(geo, [ctx] * b, HKV, high_frac=fh, low_frac=fl, device=DEV,
                                  seed=7)
        q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
        stored = case.stored_bytes(0)
        args = (q, case.pages, case.table, case.counts, case.req_idx, 0, D**-0.5)
        for variant in variants:
            plan = DecodeAttentionPlan.build(geo, HQ, HKV, b, ctx, DEV, **variant_plan(variant))
            try:
                t = bench_graph(partial(plan.run, *args))
                tp = bench_graph(partial(plan.run, *args, stages="partition"))
                tm = bench_graph(partial(plan.run, *args, stages="merge"))
            except Exception as e:  # noqa: BLE001
                print(f"stages {mix} [{variant}]: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            rows.append(dict(variant=variant, mix=mix, batch=b, context=ctx, ms=t,
                             partition_ms=tp, merge_ms=tm,
                             bw_frac=stored / (t * 1e-3) / copy_bw))
            print(f"stages B{b} ctx{ctx} {mix} [{variant}]: {t * 1e3:.0f} us (partition "
                  f"{tp * 1e3:.0f}, merge {tm * 1e3:.0f}), {rows[-1]['bw_frac']:.0%} of copy",
                  flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def variant_table(decode: list[dict], variants: list[str]) -> str:
    """One compact table: a row per case, per variant: us / % of copy BW / speedup vs the
    baseline / speedup over the byte ratio."""
    cases = sorted({(r["batch"], r["context"], r["mix"]) for r in decode},
                   key=lambda c: (c[0], c[1], list(MIXES).index(c[2])))
    by = {(r["variant"], r["batch"], r["context"], r["mix"]): r for r in decode}
    head = "| batch | context | mix | baseline (us) | byte ratio | " + " | ".join(
        f"{v}: us / %BW / speedup / sp÷ratio" for v in variants) + " |"
    lines = [head, "|" + "---|" * (5 + len(variants))]
    for c in cases:
        any_r = next(by[(v, *c)] for v in variants if (v, *c) in by)
        cells = []
        for v in variants:
            r = by.get((v, *c))
            cells.append("failed" if r is None else
                         f"{r['ms'] * 1e3:.1f} / {r['bw_frac']:.0%} / {r['speedup']:.2f} / "
                         f"{r['speedup_vs_ratio']:.2f}")
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {any_r['base_ms'] * 1e3:.1f} | "
                     f"{any_r['byte_ratio']:.2f} | " + " | ".join(cells) + " |")
    big = [r for r in decode if r["tokens"] >= 128 * 1024]
    for v in variants:
        rv = [r for r in big if r["variant"] == v]
        if rv:
            lines.append(f"\n{v}, batch*context >= 128k: {min(r['bw_frac'] for r in rv):.0%}"
                         f"...{max(r['bw_frac'] for r in rv):.0%} of copy BW, speedup/ratio "
                         f"{min(r['speedup_vs_ratio'] for r in rv):.2f}..."
                         f"{max(r['speedup_vs_ratio'] for r in rv):.2f}")
    return "\n".join(lines)


# (pages per iteration, warps, pipeline stages, target programs per SM, register cap)
SWEEP = [(1, 4, 2, 8, 0), (1, 4, 3, 8, 0), (1, 4, 2, 16, 0), (1, 2, 2, 16, 0), (2, 4, 2, 8, 0),
         (1, 4, 2, 8, 96), (1, 4, 2, 16, 80), (1, 4, 2, 8, 128), (1, 4, 3, 8, 96),
         (2, 4, 2, 8, 96), (1, 8, 2, 8, 0)]
# (mix, batch, context) of the sweep: two long-row cases by default; --sweep-case adds or
# replaces them (e.g. the end-to-end run's 30/50/20 x 384 x 2048: many short rows)
SWEEP_CASES = [("K8V4", 32, 16384), ("K4V2", 32, 16384)]
TUNED: dict[str, int] = {}


def sweep(copy_bw: float, cases: list[tuple[str, int, int]] = SWEEP_CASES) -> list[dict]:
    """Launch configurations of the decode kernel on each (mix, batch, context) case; each
    launch timed alone too (partition = the split-K pass, merge = LSE merge + output +
    scores)."""
    geo = PageGeometry.build(D, K8V4, K4V2)
    rows = []
    for mix, b, ctx in cases:
        fh, fl = MIXES[mix]
        case = random_decode_case(geo, [ctx] * b, HKV, high_frac=fh, low_frac=fl, device=DEV,
                                  seed=7)
        q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
        stored = case.stored_bytes(0)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        for ppi, warps, stages, per_sm, regs in SWEEP:
            try:
                plan = DecodeAttentionPlan.build(geo, HQ, HKV, b, ctx, DEV,
                                                 pages_per_iter=ppi, num_warps=warps,
                                                 num_stages=stages,
                                                 target_programs=per_sm * sms,
                                                 maxnreg=regs or None)
                args = (q, case.pages, case.table, case.counts, case.req_idx, 0,
                        D**-0.5)
                t = bench_graph(partial(plan.run, *args))
                tp = bench_graph(partial(plan.run, *args, stages="partition"))
                tm = bench_graph(partial(plan.run, *args, stages="merge"))
            except Exception as e:  # noqa: BLE001
                print(f"sweep {mix} ppi{ppi} w{warps} s{stages}: FAILED {e}")
                continue
            bw = stored / (t * 1e-3)
            rows.append(dict(mix=mix, batch=b, context=ctx, ppi=ppi, warps=warps,
                             stages=stages,
                             per_sm=per_sm, regs=regs, ms=t, partition_ms=tp, merge_ms=tm,
                             bw_frac=bw / copy_bw))
            print(f"sweep {mix} B{b} ctx{ctx} ppi{ppi} w{warps} s{stages} "
                  f"{per_sm}/SM regs<={regs or '-'}: "
                  f"{t * 1e3:.0f} us (partition {tp * 1e3:.0f}, merge {tm * 1e3:.0f}) "
                  f"{bw / copy_bw:.0%} of copy", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def fresh_manager(spec: MemorySpec, req: torch.Tensor, lens: torch.Tensor) -> PageManager:
    m = PageManager(spec, DEV, validate=False)
    m.allocate_prefill(req, lens)
    return m


def reclaim_ms(spec: MemorySpec, req: torch.Tensor, lens: torch.Tensor, n_high: torch.Tensor,
               n_low: torch.Tensor, reps: int = 20) -> float:
    """Median milliseconds (CUDA events) of ``PageManager.reclaim_prefill`` on a manager
    freshly through ``allocate_prefill`` each time (a reclaim consumes its state)."""
    times = []
    for _ in range(reps):
        m = fresh_manager(spec, req, lens)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        m.reclaim_prefill(req, n_high, n_low)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return sorted(times)[len(times) // 2]


def prefill_rows(quick: bool) -> list[dict]:
    rows = []
    geo = PageGeometry.build(D, K8V4, K4V2)
    for n in (1024, 4096) if quick else (1024, 4096, 16384):
        q = torch.randn(1, n, HQ, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, n, HKV, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(1, n, HKV, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        lens = torch.tensor([n], device=DEV)
        qc, kc, vc = (x.contiguous() for x in (q, k, v))
        attn = bench(partial(torch.nn.functional.scaled_dot_product_attention, qc, kc, vc,
                             is_causal=True, enable_gqa=True))
        score = bench(partial(prefill_scores, q, k, lens, D**-0.5, 64))
        lse = torch.randn(1, HQ, 64, device=DEV) + 8
        score_lse = bench(partial(prefill_scores, q, k, lens, D**-0.5, 64, lse=lse))
        sig = prefill_scores(q, k, lens, D**-0.5, 64)
        spec = MemorySpec.from_geometry(geo, num_pages=HKV * (n // 32 + 2) + 8, max_reqs=1,
                                        num_layers=1, num_kv_heads=HKV, max_context=n)
        pages = torch.empty(spec.num_pages, geo.page_bytes, dtype=torch.uint8, device=DEV)
        ah, al = torch.tensor([1.0], device=DEV), torch.tensor([0.02], device=DEV)
        req = torch.tensor([0], device=DEV)

        m = fresh_manager(spec, req, lens)
        compress = bench(partial(compress_prefill, pages, geo, m.table, req, 0, k, v, sig, lens,
                                 ah, al, 64, 64))
        cls = compress_prefill(pages, geo, m.table, req, 0, k, v, sig, lens, ah, al, 64, 64)
        reclaim = reclaim_ms(spec, req, lens, cls.n_high.view(1, 1, HKV),
                             cls.n_low.view(1, 1, HKV))
        # per layer: scoring and compression run every layer, reclaim once per request for
        # all LAYERS layers (PageManager.reclaim_prefill takes every layer's counts at once)
        score_g = bench_graph(partial(prefill_scores, q, k, lens, D**-0.5, 64))
        score_lse_g = bench_graph(partial(prefill_scores, q, k, lens, D**-0.5, 64, lse=lse))
        compress_g = bench_graph(partial(compress_prefill, pages, geo, m.table, req, 0, k, v,
                                         sig, lens, ah, al, 64, 64))
        total = score + compress + reclaim / LAYERS
        total_g = score_g + compress_g + reclaim / LAYERS
        rows.append(dict(length=n, attn_ms=attn, score_ms=score, score_given_lse_ms=score_lse,
                         compress_ms=compress, reclaim_ms=reclaim, total_ms=total,
                         score_graph_ms=score_g, score_given_lse_graph_ms=score_lse_g,
                         compress_graph_ms=compress_g, total_graph_ms=total_g,
                         frac=total / attn, frac_graph=total_g / attn,
                         frac_graph_given_lse=(score_lse_g + compress_g + reclaim / LAYERS)
                         / attn))
        print(f"prefill L{n}: attn {attn:.3f} ms, score {score:.3f} (graph {score_g:.3f}, "
              f"given lse {score_lse_g:.3f}), compress {compress:.3f} (graph "
              f"{compress_g:.3f}), reclaim {reclaim:.3f} -> {total / attn:.1%} eager, "
              f"{total_g / attn:.1%} graph", flush=True)
    return rows


# (prompts, length) of the served-prefill section: single prompts at the lengths,
# and the same token counts split into several prompts, as a prefill step packs them
SERVED_PREFILL_CASES = ((1, 1024), (1, 4096), (1, 16384), (16, 1024), (4, 4096))


def served_prefill_rows(cases=SERVED_PREFILL_CASES) -> list[dict]:
    """One layer of a prefill step as the server runs it (``DiffKVOps.extend_layer``): the
    packed prompts' attention (``choose_prompt_attention``: flash varlen with its LSE), then
    scoring given that LSE, classify and store into the step's ``PrefillBuffers``
    (``scores=False``); plus the step's one reclaim for all LAYERS layers, counted as
    1/LAYERS. Eager (what a prefill step pays: it runs without CUDA graphs) and
    graph-replayed (GPU time alone)."""
    geo = PageGeometry.build(D, K8V4, K4V2)
    attention = choose_prompt_attention(DEV)
    return [served_prefill_case(geo, attention, nb, n) for nb, n in cases]


def served_prefill_case(geo: PageGeometry, attention, nb: int, n: int) -> dict:
    t, scale = nb * n, D**-0.5
    q = torch.randn(t, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(t, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(t, HKV, D, device=DEV, dtype=torch.bfloat16)
    prompts = PackedPrompts.from_lengths([n] * nb, DEV)
    attn = partial(attention.run, q, k, v, prompts, scale)
    _, lse = attn()
    spec = MemorySpec.from_geometry(geo, num_pages=nb * LAYERS * HKV * (n // 32 + 2) + 8,
                                    max_reqs=nb, num_layers=LAYERS, num_kv_heads=HKV,
                                    max_context=n)
    pages = torch.empty(spec.num_pages, geo.page_bytes, dtype=torch.uint8, device=DEV)
    req = torch.arange(nb, device=DEV)
    lens = prompts.lengths
    m = fresh_manager(spec, req, lens)
    buffers = PrefillBuffers.allocate(nb, HKV, n, DEV)
    totals = torch.empty(nb, HKV, 2, dtype=torch.int32, device=DEV)
    ah = torch.full((nb,), 1.0, device=DEV)
    al = torch.full((nb,), 0.02, device=DEV)

    def work():
        sig = prefill_scores(q, k, lens, scale, 64, lse=lse, starts=prompts.starts,
                             max_len=n, out=buffers.significance)
        return compress_prefill(pages, geo, m.table, req, 0, k, v, sig, lens, ah, al, 64, 64,
                                starts=prompts.starts, totals=totals, tier_out=buffers.tier,
                                block_counts=buffers.block_counts, scores=False)

    cls = work()
    kept = [x.view(nb, 1, HKV).expand(nb, LAYERS, HKV) for x in (cls.n_high, cls.n_low)]
    reclaim = reclaim_ms(spec, req, lens, *kept) / LAYERS
    # (padded SDPA returns no LSE: prefill_scores then runs its own LSE pass, as served)
    r = dict(prompts=nb, length=n, attention=attention.name, lse_given=lse is not None,
             attn_ms=bench(attn),
             attn_graph_ms=bench_graph(attn), work_ms=bench(work),
             work_graph_ms=bench_graph(work), reclaim_per_layer_ms=reclaim)
    r["frac"] = (r["work_ms"] + reclaim) / r["attn_ms"]
    r["frac_graph"] = (r["work_graph_ms"] + reclaim) / r["attn_graph_ms"]
    print(f"served prefill {nb}x{n}: attn {r['attn_ms']:.3f} (graph {r['attn_graph_ms']:.3f}) "
          f"ms, score+compress {r['work_ms']:.3f} (graph {r['work_graph_ms']:.3f}), "
          f"reclaim/layer {reclaim:.3f} -> {r['frac']:.1%} eager, {r['frac_graph']:.1%} graph",
          flush=True)
    return r


def served_prefill_table(rows: list[dict]) -> str:
    lines = [f"Prefill as served, per layer ({HQ}/{HKV} heads, D {D}, bf16; attention "
             f"{rows[0]['attention']}; scoring "
             f"{'given its LSE' if rows[0]['lse_given'] else 'with its own LSE pass'} + "
             f"classify + store; "
             f"the step's reclaim for all {LAYERS} layers counted as 1/{LAYERS}):", "",
             "| prompts x length | attention eager / graph (ms) | score + compress eager / "
             "graph (ms) | reclaim per layer (ms) | overhead / attention, eager | graph |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompts']} x {r['length']} | {r['attn_ms']:.3f} / "
                     f"{r['attn_graph_ms']:.3f} | {r['work_ms']:.3f} / "
                     f"{r['work_graph_ms']:.3f} | {r['reclaim_per_layer_ms']:.3f} | "
                     f"{r['frac']:.1%} | {r['frac_graph']:.1%} |")
    return "\n".join(lines)


def compaction_rows() -> list[dict]:
    b, layers, heads = 128, 32, 8
    spec = MemorySpec(num_pages=b * layers * heads * 12, max_reqs=b, num_layers=layers,
                      num_kv_heads=heads, high_tokens_per_page=32, low_tokens_per_page=60,
                      max_context=4096)
    req = torch.arange(b, device=DEV)
    lengths = torch.full((b,), 300)
    m = PageManager(spec, DEV, validate=False)
    m.allocate_prefill(req, lengths)
    m.reclaim_prefill(req, torch.full((b, layers, heads), 160), torch.full((b, layers, heads),
                                                                           120))
    c = m.counts.long()
    m.set_counts(req, torch.stack([c[..., 2] * 32, c[..., 3] * 60], -1))  # every tier full
    snap = m.snapshot()
    tiers = torch.ones(b, 2, dtype=torch.bool, device=DEV)
    out = []
    for name, fn in (("cuda single block", partial(decode_compaction, cooperative=False)),
                     ("cuda cooperative grid", partial(decode_compaction, cooperative=True)),
                     ("torch reference", decode_compaction_reference)):
        times, kernel_us = [], []
        for i in range(60):
            m.table.copy_(snap["table"])
            m.counts.copy_(snap["counts"])
            m.free_list.head.copy_(snap["head"])
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if i == 59:  # the GPU time of the kernels alone, from the profiler
                with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    r = fn(m, req, tiers)
                    torch.cuda.synchronize()
                kernel_us = [e.device_time_total for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA]
                # (the launcher falls back to the single-block kernel when a cooperative
                # launch is refused: record which kernel really ran)
                ran = sorted({m for e in prof.events()
                              if e.device_type == torch.autograd.DeviceType.CUDA
                              for m in re.findall(r"decode_room\w*kernel", e.name)})
                continue
            e0.record()
            r = fn(m, req, tiers)
            e1.record()
            torch.cuda.synchronize()
            if i >= 10:
                times.append(e0.elapsed_time(e1) * 1e3)
        assert bool(r.ok) and int(r.needed) == b * layers * heads * 2
        us = sorted(times)[len(times) // 2]
        gpu_us = sum(kernel_us)
        out.append(dict(impl=name, us=us, gpu_us=gpu_us, kernels=len(kernel_us),
                        pages=int(r.needed), ran=",".join(ran)))
        print(f"compaction {name}: {us:.1f} us wall (events), {gpu_us:.1f} us of GPU kernels "
              f"({len(kernel_us)} kernels: {','.join(ran) or 'torch'}) for {int(r.needed)} "
              f"pages", flush=True)
    return out


# (label, argmin, block, target programs): the default scan and parallel launches and
# neighbours (block: the scan's scan_block, the parallel path's argmin_block)
POLICY_PATHS = [("scan", "scan", SCAN_BLOCK, ARGMIN_PROGRAMS),
                ("scan bt512", "scan", 512, ARGMIN_PROGRAMS),
                ("scan bt1024", "scan", 1024, ARGMIN_PROGRAMS),
                ("parallel", "parallel", ARGMIN_BLOCK, ARGMIN_PROGRAMS),
                ("parallel bt256 p16k", "parallel", 256, 16384),
                ("parallel bt1024 p4k", "parallel", 1024, 4096)]


def _policy_call(case, counts0, positions, alpha, key, value, how, block, programs) -> None:
    """Counters restored, then one policy step of layer 0 (window 64)."""
    case.counts.copy_(counts0)
    decode_policy_step(case.pages, case.geometry, case.table, case.counts, case.req_idx, 0,
                       positions, alpha, 64, key, value, argmin=how, argmin_block=block,
                       argmin_programs=programs, scan_block=block if how == "scan" else SCAN_BLOCK)


def policy_rows(batches: tuple[int, ...] = (32, 128, 305),
                contexts: tuple[int, ...] = (1024, 4096)) -> list[dict]:
    """One layer's decode policy step (``decode_policy_step``), per call, graph-replayed:
    scan vs parallel argmin on a 30/50/20 state (Hkv 8, D 128, window 64). Each call
    restores the token counters first (a graph replays the same step; without the reset
    the counters would run past the allocated pages), so the times include that small
    copy; it is also timed alone ("counts copy") and subtracted in "net"."""
    geo = PageGeometry.build(D, K8V4, K4V2)
    rows = []
    for b in batches:
        for ctx in contexts:
            case = random_decode_case(geo, [ctx] * b, HKV, high_frac=0.3, low_frac=0.5,
                                      jitter=True, device=DEV, seed=b + ctx)
            c = case.counts
            for t, n in ((0, geo.high.tokens_per_page), (1, geo.low.tokens_per_page)):
                # room for the step's writes inside the allocated pages
                c[..., t] -= ((c[..., t] % n == 0) & (c[..., t] > 0)).int()
            counts0 = c.clone()
            g = torch.Generator(device="cpu").manual_seed(b)
            positions = ((1 << 20) + torch.randint(0, 64, (b,), generator=g)).to(DEV)
            alpha = (torch.rand(b, 2, generator=g) * torch.tensor([4.0, 1.0])).to(DEV)
            key = torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16)
            value = torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16)
            tokens = int(c[case.req_idx, 0, :, :2].sum())
            copy_ms = bench_graph(partial(c.copy_, counts0))
            row = dict(batch=b, context=ctx, tokens=tokens, copy_us=copy_ms * 1e3)
            for label, how, block, programs in POLICY_PATHS:
                try:
                    row[label] = bench_graph(partial(
                        _policy_call, case, counts0, positions, alpha, key, value, how,
                        block, programs)) * 1e3
                except Exception as e:  # noqa: BLE001 - report and keep benchmarking
                    print(f"policy B{b} ctx{ctx} {label}: FAILED {type(e).__name__}: {e}",
                          flush=True)
                    row[label] = float("nan")
            row["argmin kernel"] = bench_graph(partial(
                argmin_partials, case.pages, geo, case.table, c, case.req_idx, 0, positions,
                64)) * 1e3
            row["splits"] = argmin_splits(b, HKV, case.table.shape[-1], geo)
            rows.append(row)
            # 8 bytes (score + position) per cached token is all the argmin reads
            print(f"policy B{b} ctx{ctx} ({tokens} tokens, S={row['splits']}): "
                  + ", ".join(f"{lb} {row[lb]:.1f}" for lb, *_ in POLICY_PATHS)
                  + f" us; argmin kernel alone {row['argmin kernel']:.1f} us "
                  f"({tokens * 8 / (row['argmin kernel'] * 1e-6) / 1e12:.2f} TB/s of score+pos);"
                  f" counts copy {copy_ms * 1e3:.1f} us", flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


def policy_table(rows: list[dict]) -> str:
    labels = [lb for lb, *_ in POLICY_PATHS]
    lines = ["Decode policy step, one layer, per call (us, graph; net = minus the counts "
             f"copy each call does), Hkv {HKV}, D {D}, 30/50/20:", "",
             "| batch | context | tokens | S | " + " | ".join(f"{lb} (net)" for lb in labels)
             + " | argmin kernel alone | scan / parallel |",
             "|---|---|---|---|" + "---|" * (len(labels) + 2)]
    for r in rows:
        cells = [f"{r[lb]:.1f} ({r[lb] - r['copy_us']:.1f})" for lb in labels]
        speed = (r["scan"] - r["copy_us"]) / (r["parallel"] - r["copy_us"])
        lines.append(f"| {r['batch']} | {r['context']} | {r['tokens']} | {r['splits']} | "
                     + " | ".join(cells) + f" | {r['argmin kernel']:.1f} | {speed:.1f}x |")
    return "\n".join(lines)


# (batch, context) of the fused-argmin A/B: the server profile's decode step (batch 369,
# 1.22M tokens held: ~3.3k per request, Llama-3-8B heads), and a short and a long row
FUSED_CASES = ((369, 3300), (369, 1024), (64, 8192))


def fused_rows(cases: tuple[tuple[int, int], ...] = FUSED_CASES) -> list[dict]:
    """One layer of the decode step's DiffKV bookkeeping, scan vs fused argmin, per call,
    graph-replayed, on a 30/50/20 state (Hkv 8, Hq 32, D 128, window 64, shared bounds
    passed as the server does): the policy step alone (``decode_policy_step`` without and
    with ``hints``), the merge pass alone (without and with), and policy step + decode
    attention (both launches) as one layer of the served step runs them. Each call first
    restores the counters (and, fused, the records: a replayed step would otherwise find
    them armed for the next position and scan); those copies are timed alone and
    subtracted ("net"). The fused timings are only valid if every row took its record:
    checked once before timing. Both fills of the records (``decode_attention.HINT_FILLS``)
    are timed: "loop" (merge+argmin, step fused) and "pass" (... pass), and the pass's
    records checked equal to the loop's from the same armed state."""
    geo = PageGeometry.build(D, K8V4, K4V2)
    rows = []
    for b, ctx in cases:
        rows.append(fused_case(geo, b, ctx))
        torch.cuda.empty_cache()
    return rows


def fused_case(geo: PageGeometry, b: int, ctx: int) -> dict:
    """One (batch, context) of :func:`fused_rows`."""
    case = random_decode_case(geo, [ctx] * b, HKV, high_frac=0.3, low_frac=0.5, jitter=True,
                              device=DEV, seed=b + ctx + 1)
    c = case.counts
    per = torch.tensor([geo.high.tokens_per_page, geo.low.tokens_per_page], device=DEV)
    # room for two steps (the one that arms the records, the timed one) in every tier
    c[..., :2] = torch.minimum(c[..., :2], (c[..., 2:] * per - 2).clamp(min=0))
    shared = torch.zeros(*c.shape[:3], 2, dtype=torch.int32, device=DEV)
    hints = decode_hint.allocate(*c.shape[:3], DEV)
    g = torch.Generator(device="cpu").manual_seed(b)
    p = ((1 << 20) + torch.randint(0, 64, (b,), generator=g)).to(DEV)
    alpha = (torch.rand(b, 2, generator=g) * torch.tensor([4.0, 1.0])).to(DEV)
    key = torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16)
    value = torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    plan = DecodeAttentionPlan.build(geo, HQ, HKV, b, ctx + 2, DEV, **TUNED)

    def policy(pos, fused):
        decode_policy_step(case.pages, geo, case.table, c, case.req_idx, 0, pos, alpha, 64,
                           key, value, shared=shared, hints=hints if fused else None)

    def attend(fused, stages="partition,merge", fill="loop"):
        plan.run(q, case.pages, case.table, c, case.req_idx, 0, D**-0.5, stages=stages,
                 shared=shared, hints=hints if fused else None, hint_fill=fill)

    policy(p - 1, True)  # arm the records for p, then fill them
    # the "pass" fill first, from the same armed state: its records must equal the loop's
    armed, pages_armed = hints.clone(), case.pages.clone()
    attend(True, fill="pass")
    hints_pass = hints.clone()
    case.pages.copy_(pages_armed)
    hints.copy_(armed)
    del pages_armed
    attend(True)
    pass_equal = bool(torch.equal(hints[case.req_idx], hints_pass[case.req_idx]))
    counts0, hints0 = c.clone(), hints.clone()
    first = torch.zeros(b, HKV, 2, dtype=torch.int64, device=DEV)
    valid = decode_hint.valid(hints[case.req_idx, 0], c[case.req_idx, 0], first, p, 64)
    tokens = int(c[case.req_idx, 0, :, :2].sum())
    row = dict(batch=b, context=ctx, tokens=tokens, rows_valid=float(valid.float().mean()))
    row["pass records equal"] = pass_equal

    def reset(fused):
        c.copy_(counts0)
        if fused:
            hints.copy_(hints0)

    def timed(label, fn):
        try:
            row[label] = bench_graph(fn) * 1e3
        except Exception as e:  # noqa: BLE001 - report and keep benchmarking
            print(f"fused B{b} ctx{ctx} {label}: FAILED {type(e).__name__}: {e}", flush=True)
            row[label] = float("nan")

    timed("counts copy", partial(reset, False))
    timed("counts+hints copy", partial(reset, True))
    timed("policy scan", lambda: (reset(False), policy(p, False)))
    timed("policy fused", lambda: (reset(True), policy(p, True)))
    timed("merge", partial(attend, False, "merge"))
    timed("merge+argmin", partial(attend, True, "merge"))
    timed("step scan", lambda: (reset(False), policy(p, False), attend(False)))
    timed("step fused", lambda: (reset(True), policy(p, True), attend(True)))
    timed("merge+argmin pass", partial(attend, True, "merge", "pass"))
    timed("step fused pass", lambda: (reset(True), policy(p, True), attend(True, fill="pass")))
    for lb, cp in (("policy scan", "counts copy"), ("policy fused", "counts+hints copy"),
                   ("step scan", "counts copy"), ("step fused", "counts+hints copy"),
                   ("step fused pass", "counts+hints copy")):
        row[lb + " net"] = row[lb] - row[cp]
    print(f"fused B{b} ctx{ctx} ({tokens} tokens, {row['rows_valid']:.0%} rows valid): "
          + ", ".join(f"{k} {v:.1f}" for k, v in row.items()
                      if k not in ("batch", "context", "tokens", "rows_valid",
                                   "pass records equal"))
          + f"; pass records equal: {row['pass records equal']}"
          + " us", flush=True)
    return row


def fused_table(rows: list[dict]) -> str:
    lines = [f"Fused argmin A/B, one layer, per call (us, graph, net of the counter/record "
             f"copies; x{LAYERS} layers for a step), Hkv {HKV}, Hq {HQ}, D {D}, 30/50/20:", "",
             "| batch | context | rows valid | policy scan | policy fused | merge | "
             "merge+argmin loop | merge+argmin pass | policy+attention scan | "
             "policy+attention fused loop | fused pass | saved per step, loop / pass "
             f"({LAYERS} layers, ms) | pass records = loop's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        saved = (r["step scan net"] - r["step fused net"]) * LAYERS / 1e3
        saved_p = (r["step scan net"] - r["step fused pass net"]) * LAYERS / 1e3
        lines.append(f"| {r['batch']} | {r['context']} | {r['rows_valid']:.0%} | "
                     f"{r['policy scan net']:.1f} | {r['policy fused net']:.1f} | "
                     f"{r['merge']:.1f} | {r['merge+argmin']:.1f} | "
                     f"{r['merge+argmin pass']:.1f} | {r['step scan net']:.1f} | "
                     f"{r['step fused net']:.1f} | {r['step fused pass net']:.1f} | "
                     f"{saved:.2f} / {saved_p:.2f} | {r['pass records equal']} |")
    return "\n".join(lines)


def md_tables(meta, decode, base_label, prefill, compaction) -> str:
    lines = [f"GPU: {meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"measured copy bandwidth {meta['copy_tbs']:.2f} TB/s (read + write); "
             f"baseline: {base_label}; decode config {meta.get('tuned', 'default')}.", ""]
    lines += ["| variant | batch | context | mix | time (us, graph) | eager (us) | stored MB | "
              "TB/s | % of copy BW | baseline (us, graph) | speedup | byte ratio | "
              "speedup / ratio |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['context']} | {r['mix']} | "
                     f"{r['ms'] * 1e3:.1f} | "
                     f"{r['eager_ms'] * 1e3:.1f} | {r['stored_mb']:.1f} | {r['bw_tbs']:.2f} | "
                     f"{r['bw_frac']:.0%} | "
                     f"{r['base_ms'] * 1e3:.1f} | {r['speedup']:.2f} | {r['byte_ratio']:.2f} | "
                     f"{r['speedup_vs_ratio']:.2f} |")
    lines += ["", f"Prefill, per layer (1 prompt, {HQ}/{HKV} heads, D {D}; reclaim is once "
              f"per request for all {LAYERS} layers, counted as 1/{LAYERS}):", "",
              "| prompt length | prefill attention SDPA (ms) | scoring eager / graph (ms) | "
              "scoring given LSE, graph (ms) | compression eager / graph (ms) | reclaim, all "
              "layers (ms) | total / attention, eager | graph | graph, given LSE |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in prefill:
        lines.append(f"| {r['length']} | {r['attn_ms']:.3f} | {r['score_ms']:.3f} / "
                     f"{r['score_graph_ms']:.3f} | {r['score_given_lse_graph_ms']:.3f} | "
                     f"{r['compress_ms']:.3f} / {r['compress_graph_ms']:.3f} | "
                     f"{r['reclaim_ms']:.3f} | {r['frac']:.1%} | {r['frac_graph']:.1%} | "
                     f"{r['frac_graph_given_lse']:.1%} |")
    lines += ["", "| compaction, 128 req x 32 layers x 8 heads x 2 tiers | events around the "
              "call (us) | GPU kernel time, profiler (us) | pages taken | kernels that ran |",
              "|---|---|---|---|---|"]
    for r in compaction:
        lines.append(f"| {r['impl']} | {r['us']:.1f} | {r['gpu_us']:.1f} | {r['pages']} | "
                     f"{r.get('ran', '')} |")
    return "\n".join(lines)


def parse_sweep_case(text: str) -> tuple[str, int, int]:
    """MIX:BATCHxCONTEXT, e.g. 30/50/20:384x2048."""
    try:
        mix, shape = text.split(":")
        b, ctx = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--sweep-case {text!r}: use MIX:BATCHxCONTEXT, "
                         f"MIX one of {sorted(MIXES)}") from None
    if mix not in MIXES or b < 1 or ctx < 1:
        raise SystemExit(f"--sweep-case {text!r}: MIX one of {sorted(MIXES)}, positive sizes")
    return mix, b, ctx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/bench_kernels")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep-case", action="append", default=[],
                    help="sweep case MIX:BATCHxCONTEXT (repeatable; replaces the default "
                         "K8V4 and K4V2 at 32x16384), e.g. 30/50/20:384x2048")
    ap.add_argument("--only", default="sweep,decode,prefill,served-prefill,compaction",
                    help="sections: sweep, decode, stages, prefill, served-prefill, "
                         "compaction, policy, fused (the fused argmin's A/B)")
    ap.add_argument("--fused-cases", default=",".join(f"{b}x{c}" for b, c in FUSED_CASES),
                    help="BATCHxCONTEXT cases of the fused section (comma-separated)")
    ap.add_argument("--variants", default="auto",
                    help=f"decode attention variants, comma-separated: auto (the default: the "
                         f"split-K pass serving runs on this machine, cuda where it can run, "
                         f"else asm) or NAME[@REGS] with NAME "
                         f"in {', '.join(VARIANTS)} and REGS a register cap (0: none)")
    ap.add_argument("--batches", default="", help="decode batches (default: the issue's grid)")
    ap.add_argument("--contexts", default="", help="decode contexts (default: the grid)")
    ap.add_argument("--stage-cases", default="32x16384",
                    help="BATCHxCONTEXT cases the stages section times (comma-separated)")
    args = ap.parse_args()
    variants = [serving_variant() if v == "auto" else v for v in args.variants.split(",") if v]
    for v in variants:
        variant_plan(v)  # fail before any GPU time is spent
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, compaction_backend=compaction_backend())
    meta["copy_tbs"] = copy_bandwidth() / 1e12
    print(f"copy bandwidth {meta['copy_tbs']:.2f} TB/s", flush=True)
    only = set(args.only.split(","))
    cases = [parse_sweep_case(c) for c in args.sweep_case] or SWEEP_CASES
    sweep_rows = sweep(meta["copy_tbs"] * 1e12, cases) if "sweep" in only else []
    if sweep_rows:
        # the decode table runs with the configuration fastest over both sweep cases
        def key(r: dict) -> tuple:
            return (r["ppi"], r["warps"], r["stages"], r["per_sm"], r["regs"])

        total = {k: sum(r["ms"] for r in sweep_rows if key(r) == k)
                 for k in {key(r) for r in sweep_rows}
                 if sum(key(r) == k for r in sweep_rows) == len(cases)}
        ppi, warps, stages, per_sm, regs = min(total, key=total.get)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        TUNED.update(pages_per_iter=ppi, num_warps=warps, num_stages=stages,
                     target_programs=per_sm * sms, maxnreg=regs or None)
        meta["tuned"] = dict(pages_per_iter=ppi, num_warps=warps, num_stages=stages,
                             programs_per_sm=per_sm, maxnreg=regs or None)
        print(f"tuned decode config: {meta['tuned']}", flush=True)
    ints = lambda x: tuple(int(v) for v in x.split(",") if v) or None  # noqa: E731
    decode, base_label = decode_rows(meta["copy_tbs"] * 1e12, args.quick, variants,
                                     ints(args.batches), ints(args.contexts)) \
        if "decode" in only else ([], "n/a")
    stage_cases = tuple(tuple(int(x) for x in c.split("x")) for c in args.stage_cases.split(","))
    stages = (stage_rows(meta["copy_tbs"] * 1e12, variants, stage_cases) if "stages" in only
              else [])
    prefill = prefill_rows(args.quick) if "prefill" in only else []
    served = served_prefill_rows() if "served-prefill" in only else []
    compaction = compaction_rows() if "compaction" in only else []
    policy = policy_rows() if "policy" in only else []
    fused_cases = tuple(tuple(int(x) for x in c.split("x")) for c in args.fused_cases.split(","))
    fused = fused_rows(fused_cases) if "fused" in only else []
    meta["seconds"] = time.time() - t0
    md = md_tables(meta, decode, base_label, prefill, compaction)
    if decode:
        md = f"Decode attention by variant ({base_label}):\n\n" + variant_table(
            decode, variants) + "\n\n" + md
    if stages:
        md += ("\n\n| variant | mix | B x context | step (us) | split-K pass (us) | merge (us) "
               "| % of copy |\n|---|---|---|---|---|---|---|\n" + "\n".join(
                   f"| {r['variant']} | {r['mix']} | {r['batch']} x {r['context']} | "
                   f"{r['ms'] * 1e3:.0f} | {r['partition_ms'] * 1e3:.0f} | "
                   f"{r['merge_ms'] * 1e3:.0f} | {r['bw_frac']:.0%} |" for r in stages))
    if served:
        md += "\n\n" + served_prefill_table(served)
    if policy:
        md += "\n\n" + policy_table(policy)
    if fused:
        md += "\n\n" + fused_table(fused)
    (out / "bench.md").write_text(md + "\n")
    (out / "bench.json").write_text(json.dumps(dict(meta=meta, baseline=base_label,
                                                    decode=decode, prefill=prefill,
                                                    compaction=compaction, stages=stages,
                                                    variants=variants, policy=policy,
                                                    fused=fused,
                                                    served_prefill=served,
                                                    sweep=sweep_rows), indent=1))
    print("\n" + md)
    print(f"total {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
