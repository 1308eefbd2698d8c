"""Fit a calibration from measured decode steps (the 'Decode batch' lines of an SGLang log).

Each line gives the running batch B, the KV tokens in use T and the generation throughput G
over the last logging interval, so a decode step took about B / G seconds. In the
memory-bound decode regime the cost model reduces to a linear form

    step = dense_bytes(B) / (eta_mem_gemm * BW) + layers * layer_overhead
           + attention_bytes(B, T) / (eta_attn * BW) + step_overhead + c_seq * B

with the byte counts the cost model uses; eta_attn, the per-step constant and c_seq are
fitted by non-negative least squares on the lines whose batch is below half the GPU's ridge
point (larger batches become compute-bound and are left out), with the weight streaming and
per-layer costs of the current calibration as a fixed offset. Decode lines of one model cannot
separate the weight-streaming efficiency from the per-step cost (both are constant), so the
fitted constant keeps the current per-step cost and moves the rest into eta_mem_gemm, or, if
that is not a valid efficiency, keeps eta_mem_gemm and becomes the per-step cost.
The result is a calibration entry with ``measured_on`` provenance.

When the calibration already carries measured kernel grids (``scripts/calibrate_gpu.py``),
GEMM and attention times are known per step and only the fixed costs are left: ``step_fit``
fits them (per step and request, per prefill step, request and prompt token, and a factor on
the decode attention grid) to the part of each measured interval the kernels do not explain.

What a Decode line's throughput implies: SGLang logs every ``decode_log_interval`` (40) decode
steps ``gen throughput = (sum of the interval's decode batch sizes) / (wall time since the
previous Decode line)``, and that wall time includes prefill forwards and idle time between
the decode steps. So only intervals with a Decode line before them and no Prefill line in
between measure decode steps alone (``sglang_log.decode_intervals``); for those the mean step time
is (mean batch over the interval) / throughput, with the mean batch approximated by the mean
of the two lines' ``#running-req`` (the batch only shrinks inside a prefill-free interval).
Intervals after a prefill are dropped, as is the first line (its interval starts at server
start-up) — using them would charge prefill and warm-up time to decode steps.

Prefill steps (``prefill_samples``): SGLang's Prefill line i carries ``input throughput =
(new tokens of Prefill line i-1) / (wall time between the two lines)``, so when two Prefill
lines follow each other with no Decode line between (an initial burst of whole prompts: the
scheduler runs prefill steps back to back while requests wait), the step of line i-1 took about
tokens(i-1) / throughput(i) seconds (timestamps have whole-second resolution, the throughput
does not). Under the overlap scheduler a gap is one step late (the scheduler logs batch i after
launching batch i-1 and waiting for batch i-2), which shifts the shapes by one inside a burst
of equal batches; the gap that fills or drains the pipeline is no step time at all, so the fit
that uses these samples (``step_fit``) drops samples far off its model.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.sglang_log import ServerLog, decode_intervals
from simulator.errors import SimulatorInputError
from simulator.serving.cost import ACT_BYTES, StepShape
from simulator.serving.server import ResolvedServer

MIN_SAMPLES = 8
# below this relative spread (std / mean) of a feature across the samples (the intervals'
# batch, prompts or tokens per prefill step) its cost cannot be told from the per-step cost
SPREAD_MIN = 0.05


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with theta >= 0: drop the most negative coefficient until none is."""
    active = list(range(x.shape[1]))
    theta = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            theta[active] = sol
            return theta
        active.pop(int(np.argmin(sol)))
    return theta


def decode_samples(log: ServerLog, graphed: bool | None = None) -> np.ndarray:
    """(mean batch, mean KV tokens, mean step seconds) per decode-only interval (see the
    module docstring). ``graphed``: keep only lines whose ``cuda graph:`` flag is this value
    (None: all)."""
    rows = []
    for iv in decode_intervals(log, 1):
        if iv.prefills:
            continue
        if graphed is not None and log.decode_cuda_graph[iv.index] not in (None, graphed):
            continue
        rows.append((iv.batch, iv.tokens, iv.wall_s))
    return np.array(rows, dtype=float).reshape(-1, 3)


def _shape(server: ResolvedServer, b: float, t: float) -> StepShape:
    """A decode step of ``b`` requests alike for which the log gave ``t`` as ``#token``."""
    reqs = max(1, int(round(b)))
    kv = np.full(reqs, server.pool.context_from_logged(reqs, t))
    return StepShape(decode_reqs=reqs, decode_kv_tokens=int(kv.sum()),
                     decode_read_bytes=server.pool.read_bytes_per_layer(kv, None))


def prefill_samples(log: ServerLog) -> np.ndarray:
    """(chunks, new tokens, cached tokens, seconds, line number) per Prefill line that the
    next scheduler line, another Prefill line with an input throughput, times (see the module
    docstring)."""
    rows = []
    for i in range(1, len(log.prefill_new_tokens)):
        if not log.prefill_after_prefill[i]:
            continue
        thr, tok = log.prefill_input_throughput[i], log.prefill_new_tokens[i - 1]
        if not (thr > 0 and tok > 0) or log.prefill_new_seqs[i - 1] <= 0:
            continue
        rows.append((log.prefill_new_seqs[i - 1], tok, log.prefill_cached_tokens[i - 1],
                     tok / thr, log.prefill_line_no[i - 1]))
    return np.array(rows, dtype=float).reshape(-1, 5)


def prefill_shape(server: ResolvedServer, seqs: int, tokens: int, cached: int) -> StepShape:
    """A prefill-only step of ``seqs`` whole prompts of equal length (the log gives only the
    batch's totals), attention pairs and compression as the scheduler counts them."""
    pool = server.pool
    n = max(1, int(seqs))
    ext, past = tokens / n, cached / n
    fill = int(round(ext + past))
    pairs = n * (ext * past + ext * ext / 2.0 + pool.compression_pairs(fill))
    return StepShape(prefill_tokens=int(tokens), prefill_pairs=pairs,
                     prefill_past_tokens=int(cached), prefill_seqs=n)


def fit_decode(server: ResolvedServer, samples: np.ndarray) -> dict[str, Any]:
    cost = server.cost
    dep = server.deployment
    bw = dep.gpu.hbm_bandwidth
    ridge = dep.gpu.bf16_flops / bw * dep.model.weight_bytes_per_param / 2
    keep = samples[:, 0] <= 0.5 * ridge
    s = samples[keep]
    if len(s) < MIN_SAMPLES:
        raise SimulatorInputError(
            f"need at least {MIN_SAMPLES} memory-bound decode lines (batch <= {0.5 * ridge:.0f});"
            f" the log has {len(s)}")
    cal = dep.calibration
    weight = cost.layers * sum(op[0] for op in cost.gemms) + cost.lm_head[0]
    dense, attn = decode_bytes(server, s[:, 0], s[:, 1])
    # what the current calibration already explains: weight streaming and per-layer costs
    offset = dense / (bw * cal.eta_mem_gemm) + cost.layers * cal.layer_overhead_s
    x = np.column_stack([attn / bw, np.ones(len(s)), s[:, 0]])
    inv_eta_a, const, c_seq = _nnls(x, s[:, 2] - offset)
    pred = offset + x @ np.array([inv_eta_a, const, c_seq])
    mape = float(np.mean(np.abs(pred / s[:, 2] - 1)))
    # ``const`` = per-step cost + the error of the current weight-streaming estimate; keep the
    # per-step cost and move the rest into eta_mem_gemm when that stays a valid efficiency
    stream = weight / (bw * cal.eta_mem_gemm) + const - cal.step_overhead_s
    eta_w = weight / (bw * stream) if stream > 0 else None
    if eta_w is not None and 0 < eta_w <= 1:
        step_overhead = cal.step_overhead_s
    else:
        eta_w = None
        step_overhead = max(0.0, const)
    return {"eta_mem_gemm": eta_w,
            "eta_mem_decode_attention": (1 / inv_eta_a) if inv_eta_a > 0 else None,
            "step_overhead_s": float(step_overhead), "seq_overhead_s": float(c_seq),
            "samples": int(len(s)), "samples_dropped_compute_bound": int((~keep).sum()),
            "mape": mape}


def decode_bytes(server: ResolvedServer, batch: np.ndarray,
                 kv_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per decode step: bytes the weight GEMMs and the LM head move (CUDA-graph padded batch)
    and bytes decode attention moves (KV read + write + queries), as the cost model counts;
    ``kv_tokens`` as the log's ``#token`` (``KVPool.context_from_logged``)."""
    cost, pool = server.cost, server.pool
    dense, attn = [], []
    for b, t in zip(batch.astype(int), kv_tokens.astype(int), strict=True):
        padded = cost.padded_batch(b) if cost.graphs_enabled and b <= cost.graph_max else b
        per_layer = sum(w + padded * (i + o) * ACT_BYTES for w, _, i, o in cost.gemms)
        w, _, i, o = cost.lm_head
        dense.append(cost.layers * per_layer + w + padded * (i + o) * ACT_BYTES)
        read = pool.read_bytes_per_layer(np.full(b, pool.context_from_logged(b, t)), None)
        q = b * cost.q_heads * cost.head_dim * ACT_BYTES * 2
        attn.append(cost.layers * (read + b * cost.write_bpt + q))
    return np.array(dense, dtype=float), np.array(attn, dtype=float)


def calibration_file(server: ResolvedServer, fit: dict[str, Any], log_path: str) -> dict:
    """A calibration JSON (same schema as the default) with the fitted values filled in;
    values the fit could not determine keep the current calibration's."""
    cal = server.deployment.calibration
    entry = cal.to_dict()
    key = server.deployment.kv_format.calibration_key
    if fit.get("eta_mem_gemm") is not None:
        entry["eta_mem_gemm"] = round(min(1.0, fit["eta_mem_gemm"]), 4)
    if fit.get("eta_mem_decode_attention") is not None:
        entry["eta_mem_decode_attention"] = {**cal.eta_mem_decode_attention,
                                             key: round(min(1.0, fit["eta_mem_decode_attention"]),
                                                        4)}
    entry["step_overhead_s"] = fit["step_overhead_s"]
    entry["seq_overhead_s"] = fit["seq_overhead_s"]
    for k in ("prefill_step_overhead_s", "prefill_seq_overhead_s", "prefill_token_overhead_s",
              "release_overhead_s", "eager_layer_overhead_s"):
        if k in fit:
            entry[k] = fit[k]
    if "eager_decode_layer_overhead_s" in fit.get("fitted", ()):
        entry["eager_decode_layer_overhead_s"] = fit["eager_decode_layer_overhead_s"]
    if "decode_attention_scale" in fit:
        entry["decode_attention_scale"] = round(fit["decode_attention_scale"], 4)
        # formats whose own factor differs from the default (the most-sampled format's)
        others = {f: round(v, 4) for f, v in fit.get("decode_attention_scale_by_format",
                                                        {}).items()
                  if round(v, 4) != entry["decode_attention_scale"]}
        if others:
            entry["decode_attention_scale_by_format"] = {
                **cal.decode_attention_scale_by_format, **others}
    what = "fixed costs" if fit.get("fixed_only") else "decode efficiencies and fixed costs"
    entry["provenance"] = {
        **cal.provenance,
        "source": f"{what} fitted by diffkv-sim calibrate from {log_path}",
        "fixed_costs": fit.get("how") or f"step_overhead_s and seq_overhead_s fitted from "
                                         f"the clean Decode intervals of {log_path}",
        "measured_on": f"{server.deployment.gpu.name}, {server.deployment.model.name}, "
                       f"KV format {key}",
        "date": dt.date.today().isoformat(),
        "fit": {k: fit[k] for k in ("samples", "samples_dropped_compute_bound", "mape",
                                    "mape_before") if k in fit},
        "fitting_log": log_path,
        "based_on": cal.source_file,
    }
    return {"_about": "Calibration fitted from an SGLang server log's decode lines.",
            "version": 1, "gpus": {server.deployment.gpu.key: entry}}


def write_calibration(path: str | Path, data: dict) -> Path:
    p = Path(path)
    p.write_text(json.dumps(data, indent=1) + "\n")
    return p
