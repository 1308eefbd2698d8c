"""What one layer of a prefill step's prompt ends costs the device, accounted on the CPU
(``sglang_diffkv.traffic_audit``): per torch op and per Triton launch of
``ExtendStores.store_prompt_ends`` the bytes it moves, its grid and its dot work, against
the whole-prompt path (``DiffKVOps._score_and_compress``) on the same step.

The case (``served_case``) is the served prefix-reuse step's kind at the Llama-3-8B layer
shape (8 KV heads, GQA 4, head_dim 128, the llama-3-8b preset: window 64, score_queries
64): a radix suffix of ``fresh`` tokens over an attached ``prefix``-token prefix, a chunked
prompt's last chunk of ``fresh`` tokens over ``stored`` tokens, and a whole prompt of
``whole`` tokens, in one step. Earlier steps (the exporter, the chunk before the last) run
on the reference path; the measured step's stores on the kernel path under the
interpreter. Run as a script for the table (``docs/backend.md``, stage 2):

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python tests/extend_end_cost.py \\
        [--prefix 4096] [--stored 6144] [--fresh 2048] [--whole 4096]

It takes a few minutes at the served sizes (the interpreter runs every program); the
test (``tests/test_extend_end_cost.py``) runs it at a small size.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_extend_stores import Run, Shape, hit, prompt  # noqa: E402

from sglang_diffkv.cache import CompressedKVCache  # noqa: E402
from sglang_diffkv.config import preset  # noqa: E402
from sglang_diffkv.kernels import extend_store  # noqa: E402
from sglang_diffkv.sglang import extend_ops  # noqa: E402
from sglang_diffkv.sglang.ops import DiffKVOps  # noqa: E402
from sglang_diffkv.traffic_audit import TrafficAudit  # noqa: E402

LLAMA_LAYER = Shape(128, 8, 4, 1)  # one Llama-3-8B layer's heads


@dataclass
class Case:
    prefix: int = 4096  # the radix hit's attached tokens
    stored: int = 6144  # the chunked prompt's tokens stored by its earlier chunks
    fresh: int = 2048  # fresh tokens of each prompt end
    whole: int = 4096  # the whole prompt sharing the step
    exporter_extra: int = 512  # the exporter's tokens past the hit's cut


@dataclass
class Result:
    audit: TrafficAudit
    case: Case
    seconds: float
    cache: CompressedKVCache


def served_case(case: Case, shape: Shape = LLAMA_LAYER, config=None) -> Result:
    """The measured step's ``store_prompt_ends`` (section ``end`` and its parts) and the
    whole prompt's ``_score_and_compress`` (section ``whole``), audited."""
    cfg = config or preset("llama-3-8b")
    max_ctx = max(case.prefix + case.fresh, case.stored + case.fresh,
                  case.prefix + case.exporter_extra, case.whole)
    max_ctx = 1 << (max_ctx - 1).bit_length()
    high = 32  # K8V4 tokens per page at head_dim 128 (more rows than needed otherwise)
    pages = 6 * shape.layers * shape.kv_heads * math.ceil(max_ctx / high) + 64
    run = Run(cfg, kernels=False, shape=shape, max_context=max_ctx, num_pages=pages)
    x = prompt(case.prefix + case.exporter_extra, 1, shape=shape)
    prompts = {
        "x": x,  # the exporter
        "p": prompt(case.stored + case.fresh, 2, shape=shape),  # chunked: stored, fresh
        "h": hit(x, "x", case.prefix, case.fresh, 3, shape=shape),  # radix suffix
        "w": prompt(case.whole, 4, shape=shape),  # a whole prompt
    }
    run.step(prompts, [("x", prompts["x"].q.shape[1])])
    run.step(prompts, [("p", case.stored)])
    ops = DiffKVOps(run.c, True, fused_argmin=False)
    chunks = [("h", case.fresh), ("p", case.fresh), ("w", case.whole)]
    req, fresh, ext, _, (q, k, v) = run.begin(prompts, chunks)
    step = ops.begin_prefill_step(req, fresh, ext=ext)
    layer, scale = 0, shape.scale
    ql, kl, vl = q[layer], k[layer], v[layer]
    rows, p = step.whole_rows, step.prompts
    qw, kw, vw = ql[rows], kl[rows], vl[rows]
    lse = _last_lse(qw, kw, p.lengths.tolist(), scale, cfg.score_queries)
    audit = TrafficAudit()
    patches = [(extend_store, "gather_prompts", "end: gather"),
               (extend_ops, "prefill_scores", "end: scores"),
               (extend_store, "compress_span", "end: classify + store"),
               (extend_ops.ExtendStores, "_record_cuts", "end: cut counts")]
    saved = [(o, a, getattr(o, a)) for o, a, _ in patches]
    t0 = time.perf_counter()
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, audit.wrap(getattr(owner, attr), name))
        with audit:
            with audit.section("end"):
                step.stores.store_prompt_ends(layer, ql, kl, vl, scale)
            with audit.section("whole"):
                ops._score_and_compress(
                    layer, step.req, p.lengths, qw, kw, vw, scale, step.alpha_h,
                    step.alpha_l, step.seed, lse=lse, starts=p.starts, max_len=p.max_len,
                    totals=step.totals[layer], buffers=step.buffers)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    return Result(audit, case, time.perf_counter() - t0, run.c)


def _last_lse(q: torch.Tensor, k: torch.Tensor, lengths: list[int], scale: float,
              nq: int) -> torch.Tensor:
    """The packed per-token natural-log LSE [T, Hq] the prompt attention would return, for
    each prompt's last ``nq`` queries (the only rows the scoring reads; others 0)."""
    out = torch.zeros(q.shape[0], q.shape[1])
    g = q.shape[1] // k.shape[1]
    at = 0
    for n in lengths:
        lo = at + n - min(nq, n)
        qs = q[lo:at + n].float()  # [nq, Hq, D]
        ks = k[at:at + n].float().repeat_interleave(g, 1)  # [n, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        pos = torch.arange(lo - at, n)[:, None]
        s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        out[lo:at + n] = torch.logsumexp(s, -1).transpose(0, 1)
        at += n
    return out


def report(res: Result) -> str:
    c, a = res.case, res.audit
    ends = 2 * c.fresh
    lines = [f"case: radix suffix {c.fresh} over an attached {c.prefix}; last chunk "
             f"{c.fresh} over {c.stored} stored; whole prompt {c.whole} "
             f"(Llama-3-8B layer: 8 KV heads, GQA 4, D 128); audited in {res.seconds:.0f} s"]
    for name in sorted(a.launches.keys() | a.ops.keys()):
        if name.startswith("end"):  # (the prompt end's own ops: its scoring queries)
            lines += ["", f"[{name}]", a.table(name)]
    for name, tokens in (("end", ends), ("whole", c.whole)):
        ops, tri = a.section_bytes(name)
        for sub in (n for n in a.launches.keys() | a.ops.keys() if n.startswith(name + ":")):
            o, t = a.section_bytes(sub)
            ops, tri = ops + o, tri + t
        lines.append("")
        lines.append(f"[{name}] total {(ops + tri) / 1e6:.1f} MB per layer for {tokens} fresh "
                     f"tokens ({(ops + tri) / tokens / 1e3:.1f} KB per fresh token)")
        if name == "whole":
            lines.append(a.table(name))
    fma = {}
    for sec in a.launches.values():
        for kname, lc in sec.items():
            for prec, v in lc.dot_fma.items():
                fma[(kname, prec)] = fma.get((kname, prec), 0) + v
    lines.append("")
    lines.append("(the interpreter runs every dot in fp32; on a GPU the whole prompts' bf16 "
                 "keys take tensor cores, and so, with bf16 queries, do the prompt ends' fp32 "
                 "keys: prefill._qk)")
    lines.append("dot multiply-adds per layer: " + ", ".join(
        f"{k} {p}: {v / 1e9:.2f} G" for (k, p), v in sorted(fma.items())))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in vars(Case()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = ap.parse_args()
    case = Case(**{k: getattr(args, k) for k in vars(Case())})
    print(report(served_case(case)))


if __name__ == "__main__":
    main()
