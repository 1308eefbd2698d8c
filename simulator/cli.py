"""diffkv-sim: capacity planning for SGLang with bf16, fp8 and DiffKV KV caches.

Subcommands: compare (the default comparison), replay (one format, full metrics), sweep
(request rates x KV formats), capacity (max QPS and GPUs needed under an SLO), disagg (the
cheapest prefill:decode split per KV format under an SLO, beside colocation), validate
(simulate a measured SGLang run and compare), calibrate (fit eta from an SGLang log), export
(write a trace as Mooncake JSONL for sglang.bench_serving), list (bundled traces, length
models, models and GPUs); validate-runs (fit and validate on the harness's real runs, from a
recipe), ablate-host-terms (score a shipped calibration without each host-side term),
profile-run (a run's server log beside its replay, step by step and window by window),
prefill-probes (the model beside a lone-prefill probe run) and validate-disagg (disagg and the
colocated model beside a real P/D run) hand their arguments to their modules (TOOLS).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sglang_diffkv.config import ConfigError, DiffKVConfig
from sglang_diffkv.serving_io.arrivals import resample_arrivals
from sglang_diffkv.serving_io.bundled import BUNDLED_TRACES, load_named_trace
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.loaders import FORMATS as TRACE_FORMATS
from sglang_diffkv.serving_io.trace import Trace
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl
from simulator.engine.link import LINK_SCOPES
from simulator.errors import SimulatorInputError
from simulator.kv.formats import FORMAT_NAMES
from simulator.kv.mix import TierMix
from simulator.metrics.slo import SLO
from simulator.metrics.summary import timeseries
from simulator.report import table
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration_set import CalibrationSet, load_calibration_set, measured_gpus
from simulator.specs.gpu import gpu_names, load_gpu
from simulator.specs.link import link_names, load_link
from simulator.specs.model import BUNDLED as BUNDLED_MODELS
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario
from simulator.studies.search import OnProbe, Probe, replicas_for, steady_max_rate
from simulator.workload.generate import (
    ClosedLoop,
    resized,
    scale_lengths,
    synthetic_trace,
)
from simulator.workload.lengths import length_model, length_model_names

# commands whose arguments their own module parses (`diffkv-sim NAME --help` shows them): the
# module and a one-line help; each module has main(argv) -> exit status
TOOLS: dict[str, tuple[str, str]] = {
    "validate-runs": ("simulator.validation.runs",
                      "fit step and host costs and validate on the harness's real SGLang runs "
                      "(--recipe h200: the H200 report)"),
    "ablate-host-terms": ("simulator.validation.ablation",
                          "held-out error of a shipped calibration without each host-side "
                          "term (--recipe h200)"),
    "profile-run": ("simulator.validation.run_profile",
                    "a run's server log beside its replay: where the window goes (prefill and "
                    "decode steps), the decode step by batch, batch and queue over time"),
    "prefill-probes": ("simulator.validation.prefill_probes",
                       "the simulator beside a lone-prefill probe run (python -m "
                       "sglang_diffkv.bench.prefill_ttft), and the eager launch it implies"),
    "validate-disagg": ("simulator.validation.disagg_real",
                        "disagg --split 1:1 and the colocated model beside a real bf16 P/D "
                        "run and its colocated control (scripts/gpu_pd_run.sh's results)"),
}


# ---- option groups ------------------------------------------------------------------------
def _deployment_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument("--model", default="llama-3-8b",
                   help=f"bundled model ({', '.join(BUNDLED_MODELS)}) or a path to a Hugging "
                        "Face config.json (default: %(default)s)")
    g.add_argument("--gpu", default="h100",
                   help=f"GPU: {', '.join(gpu_names())}, or a JSON file with the same fields as "
                        "simulator/specs/gpus.json (default: %(default)s)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per replica "
                   "(default: %(default)s)")
    g.add_argument("--replicas", type=int, default=1,
                   help="replicas behind the router (default: %(default)s)")
    g.add_argument("--router", default="round_robin",
                   choices=("round_robin", "least_outstanding", "random"),
                   help="how requests are spread over replicas (default: %(default)s)")
    g.add_argument("--calibration", default=None, metavar="PATH",
                   help="calibration JSON with eta efficiencies and fixed costs per GPU, for "
                        "every KV format (default: for a measured GPU (h100, h200) the shipped "
                        "calibration fitted to its real runs, simulator/calibration/"
                        "GPU-{triton,diffkv}.json, one per attention backend; for any other "
                        "GPU the published efficiencies in simulator/calibration/default.json, "
                        "an uncalibrated estimate)")


def _format_options(p: argparse.ArgumentParser, many: bool) -> None:
    g = p.add_argument_group("KV cache")
    if many:
        g.add_argument("--formats", default="bf16,fp8,diffkv",
                       help=f"comma-separated KV formats from {', '.join(FORMAT_NAMES)} "
                            "(default: %(default)s)")
    else:
        g.add_argument("--format", default="bf16", choices=FORMAT_NAMES,
                       help="KV format (default: %(default)s)")
    g.add_argument("--diffkv-config", default="llama-3-8b", metavar="SPEC",
                   help="DiffKV tiers and window: a preset name, inline JSON or a JSON file, as "
                        "SGLANG_DIFFKV_CONFIG (default: %(default)s)")
    g.add_argument("--mix", default="0.3,0.5,0.2", metavar="H,L[,P]",
                   help="DiffKV fractions of tokens (outside the recent window) kept high, "
                        "kept low and pruned; fractions or percentages (default: %(default)s)")
    g.add_argument("--head-spread", type=float, default=0.0,
                   help="spread of the kept fraction across KV heads (0: every head alike; "
                        "0.5: classes at roughly 0.4x..1.6x the mean) (default: %(default)s)")
    g.add_argument("--mix-file", default=None, metavar="PATH",
                   help='measured per-head DiffKV fractions, JSON {"heads": [[high, low], ...]} '
                        'or {"layers": [[[high, low], ...], ...]}; replaces --mix and '
                        "--head-spread")
    g.add_argument("--request-spread", type=float, default=0.0,
                   help="standard deviation of a per-request factor on the kept fraction "
                        "(default: %(default)s)")


def _server_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SGLang server settings (defaults as SGLang 0.5.10 derives them)")
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="tokens per prefill chunk; -1 disables chunking (default: by GPU memory, "
                        "8192 on H100/H200)")
    g.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="prefill tokens per batch (default: %(default)s)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest CUDA-graph decode batch; larger batches run eagerly "
                        "(default: 512 for the diffkv format, as the diffkv backend sets it; "
                        "otherwise by GPU memory, 256 at tp<4 on 80 GB)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="run every step eagerly (launch overhead per layer)")
    g.add_argument("--disable-piecewise-cuda-graph", action="store_true",
                   help="no piecewise prefill graphs (frees their memory reservation)")
    g.add_argument("--enable-mixed-chunk", action="store_true",
                   help="decode running requests in the same forward as a prefill chunk")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="no overlap scheduler: a request that arrives during a step joins the "
                        "next batch (with it, SGLang forms each batch while the previous one "
                        "runs, so such a request waits one step more)")
    g.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="scales the initial new_token_ratio 0.7 (default: %(default)s)")
    g.add_argument("--mem-fraction-static", type=float, default=None,
                   help="fraction of GPU memory for weights + KV (default: SGLang's formula)")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="cap on KV pool tokens (default: no cap)")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="cap on running requests (default: SGLang's rule from the pool size)")
    g.add_argument("--context-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="no radix cache: with ignore_eos requests SGLang then admits with "
                        "add_one_req_ignore_eos (replays every request to max_new_tokens)")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="clients do not send ignore_eos (bench_serving --disable-ignore-eos)")


def _workload_options(p: argparse.ArgumentParser, default_trace: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=default_trace,
                   help=f"bundled trace ({', '.join(BUNDLED_TRACES)}) or a trace file "
                        "(default: %(default)s)")
    g.add_argument("--trace-format", default=None, choices=TRACE_FORMATS,
                   help="format of --trace when it is a file (default: guessed from line 1)")
    g.add_argument("--synthetic", default=None, metavar="LENGTHS",
                   help="instead of --trace, generate requests with fitted lengths: "
                        f"{', '.join(length_model_names())} (needs --rate)")
    g.add_argument("--num-requests", "-n", type=int, default=None,
                   help="use only the first N requests (synthetic: how many to generate)")
    g.add_argument("--rate", type=float, default=None,
                   help="replace arrivals by a Gamma process at this many req/s ('inf': all at "
                        "t=0) keeping the trace's lengths (default: the trace's own arrivals)")
    g.add_argument("--cv", type=float, default=1.0,
                   help="coefficient of variation of inter-arrival times with --rate "
                        "(1: Poisson) (default: %(default)s)")
    g.add_argument("--time-scale", type=float, default=None,
                   help="multiply the trace's inter-arrival times (0.5 = twice the rate)")
    g.add_argument("--closed-loop", type=int, default=None, metavar="USERS",
                   help="closed loop: USERS clients each sending its next request when the "
                        "previous one finishes (arrival times ignored)")
    g.add_argument("--think-time", type=float, default=0.0,
                   help="closed loop: seconds between a response and the next request")
    g.add_argument("--input-scale", type=float, default=1.0, metavar="F",
                   help="multiply every prompt length by F, e.g. 2 for a prompt-heavier "
                        "version of the trace (default: %(default)s)")
    g.add_argument("--output-scale", type=float, default=1.0, metavar="F",
                   help="multiply every output length (and client max_tokens) by F "
                        "(default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="client max_tokens for every request (default: the trace's, else its "
                        "output length, like bench_serving)")


def _slo_options(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("SLO" + (" (at least one limit)" if required else " (optional)"))
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="per-request TTFT limit")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="per-request TPOT limit")
    g.add_argument("--slo-e2e-s", type=float, default=None, help="per-request latency limit")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="fraction of requests that must meet the limits (default: %(default)s)")


def _output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    g.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on for long runs in a terminal)")


def _cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, e.g. under taskset), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:                # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diffkv-sim",
        description="Simulate SGLang 0.5.10 serving a trace with bf16, fp8, K8V4, K4V2 or "
                    "DiffKV KV caches: batch size, throughput, TTFT/TPOT, memory, capacity.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("compare", help="bf16 vs fp8 vs DiffKV on one trace (no arguments needed)",
                       description="Replay one trace with several KV formats and print a table. "
                                   "Default: the bundled long-generation trace (600 MATH-like "
                                   "requests, Poisson 8 req/s) on Llama-3-8B / H100.")
    _workload_options(c, "long-generation")
    _format_options(c, many=True)
    _deployment_options(c)
    _server_options(c)
    _slo_options(c, required=False)
    _output_options(c)

    r = sub.add_parser("replay", help="replay a trace with one KV format, full metrics",
                       description="Replay a trace and print bench_serving-style metrics.")
    _workload_options(r, "sharegpt")
    _format_options(r, many=False)
    _deployment_options(r)
    _server_options(r)
    _slo_options(r, required=False)
    _output_options(r)

    s = sub.add_parser("sweep", help="request rates x KV formats",
                       description="Poisson (or Gamma) arrivals at each rate with the trace's "
                                   "lengths, for each KV format.")
    s.add_argument("--rates", default="4,8,16,32,64",
                   help="comma-separated request rates in req/s (default: %(default)s)")
    _workload_options(s, "sharegpt")
    _format_options(s, many=True)
    _deployment_options(s)
    _server_options(s)
    _slo_options(s, required=False)
    _output_options(s)

    k = sub.add_parser("capacity", help="max QPS per replica and GPUs needed under an SLO",
                       description="For each KV format: the highest Poisson rate one replica "
                                   "sustains under the SLO in steady state (bisection on "
                                   "traces of the trace's lengths, doubled in length until "
                                   "the answer moves by less than --steady-tol), the metrics "
                                   "at that rate, and the GPUs the trace's rate (or --rate) "
                                   "needs: ceil(rate / max rate per replica) replicas.")
    k.add_argument("--max-replicas", type=int, default=64,
                   help="give up above this many replicas (default: %(default)s)")
    k.add_argument("--rate-bracket", default="0.25,256", metavar="LO,HI",
                   help="req/s range searched for the max rate (default: %(default)s)")
    k.add_argument("--start-requests", type=int, default=1000,
                   help="requests in the first (shortest) search trace; the trace's lengths "
                        "are drawn again past its end (default: %(default)s)")
    k.add_argument("--max-requests", type=int, default=16000,
                   help="longest search trace: stop doubling here and say the answer is not "
                        "steady (default: %(default)s)")
    k.add_argument("--steady-tol", type=float, default=0.05,
                   help="steady state: the max rate moved by at most this fraction when the "
                        "trace doubled (default: %(default)s)")
    _workload_options(k, "azure-conv")
    _format_options(k, many=True)
    _deployment_options(k)
    _server_options(k)
    _slo_options(k, required=True)
    _output_options(k)

    dg = sub.add_parser(
        "disagg", help="prefill/decode disaggregation: the cheapest P:D split and KV format "
                       "under an SLO, beside colocated serving",
        description="For each KV format: the fewest GPUs, as P prefill + D decode replicas "
                    "joined by KV transfer links, that serve the trace at its rate (or "
                    "--rate) under the SLO, with the goodput per GPU, beside the fewest "
                    "colocated replicas doing the same. The decode replica preallocates a "
                    "request's KV (SGLang's --disaggregation-mode decode), the prefill "
                    "replica prefills it and sends its KV as its pool stores it (bf16/fp8: "
                    "each chunk's slots; diffkv: the compressed pages, metadata included), "
                    "and the link queues transfers (FIFO, latency + bytes / bandwidth). "
                    "Each probe replays the trace's lengths at the rate (Poisson); the "
                    "answer is searched again on traces twice as long until it stays the "
                    "same (steady state). Default: the bundled Azure code trace (long "
                    "prompts, short outputs) at 30 req/s, TTFT 250 ms and TPOT 15 ms for "
                    "90% of requests, a 100 Gb/s RDMA link per pair of replicas "
                    "(docs/disaggregation.md's worked example).")
    g = dg.add_argument_group("disaggregation")
    g.add_argument("--link", default="rdma-100", metavar="LINK",
                   help=f"KV transfer link: {', '.join(link_names())}, or a JSON file with the "
                        "fields of simulator/specs/links.json (default: %(default)s)")
    g.add_argument("--link-scope", default="pair", choices=LINK_SCOPES,
                   help="pair: every (prefill, decode) pair of replicas has a link of its own; "
                        "gpu: every replica has one port per direction (one NIC per GPU), "
                        "shared by all its transfers (default: %(default)s)")
    g.add_argument("--split", default=None, metavar="P:D",
                   help="replay this split only (P prefill and D decode replicas), beside "
                        "as many colocated replicas, instead of searching")
    g.add_argument("--trace-arrivals", action="store_true",
                   help="with --split: replay the trace's own arrival times (all of its "
                        "requests, or -n), not Poisson arrivals at --rate: to set the "
                        "model beside a measured P/D run of the same trace")
    g.add_argument("--max-gpus", type=int, default=32,
                   help="give up above this many GPUs per deployment (default: %(default)s)")
    g.add_argument("--start-requests", type=int, default=1000,
                   help="requests in the first (shortest) search trace; the trace's lengths "
                        "are drawn again past its end (default: %(default)s)")
    g.add_argument("--max-requests", type=int, default=4000,
                   help="longest search trace: stop doubling here and say the answer is not "
                        "steady (default: %(default)s)")
    g.add_argument("--jobs", type=int, default=None,
                   help="searches run at once, each in a process of its own: every KV "
                        "format's split search and its colocated one, split searches first "
                        "(default: one per CPU core this process may use)")
    g.add_argument("--colocated", default="replay", choices=("replay", "capacity", "none"),
                   help="the colocated answer: replay = the fewest colocated replicas meeting "
                        "the SLO on the same probe traces (same requests, arrivals and "
                        "criterion); capacity = the 'capacity' command's answer (steady max "
                        "rate per replica, ceil(rate / it) replicas; slower); none = skip "
                        "(default: %(default)s)")
    _workload_options(dg, "azure-code")
    _format_options(dg, many=True)
    _deployment_options(dg)
    _server_options(dg)
    _slo_options(dg, required=True)
    _output_options(dg)
    dg.set_defaults(rate=30.0, slo_ttft_ms=250.0, slo_tpot_ms=15.0)

    v = sub.add_parser("validate", help="simulate a run and compare with SGLang's measurements",
                       description="Replay the trace a real SGLang run served and compare the "
                                   "server log (pool size, decode batch, token usage, "
                                   "retractions) and bench_serving's result (throughput, TTFT, "
                                   "TPOT, ITL, E2E) with the simulation, metric by metric.")
    v.add_argument("--server-log", default=None, metavar="PATH",
                   help="SGLang server log (launch_server output)")
    v.add_argument("--bench-json", default=None, metavar="PATH",
                   help="bench_serving --output-file result (JSONL; the last run is used)")
    v.add_argument("--bench-index", type=int, default=-1,
                   help="which run of --bench-json to use (default: %(default)s, the last)")
    _workload_options(v, "sharegpt")
    _format_options(v, many=False)
    _deployment_options(v)
    _server_options(v)
    _output_options(v)

    cal = sub.add_parser("calibrate", help="fit eta and fixed costs from an SGLang log",
                         description="Fit the memory efficiencies (weights, decode attention "
                                     "for --format) and the per-step and per-sequence costs "
                                     "from the 'Decode batch' lines of an SGLang server log, "
                                     "and write a calibration JSON for --calibration.")
    cal.add_argument("--server-log", required=True, metavar="PATH",
                     help="SGLang server log with 'Decode batch' lines")
    cal.add_argument("--out", required=True, metavar="PATH", help="calibration JSON to write")
    cal.add_argument("--fit", default="auto", choices=("auto", "fixed", "decode"),
                     help="what to fit: 'fixed' = the fixed step costs (per step and request, "
                          "per prefill step, request and prompt token) and the decode "
                          "attention factor, with kernel times from the calibration's measured "
                          "grids (e.g. scripts/calibrate_gpu.py's file given as --calibration): "
                          "the joint fit simulator/validation/runs.py runs; 'decode' = "
                          "also the weight and decode-attention efficiencies; 'auto' = fixed "
                          "when --calibration has measured grids (default: %(default)s)")
    _format_options(cal, many=False)
    _deployment_options(cal)
    _server_options(cal)
    cal.add_argument("--json", default=None, metavar="PATH", help="write the fit as JSON")
    cal.set_defaults(seed=0, progress=False)

    e = sub.add_parser("export", help="write a trace as Mooncake JSONL (for bench_serving)",
                       description="Write the (possibly resampled or synthetic) workload as "
                                   "Mooncake JSONL: python -m sglang.bench_serving "
                                   "--dataset-name mooncake --dataset-path FILE "
                                   "--use-trace-timestamps replays the same requests.")
    e.add_argument("out", help="output path (.jsonl or .jsonl.gz)")
    _workload_options(e, "sharegpt")
    e.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")

    sub.add_parser("list", help="list bundled traces, length models, models and GPUs")
    for name, (_, help_text) in TOOLS.items():
        # listed for --help only: main() hands these commands' arguments to their module
        sub.add_parser(name, help=help_text, add_help=False)
    return p


# ---- building inputs from options ----------------------------------------------------------
def _workload(a: argparse.Namespace) -> Trace | ClosedLoop:
    if a.synthetic:
        if a.rate is None:
            raise SimulatorInputError("--synthetic needs --rate (req/s, or inf)")
        n = 1000 if a.num_requests is None else a.num_requests
        trace = synthetic_trace(length_model(a.synthetic), n, a.rate, seed=a.seed, cv=a.cv)
    else:
        trace = load_named_trace(a.trace, a.trace_format)
        if a.num_requests is not None:
            trace = trace.head(a.num_requests)
        if a.time_scale is not None:
            trace = trace.time_scaled(a.time_scale)
        if a.rate is not None:
            trace = resample_arrivals(trace, a.rate, a.seed, a.cv)
    trace = scale_lengths(trace, getattr(a, "input_scale", 1.0),
                          getattr(a, "output_scale", 1.0))
    if a.max_new_tokens is not None:
        from dataclasses import replace

        if a.max_new_tokens < 1:
            raise SimulatorInputError(f"--max-new-tokens={a.max_new_tokens} must be >= 1")
        trace = replace(trace, requests=tuple(
            replace(r, output_tokens=min(r.output_tokens, a.max_new_tokens),
                    max_new_tokens=a.max_new_tokens) for r in trace.requests))
    if a.closed_loop is not None:
        return ClosedLoop(trace.requests, a.closed_loop, a.think_time,
                          name=f"{trace.name}-closed{a.closed_loop}",
                          prefix_block_tokens=trace.prefix_block_tokens)
    return trace


def _slo(a: argparse.Namespace, required: bool) -> SLO | None:
    vals = (a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2e_s)
    if all(v is None for v in vals):
        if required:
            raise SimulatorInputError("give an SLO: --slo-ttft-ms, --slo-tpot-ms or --slo-e2e-s")
        return None
    return SLO(ttft_s=math.inf if a.slo_ttft_ms is None else a.slo_ttft_ms / 1e3,
               tpot_s=math.inf if a.slo_tpot_ms is None else a.slo_tpot_ms / 1e3,
               e2e_s=math.inf if a.slo_e2e_s is None else a.slo_e2e_s,
               attainment=a.slo_attainment)


def _scenario(a: argparse.Namespace) -> Scenario:
    model = load_model(a.model)
    gpu = load_gpu(a.gpu)
    calib = load_calibration_set(gpu.key, a.calibration)
    settings = ServerSettings(
        tp=a.tp, chunked_prefill_size=a.chunked_prefill_size,
        max_prefill_tokens=a.max_prefill_tokens, cuda_graph_max_bs=a.cuda_graph_max_bs,
        disable_cuda_graph=a.disable_cuda_graph,
        enable_piecewise_cuda_graph=not a.disable_piecewise_cuda_graph,
        enable_mixed_chunk=a.enable_mixed_chunk,
        disable_overlap_schedule=a.disable_overlap_schedule,
        schedule_conservativeness=a.schedule_conservativeness,
        mem_fraction_static=a.mem_fraction_static, max_total_tokens=a.max_total_tokens,
        max_running_requests=a.max_running_requests, context_len=a.context_len,
        disable_radix_cache=a.disable_radix_cache, ignore_eos=not a.no_ignore_eos)
    try:
        dcfg = DiffKVConfig.from_spec(a.diffkv_config)
    except ConfigError as e:
        raise SimulatorInputError(f"--diffkv-config {a.diffkv_config!r}: {e}") from e
    mix = (TierMix.from_file(a.mix_file, a.request_spread) if a.mix_file
           else TierMix.parse(a.mix, a.head_spread, a.request_spread))
    return Scenario(model, gpu, calib, settings, dcfg, mix, a.replicas, a.router, a.seed,
                    a.progress)


def _formats(a: argparse.Namespace) -> list[str]:
    names = [f.strip().lower() for f in a.formats.split(",") if f.strip()]
    bad = [f for f in names if f not in FORMAT_NAMES]
    if bad or not names:
        raise SimulatorInputError(f"--formats {a.formats!r}: unknown {bad}; choose from "
                                  f"{', '.join(FORMAT_NAMES)}")
    return names


def _header(sc: Scenario, workload: Trace | ClosedLoop) -> str:
    n = len(workload)
    kind = (f"closed loop, {workload.users} users" if isinstance(workload, ClosedLoop)
            else ("all at t=0" if math.isinf(workload.mean_rate)
                  else f"{workload.mean_rate:.2f} req/s over {workload.duration_s:.0f} s"))
    tp = f" x tp{sc.settings.tp}" if sc.settings.tp > 1 else ""
    rep = f", {sc.replicas} replicas" if sc.replicas > 1 else ""
    return (f"{sc.model.name} on {sc.gpu.name}{tp}{rep} | trace {workload.name}: {n:,} "
            f"requests, {kind}")


def _calibration_note(sc: Scenario) -> str:
    """Which calibration ran (every command's output says it, and whether it is measured)."""
    c = sc.calibration
    return c.note() if isinstance(c, CalibrationSet) else f"calibration: {c.source_file}"


# ---- commands ----------------------------------------------------------------------------
def cmd_compare(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    sc = _scenario(a)
    workload = _workload(a)
    slo = _slo(a, False)
    summaries, series, servers = [], {}, []
    t0 = time.perf_counter()
    for f in _formats(a):
        srv = sc.server(f)
        res, s = sc.run_summary(workload, f, slo, srv)
        summaries.append(s)
        series[f] = timeseries(res)
        servers.append(srv.describe())
    elapsed = time.perf_counter() - t0
    print(table.compare_table(summaries, _header(sc, workload)), file=out)
    for srv in servers:
        if srv["kv_format"] == "diffkv":
            print(f"\n{srv['kv_format_detail']}", file=out)
    for s in summaries:
        note = table.eager_note(s)
        if note:
            print(note, file=out)
    print(f"KV pool from SGLang's formula: mem_fraction_static={servers[0]['mem_fraction_static']},"
          f" {servers[0]['memory']['kv_pool_gib']:.1f} GiB per GPU. Simulated in {elapsed:.1f} s.",
          file=out)
    print(_calibration_note(sc), file=out)
    payload = {"command": "compare", "scenario": sc.describe(), "servers": servers,
               "summaries": summaries, "timeseries": series, "elapsed_s": elapsed}
    if a.plot:
        from simulator.report.plots import plot_timeseries

        p = plot_timeseries(series, a.plot, _header(sc, workload))
        print(f"plot: {p}", file=out)
    return payload


def cmd_replay(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    sc = _scenario(a)
    workload = _workload(a)
    srv = sc.server(a.format)
    t0 = time.perf_counter()
    res, s = sc.run_summary(workload, a.format, _slo(a, False), srv)
    elapsed = time.perf_counter() - t0
    print(_header(sc, workload), file=out)
    print(table.summary_table(s), file=out)
    note = table.eager_note(s)
    if note:
        print(note, file=out)
    n = len(workload)
    print(f"Simulated {n:,} requests in {elapsed:.2f} s ({n / elapsed:,.0f} req/s).", file=out)
    print(_calibration_note(sc), file=out)
    series = timeseries(res)
    per_request = [{"id": r.rid, "arrival": r.arrival, "input": r.input_len,
                    "output": r.gen, "first_token": r.first_token, "finish": r.finish,
                    "retractions": r.retractions, "rejected": r.rejected}
                   for r in res.requests]
    if a.plot:
        from simulator.report.plots import plot_timeseries

        print(f"plot: {plot_timeseries({a.format: series}, a.plot, _header(sc, workload))}",
              file=out)
    return {"command": "replay", "scenario": sc.describe(), "server": srv.describe(),
            "summary": s, "timeseries": series, "requests": per_request, "elapsed_s": elapsed}


def cmd_sweep(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    sc = _scenario(a)
    base = _workload(a)
    if isinstance(base, ClosedLoop):
        raise SimulatorInputError("sweep varies the arrival rate; it cannot use --closed-loop")
    try:
        rates = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError as e:
        raise SimulatorInputError(f"--rates {a.rates!r} must be comma-separated numbers") from e
    if not rates or any(not r > 0 for r in rates):
        raise SimulatorInputError(f"--rates {a.rates!r} must be numbers > 0")
    slo = _slo(a, False)
    rows = []
    for f in _formats(a):
        srv = sc.server(f)
        for rate in rates:
            load = resample_arrivals(base, rate, a.seed, a.cv)
            _, s = sc.run_summary(load, f, slo, srv)
            row = {"format": f, "rate": rate, "output_throughput": s["output_throughput"],
                   "request_throughput": s["request_throughput"], "mean_batch": s["mean_batch"],
                   "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                   "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
                   "retractions": s["retractions"]}
            if slo:
                row["slo_attainment"] = s["slo_attainment"]
                row["goodput"] = s["goodput"]
            rows.append(row)
    headers = list(rows[0])
    print(table.render(headers, [[r[h] for h in headers] for r in rows],
                       _header(sc, base) + " | rates swept"), file=out)
    print(_calibration_note(sc), file=out)
    if a.plot:
        from simulator.report.plots import plot_sweep

        for p in plot_sweep(rows, a.plot, f"{sc.model.name} on {sc.gpu.key}, {base.name}"):
            print(f"plot: {p}", file=out)
    return {"command": "sweep", "scenario": sc.describe(), "rows": rows}


def cmd_capacity(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    sc = _scenario(a)
    trace = _workload(a)
    if isinstance(trace, ClosedLoop):
        raise SimulatorInputError("capacity needs an open-loop trace, not --closed-loop")
    slo = _slo(a, True)
    assert slo is not None
    try:
        lo, hi = (float(x) for x in a.rate_bracket.split(","))
    except ValueError as e:
        raise SimulatorInputError(f"--rate-bracket {a.rate_bracket!r} must be LO,HI") from e
    if a.max_replicas < 1:
        raise SimulatorInputError(f"--max-replicas {a.max_replicas} must be >= 1")
    rate = a.rate if a.rate is not None else trace.mean_rate
    # one replica, no per-run bar: the search's own bar counts its runs
    one = dataclasses.replace(sc.with_replicas(1), progress=False)
    results = []
    t0 = time.perf_counter()
    for f in _formats(a):
        with _search_progress(a, f) as on_probe:
            found = steady_max_rate(one, trace, f, slo, lo, hi, a.start_requests,
                                    a.steady_tol, a.max_requests, a.seed, on_probe)
        need = replicas_for(rate, found["max_rate"], sc.settings.tp, a.max_replicas)
        results.append({"format": f, "max_rate_per_replica": found["max_rate"], **need,
                        "at_max": found["at_max"], "converged": found["converged"],
                        "levels": found["levels"], "last_change": found["last_change"],
                        "search_note": found["note"], "probes": found["probes"]})
    elapsed = time.perf_counter() - t0
    rows = []
    for r in results:
        m = r["at_max"] or {}
        why = m.get("rejection_reasons") or {}
        rows.append([r["format"], r["max_rate_per_replica"], m.get("request_throughput"),
                     m.get("output_throughput"), m.get("ttft_p50_ms"), m.get("ttft_p99_ms"),
                     m.get("tpot_p50_ms"), m.get("tpot_p99_ms"),
                     None if not m else f"{m['attainment']:.0%}",
                     _rejected_cell(m.get("rejected", 0), why),
                     r["replicas"] if r["replicas"] else "-", r["gpus"] if r["gpus"] else "-"])
    title = (f"{_header(sc, trace)}\nSLO: {slo.describe()}; GPUs for {rate:.2f} req/s"
             f"{' (--rate)' if a.rate is not None else ' (the trace rate)'}; metrics at "
             "each format's max rate on its longest trace")
    print(table.render(["format", "max req/s per replica", "req/s", "out tok/s",
                        "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                        "SLO met", "rejected", "replicas", "GPUs"], rows, title), file=out)
    for r in results:
        print(_steady_line(r, a.steady_tol), file=out)
    print(f"GPUs = replicas x tp{sc.settings.tp}, replicas = ceil({rate:.2f} req/s / max "
          f"req/s per replica). Searched in {elapsed:.1f} s.", file=out)
    print(_calibration_note(sc), file=out)
    if a.plot:
        from simulator.report.plots import plot_capacity

        p = plot_capacity(results, slo.attainment, a.plot,
                          f"{sc.model.name} on {sc.gpu.key}, {trace.name}: {slo.describe()}")
        print(f"plot: {p}", file=out)
    return {"command": "capacity", "scenario": sc.describe(), "slo": slo.describe(),
            "rate": rate, "trace_rate": trace.mean_rate, "results": results,
            "elapsed_s": elapsed}


def _rejected_cell(n: int, reasons: dict[str, int]) -> str:
    """Rejected requests with the commonest reason, for a table cell."""
    if not n:
        return "0"
    top = max(reasons, key=reasons.__getitem__) if reasons else "?"
    return f"{n:,} ({top})"


def _steady_line(r: dict[str, Any], tol: float) -> str:
    """How the format's answer moved as the trace grew: whether it reached steady state."""
    steps = " -> ".join(f"{x['max_rate']:.3g} ({x['requests']:,} req)" for x in r["levels"])
    change = r["last_change"]
    moved = "" if change is None else f"; last change {change:.1%}"
    if r["converged"]:
        verdict = f"steady within {tol:.0%}"
    elif r["max_rate_per_replica"] == 0:
        verdict = "no rate in --rate-bracket meets the SLO"
    else:
        verdict = f"NOT steady within {tol:.0%} by --max-requests: treat as an upper bound"
    if r["search_note"]:
        verdict += f" ({r['search_note']})"
    line = f"{r['format']}: max req/s by trace length {steps}{moved}: {verdict}"
    if r.get("note"):
        line += f"; {r['note']}"
    return line


@contextlib.contextmanager
def _search_progress(a: argparse.Namespace, fmt: str) -> Iterator[OnProbe]:
    """A progress bar on stderr over a search's probes (each a full simulation), shown in a
    terminal unless --no-progress (--progress forces it)."""
    from tqdm import tqdm

    show = a.progress if a.progress is not None else sys.stderr.isatty()
    bar = tqdm(desc=f"capacity {fmt}", unit="probe", file=sys.stderr, disable=not show,
               leave=False)

    def on_probe(p: Probe) -> None:
        bar.set_postfix_str(f"{p.requests:,} req @ {p.rate:.3g} req/s: "
                            f"{p.attainment:.0%} {'met' if p.met else 'missed'}")
        bar.update()
    try:
        yield on_probe
    finally:
        bar.close()


def _split_arg(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D), both >= 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        p = d = 0
    if p < 1 or d < 1:
        raise SimulatorInputError(f"--split {text!r} must be P:D with P and D integers >= 1 "
                                  "(prefill and decode replicas), e.g. 2:1")
    return p, d


def _disagg_inputs(a: argparse.Namespace) -> tuple[Scenario, Trace, Any, SLO, float, int]:
    """(scenario, trace, link, SLO, rate, max replicas) from disagg's options, validated."""
    sc = _scenario(a)
    link = load_link(a.link)
    if a.link_scope not in LINK_SCOPES:
        raise SimulatorInputError(f"--link-scope {a.link_scope!r}: choose one of "
                                  f"{', '.join(LINK_SCOPES)}")
    if a.rate is not None and not (a.rate > 0 and math.isfinite(a.rate)):
        raise SimulatorInputError(f"--rate {a.rate!r}: disagg needs a finite rate > 0 (req/s)")
    # the probes replay the trace at the rate; the trace itself keeps its own arrivals
    trace = _workload(argparse.Namespace(**{**vars(a), "rate": None}))
    if isinstance(trace, ClosedLoop):
        raise SimulatorInputError("disagg needs an open-loop trace, not --closed-loop")
    rate = a.rate if a.rate is not None else trace.mean_rate
    if not (rate > 0 and math.isfinite(rate)):
        raise SimulatorInputError(f"the trace's rate {rate!r} req/s cannot be replayed; give "
                                  "--rate")
    if a.max_gpus < 2:
        raise SimulatorInputError(f"--max-gpus {a.max_gpus} must be >= 2 (a prefill and a "
                                  "decode replica)")
    if a.jobs is not None and a.jobs < 1:
        raise SimulatorInputError(f"--jobs {a.jobs} must be >= 1")
    if a.replicas != 1:
        raise SimulatorInputError(f"--replicas {a.replicas}: disagg chooses the replicas "
                                  "(--split P:D replays given ones)")
    if a.trace_arrivals and a.split is None:
        raise SimulatorInputError("--trace-arrivals replays one deployment: give --split P:D")
    slo = _slo(a, True)
    assert slo is not None
    max_replicas = a.max_gpus // sc.settings.tp
    if max_replicas < 2:
        raise SimulatorInputError(f"--max-gpus {a.max_gpus} holds fewer than two replicas of "
                                  f"--tp {sc.settings.tp}")
    return sc, trace, link, slo, rate, max_replicas


# the parts of a format's answer that ``_disagg_format`` computes: both, or, where they do
# not depend on each other (a searched split beside replayed colocated fleets), either one
# alone, so that --jobs can run them in processes of their own
BOTH, SPLIT, COLOCATED = "both", "split", "colocated"


def _disagg_format(a: argparse.Namespace, fmt: str, on_probe: Any,
                   part: str = BOTH) -> dict[str, Any]:
    """One KV format's answers for ``cmd_disagg``: the split (searched, or --split
    replayed) and the colocated one; ``part`` (``_disagg_parts``) leaves one of the two
    None. Runs in a worker process under --jobs."""
    from simulator.studies import disagg_search as ds

    sc, trace, link, slo, rate, max_replicas = _disagg_inputs(a)
    tp = sc.settings.tp
    srv = sc.server(fmt)
    if a.split is None:
        found = colo = None
        if part != COLOCATED:
            found = ds.cheapest_split(srv, trace, slo, link, rate, a.link_scope, a.router,
                                      a.start_requests, a.max_requests, max_replicas, a.seed,
                                      on_probe)
        if part != SPLIT:
            colo = _colocated(a, sc, srv, trace, fmt, slo, rate, max_replicas, found,
                              on_probe)
        return {"format": fmt, "disagg": found, "colocated": colo}
    split = _split_arg(a.split)
    if a.trace_arrivals:
        load, n = trace, len(trace)
    else:
        n = a.start_requests
        load = resample_arrivals(resized(trace, n, a.seed), rate, a.seed)
    best = ds.probe_split(srv, load, slo, *split, link, a.link_scope, a.router, a.seed)
    on_probe(best)
    gpus = sum(split) * tp
    found = {"best": best, "levels": [{"requests": n, "prefill": split[0], "decode": split[1]}],
             "converged": None, "note": "", "probes": [best], "gpus": gpus,
             "goodput_per_gpu": best.summary["goodput"] / gpus}
    colo = None
    if a.colocated != "none":
        fleet = ds.probe_fleet(srv, load, slo, sum(split), a.router, a.seed)
        on_probe(fleet)
        colo = {"best": fleet, "levels": [], "converged": None, "probes": [fleet],
                "gpus": gpus, "goodput_per_gpu": fleet.summary["goodput"] / gpus}
    return {"format": fmt, "disagg": found, "colocated": colo}


def _disagg_worker(a: argparse.Namespace, fmt: str, part: str, queue: Any) -> dict[str, Any]:
    """``_disagg_format`` in a worker process, its probes reported on ``queue``."""
    return _disagg_format(a, fmt, lambda p: queue.put((fmt, _probe_note(p))), part)


def _disagg_parts(a: argparse.Namespace) -> tuple[str, ...]:
    """The parts of each format's answer that can run in processes of their own: the split
    search and the colocated replays are independent (``--colocated capacity`` replays its
    answer on the split search's longest trace, and --split is one replay)."""
    return (SPLIT, COLOCATED) if a.split is None and a.colocated == "replay" else (BOTH,)


def _disagg_jobs(a: argparse.Namespace, searches: int) -> int:
    """Processes for ``searches`` searches: --jobs, else one per core. Not one per search:
    with more processes than cores the cores are shared among all of them, so the slowest
    search (DiffKV's split search in the default example, a third of all the work) gets a
    fraction of a core until the others end and then runs alone; a worker per core that
    takes the split searches first starts it early and fills the other cores with the
    shorter searches (the default example on two cores: about 9 s against 11 s)."""
    return min(a.jobs if a.jobs is not None else _cpu_cores(), searches)


def _probe_note(p: Any) -> str:
    where = f"{p.prefill}P+{p.decode}D" if hasattr(p, "prefill") else f"{p.replicas} coloc"
    return f"{p.requests:,} req, {where}: {p.attainment:.0%} {'met' if p.met else 'missed'}"


def _disagg_parallel(a: argparse.Namespace, formats: list[str]) -> list[dict[str, Any]]:
    """Each format's searches in processes of their own (``_disagg_jobs``), one progress
    bar over all. The split searches are queued first: they take longest, so where fewer
    processes than searches run, the colocated ones fill in behind them."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait

    from tqdm import tqdm

    show = a.progress if a.progress is not None else sys.stderr.isatty()
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    tasks = [(f, part) for part in _disagg_parts(a) for f in formats]
    with ctx.Manager() as manager, ProcessPoolExecutor(_disagg_jobs(a, len(tasks)),
                                                       mp_context=ctx) as pool:
        queue = manager.Queue()
        futures = [pool.submit(_disagg_worker, a, f, part, queue) for f, part in tasks]
        bar = tqdm(desc="disagg " + ",".join(formats), unit="replay", file=sys.stderr,
                   disable=not show, leave=False)
        try:
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.2)
                while not queue.empty():
                    fmt, note = queue.get()
                    bar.set_postfix_str(f"{fmt} {note}")
                    bar.update()
        finally:
            bar.close()
        results = {f: {"format": f, "disagg": None, "colocated": None} for f in formats}
        for (f, part), fut in zip(tasks, futures, strict=True):
            done = fut.result()
            for key in ("disagg", "colocated"):
                if part in (BOTH, SPLIT if key == "disagg" else COLOCATED):
                    results[f][key] = done[key]
        return [results[f] for f in formats]


def cmd_disagg(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    sc, trace, link, slo, rate, _ = _disagg_inputs(a)
    tp = sc.settings.tp
    split = _split_arg(a.split) if a.split else None
    formats = _formats(a)
    t0 = time.perf_counter()
    if _disagg_jobs(a, len(formats) * len(_disagg_parts(a))) > 1:
        results = _disagg_parallel(a, formats)
    else:
        results = []
        for f in formats:
            with _disagg_progress(a, f) as on_probe:
                results.append(_disagg_format(a, f, on_probe))
    probes = sum(len(r["disagg"]["probes"]) + (len(r["colocated"]["probes"])
                                                if r["colocated"] else 0) for r in results)
    elapsed = time.perf_counter() - t0
    when = ("replayed at its own arrival times" if a.trace_arrivals else
            f"replayed at {rate:.3g} req/s"
            f"{' (--rate)' if a.rate is not None else ' (the trace rate)'}")
    title = (f"{_header(sc, trace)}\n{when}; SLO: "
             f"{slo.describe()}; link {link.describe()}, one per "
             f"{'pair of replicas' if a.link_scope == 'pair' else 'GPU and direction'}")
    print(_disagg_table(results, tp, title), file=out)
    for r in results:
        print(_disagg_lines(r), file=out)
    n_split = len(trace) if a.trace_arrivals else a.start_requests
    what = (f"the split {split[0]}:{split[1]} on {n_split:,} requests" if split
            else "the fewest GPUs")
    print(f"GPUs = (P + D) x tp{tp}; goodput = requests meeting the SLO per second; "
          f"{what}. {probes} replays in {elapsed:.1f} s.", file=out)
    print(_calibration_note(sc), file=out)
    payload = {"command": "disagg", "scenario": sc.describe(), "slo": slo.describe(),
               "rate": rate, "link": dataclasses.asdict(link), "link_scope": a.link_scope,
               "results": [_disagg_json(r) for r in results], "elapsed_s": elapsed}
    if a.plot:
        from simulator.report.plots import plot_disagg

        p = plot_disagg(payload["results"], a.plot,
                        f"{sc.model.name} on {sc.gpu.key}, {trace.name} at {rate:.3g} req/s, "
                        f"{link.key} ({a.link_scope}): {slo.describe()}")
        print(f"plot: {p}", file=out)
    return payload


def _colocated(a: argparse.Namespace, sc: Scenario, srv: Any, trace: Trace, fmt: str,
               slo: SLO, rate: float, max_replicas: int, found: dict[str, Any] | None,
               on_probe: Any) -> dict[str, Any] | None:
    """The colocated answer for ``cmd_disagg`` (--colocated); ``found``, the split search's
    answer, is needed by --colocated capacity alone."""
    from simulator.studies import disagg_search as ds

    if a.colocated == "none":
        return None
    if a.colocated == "replay":
        return ds.cheapest_colocated(srv, trace, slo, rate, a.router, a.start_requests,
                                     a.max_requests, max_replicas, a.seed, on_probe)
    one = dataclasses.replace(sc.with_replicas(1), progress=False)
    steady = steady_max_rate(one, trace, fmt, slo, start_requests=a.start_requests,
                             max_requests=a.max_requests, seed=a.seed)
    need = replicas_for(rate, steady["max_rate"], sc.settings.tp, max_replicas)
    res: dict[str, Any] = {"best": None, "levels": steady["levels"],
                           "converged": steady["converged"], "probes": steady["probes"],
                           "gpus": need["gpus"], "goodput_per_gpu": None,
                           "max_rate_per_replica": steady["max_rate"]}
    if need["replicas"]:
        assert found is not None, "--colocated capacity runs after the split search"
        # replayed on the split search's longest trace, for a like-for-like goodput
        n = found["levels"][-1]["requests"]
        load = resample_arrivals(resized(trace, n, a.seed), rate, a.seed)
        res["best"] = ds.probe_fleet(srv, load, slo, need["replicas"], a.router, a.seed)
        res["goodput_per_gpu"] = res["best"].summary["goodput"] / need["gpus"]
    return res


def _disagg_table(results: list[dict[str, Any]], tp: int, title: str) -> str:
    rows = []
    for r in results:
        b = r["disagg"]["best"]
        c = r["colocated"]
        cb = c["best"] if c else None
        rows.append([
            r["format"],
            f"{b.prefill}:{b.decode}" if b else "-",
            r["disagg"]["gpus"],
            f"{b.attainment:.0%}" if b else None,
            b.summary["ttft_ms"]["p90"] if b else None,
            b.summary["tpot_ms"]["p90"] if b else None,
            r["disagg"]["goodput_per_gpu"],
            b.kv["bytes"] / 1e6 if b else None,
            b.kv["wire_ms"] if b else None,
            f"{b.kv['busiest_port']:.0%}" if b else None,
            c["gpus"] if c else None,
            f"{cb.attainment:.0%}" if cb else None,
            cb.summary["ttft_ms"]["p90"] if cb else None,
            cb.summary["tpot_ms"]["p90"] if cb else None,
            c["goodput_per_gpu"] if c else None,
        ])
    return table.render(["format", "P:D", "GPUs", "SLO met", "TTFT p90 ms", "TPOT p90 ms",
                         "goodput/GPU", "KV MB/req", "wire ms", "link busy", "coloc GPUs",
                         "coloc met", "coloc TTFT p90", "coloc TPOT p90",
                         "coloc goodput/GPU"], rows, title)


def _disagg_lines(r: dict[str, Any]) -> str:
    """How a format's answer moved with the trace length, and where its TTFT goes."""
    d = r["disagg"]
    steps = " -> ".join(f"{x['prefill']}:{x['decode']} ({x['requests']:,} req)"
                        if x["prefill"] else f"none ({x['requests']:,} req)"
                        for x in d["levels"])
    if d["converged"] is None:
        verdict = "replayed as given"
    elif d["best"] is None:
        verdict = d.get("note") or "no split within --max-gpus meets the SLO"
    elif d["converged"]:
        verdict = "steady"
    else:
        verdict = "NOT steady by --max-requests: treat as a lower bound"
    line = f"{r['format']}: P:D by trace length {steps}: {verdict}"
    b = d["best"]
    if b is not None:
        k = b.kv
        line += (f"\n  mean TTFT (ms): KV reservation {k['reserve_wait_ms']:.1f}, prefill queue "
                 f"{k['prefill_wait_ms']:.1f}, prefill {k['prefill_ms']:.1f}, link queue "
                 f"{k['link_wait_ms']:.1f}, wire {k['wire_ms']:.1f}, decode slot "
                 f"{k['join_wait_ms']:.1f}")
    c = r["colocated"]
    if c and c["levels"] and "replicas" in c["levels"][0]:
        steps = " -> ".join(f"{x['replicas'] or 'none'} ({x['requests']:,} req)"
                            for x in c["levels"])
        tail = "steady" if c["converged"] else "NOT steady by --max-requests"
        if c["best"] is None:
            tail = "no fleet within --max-gpus meets the SLO"
        line += f"\n  colocated replicas by trace length {steps}: {tail}"
    elif c and "max_rate_per_replica" in c:
        if c["max_rate_per_replica"] > 0:
            line += (f"\n  colocated (capacity): {c['max_rate_per_replica']:.3g} req/s per "
                     f"replica{'' if c['converged'] else ' (NOT steady)'}")
        else:
            line += "\n  colocated (capacity): no rate meets the SLO on one replica"
    return line


def _probe_row(p: Any) -> dict[str, Any]:
    """A split's or a colocated fleet's probe (``disagg_search``) as a JSON row."""
    row = {"requests": p.requests, "attainment": p.attainment, "met": p.met,
           "ttft_p90_ms": p.summary["ttft_ms"]["p90"], "tpot_p90_ms": p.summary["tpot_ms"]["p90"],
           "goodput": p.summary["goodput"]}
    if hasattr(p, "prefill"):
        return row | {"prefill": p.prefill, "decode": p.decode, "kv": p.kv, "blame": p.blame}
    return row | {"replicas": p.replicas}


def _disagg_json(r: dict[str, Any]) -> dict[str, Any]:
    def part(x: dict[str, Any] | None) -> dict[str, Any] | None:
        if x is None:
            return None
        # the capacity search's probes are rows already; the others are probe objects
        probes = [p if isinstance(p, dict) else _probe_row(p) for p in x["probes"]]
        return {"gpus": x["gpus"], "goodput_per_gpu": x["goodput_per_gpu"],
                "converged": x["converged"], "levels": x["levels"], "probes": probes,
                "best": None if x["best"] is None else {**_probe_row(x["best"]),
                                                         "summary": x["best"].summary},
                **({"max_rate_per_replica": x["max_rate_per_replica"]}
                   if "max_rate_per_replica" in x else {})}
    return {"format": r["format"], "disagg": part(r["disagg"]),
            "colocated": part(r["colocated"])}


@contextlib.contextmanager
def _disagg_progress(a: argparse.Namespace, fmt: str) -> Iterator[Any]:
    """A progress bar on stderr over the replays of a format's searches (in a terminal
    unless --no-progress; --progress forces it)."""
    from tqdm import tqdm

    show = a.progress if a.progress is not None else sys.stderr.isatty()
    bar = tqdm(desc=f"disagg {fmt}", unit="replay", file=sys.stderr, disable=not show,
               leave=False)

    def on_probe(p: Any) -> None:
        bar.set_postfix_str(_probe_note(p))
        bar.update()
    try:
        yield on_probe
    finally:
        bar.close()


def cmd_validate(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    from sglang_diffkv.serving_io.sglang_log import parse_server_log
    from simulator.validation.bench_result import read_bench_result
    from simulator.validation.compare import compare_runs

    if a.server_log is None and a.bench_json is None:
        raise SimulatorInputError("give --server-log and/or --bench-json to compare against")
    log = parse_server_log(a.server_log) if a.server_log else None
    bench = read_bench_result(a.bench_json, a.bench_index) if a.bench_json else None
    sc = _scenario(a)
    workload = _workload(a)
    res, s = sc.run_summary(workload, a.format)
    running = [rep.log.arrays()["running"] for rep in res.replicas]
    decode = np.concatenate([x[x > 0] for x in running]) if running else np.zeros(0)
    rows = compare_runs(s, bench, log, decode)
    print(_header(sc, workload) + f" | {a.format}", file=out)
    print(table.render(["metric", "measured", "simulated", "error"],
                       [[r["metric"], r["measured"], r["simulated"],
                         "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"]
                        for r in rows]), file=out)
    print(_calibration_note(sc), file=out)
    if a.plot:
        from simulator.report.plots import plot_timeseries

        title = _header(sc, workload) + f" | {a.format} (simulated)"
        print(f"plot: {plot_timeseries({a.format: timeseries(res)}, a.plot, title)}", file=out)
    return {"command": "validate", "scenario": sc.describe(), "summary": s, "rows": rows,
            "server_log": a.server_log, "bench_json": a.bench_json}


def cmd_calibrate(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    from sglang_diffkv.serving_io.sglang_log import parse_server_log
    from simulator.validation.fit import (
        calibration_file,
        decode_samples,
        fit_decode,
        write_calibration,
    )
    from simulator.validation.step_fit import COSTS, fit_step_costs, step_rows

    log = parse_server_log(a.server_log)
    srv = _scenario(a).server(a.format)
    fixed = a.fit == "fixed" or (a.fit == "auto" and bool(srv.deployment.calibration.measured))
    if fixed:
        # the validation script's joint fit (step_fit), on this one log
        rows_in = step_rows(srv, log, a.server_log, None)
        fit = {**fit_step_costs(srv, rows_in), "fixed_only": True}
        fit["samples"] = fit["rows"]
        rows = [[k if k in fit["fitted"] else f"{k} (kept)", fit[k]] for k in COSTS]
        rows += [["rows used (dropped)", f"{fit['rows']} ({len(fit['dropped'])})"],
                 ["kernels' share of a step", f"{100 * fit['kernel_share']:.0f}%"],
                 ["fit error (MAPE) before / after",
                  f"{100 * fit['mape_before']:.1f}% / {100 * fit['mape']:.1f}%"]]
    else:
        fit = fit_decode(srv, decode_samples(log))
        rows = [["eta_mem_gemm", fit["eta_mem_gemm"]],
                [f"eta_mem_decode_attention[{srv.deployment.kv_format.calibration_key}]",
                 fit["eta_mem_decode_attention"]],
                ["step_overhead_s", fit["step_overhead_s"]],
                ["seq_overhead_s", fit["seq_overhead_s"]],
                ["decode lines used / dropped", f"{fit['samples']} / "
                                                f"{fit['samples_dropped_compute_bound']}"],
                ["fit error (MAPE)", f"{100 * fit['mape']:.1f}%"]]
    path = write_calibration(a.out, calibration_file(srv, fit, a.server_log))
    print(table.render(["parameter", "fitted"], rows), file=out)
    print(f"calibration: {path} (use with --calibration {path})", file=out)
    return {"command": "calibrate", "fit": fit, "calibration": str(path)}


def cmd_export(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    a.max_new_tokens = getattr(a, "max_new_tokens", None)
    w = _workload(a)
    if isinstance(w, ClosedLoop):
        raise SimulatorInputError("export writes timestamps; it cannot use --closed-loop")
    p = write_mooncake_jsonl(w, a.out)
    print(f"wrote {len(w):,} requests to {p}", file=out)
    return {}


def cmd_list(a: argparse.Namespace, out: Any) -> dict[str, Any]:
    print("bundled traces:", file=out)
    for name, (_, fmt, desc) in BUNDLED_TRACES.items():
        print(f"  {name:24s} [{fmt}] {desc}", file=out)
    print("length models (--synthetic): " + ", ".join(length_model_names()), file=out)
    print("models: " + ", ".join(BUNDLED_MODELS), file=out)
    measured = measured_gpus()
    print("GPUs: " + ", ".join(f"{g} ({'measured' if g in measured else 'uncalibrated'})"
                               for g in gpu_names()), file=out)
    print("KV formats: " + ", ".join(FORMAT_NAMES), file=out)
    return {}


COMMANDS = {"compare": cmd_compare, "replay": cmd_replay, "sweep": cmd_sweep,
            "capacity": cmd_capacity, "disagg": cmd_disagg, "validate": cmd_validate,
            "calibrate": cmd_calibrate,
            "export": cmd_export, "list": cmd_list}


def main(argv: Sequence[str] | None = None, out: Any = None) -> int:
    out = out or sys.stdout
    words = list(argv if argv is not None else sys.argv[1:])
    if words and words[0] in TOOLS:
        import importlib

        return int(importlib.import_module(TOOLS[words[0]][0]).main(words[1:]))
    args = build_parser().parse_args(argv)
    if args.command is None:
        args = build_parser().parse_args(["compare", *(argv or [])])
    try:
        payload = COMMANDS[args.command](args, out)
        if getattr(args, "json", None):
            path = table.write_json(args.json, payload)
            print(f"json: {path}", file=out)
    except InputError as e:
        print(f"diffkv-sim: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head and closed early
        return 0
    return 0
