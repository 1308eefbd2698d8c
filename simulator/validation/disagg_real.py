"""``diffkv-sim validate-disagg RESULTS [RESULTS ...]``: the P/D model beside a real bf16
prefill/decode deployment of SGLang and its colocated control, replaying the same requests.

RESULTS are the folders (or files) a real run brought back (scripts/gpu_pd_run.sh, one folder
per GPU call; ``sglang_diffkv.serving_io.pd_run`` describes the files): ``pd_runs_pd.json``
(a prefill server on one GPU, a decode server on another, SGLang's router, Mooncake's TCP
transport between them), ``pd_runs_colocated.json`` (one ordinary server on one GPU, the same
trace and rates) and ``pd_link.json`` (the link's bandwidth, measured on the same machine).

For every rate of the P/D replay this runs what ``diffkv-sim disagg --split 1:1 --formats bf16
--trace-arrivals`` runs (``simulate_disagg``: one prefill and one decode replica, one link per
pair) on the measured requests (their arrival times, prompt and output lengths) with the
servers' own settings (their start-up ``server_args``), and for the control the colocated
replica model on the same requests; then it prints measured against simulated TTFT and TPOT
(p50, p90), request and output-token throughput, and for P/D SGLang's own per-request KV
transfer time and size against the model's. ``--export DIR`` writes each run's trace and the
link as files and prints the ``diffkv-sim disagg`` command that reproduces the P/D column.

A one-GPU run (scripts/gpu_pd_run.sh on a machine with one GPU: both P/D servers on GPU 0,
``"shared_gpu": true`` in ``pd_runs_pd.json``, or both commands naming the same
``--base-gpu-id``) is accepted and said so in the report's first lines: the model gives each
replica a GPU of its own, so the TTFT/TPOT and P/D-over-colocated rows carry the two servers'
contention for one GPU (indicative); the KV transfer rows (SGLang's bytes and time per request
against the model's bytes, ``simulator/kv/transfer.py``, and its link queue + wire time) are
the measurement, on the link fitted to the same-GPU Mooncake probe (``same_gpu`` in
``pd_link.json``).

The link (``--link``): ``measured`` (default) fits latency + bytes / bandwidth to the Mooncake
TCP probe of ``pd_link.json``, or, without it, chains the probe's GPU->host copy, loopback
socket and host->GPU copy rates; ``sglang`` takes SGLang's own transfer metrics of the slowest
rate (bytes / time per request); or a link key (``tcp-loopback`` holds the idle one-host
Mooncake TCP measurement) or JSON file, as ``diffkv-sim disagg --link``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.pd_run import (
    LinkProbe,
    PdReplay,
    PdResults,
    PdRun,
    fit_link,
    latency_stats,
    link_rows,
    load_pd_results,
    measured_arrays,
    transfer_means,
)
from sglang_diffkv.serving_io.sglang_log import ServerLog
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl
from simulator.engine.cluster import RunResult
from simulator.engine.disagg import simulate_disagg
from simulator.errors import SimulatorInputError
from simulator.report.table import render
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration_set import load_calibration_set
from simulator.specs.gpu import load_gpu
from simulator.specs.link import LinkSpec, load_link
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario
from simulator.validation.harness import server_settings

PROG = "diffkv-sim validate-disagg"
FORMAT = "bf16"
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "req_s", "out_tok_s")
SHARED_GPU_LINE = (
    "ONE GPU: the P/D pair's prefill and decode servers shared one GPU; the model gives each "
    "replica its own, so the TTFT/TPOT rows include their contention and are indicative only; "
    "the KV transfer rows (bytes and ms per request) are the measurement")
LABELS = {"ttft_p50_ms": "TTFT p50 ms", "ttft_p90_ms": "TTFT p90 ms",
          "tpot_p50_ms": "TPOT p50 ms", "tpot_p90_ms": "TPOT p90 ms", "req_s": "req/s",
          "out_tok_s": "output tok/s", "kv_ms": "KV transfer ms/req", "kv_mb": "KV MB/req"}


@dataclass(frozen=True)
class Row:
    deployment: str
    rate: float
    metric: str
    measured: float
    simulated: float

    @property
    def error(self) -> float | None:
        ok = math.isfinite(self.measured) and math.isfinite(self.simulated) and self.measured
        return self.simulated / self.measured - 1 if ok else None


# ---- inputs ----------------------------------------------------------------------------------
def gpu_key(res: PdResults, given: str) -> str:
    """``given`` unless it is ``auto``: then h100 or h200 from the devices the files name (a
    lent 2-GPU machine may come with either card)."""
    if given != "auto":
        return given
    names = {x.device for x in [*res.replays, *res.links] if x.device}
    keys = {k for n in names for k in ("h100", "h200") if k in n.lower()}
    if len(keys) != 1:
        raise SimulatorInputError(
            f"--gpu auto: the files name the devices {sorted(names) or 'none'}; give --gpu "
            "h100 or h200" + (" (they differ: compare runs of one card only)"
                              if len(keys) > 1 else ""))
    return keys.pop()


def _latest(links: Sequence[LinkProbe], probe: str) -> tuple[dict[str, Any], str] | None:
    """The probe ``probe`` without an error from the last link file that has it."""
    for lp in reversed(links):
        p = lp.probes.get(probe)
        if isinstance(p, dict) and not p.get("error"):
            return p, lp.path
    return None


def measured_link(res: PdResults) -> LinkSpec:
    """The link from ``pd_link.json``: Mooncake's TCP transfers fitted, else the chain of the
    GPU->host copy, the loopback socket and the host->GPU copy (one after the other, as a
    transfer that is not pipelined would go), with the socket's round trip as latency."""
    if (m := _latest(res.links, "mooncake_tcp")) is not None and m[0].get("transfers"):
        probe, path = m
        rows = link_rows(probe["transfers"])
        lat, bw = fit_link(rows)
        same = bool(probe.get("same_gpu"))
        return LinkSpec("measured-mooncake-tcp" + ("-same-gpu" if same else ""),
                        "Mooncake TCP transport "
                        + ("GPU 0->GPU 0, another process (one GPU; measured)" if same
                           else "GPU->GPU (measured)"),
                        bw, 1.0, lat,
                        f"fitted to {len(rows)} Mooncake TCP transfers of {int(rows[0][1])} "
                        f"pieces{' within one GPU' if same else ''}, the median of each size "
                        f"({path})")
    s = _latest(res.links, "socket_loopback")
    c = _latest(res.links, "memcpy")
    if s is not None and c is not None:
        (sock, spath), (cp, _) = s, c
        rates = (cp["d2h_pinned"], sock["bandwidth"], cp["h2d_pinned"])
        bw = 1.0 / sum(1.0 / r for r in rates)
        return LinkSpec("measured-socket-chain", "GPU->host, loopback TCP, host->GPU (measured)",
                        bw, 1.0, float(sock.get("rtt_s", 0.0)),
                        "1 / (1/D2H + 1/socket + 1/H2D) of the probes in "
                        f"{spath}: {', '.join(f'{r / 1e9:.2f}' for r in rates)} GB/s")
    raise SimulatorInputError(
        "--link measured: no usable link probe (pd_link.json with mooncake_tcp, or "
        "socket_loopback and memcpy) among the results; give --link sglang, a link key or a "
        "JSON file")


def sglang_link(res: PdResults) -> LinkSpec:
    """Bytes / time per request of SGLang's own transfer metrics at the P/D replay's lowest
    rate (the least queueing behind other transfers), no fixed latency."""
    pd = res.replay("pd")
    if pd is None:
        raise SimulatorInputError("--link sglang needs the P/D replay (pd_runs_pd.json)")
    for run in sorted(pd.runs, key=lambda r: r.rate):
        t = transfer_means(run.transfer)
        if t is not None and t["latency_ms"] > 0 and math.isfinite(t["mb"]):
            bw = t["mb"] * 1e6 / (t["latency_ms"] / 1e3)
            return LinkSpec("measured-sglang", "SGLang's KV transfers (measured)", bw, 1.0, 0.0,
                            f"mean {t['mb']:.1f} MB in {t['latency_ms']:.1f} ms per request "
                            f"at {run.rate:g} req/s ({pd.path})")
    raise SimulatorInputError("--link sglang: the P/D replay has no sglang:kv_transfer metrics "
                              "(servers started without --enable-metrics?)")


def choose_link(res: PdResults, spec: str) -> LinkSpec:
    if spec == "measured":
        return measured_link(res)
    if spec == "sglang":
        return sglang_link(res)
    return load_link(spec)


def settings_of(replay: PdReplay) -> ServerSettings:
    """The simulator's settings from the servers' recorded command lines and start-up
    ``server_args`` (SGLang's resolved values win): the prefill server's for P/D (the decode
    server runs the same flags; its forced chunk cache is the model's too), the server's for
    the colocated control."""
    role = "prefill" if replay.deployment == "pd" else "colocated"
    srv = replay.server(role) or (replay.servers[0] if replay.servers else None)
    if srv is None or not (srv.command or srv.server_args):
        raise SimulatorInputError(f"{replay.path}: no command line or server_args for the "
                                  f"{role} server: its settings are unknown")
    settings, fmt = server_settings({"command": srv.command},
                                    ServerLog(path=replay.path, server_args=srv.server_args))
    if fmt != FORMAT:
        raise SimulatorInputError(f"{replay.path}: the {role} server runs {fmt}; this "
                                  f"validation replays {FORMAT} only")
    return settings


def run_trace(run: PdRun, name: str) -> Trace:
    """The measured requests as the simulator's trace: scheduled arrival, prompt and output
    lengths (each generated in full: the client sends ignore_eos)."""
    return Trace.from_requests([TraceRequest(r.arrival_s, r.input_len, r.output_len,
                                             r.output_len) for r in run.requests], name=name)


# ---- simulation ----------------------------------------------------------------------------
def simulated_arrays(res: RunResult) -> dict[str, np.ndarray]:
    """Per completed simulated request, keyed by ``index`` (the trace position), with the
    calibration's client latency added as ``per_request_arrays`` adds it."""
    lat = res.server.deployment.calibration.first_token_latency_s
    rows = [(r.rid, r.arrival, r.first_token - r.arrival + lat, r.finish - r.arrival + lat,
             r.gen) for r in res.requests if r.rejected is None and r.finish >= 0]
    a = np.array(rows, dtype=float).reshape(-1, 5)
    idx, arrival, ttft, e2e, out = a.T
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), np.nan)
    return {"index": idx.astype(int), "arrival": arrival, "ttft": ttft, "e2e": e2e,
            "tpot": tpot, "output": out}


def _subset(a: dict[str, np.ndarray], keep: set[int]) -> dict[str, np.ndarray]:
    m = np.isin(a["index"], sorted(keep))
    return {k: v[m] for k, v in a.items()}


def _stats(a: dict[str, np.ndarray]) -> dict[str, float]:
    return latency_stats(a["arrival"], a["ttft"], a["e2e"], a["tpot"], a["output"])


def compare_run(replay: PdReplay, run: PdRun, sc: Scenario, link: LinkSpec,
                seed: int = 0) -> dict[str, Any]:
    """One rate: measured and simulated statistics over the requests both completed."""
    trace = run_trace(run, f"{replay.deployment}@{run.rate:g}rps")
    srv = sc.server(FORMAT)
    if replay.deployment == "pd":
        res = simulate_disagg(trace, srv, 1, 1, link, "pair", "round_robin", seed)
    else:
        res = sc.run(trace, FORMAT, srv)
    sim = simulated_arrays(res)
    meas = measured_arrays(run)
    both = set(meas["index"].tolist()) & set(sim["index"].tolist())
    if not both:
        raise SimulatorInputError(f"{replay.path} at {run.rate:g} req/s: no request completed "
                                  "both measured and simulated")
    m, s = _stats(_subset(meas, both)), _stats(_subset(sim, both))
    out: dict[str, Any] = {
        "deployment": replay.deployment, "rate": run.rate, "requests": len(run.requests),
        "measured_completed": int(meas["index"].size),
        "simulated_completed": int(sim["index"].size), "compared": len(both),
        "time_limited": run.time_limited, "measured": m, "simulated": s,
        "pool_tokens_model": srv.pool.token_capacity}
    if replay.deployment == "pd":
        kv = res.meta["kv"]
        # SGLang's latency: the prompt's last forward done -> the decode side's ack; the
        # model's: the last prefill step's end -> the last byte in (queue + wire)
        recs = [kv[i] for i in sorted(both)]
        out["simulated"]["kv_ms"] = 1e3 * float(np.mean([x.arrived - x.prefill_end
                                                          for x in recs]))
        out["simulated"]["kv_mb"] = float(np.mean([x.bytes for x in recs])) / 1e6
        t = transfer_means(run.transfer)
        out["measured"]["kv_ms"] = t["latency_ms"] if t else math.nan
        out["measured"]["kv_mb"] = t["mb"] if t else math.nan
    return out


def validate(paths: Sequence[str | Path], gpu: str = "auto", link_spec: str = "measured",
             calibration: str | None = None, seed: int = 0) -> dict[str, Any]:
    res = load_pd_results(paths)
    key = gpu_key(res, gpu)
    link = choose_link(res, link_spec)
    calib = load_calibration_set(key, calibration)
    g = load_gpu(key)
    model = load_model("llama-3-8b")
    runs = []
    settings: dict[str, Any] = {}
    for replay in sorted(res.replays, key=lambda r: r.deployment != "pd"):
        st = settings_of(replay)
        settings[replay.deployment] = st
        sc = Scenario(model, g, calib, st)
        for run in sorted(replay.runs, key=lambda r: r.rate):
            runs.append(compare_run(replay, run, sc, link, seed))
    servers = {f"{r.deployment}/{s.role}": s.max_total_num_tokens
               for r in res.replays for s in r.servers}
    pd = res.replay("pd")
    return {"gpu": key, "link": asdict(link), "calibration": calib.note(), "runs": runs,
            "shared_gpu": bool(pd is not None and pd.shared_gpu),
            "settings": {k: v.to_dict() for k, v in settings.items()},
            "pool_tokens_measured": servers, "files": [r.path for r in res.replays]
            + [lp.path for lp in res.links]}


def rows_of(result: dict[str, Any]) -> list[Row]:
    out = []
    for r in result["runs"]:
        keys = METRICS + (("kv_ms", "kv_mb") if r["deployment"] == "pd" else ())
        for k in keys:
            out.append(Row(r["deployment"], r["rate"], k, r["measured"][k], r["simulated"][k]))
    return out


def ratio_rows(result: dict[str, Any]) -> list[list[Any]]:
    """P/D over colocated at each rate both ran: what disaggregation changed, measured and
    modelled."""
    by = {(r["deployment"], r["rate"]): r for r in result["runs"]}
    out = []
    for (dep, rate), pd in sorted(by.items()):
        co = by.get(("colocated", rate))
        if dep != "pd" or co is None:
            continue
        for k in METRICS[:4]:
            meas = pd["measured"][k] / co["measured"][k] if co["measured"][k] else math.nan
            sim = pd["simulated"][k] / co["simulated"][k] if co["simulated"][k] else math.nan
            out.append([rate, LABELS[k], meas, sim,
                        "-" if not (math.isfinite(meas) and meas) else f"{sim / meas - 1:+.1%}"])
    return out


def report(result: dict[str, Any]) -> str:
    link = LinkSpec(**result["link"])
    lines = [f"llama-3-8b ({FORMAT}) on {result['gpu']}: measured (SGLang) against "
             f"simulated, the same requests; P/D = 1 prefill + 1 decode replica "
             f"(diffkv-sim disagg --split 1:1 --trace-arrivals), link {link.describe()}",
             f"link: {link.provenance}", result["calibration"]]
    if result.get("shared_gpu"):
        lines[1:1] = [SHARED_GPU_LINE]
    table = []
    for row in rows_of(result):
        err = row.error
        table.append([row.deployment, row.rate, LABELS[row.metric], row.measured,
                      row.simulated, "-" if err is None else f"{err:+.1%}"])
    lines.append(render(["deployment", "req/s", "metric", "measured", "simulated", "error"],
                        table))
    notes = []
    for r in result["runs"]:
        if r["compared"] < r["requests"] or r["time_limited"]:
            notes.append(f"{r['deployment']} @ {r['rate']:g} req/s: compared {r['compared']} "
                         f"of {r['requests']} requests (measured completed "
                         f"{r['measured_completed']}, simulated {r['simulated_completed']}"
                         f"{'; the run was cut at its time limit' if r['time_limited'] else ''})")
    rr = ratio_rows(result)
    if rr:
        lines.append(render(["req/s", "P/D / colocated", "measured", "simulated", "error"], rr,
                            "what disaggregation changed: P/D over colocated, each side"
                            + (" (measured P/D on one shared GPU: indicative)"
                               if result.get("shared_gpu") else "")))
    model_pool = {r["deployment"]: r["pool_tokens_model"] for r in result["runs"]}
    pools = ", ".join(f"{k} {v}" for k, v in result["pool_tokens_measured"].items() if v)
    if pools:
        notes.append(f"KV pool tokens: measured {pools}; the model's "
                     + ", ".join(f"{k} {v}" for k, v in model_pool.items()))
    lines += notes
    return "\n".join(lines)


# ---- export: the same P/D replay through diffkv-sim disagg ---------------------------------
def settings_flags(s: ServerSettings) -> list[str]:
    """``diffkv-sim`` options that give ``s`` (those that differ from its defaults)."""
    d = ServerSettings()
    out: list[str] = []
    for name, opt in (("chunked_prefill_size", "--chunked-prefill-size"),
                      ("max_prefill_tokens", "--max-prefill-tokens"),
                      ("cuda_graph_max_bs", "--cuda-graph-max-bs"),
                      ("schedule_conservativeness", "--schedule-conservativeness"),
                      ("mem_fraction_static", "--mem-fraction-static"),
                      ("max_total_tokens", "--max-total-tokens"),
                      ("max_running_requests", "--max-running-requests"),
                      ("context_len", "--context-len")):
        v = getattr(s, name)
        if v is not None and v != getattr(d, name):
            out += [opt, f"{v:g}" if isinstance(v, float) else str(v)]
    for name, opt, on in (("disable_cuda_graph", "--disable-cuda-graph", True),
                          ("enable_piecewise_cuda_graph", "--disable-piecewise-cuda-graph", False),
                          ("enable_mixed_chunk", "--enable-mixed-chunk", True),
                          ("disable_overlap_schedule", "--disable-overlap-schedule", True),
                          ("disable_radix_cache", "--disable-radix-cache", True),
                          ("ignore_eos", "--no-ignore-eos", False)):
        if getattr(s, name) == on and getattr(d, name) != on:
            out.append(opt)
    return out


def export(paths: Sequence[str | Path], result: dict[str, Any], out: Path) -> list[str]:
    """Each P/D run's trace (Mooncake JSONL) and the link (JSON) under ``out``; the
    ``diffkv-sim disagg`` commands that replay them."""
    res = load_pd_results(paths)
    pd = res.replay("pd")
    if pd is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    link = dict(result["link"])
    key = link.pop("key")
    link_path = out / f"{key}.json"
    link_path.write_text(json.dumps(link, indent=1))
    flags = settings_flags(ServerSettings(**result["settings"]["pd"]))
    cmds = []
    for run in sorted(pd.runs, key=lambda r: r.rate):
        p = write_mooncake_jsonl(run_trace(run, f"pd@{run.rate:g}"),
                                 out / f"pd_{run.rate:g}rps.jsonl")
        cmds.append(" ".join(["diffkv-sim", "disagg", "--trace", str(p), "--trace-arrivals",
                              "--split", "1:1", "--formats", FORMAT, "--gpu", result["gpu"],
                              "--link", str(link_path), "--colocated", "none", *flags]))
    return cmds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="the folders (or pd_*.json files) a real P/D "
                   "validation run brought back, one per GPU call")
    p.add_argument("--gpu", default="auto", help="h100, h200, or auto: from the device the "
                   "files name (default: %(default)s)")
    p.add_argument("--link", default="measured", metavar="LINK",
                   help="measured (pd_link.json's probes), sglang (SGLang's own transfer "
                        "metrics), a link key (e.g. tcp-loopback, Mooncake TCP measured idle) "
                        "or a JSON file (default: %(default)s)")
    p.add_argument("--calibration", default=None, metavar="PATH",
                   help="a calibration file instead of the GPU's shipped set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write each P/D run's trace and the link there, and print the "
                        "diffkv-sim disagg commands that replay them")
    p.add_argument("--json", default=None, metavar="PATH", help="write the comparison as JSON")
    return p


def main(argv: Sequence[str] | None = None, out: Any = None) -> int:
    out = out or sys.stdout
    a = build_parser().parse_args(argv)
    try:
        result = validate(a.results, a.gpu, a.link, a.calibration, a.seed)
        print(report(result), file=out)
        if a.export:
            for c in export(a.results, result, Path(a.export)):
                print(c, file=out)
        if a.json:
            rows = [asdict(r) | {"error": r.error} for r in rows_of(result)]
            Path(a.json).write_text(json.dumps({**result, "rows": rows}, indent=1,
                                               default=str))
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
