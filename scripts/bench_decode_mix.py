#!/usr/bin/env python3
"""Decode attention on the batches a server really runs (issue 8): mixed contexts, KV slots
scattered by decode-time allocation, and DiffKV plans built for the server's context limit.

``calibrate_gpu.py`` times each decode kernel on uniform batches (every request at one
context, its KV in contiguous slots, DiffKV's plan built for that context). A saturated server
runs something else: contexts from tens to thousands of tokens in one batch; a page-size-1
pool whose decode steps hand each request one slot per step, interleaved with the rest of the
batch; DiffKV plans built for ``context_len``. This script times the same kernels, the same
way (CUDA-graph replays cycling through copies larger than L2), on batches taken from a
simulated run, in these cases (each against the uniform batch of the same total tokens):

  triton (SGLang 0.5.10's decode_attention_fwd + get_num_kv_splits_triton), bf16 and fp8:
    uniform       B x round(mean context), contiguous slots       (the calibration grid's case)
    mixed         the run's contexts, contiguous slots per request
    appended      the run's contexts; prompts contiguous, generated tokens one slot per step
                  across the requests still generating (what the token allocator hands out)
    random        the run's contexts, slots a random permutation of the pool
    uniform-app.  the uniform batch with the same prompt share appended the same way
  DiffKV 30/50/20 (DecodeAttentionPlan; pages are scattered in every case):
    uniform       plan for the mean context                       (the calibration grid's case)
    mixed         plan for the batch's longest context
    mixed@server  plan for --server-context (SGLang's context_len: what the server builds)
    uniform@server

Two steps:

    # any machine: the running batches of a validation run, simulated (needs simpy)
    python scripts/bench_decode_mix.py contexts \
        docs/data/h100-2026-11-23/e2e-s13-sharegpt-bf16-graphs1536 \
        --run bf16/sharegpt --batches 31,64,128,256,384,512,640 --out contexts.json
    # GPU: time them; prints a table, writes OUT/decode_mix.json and OUT/decode_mix.md
    python scripts/bench_decode_mix.py time contexts.json --out results/decode-mix
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SERVER_CONTEXT = 8192    # context_len of the Llama-3-8B-shaped servers in docs/data
TRITON_CASES = ("uniform", "mixed", "appended", "random", "uniform-appended")
DIFFKV_CASES = ("uniform", "mixed", "mixed@server", "uniform@server")
# --basic: the mixed batch against the uniform one only, both as the server runs them
BASIC_TRITON = ("uniform", "mixed")
BASIC_DIFFKV = ("uniform@server", "mixed@server")


# ---- step 1: contexts from a simulated run (CPU) ----------------------------------------------
def simulated_batches(results: str, run_key: str, batches: list[int]) -> dict[str, Any]:
    """For each target size, the decode batch of the simulated replay of ``run_key`` closest
    to it, taken at the middle of the steps within 5% of that size: each request's context
    and prompt length."""
    import numpy as np
    import validate_simulator as vs

    from simulator.specs.calibration import load_calibration
    from simulator.workload.loaders import load_trace

    d, tag, ren = vs.results_arg(results)
    scratch = Path(tempfile.gettempdir()) / "bench_decode_mix" / vs.scratch_name(d)
    h = vs.load_harness(d, scratch, tag=tag, rename=ren)
    run = h.run(run_key)
    log = vs.slice_log(run, run.server_log or h.server_logs[run.config])
    settings, fmt = vs.server_settings(h.configs[run.config], log)
    sc = vs.scenario("llama-3-8b", "h100", load_calibration("h100"), settings, h, run.config)
    srv = sc.server(fmt)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    make = srv.new_scheduler

    def recording(seed: int, *args: Any) -> Any:
        """The server's own scheduler, its decode batches recorded as they are formed."""
        sched = make(seed, *args)
        form = sched.next_batch

        def next_batch(visible_until: float = math.inf) -> Any:
            b = form(visible_until)
            if b is not None and b.decode and sched.run_reqs:
                prompts = np.array([r.input_len for r in sched.run_reqs], dtype=np.int64)
                seen.append((sched.kv.copy(), np.minimum(prompts, sched.kv)))
            return b

        sched.next_batch = next_batch
        return sched

    srv.new_scheduler = recording  # type: ignore[method-assign]
    sc.run(load_trace(run.trace_path), fmt, server=srv)
    out = []
    for want in batches:
        near = [s for s in seen if abs(len(s[0]) - want) <= max(1, want // 20)]
        if not near:
            raise SystemExit(f"run {run_key}: no simulated decode batch within 5% of {want}")
        kv, prompt = near[len(near) // 2]
        out.append({"batch": len(kv), "contexts": kv.tolist(), "prompts": prompt.tolist()})
    return {"source": {"results": results, "run": run_key, "format": fmt,
                       "note": "running batches of the simulator's replay (base calibration)"},
            "batches": out}


def synthetic_batches(batches: list[int], means: list[int], cvs: list[float],
                      max_context: int, max_tokens: int, prompt_share: float,
                      seed: int) -> dict[str, Any]:
    """Log-normal contexts for every (batch, mean, CV), clipped to [1, max_context] (the
    timing step reports the mean and CV each batch really has). Points over ``max_tokens``
    tokens are left out."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for b in batches:
        for m in means:
            if b * m > max_tokens:
                continue
            for cv in cvs:
                sig2 = np.log1p(cv * cv)
                ctx = rng.lognormal(np.log(m) - sig2 / 2, np.sqrt(sig2), size=b)
                ctx = np.clip(np.rint(ctx), 1, max_context).astype(np.int64)
                pr = np.minimum(ctx, np.rint(prompt_share * ctx)).astype(np.int64)
                out.append({"batch": b, "contexts": ctx.tolist(), "prompts": pr.tolist(),
                            "target": {"mean": m, "cv": cv}})
    return {"source": {"synthetic": "log-normal", "seed": seed, "prompt_share": prompt_share,
                       "max_context": max_context}, "batches": out}


# ---- step 2: timing (GPU) ---------------------------------------------------------------------
def slot_layouts(contexts: list[int], prompts: list[int], rng: Any,
                 cases: tuple[str, ...] = TRITON_CASES) -> dict[str, Any]:
    """(contexts, flat KV slot indices) of each triton case in ``cases``; slots are
    request-major, each request's tokens in position order. ``appended``: prompts take
    contiguous runs in request order, then each decode step gives the next slot to every
    request generating at it (all of them end at the last step: request r has generated for
    the last ``contexts - prompts`` steps)."""
    import numpy as np

    ctx = np.asarray(contexts, dtype=np.int64)
    pr = np.asarray(prompts, dtype=np.int64)
    total = int(ctx.sum())

    def appended(c: np.ndarray, p: np.ndarray) -> np.ndarray:
        gen = c - p
        slot = np.empty(int(c.sum()), dtype=np.int64)
        st = np.concatenate([[0], np.cumsum(c)[:-1]])
        nxt = 0
        for i in range(len(c)):
            slot[st[i]:st[i] + p[i]] = np.arange(nxt, nxt + p[i])
            nxt += int(p[i])
        steps = int(gen.max(initial=0))
        first = steps - gen             # every request generates up to the last step
        for t in range(steps):
            live = np.nonzero(first <= t)[0]
            slot[st[live] + p[live] + t - first[live]] = np.arange(nxt, nxt + len(live))
            nxt += len(live)
        return slot

    mean = max(1, round(total / len(ctx)))
    uni = np.full(len(ctx), mean, dtype=np.int64)
    uni_p = np.full(len(ctx), round(float(pr.sum()) / max(total, 1) * mean), dtype=np.int64)
    build = {"uniform": lambda: (uni, np.arange(int(uni.sum()))),
             "mixed": lambda: (ctx, np.arange(total)),
             "appended": lambda: (ctx, appended(ctx, pr)),
             "random": lambda: (ctx, rng.permutation(total)),
             "uniform-appended": lambda: (uni, appended(uni, uni_p))}
    return {case: build[case]() for case in cases}


def time_triton(fwd: Any, splits: Any, dtype: Any, contexts: list[int], prompts: list[int],
                seed: int, cases: tuple[str, ...] = TRITON_CASES) -> dict[str, float]:
    import numpy as np
    import torch
    from calibrate_gpu import time_sglang_decode

    lay = slot_layouts(contexts, prompts, np.random.default_rng(seed), cases)
    return {case: time_sglang_decode(fwd, splits, dtype, ctx.tolist(),
                                     torch.from_numpy(slots))[0]
            for case, (ctx, slots) in lay.items()}


def time_diffkv(contexts: list[int], server_context: int, seed: int,
                cases: tuple[str, ...] = DIFFKV_CASES) -> dict[str, float]:
    from calibrate_gpu import K4V2, K8V4, MIXES, D, time_diffkv_decode

    from sglang_diffkv.layout import PageGeometry

    geo = PageGeometry.build(D, K8V4, K4V2)
    fh, fl = MIXES["diffkv"]
    b = len(contexts)
    mean = max(1, round(sum(contexts) / b))
    plans = {"uniform": ([mean] * b, mean), "mixed": (contexts, max(contexts)),
             "mixed@server": (contexts, server_context),
             "uniform@server": ([mean] * b, server_context)}
    return {name: time_diffkv_decode(geo, plans[name][0], plans[name][1], fh, fl, seed)[0]
            for name in cases}


def table(rows: list[dict]) -> str:
    lines = ["| kernel | batch | mean ctx | CV | max ctx | prompt share | microseconds per layer "
             "call (ratio to the first case) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["time_us"]
        first = next(iter(t.values()))
        cells = ", ".join(f"{c} {v:.0f}" + (f" ({v / first:.2f})" if i else "")
                          for i, (c, v) in enumerate(t.items()))
        lines.append(f"| {r['kernel']} | {r['batch']} | {r['mean_context']:.0f} | "
                     f"{r['cv']:.2f} | {r['max_context']} | {r['prompt_share']:.2f} | {cells} |")
    return "\n".join(lines)


def time_all(spec: dict[str, Any], out_dir: Path, server_context: int,
             kernels: set[str], basic: bool = False) -> list[dict]:
    import torch
    from calibrate_gpu import kv_split_fn, provenance, sglang_kernels

    fwd, _, src = sglang_kernels()
    splits, splits_src = kv_split_fn()
    rows: list[dict] = []
    for i, bt in enumerate(spec["batches"]):
        ctx, pr = bt["contexts"], bt["prompts"]
        mean = sum(ctx) / len(ctx)
        cv = (sum((c - mean) ** 2 for c in ctx) / len(ctx)) ** 0.5 / mean
        meta = {"batch": len(ctx), "mean_context": mean, "cv": cv, "max_context": max(ctx),
                "prompt_share": sum(pr) / sum(ctx)}
        runs: list[tuple[str, Any]] = []
        if fwd is not None:
            runs += [(k, partial(time_triton, fwd, splits, dt, ctx, pr, i,
                                 BASIC_TRITON if basic else TRITON_CASES))
                     for k, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn))
                     if k in kernels]
        if "diffkv" in kernels:
            runs.append(("diffkv", partial(time_diffkv, ctx, server_context, i,
                                           BASIC_DIFFKV if basic else DIFFKV_CASES)))
        for name, fn in runs:
            t = fn()
            rows.append({"kernel": name, **meta, "time_us": {c: s * 1e6 for c, s in t.items()}})
            print(f"{name:6s} B={meta['batch']:5d} mean {meta['mean_context']:6.0f}: "
                  + "  ".join(f"{c} {s * 1e6:7.1f}" for c, s in t.items()), flush=True)
    result = {"source": spec["source"], "server_context": server_context,
              "provenance": provenance(src, splits_src), "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_mix.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(rows)
    (out_dir / "decode_mix.md").write_text(text + "\n")
    print(text)
    return rows


def _numbers(ap: argparse.ArgumentParser, flag: str, text: str, kind: type) -> list:
    try:
        vals = [kind(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"{flag} {text!r}: expected comma-separated numbers")
    if any(v <= 0 for v in vals):
        ap.error(f"{flag} {text!r}: every value must be > 0")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("contexts", help="simulate a validation run and save its decode batches")
    c.add_argument("results", help="a scripts/bench_e2e.py --out folder, DIR[#TAG[@OLD=NEW]]")
    c.add_argument("--run", required=True, help="run key, e.g. bf16/sharegpt")
    c.add_argument("--batches", required=True, help="comma-separated batch sizes")
    c.add_argument("--out", required=True, help="contexts JSON to write")
    y = sub.add_parser("synthetic", help="log-normal batches over batch x mean x CV")
    y.add_argument("--batches", default="16,32,64,128,256,512,1024")
    y.add_argument("--means", default="256,1024,3072")
    y.add_argument("--cvs", default="0.4,0.8,1.4")
    y.add_argument("--max-context", type=int, default=SERVER_CONTEXT)
    y.add_argument("--max-tokens", type=int, default=1 << 21)
    y.add_argument("--prompt-share", type=float, default=0.3)
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("--out", required=True, help="contexts JSON to write")
    t = sub.add_parser("time", help="time the kernels on a contexts JSON (GPU)")
    t.add_argument("contexts", help="a JSON written by the contexts step")
    t.add_argument("--out", default="results/decode-mix")
    t.add_argument("--server-context", type=int, default=SERVER_CONTEXT,
                   help="context_len DiffKV's server plans are built for (default %(default)s)")
    t.add_argument("--kernels", default="bf16,fp8,diffkv")
    t.add_argument("--basic", action="store_true",
                   help="only the mixed batch against the uniform one, as the server runs them")
    a = ap.parse_args(argv)
    if a.cmd in ("contexts", "synthetic"):
        sizes = _numbers(ap, "--batches", a.batches, int)
        if a.cmd == "synthetic":
            means = _numbers(ap, "--means", a.means, int)
            cvs = _numbers(ap, "--cvs", a.cvs, float)
            if not 0.0 <= a.prompt_share <= 1.0:
                ap.error(f"--prompt-share {a.prompt_share}: must be in [0, 1]")
            spec = synthetic_batches(sizes, means, cvs, a.max_context, a.max_tokens,
                                     a.prompt_share, a.seed)
        else:
            spec = simulated_batches(a.results, a.run, sizes)
        Path(a.out).write_text(json.dumps(spec) + "\n")
        print(f"wrote {a.out}: " + ", ".join(
            f"B={b['batch']} mean {sum(b['contexts']) / b['batch']:.0f}"
            for b in spec["batches"]))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench_decode_mix: no CUDA device", file=sys.stderr)
        return 2
    kernels = set(a.kernels.split(","))
    bad = kernels - {"bf16", "fp8", "diffkv"}
    if bad:
        ap.error(f"--kernels {a.kernels!r}: unknown {sorted(bad)}; allowed bf16, fp8, diffkv")
    time_all(json.loads(Path(a.contexts).read_text()), Path(a.out), a.server_context, kernels,
             a.basic)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
