"""Where the diffkv backend's time goes, per step, without SGLang (GPU).

Replays what ``sglang_diffkv.sglang.backend`` does for one prefill step and one decode step of
a Llama-3-8B-shaped model (32 layers, 32 q / 8 KV heads, head_dim 128) on the kernels path
(``DiffKVOps``), in benchmark mode (30/50/20), and reports per part:

- host: wall time of the Python call (launch cost included), synchronised after each part;
- gpu: CUDA-event time of the same part;
- a torch.profiler table of the GPU kernels of one whole step.

    python scripts/profile_backend_ops.py --out DIR [--prefill 1x300,30x512] [--decode 305x2048]

Writes ``DIR/profile_backend_ops.md`` (tables) and ``.json``. The numbers explain the
end-to-end runs in docs/benchmarks.md; they are not a benchmark target.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.sglang.ops import DiffKVOps

LAYERS, HQ, HKV, D = 32, 32, 8, 128


def timed(fn: Callable[[], object], rep: int = 3) -> tuple[float, float]:
    """(host ms, gpu ms), best of ``rep`` synchronised calls."""
    host, gpu = [], []
    for _ in range(rep):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return min(host), min(gpu)


def make_cache(max_reqs: int, num_pages: int) -> tuple[CompressedKVCache, DiffKVOps]:
    config = DiffKVConfig.from_dict({"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]})
    cache = CompressedKVCache(config, head_dim=D, num_layers=LAYERS, num_kv_heads=HKV,
                              num_pages=num_pages, max_reqs=max_reqs, max_context=8192,
                              device="cuda", validate=False)
    return cache, DiffKVOps(cache, use_kernels=True)


def prefill_parts(cache: CompressedKVCache, ops: DiffKVOps, b: int, length: int,
                  first_req: int) -> dict[str, tuple[float, float]]:
    req = torch.arange(first_req, first_req + b, device="cuda")
    lengths = torch.full((b,), length, dtype=torch.int64, device="cuda")
    q = torch.randn(b, HQ, length, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, length, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HKV, length, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5
    out: dict[str, tuple[float, float]] = {}

    def cycle() -> None:  # the whole step's DiffKV work (what the profiler table shows)
        cache.begin_prefill(req.tolist(), [length] * b)
        for layer in range(LAYERS):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
            ops.prefill_layer(layer, req, lengths, q, k, v, scale)
        cache.end_prefill(req)
        cache.free(req.tolist())

    cycle()  # compile everything once
    out["begin_prefill (alloc)"] = timed(lambda: (cache.begin_prefill(req.tolist(), [length] * b),
                                                  cache.free(req.tolist())))
    cache.begin_prefill(req.tolist(), [length] * b)
    out["SDPA (x32 layers)"] = timed(lambda: [F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=True) for _ in range(LAYERS)])
    out["prefill_scores (x32)"] = timed(lambda: [ops.k.prefill_scores(
        q, k, lengths, scale, cache.config.score_queries) for _ in range(LAYERS)])
    out["ops.prefill_layer (x32)"] = timed(lambda: [ops.prefill_layer(
        layer, req, lengths, q, k, v, scale) for layer in range(LAYERS)], rep=1)
    out["end_prefill (reclaim)"] = timed(lambda: cache.end_prefill(req), rep=1)
    cache.free(req.tolist())
    out["whole step"] = timed(cycle, rep=2)
    return out


def decode_parts(cache: CompressedKVCache, ops: DiffKVOps, b: int, context: int,
                 first_req: int) -> tuple[dict[str, tuple[float, float]], str]:
    req = torch.arange(first_req, first_req + b, device="cuda")
    lengths = torch.full((b,), context, dtype=torch.int64, device="cuda")
    chunk = 32  # prefill in groups: all-high admission takes ceil(L/32)+1 pages per row
    kv = torch.randn(chunk, HKV, context, D, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(chunk, HQ, context, D, device="cuda", dtype=torch.bfloat16)
    for s in range(0, b, chunk):
        r = req[s:s + chunk]
        n = r.numel()
        res = cache.begin_prefill(r.tolist(), [context] * n)
        if not bool(res.ok):
            raise RuntimeError(f"--pages too small for {b} x {context}")
        for layer in range(LAYERS):
            ops.prefill_layer(layer, r, lengths[:n], qp[:n], kv[:n], kv[:n], D ** -0.5)
        cache.end_prefill(r)
    del kv, qp
    state = {"pos": context}
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, D, device="cuda", dtype=torch.bfloat16)

    def store_all() -> None:
        pos = torch.full((b,), state["pos"], dtype=torch.int64, device="cuda")
        for layer in range(LAYERS):
            ops.decode_store(layer, req, pos, k, k)

    def step() -> None:
        cache.begin_decode(req)
        pos = torch.full((b,), state["pos"], dtype=torch.int64, device="cuda")
        for layer in range(LAYERS):
            ops.decode_store(layer, req, pos, k, k)
            ops.decode_attend(layer, req, q, D ** -0.5, max_seq_len=state["pos"] + 1)
        state["pos"] += 1

    for _ in range(3):
        step()
    out = {
        "begin_decode (alloc)": timed(lambda: cache.begin_decode(req)),
        "decode_store = policy step (x32)": timed(store_all),
        "decode_attend (x32)": timed(lambda: [ops.decode_attend(
            layer, req, q, D ** -0.5, max_seq_len=state["pos"] + 1) for layer in range(LAYERS)]),
        "whole step": timed(step),
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    cache.free(req.tolist())
    return out, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/profile_backend_ops")
    ap.add_argument("--prefill", default="1x300,1x1000,30x512", help="BxL,...")
    ap.add_argument("--decode", default="305x2048", help="BxCONTEXT,...")
    ap.add_argument("--pages", type=int, default=3_000_000)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache, ops = make_cache(512, a.pages)
    rows, tables = [], []
    for spec in filter(None, a.prefill.split(",")):
        b, length = (int(x) for x in spec.split("x"))
        try:
            for part, (h, g) in prefill_parts(cache, ops, b, length, 0).items():
                rows.append({"step": f"prefill {b}x{length}", "part": part, "host_ms": h,
                             "gpu_ms": g})
        except Exception as e:  # one failed shape must not cost the rest of the GPU call
            print(f"prefill {spec} failed: {type(e).__name__}: {e}")
    for spec in filter(None, a.decode.split(",")):
        b, ctx = (int(x) for x in spec.split("x"))
        try:
            parts, table = decode_parts(cache, ops, b, ctx, 0)
        except Exception as e:
            print(f"decode {spec} failed: {type(e).__name__}: {e}")
            continue
        tables.append(f"decode {b}x{ctx}, one step, GPU kernels:\n```\n{table}\n```")
        for part, (h, g) in parts.items():
            rows.append({"step": f"decode {b}x{ctx}", "part": part, "host_ms": h, "gpu_ms": g})
    lines = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", "",
             "| step | part | host ms | GPU ms (events) |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['part']} | {r['host_ms']:.2f} | {r['gpu_ms']:.2f} |"
              for r in rows]
    text = "\n".join(lines + [""] + tables)
    print(text)
    (out / "profile_backend_ops.md").write_text(text + "\n")
    (out / "profile_backend_ops.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
