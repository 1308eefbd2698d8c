"""Where the diffkv backend's time goes, per step, without SGLang (GPU).

Replays what ``sglang_diffkv.sglang.backend`` does for one prefill step and one decode step of
a Llama-3-8B-shaped model (32 layers, 32 q / 8 KV heads, head_dim 128) on the kernels path
(``DiffKVOps``), in benchmark mode (30/50/20), and reports:

- prefill: the whole step three ways (packed prompts with the chosen attention, packed with
  padded SDPA, and session 5's padded prompts), and a cProfile of the packed step's host time;
- decode: per part, and a torch.profiler table of the GPU kernels of one whole step;
- host: wall time of the Python call (launch cost included), synchronised after each part;
  gpu: CUDA-event time of the same part.

    python scripts/profile_backend_ops.py --out DIR [--prefill 2x450,sharegpt46] [--decode 305x2048]

Writes ``DIR/profile_backend_ops.md`` (tables) and ``.json``. The numbers explain the
end-to-end runs in docs/benchmarks.md; they are not a benchmark target.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sglang_diffkv.bench.workloads import sharegpt_trace
from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.prompt_attention import (
    PackedPrompts,
    PromptAttention,
    attend_padded,
    causal_sdpa,
)
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


def prefill_lengths(spec: str) -> list[int]:
    """``BxL`` (B prompts of L tokens) or ``sharegptN[@K]`` (the K-th group of N prompt
    lengths of the bundled ShareGPT-shaped trace, as one saturated prefill batch takes
    them)."""
    if spec.startswith("sharegpt"):
        n_text, _, k_text = spec[len("sharegpt"):].partition("@")
        n, k = int(n_text), int(k_text or 0)
        reqs = sharegpt_trace(n * (k + 1)).requests[n * k:]
        return [r.input_tokens for r in reqs]
    b, length = (int(x) for x in spec.split("x"))
    return [length] * b


def prefill_inputs(cache: CompressedKVCache, ops: DiffKVOps, lengths: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              Callable[[], None]]:
    """Random packed q / k / v for prompts of ``lengths`` and the backend's packed prefill
    step over them (allocate, every layer's ``extend_layer``, reclaim, free): (req, q, k, v,
    lengths on the device, step)."""
    req = torch.arange(len(lengths), device="cuda")
    t = sum(lengths)
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16)
    lengths_dev = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def step() -> None:
        cache.begin_prefill(req.tolist(), lengths)
        st = ops.begin_prefill_step(req, lengths, lengths_dev)
        for layer in range(LAYERS):
            ops.extend_layer(layer, st, q, k, v, D ** -0.5)
        ops.end_prefill_step(st)
        cache.free(req.tolist())

    return req, q, k, v, lengths_dev, step


def prefill_parts(cache: CompressedKVCache, ops: DiffKVOps, lengths: list[int]
                  ) -> dict[str, tuple[float, float]]:
    """One prefill step of the backend's DiffKV work for prompts of ``lengths`` (packed,
    as SGLang passes them), three ways: the backend's path with its chosen attention, the
    same path with padded SDPA, and the path before packing (session 5: pad, SDPA, unpad,
    then scoring and compression on the padded prompts, a gather and two copies a layer)."""
    req, q, k, v, lengths_dev, packed = prefill_inputs(cache, ops, lengths)
    scale = D ** -0.5
    chosen = ops.prompt_attention

    def packed_step(attention: PromptAttention) -> None:
        ops.prompt_attention = attention
        packed()

    def padded_step() -> None:  # the session-5 backend
        cache.begin_prefill(req.tolist(), lengths)
        p = PackedPrompts.from_lengths(lengths, "cuda", lengths_dev)
        lens = p.lengths.long()
        for layer in range(LAYERS):
            qp, kp, vp = p.pad(q), p.pad(k), p.pad(v)
            p.unpad(causal_sdpa(qp, kp, vp, scale))
            ops.prefill_layer(layer, req, lens, qp, kp, vp, scale)
        cache.end_prefill(req)
        cache.free(req.tolist())

    padded = PromptAttention("padded", attend_padded, "forced")
    runs = {f"packed, {chosen.name} attention": lambda: packed_step(chosen),
            "packed, padded attention": lambda: packed_step(padded),
            "session 5 (padded prompts)": padded_step}
    out: dict[str, tuple[float, float]] = {}
    for name, fn in runs.items():
        fn()  # compile everything once
        out[name] = timed(fn, rep=3)
    ops.prompt_attention = chosen
    return out


def host_profile(cache: CompressedKVCache, ops: DiffKVOps, lengths: list[int], spec: str
                 ) -> str:
    """cProfile of five packed prefill steps (host side only: where launch time goes)."""
    step = prefill_inputs(cache, ops, lengths)[-1]
    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return f"prefill {spec}, host cProfile of 5 packed steps:\n```\n{text.getvalue()}\n```"


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
    ap.add_argument("--prefill", default="1x300,2x450,1x4000,sharegpt46",
                    help="BxL or sharegptN[@K] (N lengths of the ShareGPT-shaped trace), ...")
    ap.add_argument("--decode", default="305x2048", help="BxCONTEXT,...")
    ap.add_argument("--host-profile", default="2x450",
                    help="prefill shape whose packed step's host time cProfile breaks down "
                         "(top functions by own time); empty: none")
    ap.add_argument("--pages", type=int, default=3_000_000)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache, ops = make_cache(512, a.pages)
    rows, tables = [], []
    for spec in filter(None, a.prefill.split(",")):
        try:
            lengths = prefill_lengths(spec)
            name = (f"prefill {spec}: {len(lengths)} prompts, {sum(lengths)} tokens, "
                    f"longest {max(lengths)}")
            for part, (h, g) in prefill_parts(cache, ops, lengths).items():
                rows.append({"step": name, "part": part, "host_ms": h, "gpu_ms": g})
        except Exception as e:  # one failed shape must not cost the rest of the GPU call
            print(f"prefill {spec} failed: {type(e).__name__}: {e}")
    if a.host_profile:
        tables.append(host_profile(cache, ops, prefill_lengths(a.host_profile), a.host_profile))
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
