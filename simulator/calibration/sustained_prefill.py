#!/usr/bin/env python3
"""Does a prefill step run slower when prefill steps follow each other for seconds (a burst's
chunked prefill) than when it runs alone (a low-rate arrival)? One GPU run, plain torch.

A "step" is the dense part of a Llama-shaped prefill forward over M tokens, every layer:
RMSNorm, qkv, o, RMSNorm, gate_up, SiLU-and-mul, down (F.linear bf16, the weights of all
layers resident, so each call streams a different layer's weights as a server's does), plus
causal SDPA over the chunk's sequences (GQA, flash). For each M it times, with CUDA events:

  isolated   ``--isolated`` steps, each after ``--idle-s`` of idle GPU (a low-rate arrival)
  sustained  steps back to back for ``--sustained-s`` (a burst of queued prompts)

and samples the SM clock, power and temperature (nvidia-smi, every 50 ms) meanwhile. The
table compares the first and the last second of the sustained phase with the isolated steps,
next to the simulator's modelled time of the same step (``--calibration``), so a gap between
the model and a server's back-to-back prefill steps can be put down to the GPU's clocks under
load or not.

``--duty PxD,...`` adds a third phase per pattern, the way a server interleaves an arriving
prompt with the running batch: P prefill steps of ``--duty-shape``, then D decode-like steps
(the dense stack over ``--decode-tokens`` tokens, one CUDA graph replay each: weight streaming,
little compute), repeated for ``--duty-s`` seconds. Its table gives, over the phase's second
half, the fraction of time in prefill steps, their median time against the same shape alone
and back to back, the decode steps' median, the clock and the power: how much prefill it takes
before a prefill step runs at the back-to-back clocks. Writes ``OUT/sustained_prefill.json``
(every step, every clock sample).

    python python -m simulator.calibration.sustained_prefill --out /tmp/probe --gpu h200 \
        --calibration docs/data/h200-2026-11-24/calibration/calibration.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

# the server and its cost model, not the simpy engine: the GPU machine has no simpy
from simulator.kv.formats import make_format
from simulator.serving.cost import StepShape
from simulator.serving.server import Deployment, ResolvedServer
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration import load_calibration
from simulator.specs.gpu import load_gpu
from simulator.specs.model import ModelSpec, load_model

DEV = "cuda"
SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class DenseStack:
    """All layers' weights of ``m`` and one prefill step's forward over ``seqs`` sequences."""

    def __init__(self, m: ModelSpec):
        h, d = m.hidden_size, m.head_dim
        self.m = m
        q, kv = m.num_heads * d, m.num_kv_heads * d
        self.q, self.kv = q, kv

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        self.layers = [(w(q + 2 * kv, h), w(h, q), w(2 * m.intermediate_size, h),
                        w(h, m.intermediate_size)) for _ in range(m.num_layers)]
        self.norm = torch.ones(h, device=DEV, dtype=torch.bfloat16)

    def step(self, x: torch.Tensor, seqs: int) -> torch.Tensor:
        m = self.m
        tokens = x.shape[0]
        per = tokens // seqs
        for qkv_w, o_w, gu_w, down_w in self.layers:
            y = F.rms_norm(x, (m.hidden_size,), self.norm)
            qkv = F.linear(y, qkv_w)
            qh = qkv[:, :self.q].view(seqs, per, m.num_heads, m.head_dim).transpose(1, 2)
            kh = qkv[:, self.q:self.q + self.kv].view(seqs, per, m.num_kv_heads,
                                                     m.head_dim).transpose(1, 2)
            vh = qkv[:, self.q + self.kv:].view(seqs, per, m.num_kv_heads,
                                                m.head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(tokens, self.q), o_w)
            y = F.rms_norm(x, (m.hidden_size,), self.norm)
            g, u = F.linear(y, gu_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, down_w)
        return x


def timed_call(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall start, milliseconds) of one call of ``fn`` on the GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return t0, start.elapsed_time(end)


def timed_step(stack: DenseStack, x: torch.Tensor, seqs: int) -> tuple[float, float]:
    """(wall start, milliseconds) of one step."""
    return timed_call(lambda: stack.step(x, seqs))


def decode_graph(stack: DenseStack, tokens: int) -> torch.cuda.CUDAGraph:
    """The dense stack over ``tokens`` tokens (one sequence each: no attention to speak of)
    captured once, replayed as a server replays its decode graphs."""
    x = torch.randn(tokens, stack.m.hidden_size, device=DEV, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            stack.step(x, tokens)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stack.step(x, tokens)
    return g


def parse_duty(text: str) -> list[tuple[int, int]]:
    """``PxD,...``: P prefill steps then D decode steps, per pattern (P + D >= 1)."""
    out = []
    for term in filter(None, text.split(",")):
        try:
            p, d = (int(v) for v in term.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--duty {term!r}: PREFILLSxDECODES, e.g. 1x4") from None
        if p < 0 or d < 0 or p + d < 1:
            raise SystemExit(f"--duty {term!r}: counts >= 0, at least one step")
        out.append((p, d))
    return out


def duty_summary(steps: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Over the second half of a duty phase (``(kind, wall start, ms)`` per step): the share
    of wall time in prefill steps and the median step of each kind."""
    t_mid = 0.5 * (steps[0][1] + steps[-1][1])
    late = [s for s in steps if s[1] >= t_mid]
    span = late[-1][1] + late[-1][2] / 1e3 - late[0][1]

    def med(kind: str) -> float | None:
        v = [ms for k, _, ms in late if k == kind]
        return statistics.median(v) if v else None
    pf = sum(ms for k, _, ms in late if k == "prefill") / 1e3
    return {"t0": t_mid, "t1": late[-1][1], "prefill_share": pf / span if span > 0 else 0.0,
            "prefill_ms": med("prefill"), "decode_ms": med("decode")}


def bf16_server(model: str, gpu: str, calibration: str | None) -> ResolvedServer:
    """The simulator's bf16 server with default settings (its cost model is what we compare)."""
    spec = load_model(model)
    gpu_spec = load_gpu(gpu)
    return ResolvedServer(Deployment(spec, gpu_spec, make_format("bf16", spec.head_dim),
                                     ServerSettings(),
                                     load_calibration(gpu_spec.key, calibration)))


def modelled_ms(model: str, gpu: str, calibration: str | None, tokens: int, seqs: int) -> float:
    """The simulator's time of the same step (dense GEMMs, prefill attention, per-layer and
    per-step costs; the LM head over one position per sequence)."""
    per = tokens // seqs
    shape = StepShape(prefill_tokens=tokens, prefill_pairs=seqs * per * per / 2,
                      prefill_seqs=seqs)
    return bf16_server(model, gpu, calibration).cost.step_time(shape) * 1e3


def smi_samples(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines()[1:]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            rows.append({"t": ts, "sm_mhz": float(parts[1].split()[0]),
                         "power_w": float(parts[2].split()[0]), "temp_c": float(parts[3]),
                         "reasons": parts[4]})
        except (ValueError, IndexError):
            continue
    return rows


def during(samples: list[dict], t0: float, t1: float, key: str) -> float | None:
    vals = [s[key] for s in samples if t0 <= s["t"] <= t1]
    return statistics.median(vals) if vals else None


def _num(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def parse_shape(text: str, flag: str) -> tuple[int, int]:
    try:
        tokens, seqs = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"{flag} {text}: TOKENSxSEQS, e.g. 4096x1") from None
    if tokens < 1 or seqs < 1 or tokens % seqs:
        raise SystemExit(f"{flag} {text}: TOKENSxSEQS with SEQS dividing TOKENS")
    return tokens, seqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200", help="the simulator's GPU key, for the model column")
    ap.add_argument("--calibration", default=None,
                    help="calibration JSON for the model column (default: the shipped one)")
    ap.add_argument("--shapes", default="4096x1,8000x1,8000x20",
                    help="TOKENSxSEQS steps to probe, comma-separated (default: %(default)s)")
    ap.add_argument("--isolated", type=int, default=6)
    ap.add_argument("--idle-s", type=float, default=1.5)
    ap.add_argument("--sustained-s", type=float, default=8.0)
    ap.add_argument("--duty", default="", help="PxD patterns (P prefill steps, D decode "
                    "steps), comma-separated; empty: no duty phase")
    ap.add_argument("--duty-shape", default="2048x4", help="TOKENSxSEQS of the duty phase's "
                    "prefill steps (default: %(default)s)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--duty-s", type=float, default=6.0)
    a = ap.parse_args(argv)
    duty = parse_duty(a.duty)
    shapes = [parse_shape(s, "--shapes") for s in a.shapes.split(",")]
    duty_shape = parse_shape(a.duty_shape, "--duty-shape")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    smi_path = out / "smi.csv"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv",
                            "-lms", "50"], stdout=smi_path.open("w"), stderr=subprocess.DEVNULL)
    stack = DenseStack(load_model(a.model))
    results = []
    try:
        for tokens, seqs in shapes:
            x = torch.randn(tokens, stack.m.hidden_size, device=DEV, dtype=torch.bfloat16)
            for _ in range(3):
                timed_step(stack, x, seqs)
            iso = []
            for _ in range(a.isolated):
                time.sleep(a.idle_s)
                iso.append(timed_step(stack, x, seqs))
            sus = []
            t_end = time.time() + a.sustained_s
            while time.time() < t_end:
                sus.append(timed_step(stack, x, seqs))
            time.sleep(a.idle_s)
            results.append({"tokens": tokens, "seqs": seqs, "isolated": iso, "sustained": sus,
                            "model_ms": modelled_ms(a.model, a.gpu, a.calibration, tokens,
                                                    seqs)})
            del x
        duties = []
        if duty:
            tokens, seqs = duty_shape
            xp = torch.randn(tokens, stack.m.hidden_size, device=DEV, dtype=torch.bfloat16)
            g = decode_graph(stack, a.decode_tokens)
            for p, d in duty:
                time.sleep(a.idle_s)
                steps = []
                t_end = time.time() + a.duty_s
                while time.time() < t_end:
                    steps += [("prefill", *timed_step(stack, xp, seqs)) for _ in range(p)]
                    steps += [("decode", *timed_call(g.replay)) for _ in range(d)]
                duties.append({"prefills": p, "decodes": d, "steps": steps})
    finally:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
    samples = smi_samples(smi_path)
    head = (f"{'step':>10} {'model ms':>9} {'isolated ms':>12} {'sustained 1st s':>16} "
            f"{'last s':>8} {'MHz iso':>8} {'MHz 1st s':>9} {'MHz last s':>10} "
            f"{'W last s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        iso_ms = statistics.median(ms for _, ms in r["isolated"])
        t0 = r["sustained"][0][0]
        t1 = r["sustained"][-1][0]
        first = [ms for t, ms in r["sustained"] if t < t0 + 1.0]
        last = [ms for t, ms in r["sustained"] if t > t1 - 1.0]
        iso_mhz = [during(samples, t, t + ms / 1e3, "sm_mhz") for t, ms in r["isolated"]]
        iso_mhz = [v for v in iso_mhz if v is not None]

        r["summary"] = {
            "isolated_ms": iso_ms, "sustained_first_s_ms": statistics.median(first),
            "sustained_last_s_ms": statistics.median(last),
            "mhz_isolated": statistics.median(iso_mhz) if iso_mhz else None,
            "mhz_first_s": during(samples, t0, t0 + 1.0, "sm_mhz"),
            "mhz_last_s": during(samples, t1 - 1.0, t1, "sm_mhz"),
            "power_last_s": during(samples, t1 - 1.0, t1, "power_w")}
        s = r["summary"]
        lines.append(f"{r['tokens']:>6}x{r['seqs']:<3} {r['model_ms']:9.1f} {iso_ms:12.1f} "
                     f"{s['sustained_first_s_ms']:16.1f} {s['sustained_last_s_ms']:8.1f} "
                     f"{_num(s['mhz_isolated']):>8} {_num(s['mhz_first_s']):>9} "
                     f"{_num(s['mhz_last_s']):>10} {_num(s['power_last_s']):>8}")
    if duties:
        ref = next((r["summary"] for r in results
                    if (r["tokens"], r["seqs"]) == duty_shape), None)
        head = (f"{'P x D':>7} {'prefill share':>13} {'prefill ms':>10} {'/alone':>7} "
                f"{'/back to back':>13} {'decode ms':>9} {'MHz':>6} {'W':>5}")
        lines += ["", f"duty phase: prefill {duty_shape[0]}x{duty_shape[1]}, decode "
                  f"{a.decode_tokens} tokens (CUDA graph)", head, "-" * len(head)]
        for dd in duties:
            sm = duty_summary(dd["steps"])
            sm["mhz"] = during(samples, sm["t0"], sm["t1"], "sm_mhz")
            sm["power_w"] = during(samples, sm["t0"], sm["t1"], "power_w")
            dd["summary"] = sm
            pms = sm["prefill_ms"]
            alone = pms / ref["isolated_ms"] if ref and pms else None
            b2b = pms / ref["sustained_last_s_ms"] if ref and pms else None
            lines.append(f"{dd['prefills']:>3}x{dd['decodes']:<3} {sm['prefill_share']:13.2f} "
                         f"{_num(pms, '.1f'):>10} {_num(alone, '.3f'):>7} "
                         f"{_num(b2b, '.3f'):>13} {_num(sm['decode_ms'], '.2f'):>9} "
                         f"{_num(sm['mhz']):>6} {_num(sm['power_w']):>5}")
    table = "\n".join(lines)
    print(table)
    (out / "sustained_prefill.json").write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "table": table, "steps": results, "duty": duties, "smi": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
