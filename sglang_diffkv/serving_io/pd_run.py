"""The files a real prefill/decode (P/D) validation run writes, and the statistics both sides
compute from them: the bench's replay driver (``sglang_diffkv.bench.pd_replay``) and link probe
(``sglang_diffkv.bench.link_probe``) write them on the GPU machine; ``diffkv-sim
validate-disagg`` (``simulator.validation.disagg_real``) reads them and replays the same
requests. One module for both, so the measured and the simulated numbers are computed by the
same code (TTFT/TPOT percentiles, throughput, the link fit).

Two kinds of JSON file, each named ``pd_*.json`` and carrying ``"schema": 1``:

``kind: "replay"`` (``pd_runs_<deployment>.json``), one deployment (``pd``: a prefill server, a
decode server and the router; ``colocated``: one ordinary server) replaying one trace at
several request rates::

    {"schema": 1, "kind": "replay", "deployment": "pd", "device": "NVIDIA H100 80GB HBM3",
     "trace": {"name": "azure-conv", "seed": 0, "window_s": 50, "context_len": 8192},
     "servers": [{"role": "prefill", "command": "...", "max_total_num_tokens": 426000,
                  "max_running_requests": 4096, "server_args": {...}}, ...],
     "router": "python -m sglang_router.launch_router ...",
     "runs": [{"rate": 2.0, "time_limited": false, "wall_s": 58.1,
               "transfer": {"sglang:kv_transfer_latency_ms_sum": 812.0, ...},
               "fields": ["index", "arrival_s", ...], "requests": [[0, 0.0, ...], ...]}]}

``"shared_gpu": true`` (optional; absent means false, unless the prefill and decode servers'
commands name the same ``--base-gpu-id``): both P/D servers ran on one GPU (the one-GPU
variant of scripts/gpu_pd_run.sh).

``requests`` rows follow ``fields`` (``REQUEST_FIELDS``): times are seconds after the run's
start, ``send_s`` / ``first_token_s`` / ``end_s`` null for a request never sent or never
answered; ``completed`` is 1 for a request that streamed all its tokens. ``transfer``: the
change over the run of the prefill server's ``sglang:kv_transfer_*`` Prometheus series
(``--enable-metrics``; null when it had none).

``kind: "link"`` (``pd_link.json``): bandwidth probes on the same machine, each optional::

    {"schema": 1, "kind": "link", "device": "...",
      "gpus": 1, "same_gpu": true,
     "probes": {"socket_loopback": {"bytes": 4294967296, "seconds": 1.9, "rtt_s": 3e-05},
                "memcpy": {"d2h_pinned": 2.4e10, "h2d_pinned": ..., ...},
                "mooncake_tcp": {"transfers": [[bytes, pieces, seconds], ...]}}}

``mooncake_tcp`` times Mooncake's transfer engine with its TCP transport (what SGLang's
``--disaggregation-transfer-backend mooncake_tcp`` uses) writing GPU 0 memory into GPU 1
memory (``same_gpu``, one GPU: into another process's buffer on GPU 0), one
``batch_transfer_sync_write`` of ``pieces`` equal pieces per row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.json_file import read_json
from sglang_diffkv.serving_io.launch_args import launch_args

SCHEMA = 1
DEPLOYMENTS = ("pd", "colocated")
REQUEST_FIELDS = ("index", "arrival_s", "input_len", "output_len", "send_s", "first_token_s",
                  "end_s", "tokens", "completed")
LINK_FILE = "pd_link.json"
# the prefill server's per-request KV transfer series (SGLang 0.5.17 metrics_collector):
# latency from the request entering the transfer queue (its prompt's last forward done) to the
# decode side's acknowledgement, and the request's KV megabytes (MiB: bytes / 2**20)
TRANSFER_LATENCY = "sglang:kv_transfer_latency_ms"
TRANSFER_MB = "sglang:kv_transfer_total_mb"
SHARED_GPU_NOTE = ("one GPU: the prefill and decode servers shared it; their TTFT/TPOT include "
                   "each other's contention (indicative only); the KV transfer bytes and times "
                   "(sglang:kv_transfer_*) are the measurement")


def replay_file(deployment: str) -> str:
    return f"pd_runs_{deployment}.json"


@dataclass(frozen=True)
class PdRequest:
    index: int
    arrival_s: float
    input_len: int
    output_len: int
    send_s: float | None
    first_token_s: float | None
    end_s: float | None
    tokens: int
    completed: bool


@dataclass(frozen=True)
class PdServer:
    role: str
    command: str
    max_total_num_tokens: int | None
    max_running_requests: int | None
    server_args: dict[str, str]


@dataclass(frozen=True)
class PdRun:
    rate: float
    requests: tuple[PdRequest, ...]
    time_limited: bool
    wall_s: float | None
    transfer: dict[str, float] | None


@dataclass(frozen=True)
class PdReplay:
    path: str
    deployment: str
    device: str
    trace: dict[str, Any]
    servers: tuple[PdServer, ...]
    router: str | None
    runs: tuple[PdRun, ...]
    shared_gpu: bool = False

    def server(self, role: str) -> PdServer | None:
        return next((s for s in self.servers if s.role == role), None)


@dataclass(frozen=True)
class LinkProbe:
    path: str
    device: str
    probes: dict[str, Any]
    same_gpu: bool = False


@dataclass
class PdResults:
    replays: list[PdReplay] = field(default_factory=list)
    links: list[LinkProbe] = field(default_factory=list)

    def replay(self, deployment: str) -> PdReplay | None:
        return next((r for r in self.replays if r.deployment == deployment), None)


# ---- reading ---------------------------------------------------------------------------------
def _need(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise InputError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise InputError(f"{where}: field {key!r} = {v!r} has the wrong type")
    if not isinstance(v, kind):
        raise InputError(f"{where}: field {key!r} = {v!r} has the wrong type")
    return v


def _time(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise InputError(f"{where}: {v!r} is not a time in seconds >= 0 (or null)")
    return float(v)


def _count(v: Any, where: str, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise InputError(f"{where}: {v!r} is not an integer >= {least}")
    return v


def _request(fields: Sequence[str], row: Any, where: str) -> PdRequest:
    if not isinstance(row, list) or len(row) != len(fields):
        raise InputError(f"{where}: expected a list of {len(fields)} values ({', '.join(fields)})")
    d = dict(zip(fields, row, strict=True))
    arrival = _time(d["arrival_s"], f"{where} arrival_s")
    if arrival is None:
        raise InputError(f"{where}: arrival_s is null")
    r = PdRequest(_count(d["index"], f"{where} index", 0), arrival,
                  _count(d["input_len"], f"{where} input_len", 1),
                  _count(d["output_len"], f"{where} output_len", 1),
                  _time(d["send_s"], f"{where} send_s"),
                  _time(d["first_token_s"], f"{where} first_token_s"),
                  _time(d["end_s"], f"{where} end_s"),
                  _count(d["tokens"], f"{where} tokens", 0), bool(d["completed"]))
    if r.completed and (r.send_s is None or r.first_token_s is None or r.end_s is None
                        or not r.send_s <= r.first_token_s <= r.end_s):
        raise InputError(f"{where}: a completed request needs send_s <= first_token_s <= end_s")
    return r


def _run(d: Any, where: str) -> PdRun:
    if not isinstance(d, dict):
        raise InputError(f"{where}: a run must be a JSON object")
    rate = _need(d, "rate", (int, float), where)
    if not (rate > 0 and math.isfinite(rate)):
        raise InputError(f"{where}: rate {rate!r} must be a positive number of req/s")
    fields = _need(d, "fields", list, where)
    missing = [f for f in REQUEST_FIELDS if f not in fields]
    if missing:
        raise InputError(f"{where}: fields lack {missing}")
    # read by name so a later writer may add fields
    pick = [fields.index(f) for f in REQUEST_FIELDS]
    rows = _need(d, "requests", list, where)
    if not rows:
        raise InputError(f"{where}: no requests")
    reqs = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(fields):
            raise InputError(f"{where} request {i}: expected {len(fields)} values")
        reqs.append(_request(REQUEST_FIELDS, [row[k] for k in pick], f"{where} request {i}"))
    if [r.index for r in reqs] != list(range(len(reqs))):
        raise InputError(f"{where}: request indices must be 0, 1, 2, ... in order")
    if any(b.arrival_s < a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)):
        raise InputError(f"{where}: arrival_s must not decrease")
    transfer = d.get("transfer")
    if transfer is not None and not (isinstance(transfer, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool)
            for v in transfer.values())):
        raise InputError(f"{where}: transfer must be an object of numbers or null")
    wall = d.get("wall_s")
    return PdRun(float(rate), tuple(reqs), bool(d.get("time_limited", False)),
                 None if wall is None else float(wall), transfer)


def _server(d: Any, where: str) -> PdServer:
    if not isinstance(d, dict):
        raise InputError(f"{where}: a server must be a JSON object")
    args = d.get("server_args") or {}
    if not isinstance(args, dict):
        raise InputError(f"{where}: server_args must be an object")

    def opt_int(key: str) -> int | None:
        v = d.get(key)
        return None if v is None else _count(v, f"{where} {key}", 1)
    return PdServer(str(_need(d, "role", str, where)), str(d.get("command") or ""),
                    opt_int("max_total_num_tokens"), opt_int("max_running_requests"),
                    {str(k): str(v) for k, v in args.items()})


def read_pd_file(path: str | Path) -> PdReplay | LinkProbe:
    p = Path(path)
    data = read_json(p, "P/D run file")
    where = str(p)
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object")
    if data.get("schema") != SCHEMA:
        raise InputError(f"{where}: schema {data.get('schema')!r}, expected {SCHEMA}")
    kind = data.get("kind")
    device = str(data.get("device") or "")
    if kind == "link":
        probes = _need(data, "probes", dict, where)
        return LinkProbe(where, device, probes, bool(data.get("same_gpu", False)))
    if kind != "replay":
        raise InputError(f"{where}: kind {kind!r}, expected 'replay' or 'link'")
    dep = _need(data, "deployment", str, where)
    if dep not in DEPLOYMENTS:
        raise InputError(f"{where}: deployment {dep!r}, expected one of {DEPLOYMENTS}")
    runs = tuple(_run(r, f"{where} run {i}")
                 for i, r in enumerate(_need(data, "runs", list, where)))
    rates = [r.rate for r in runs]
    if len(set(rates)) != len(rates):
        raise InputError(f"{where}: a rate appears twice: {rates}")
    servers = tuple(_server(s, f"{where} server {i}")
                    for i, s in enumerate(data.get("servers") or []))
    trace = data.get("trace") or {}
    if not isinstance(trace, dict):
        raise InputError(f"{where}: trace must be an object")
    router = data.get("router")
    shared = bool(data.get("shared_gpu", False)) or (dep == "pd" and _same_gpu_ids(servers))
    return PdReplay(where, dep, device, trace, servers, None if router is None else str(router),
                    runs, shared)


def _same_gpu_ids(servers: Sequence[PdServer]) -> bool:
    """The prefill and decode servers' commands name the same ``--base-gpu-id`` (the files of
    a one-GPU run written before ``shared_gpu`` was recorded)."""
    ids = {s.role: launch_args(s.command).get("base_gpu_id") for s in servers}
    return ids.get("prefill") is not None and ids.get("prefill") == ids.get("decode")


def pd_files(paths: Iterable[str | Path]) -> list[Path]:
    """The ``pd_*.json`` files named, or found (recursively) in the folders named, sorted."""
    out: list[Path] = []
    for x in paths:
        p = Path(x)
        if p.is_dir():
            found = sorted(p.rglob("pd_*.json"))
            if not found:
                raise InputError(f"{p}: no pd_*.json file in this folder or below")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(f"{p}: no such file or folder")
    return out


def load_pd_results(paths: Iterable[str | Path]) -> PdResults:
    """Every replay and link file under ``paths`` (the calls of one validation come back in
    separate folders: give them all). A deployment may appear in one file only."""
    res = PdResults()
    for f in pd_files(paths):
        item = read_pd_file(f)
        if isinstance(item, LinkProbe):
            res.links.append(item)
            continue
        if (old := res.replay(item.deployment)) is not None:
            raise InputError(f"deployment {item.deployment!r} appears in both {old.path} and "
                             f"{item.path}: give the folders of one validation only")
        res.replays.append(item)
    if not res.replays:
        raise InputError("no replay file (pd_runs_*.json) among " + ", ".join(map(str, paths)))
    return res


# ---- statistics ------------------------------------------------------------------------------
def measured_arrays(run: PdRun, only: set[int] | None = None) -> dict[str, np.ndarray]:
    """Per completed request (or those of ``only``, when completed), as the client saw it:
    ``index``; ``arrival`` (scheduled, s after the start); ``ttft`` = first token - send;
    ``e2e`` = end - send; ``tpot`` = (e2e - ttft) / (tokens - 1) (nan for one token), as
    sglang.bench_serving; ``output`` tokens."""
    rows = [r for r in run.requests if r.completed and (only is None or r.index in only)]
    a = np.array([[r.index, r.arrival_s, r.first_token_s - r.send_s, r.end_s - r.send_s,
                   r.tokens] for r in rows  # type: ignore[operator]
                  ], dtype=float).reshape(-1, 5)
    idx, arrival, ttft, e2e, out = a.T
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), np.nan)
    return {"index": idx.astype(int), "arrival": arrival, "ttft": ttft, "e2e": e2e,
            "tpot": tpot, "output": out}


def _pct(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else math.nan


def latency_stats(arrival: np.ndarray, ttft: np.ndarray, e2e: np.ndarray, tpot: np.ndarray,
                  output: np.ndarray) -> dict[str, float]:
    """TTFT and TPOT p50/p90 (ms) and throughput over completed requests: ``req_s`` and
    ``out_tok_s`` = completed requests (their output tokens) / (last finish - first arrival),
    the simulator's ``summarize`` definition, applied to measured and simulated alike."""
    n = int(ttft.size)
    dur = float((arrival + e2e).max() - arrival.min()) if n else 0.0
    per_s = (lambda x: x / dur if dur > 0 else math.nan)  # noqa: E731
    return {"n": n,
            "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p90_ms": 1e3 * _pct(ttft, 90),
            "tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p90_ms": 1e3 * _pct(tpot, 90),
            "req_s": per_s(n), "out_tok_s": per_s(float(output.sum()))}


def transfer_means(transfer: Mapping[str, float] | None) -> dict[str, float] | None:
    """Mean KV transfer latency (ms) and size (MB = 10**6 bytes) per request over a run, from
    the change in the prefill server's ``sglang:kv_transfer_*`` histograms; None without
    them."""
    if not transfer:
        return None
    n = transfer.get(TRANSFER_LATENCY + "_count", 0.0)
    if n <= 0:
        return None
    out = {"count": n, "latency_ms": transfer.get(TRANSFER_LATENCY + "_sum", math.nan) / n}
    m = transfer.get(TRANSFER_MB + "_count", 0.0)
    # SGLang's "MB" is bytes / 2**20
    out["mb"] = (transfer.get(TRANSFER_MB + "_sum", math.nan) * 2**20 / 1e6 / m if m > 0
                 else math.nan)
    return out


def fit_link(rows: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``seconds = latency + bytes / bandwidth``, least
    squares over the median time of each size among rows ``(bytes, ..., seconds)`` (the last
    value is the time; a size's first transfers may pay for fresh memory, the median does
    not follow them); a negative intercept (noise) is clipped to 0 and the bandwidth refitted
    through the origin."""
    a = np.array([[float(r[0]), float(r[-1])] for r in rows], dtype=float).reshape(-1, 2)
    if a.shape[0] < 1 or not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise InputError("a link fit needs rows of positive (bytes, seconds)")
    x = np.unique(a[:, 0])
    y = np.array([np.median(a[a[:, 0] == v, 1]) for v in x])
    if x.size >= 2:
        slope, icpt = np.polyfit(x, y, 1)
        if slope > 0 and icpt >= 0:
            return float(icpt), float(1.0 / slope)
    return 0.0, float((x * x).sum() / (x * y).sum())


def link_rows(transfers: Sequence[Sequence[float]], pieces: int = 64) -> list[Sequence[float]]:
    """The Mooncake probe's rows ``[bytes, pieces, seconds]`` to fit a link to: those in
    ``pieces`` pieces (SGLang sends a request's KV as one piece per layer and K/V buffer at
    least: 64 for Llama-3-8B), else those of the most common piece count."""
    mine = [r for r in transfers if int(r[1]) == pieces]
    if mine or not transfers:
        return mine
    counts: dict[int, int] = {}
    for r in transfers:
        counts[int(r[1])] = counts.get(int(r[1]), 0) + 1
    best = max(counts, key=lambda k: (counts[k], k))
    return [r for r in transfers if int(r[1]) == best]
