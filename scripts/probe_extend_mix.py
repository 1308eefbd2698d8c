#!/usr/bin/env python3
"""SGLang's triton extend (prefill) attention on chunks of several sequences, against the
simulator's model of the same chunk. One GPU run.

The calibration (``scripts/calibrate_gpu.py``) times the kernel on one sequence per chunk
(chunk x past); a server's chunk holds several: a prompt's tail with its earlier chunks as
past next to the head of the next prompt, or tens of short prompts. This times one layer's
``extend_attention_fwd`` (bf16 KV) for the compositions given and prints the simulator's time
for each (``CostModel.prefill_attention_time``: with a measured calibration, the tiles the
launch computes at the grid's per-tile time, ``simulator/serving/extend_grid.py``).

A composition is ``[Nx]EXTEND+PAST`` terms joined by ``/``, e.g. ``320+7680/7872+0`` or
``20x400+0`` (twenty 400-token prompts with no past); ``--cycle
PROMPT,CHUNK`` adds the compositions a burst of PROMPT-token prompts cut into CHUNK-token chunks
goes through (one prompt's tail, the next prompt's head). Writes ``OUT/extend_mix.json``.

    python scripts/probe_extend_mix.py --out /tmp/x --cycle 8000,8192 \
        --calibration docs/data/h200-2026-11-24/calibration/calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate_gpu import DEV, HKV, HQ, D, sglang_kernels, timed  # noqa: E402
from probe_sustained_prefill import bf16_server  # noqa: E402

Composition = list[tuple[int, int]]  # (extend tokens, past tokens) per sequence


def parse(text: str) -> Composition:
    seqs = []
    for term in text.split("/"):
        n, _, ep = term.rpartition("x")
        try:
            e, p = (int(v) for v in ep.split("+"))
            n = int(n) if n else 1
        except ValueError:
            raise SystemExit(f"composition {text!r}: terms are [Nx]EXTEND+PAST, e.g. 320+7680 "
                             f"or 20x400+0") from None
        if e < 1 or p < 0 or n < 1:
            raise SystemExit(f"composition {text!r}: N >= 1, EXTEND >= 1 and PAST >= 0 in "
                             f"{term!r}")
        seqs += [(e, p)] * n
    return seqs


def cycle(prompt: int, chunk: int, points: int) -> list[Composition]:
    """``points`` chunks spread over one period of a burst of ``prompt``-token prompts in
    ``chunk``-token chunks: the chunk starting ``off`` tokens into a prompt holds that prompt's
    remaining ``prompt - off`` tokens (past ``off``), then whole prompts, then a head."""
    out = []
    for i in range(points):
        off = round(i * (prompt - 1) / max(points - 1, 1))
        seqs, left, past = [], chunk, off
        while left > 0:
            take = min(prompt - past, left)
            seqs.append((take, past))
            left -= take
            past = 0
        out.append(seqs)
    return out


def label(c: Composition) -> str:
    terms: list[list] = []
    for seq in c:
        if terms and terms[-1][1] == seq:
            terms[-1][0] += 1
        else:
            terms.append([1, seq])
    return "/".join(f"{n}x{e}+{p}" if n > 1 else f"{e}+{p}" for n, (e, p) in terms)


def time_extend(ext, c: Composition) -> float:
    """Seconds per call of one layer's extend over composition ``c`` (bf16 KV, causal)."""
    tokens = sum(e for e, _ in c)
    past = sum(p for _, p in c)
    q = torch.randn(tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    kb = torch.randn(past + tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    vb = torch.randn(past + tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    qo = torch.tensor([0] + list(torch.tensor([e for e, _ in c]).cumsum(0)), device=DEV,
                      dtype=torch.int32)
    kvp = torch.tensor([0] + list(torch.tensor([p for _, p in c]).cumsum(0)), device=DEV,
                       dtype=torch.int32)
    idx = torch.arange(past, device=DEV, dtype=torch.int64)
    fn = partial(ext, q, k, v, o, kb, vb, qo, kvp, idx, None, True, None,
                 max(e for e, _ in c), 1.0, 1.0, D**-0.5)
    return timed(fn, False, 1)


def modelled_s(cost, c: Composition) -> float:
    """The cost model's time of one layer's extend over ``c``."""
    tokens = sum(e for e, _ in c)
    past = sum(p for _, p in c)
    pairs = sum(e * p + e * e / 2 for e, p in c)
    return cost.prefill_attention_time(tokens, past, pairs, len(c), tuple(c))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("compositions", nargs="*", help="EXTEND+PAST[/EXTEND+PAST...]")
    ap.add_argument("--cycle", default=None, help="PROMPT,CHUNK: a burst's chunk compositions")
    ap.add_argument("--cycle-points", type=int, default=9)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--calibration", default=None)
    a = ap.parse_args(argv)
    comps = [parse(t) for t in a.compositions]
    if a.cycle:
        prompt, chunk = (int(v) for v in a.cycle.split(","))
        comps += cycle(prompt, chunk, a.cycle_points)
    if not comps:
        raise SystemExit("give compositions or --cycle PROMPT,CHUNK")
    _, ext, where = sglang_kernels()
    if ext is None:
        raise SystemExit(f"SGLang's extend kernel did not load: {where}")
    cost = bf16_server(a.model, a.gpu, a.calibration).cost
    rows = []
    head = (f"{'composition (extend+past per sequence)':>44} {'measured us':>12} "
            f"{'model us':>9} {'model/meas':>10}")
    lines = [head, "-" * len(head)]
    for c in comps:
        t = time_extend(ext, c)
        m = modelled_s(cost, c)
        rows.append({"composition": c, "time_s": t, "model_s": m})
        lines.append(f"{label(c):>44} {t * 1e6:12.1f} {m * 1e6:9.1f} {m / t:10.2f}")
        torch.cuda.empty_cache()
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "extend_mix.json").write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(), "kernel": where, "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "table": table, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
