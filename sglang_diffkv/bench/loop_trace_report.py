"""Busy segments of SGLang scheduler loop traces (SGLANG_DIFFKV_LOOP_TRACE, see
sglang_diffkv/bench/loop_records.py), one table row per segment, and how each run's one-token
extends cost the host compared with the first run's. CPU only.

    python -m sglang_diffkv.bench.loop_trace_report fp8=/tmp/s24/1/fp8/loop \
        bf16=/tmp/s24/1/bf16/loop

With --graph-max-bs N (the server's cuda_graph_max_bs), each row also gives the median wall
time of the decode iterations at batch N/1.25 to N (CUDA graphs) and N+1 to 1.25 N (eager):
where the eager steps are host-bound, the latter is the host's iteration around an eager
decode step, the simulator's eager_decode_host_s. The iteration grows with the batch
(per-request metadata and results), so the row also fits a line through the eager iterations'
mean walls in bands of N/4 requests: its intercept and slope are eager_decode_host_s and
eager_decode_host_per_req_s. Each figure here names the calibration field it measures;
``diffkv-sim validate-runs`` takes it as the option of that name in the field's unit,
seconds (``--eager-decode-host-s diffkv=S``), where these tables print ms.

Each LABEL=PATH names a loop-*.jsonl[.gz] file, a folder holding them, or a scripts/bench_e2e.py
result folder of a server started with SGLANG_DIFFKV_LOOP_TRACE=FOLDER/loop (results.json
beside loop/): then each workload run's window (from its start to the next run's) is a
segment, named by the run (sharegpt, ladder@6rps, ...), and the comparison pairs runs of the
same name. Otherwise a folder with several
files (one per scheduler process) gives each file its own rows, labelled LABEL:loop-PID, and
the comparison pairs a run's n-th file with the first run's n-th file. Segments are the
stretches of the loop between idle gaps longer than --gap-s; those shorter than --min-s
(warm-up probes, stray requests) are left out and not numbered. A one-token extend is a
run_batch of an extend batch with at most 2 new tokens (a prompt the radix cache held);
"1tok spans" are the host ms inside its run_batch of the methods the trace times
(runner_extend: the model runner's eager forward; attn_extend: the attention backend's
extend, KV store included; attn_metadata; kv_store: the KV pool's set_kv_buffer).

For a result folder whose logs.tar.gz holds the bench client's per-request records, a third
table splits each run's client TTFT at the scheduler: pre (send -> received: HTTP, the
tokenizer manager, the wait for the loop's next poll), queue, step (launched -> first token
streamed) and post (streamed -> the client's first token). Client and scheduler share the
machine's clock; requests are joined in time order. For a ladder run (open-loop arrivals) it
also gives the mean wait for the loop's next poll, and the first-token latency: mean pre less
that wait, plus mean post. The simulator makes each request wait for the next batch itself, so
this, not pre + post, is what it adds to every TTFT.

    D=docs/data/h200-2026-11-25/s24-loop   # loop traces: git checkout 8dc2c27 -- $D
    python -m sglang_diffkv.bench.loop_trace_report fp8=$D/c3/fp8 bf16=$D/c3/bf16

A last table pools the one-prompt extends (run_batch of a prefill of one prompt, any length)
of every result folder's ladder runs by server configuration: n, mean and spread. The mean is
the simulator's eager prefill launch (eager_prefill_launch_s), and the ladders' first-token
latency, averaged over their requests, its first_token_latency_s, and the median turnaround,
the host's time from an extend's launches to the next step's launch, its
eager_prefill_turnaround_s. Give it several starts
of one configuration, as the host's speed moves between starts:

    D=docs/data/h200-2026-11-25/s32-probe  # git checkout 8dc2c27 -- $D (its loop traces)
    python -m sglang_diffkv.bench.loop_trace_report b1=$D/c1/bf16 b2=$D/c2/bf16 b3=$D/c3/bf16 \
        b4=$D/c4/bf16 f1=$D/c1/fp8 f2=$D/c2/fp8 f3=$D/c3/fp8 f4=$D/c4/fp8
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import statistics
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sglang_diffkv.bench.loop_records import (
    Mode,
    ModeStats,
    Phase,
    Record,
    RequestTimes,
    poll_wait_s,
    read_loop_trace,
    request_times,
    segments,
    summarize,
    timed_iterations,
    trace_files,
)

ONE_TOKEN_MAX = 2  # new tokens of an extend that counts as one-token
# the open-loop runs whose one-prompt launches are pooled: a burst's prefills batch many
# prompts, a ladder's mostly one (bench_e2e.py's run labels)
LADDER_PREFIX = "ladder"
# the batches either side of the largest CUDA graph N whose decode iterations time the edge:
# (N / EDGE, N] run graphs, (N, EDGE * N] run eager (their kernels still short of the host's
# iteration on an H200 DiffKV server: 24-29 ms modelled against 32-38 ms measured, session 28)
EDGE = 1.25
# the eager decode iterations' host line: their mean wall in bands of N / HOST_BANDS requests
# above the largest CUDA graph N, each band of at least HOST_BAND_MIN iterations, fitted as
# a + b * batch by least squares weighted by the bands' iteration counts. Means, not medians:
# a burst lasts the sum of its iterations, and the garbage collections and slow polls that
# lengthen some of them by tens of ms (more of them the larger the batch) take their time too
HOST_BANDS = 4
HOST_BAND_MIN = 5


class ReportInputError(Exception):
    """A path that holds no loop trace, or a trace that does not read."""


def label_path(value: str) -> tuple[str, str]:
    """argparse type of a LABEL=PATH argument."""
    label, sep, path = value.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {value!r}")
    return label, path


def label_files(path: str | Path) -> list[Path]:
    """The trace files PATH names: itself, or the loop-*.jsonl[.gz] files of a folder."""
    p = Path(path)
    if p.is_dir():
        files = trace_files(p)
        if not files:
            raise ReportInputError(f"{p}: no loop-*.jsonl[.gz] files in this folder")
        return files
    if p.is_file():
        return [p]
    raise ReportInputError(f"{p}: no such file or folder")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics; None when empty."""
    return float(np.percentile(values, q)) if values else None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _mode_ms(stats: ModeStats | None, what: str) -> float | None:
    if stats is None or not stats.iterations:
        return None
    return stats.mean_ms(what)


def one_token_runs(seg: list[Record]) -> list[Record]:
    """The run_batch records of extends with at most ONE_TOKEN_MAX new tokens."""
    return [r for r in seg
            if r.phase == Phase.RUN and r.mode == Mode.EXTEND and r.tokens <= ONE_TOKEN_MAX]


def one_token_ms(seg: list[Record]) -> list[float]:
    """Host ms of each one-token extend's run_batch."""
    return [1e3 * (r.t1 - r.t0) for r in one_token_runs(seg)]


def one_prompt_ms(seg: list[Record]) -> list[float]:
    """Host ms of each run_batch of an extend of one prompt (any length): what the simulator's
    eager prefill launch (``eager_prefill_launch_s``) stands for."""
    return [1e3 * (r.t1 - r.t0) for r in seg
            if r.phase == Phase.RUN and r.mode == Mode.EXTEND and r.size == 1]


def turnaround_ms(seg: list[Record]) -> list[float]:
    """Host ms from the end of each extend's run_batch (its launches) to the next step's
    launch, where the iteration after it launched one: a decode step's graph replay ends its
    run_batch, a prefill's launches begin with its run_batch. What the simulator's
    ``eager_prefill_turnaround_s`` stands for: the GPU idles through it after a
    launch-bound prefill. An extend whose kernels outlast its launches is waited for inside
    it (a long prompt), hence the median."""
    its = timed_iterations(seg)
    out = []
    for a, b in zip(its, its[1:], strict=False):
        if a.run is None or b.run is None or a.run.mode != Mode.EXTEND:
            continue
        if b.run.mode == Mode.DECODE:
            out.append(1e3 * (b.run.t1 - a.run.t1))
        elif b.run.mode == Mode.EXTEND:
            out.append(1e3 * (b.run.t0 - a.run.t1))
    return out


class RunWindow(NamedTuple):
    name: str     # the run's label: sharegpt, ladder@6rps, ...
    config: str   # the server configuration it ran on
    start: float  # wall clock
    end: float

    def records(self, records: list[Record]) -> list[Record]:
        """Those of ``records`` that start inside this run's window."""
        return [r for r in records if self.start <= r.t0 < self.end]

    @property
    def ladder(self) -> bool:
        """Whether the run is an open-loop ladder (random arrivals) rather than a burst."""
        return self.name.startswith(LADDER_PREFIX)


def run_windows(results_json: Path) -> list[RunWindow]:
    """Each run of a bench_e2e.py results.json; a run ends where the next begins (the last:
    its client duration plus a minute)."""
    try:
        runs = json.loads(results_json.read_text())["runs"]
        starts = [(str(r["label"]), str(r.get("config", "")), float(r["wall_start_unix"]),
                   float(r["client"]["duration"])) for r in runs]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReportInputError(f"{results_json}: not a bench_e2e.py results file ({e})") from e
    return [RunWindow(name, config, t0,
                      starts[i + 1][2] if i + 1 < len(starts) else t0 + dur + 60.0)
            for i, (name, config, t0, dur) in enumerate(starts)]


def one_token_spans_ms(seg: list[Record]) -> dict[str, float]:
    """Mean host ms per one-token extend of each span timed inside its run_batch."""
    runs = one_token_runs(seg)
    names = sorted({k for r in runs for k in r.spans})
    return {k: 1e3 * statistics.fmean(r.spans.get(k, 0.0) for r in runs) for k in names}


def decode_edge_ms(seg: list[Record], graph_max_bs: int) -> dict[str, float | int | None]:
    """Median wall ms and count of the decode iterations just below the largest CUDA graph
    (batch in (N / EDGE, N]) and just above it (in (N, EDGE * N])."""
    walls: dict[str, list[float]] = {"graphed": [], "eager": []}
    for it in timed_iterations(seg):
        if it.run is None or it.run.mode != Mode.DECODE:
            continue
        b = it.run.size
        if graph_max_bs / EDGE < b <= graph_max_bs:
            walls["graphed"].append(1e3 * it.wall_s)
        elif graph_max_bs < b <= EDGE * graph_max_bs:
            walls["eager"].append(1e3 * it.wall_s)
    out: dict[str, float | int | None] = {}
    for side, w in walls.items():
        out[f"{side}_edge_n"] = len(w)
        out[f"{side}_edge_median_ms"] = median(w)
    return out


def eager_points(seg: list[Record], graph_max_bs: int) -> list[tuple[int, float]]:
    """(batch, wall ms) of each decode iteration above ``graph_max_bs`` (eager)."""
    return [(it.run.size, 1e3 * it.wall_s) for it in timed_iterations(seg)
            if it.run is not None and it.run.mode == Mode.DECODE
            and it.run.size > graph_max_bs]


def host_line(points: Sequence[tuple[int, float]],
              graph_max_bs: int) -> dict[str, float | int | None]:
    """The host iteration around an eager decode step as a line in its batch:
    ``eager_host_base_ms`` + ``eager_host_per_req_us`` x batch (the simulator's
    eager_decode_host_s and eager_decode_host_per_req_s), through the mean walls of
    ``points`` (eager_points) in ``eager_host_bands`` bands; None where fewer than two bands
    hold HOST_BAND_MIN iterations."""
    width = max(1, graph_max_bs // HOST_BANDS)
    bands: dict[int, list[tuple[int, float]]] = {}
    for b, ms in points:
        bands.setdefault((b - graph_max_bs - 1) // width, []).append((b, ms))
    pts = [(float(np.mean([b for b, _ in v])), float(np.mean([w for _, w in v])), len(v))
           for v in bands.values() if len(v) >= HOST_BAND_MIN]
    out: dict[str, float | int | None] = {"eager_host_bands": len(pts),
                                          "eager_host_base_ms": None,
                                          "eager_host_per_req_us": None}
    if len(pts) < 2 or len({b for b, _, _ in pts}) < 2:
        return out
    x, y, n = (np.array(v) for v in zip(*pts, strict=True))
    slope, base = np.polyfit(x, y, 1, w=np.sqrt(n))
    out["eager_host_base_ms"] = float(base)
    out["eager_host_per_req_us"] = float(1e3 * slope)
    return out


def eager_host_line(seg: list[Record], graph_max_bs: int) -> dict[str, float | int | None]:
    """``host_line`` of one segment's eager decode iterations."""
    return host_line(eager_points(seg, graph_max_bs), graph_max_bs)


def segment_rows(records: list[Record], label: str, gap_s: float = 0.3, min_s: float = 5.0,
                 t_ref: float | None = None, file: str = "", part: int = 0,
                 windows: list[RunWindow] | None = None,
                 graph_max_bs: int | None = None) -> list[dict]:
    """One row per busy segment of at least ``min_s`` seconds, numbered from 0 among those,
    or, given ``windows`` (the runs of a results file), one per window that holds records,
    named by it.

    ``start_s`` counts from ``t_ref`` (default: the first record). Numbers without data
    (no decode iterations, no one-token extends) are None. ``graph_max_bs``: add
    ``decode_edge_ms``'s numbers.
    """
    if not records:
        return []
    ref = records[0].t0 if t_ref is None else t_ref
    if windows is None:
        named = list(enumerate(segments(records, gap_s)))
    else:
        named = [(w.name, w.records(records)) for w in windows]
    rows: list[dict] = []
    for name, seg in named:
        if not seg:
            continue
        s = summarize(seg)
        if s.duration_s < min_s:
            continue
        one = one_token_ms(seg)
        ext = s.modes.get(Mode.EXTEND)
        dec = s.modes.get(Mode.DECODE)
        rows.append({
            "label": label,
            "file": file,
            "part": part,
            "segment": len(rows) if windows is None else name,
            "start_s": s.start - ref,
            "duration_s": s.duration_s,
            "prefills": s.requests,
            "queue_median_ms": median(s.queue_ms),
            "queue_mean_ms": mean(s.queue_ms),
            "step_median_ms": median(s.step_ms),
            "step_mean_ms": mean(s.step_ms),
            "extend_iterations": ext.iterations if ext is not None else 0,
            "one_token_n": len(one),
            "one_token_p10_ms": percentile(one, 10),
            "one_token_median_ms": median(one),
            "one_token_mean_ms": mean(one),
            "decode_iterations": dec.iterations if dec is not None else 0,
            "decode_wall_ms": _mode_ms(dec, "wall"),
            "decode_wait_ms": _mode_ms(dec, "wait"),
            "decode_run_ms": _mode_ms(dec, "run"),
            "one_token_spans_ms": one_token_spans_ms(seg),
            **(decode_edge_ms(seg, graph_max_bs) | eager_host_line(seg, graph_max_bs)
               if graph_max_bs else {}),
        })
    return rows


def client_requests(tar: tarfile.TarFile, name: str, config: str,
                    run: str) -> list[tuple[float, float]] | None:
    """(send, first token) seconds after the run's start of each of its requests that streamed
    a token, as the bench client wrote them into a result folder's logs.tar.gz (``tar``, read
    as ``name``: logs/requests__CONFIG__RUN.jsonl.gz); None when it holds no such file."""
    member = f"logs/requests__{config}__{run}.jsonl.gz"
    try:
        f = tar.extractfile(member)
        data = f.read() if f is not None else None
    except (OSError, KeyError, tarfile.TarError):
        return None
    if data is None:
        return None
    out: list[tuple[float, float]] = []
    where = f"{name}:{member.removeprefix('logs/')}"
    for lineno, line in enumerate(gzip.decompress(data).decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            first = rec.get("first_token_s")
            if first is not None and first > 0:
                out.append((float(rec["send_s"]), float(first)))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ReportInputError(f"{where}:{lineno}: bad request record: {e}") from e
    return sorted(out)


# a request whose way in (pre) or first token's way out (post) took longer than this met a
# pause of the tokenizer manager: its full garbage collection (0.39-0.53 s on the H200, SGLang's
# GC warning), not a cost every request pays. The tokenization of a long prompt holds the
# requests behind it 0.10-0.16 s, which stays in.
PAUSE_MIN_S = 0.2


def _pause_windows(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The merged (start, end) of the ``spans`` longer than PAUSE_MIN_S."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(x for x in spans if x[1] - x[0] > PAUSE_MIN_S):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def ttft_split(times: dict[str, RequestTimes], sends: list[tuple[float, float]],
               poll_s: float | None = None) -> dict:
    """Where each client request's TTFT went. ``sends``: (send, first token) on the
    scheduler's wall clock. Each is joined with the first request the scheduler received at
    or after its send that no earlier send took (time order: two requests sent within a
    millisecond may swap, which moves no mean). pre: send -> received (HTTP, the tokenizer
    manager, the wait for the loop's next poll); queue: received -> launched; step: launched
    -> first token streamed; post: streamed -> the client's first token (detokenizer, HTTP).
    pauses: the tokenizer manager's GC pauses (a pre or post over PAUSE_MIN_S), their count and
    longest ms. With ``poll_s``, the run's mean wait for the loop's poll (``poll_wait_s``): also
    first_token_ms, the mean of pre less that wait, plus post, over the requests whose way in
    and out no pause overlaps (first_token_all_ms: over all). A simulator whose scheduler
    forms each batch from the requests that arrived before it (so waits for the poll itself)
    and models the pauses apart adds this latency to every TTFT (first_token_latency_s)."""
    got = sorted(times.values(), key=lambda t: t.received)
    received = [t.received for t in got]
    joined: list[tuple[float, float, RequestTimes]] = []
    j = 0
    for send, first in sorted(sends):
        j = bisect.bisect_left(received, send, lo=j)
        if j >= len(got):
            break
        joined.append((send, first, got[j]))
        j += 1
    ways = [((send, t.received), (t.streamed, first)) for send, first, t in joined]
    # a burst's requests queue for seconds at the tokenizer manager: no pause to tell apart
    windows = _pause_windows([w for pair in ways for w in pair]) if poll_s is not None else []
    parts: dict[str, list[float]] = {k: [] for k in ("ttft", "pre", "queue", "step", "post")}
    calm: dict[str, list[float]] = {"pre": [], "post": []}
    for (send, first, t), pair in zip(joined, ways, strict=True):
        for k, v in (("ttft", first - send), ("pre", t.received - send),
                     ("queue", t.launched - t.received), ("step", t.streamed - t.launched),
                     ("post", first - t.streamed)):
            parts[k].append(1e3 * v)
        if not any(a < w1 and w0 < b for a, b in pair for w0, w1 in windows):
            calm["pre"].append(1e3 * (t.received - send))
            calm["post"].append(1e3 * (first - t.streamed))
    row: dict = {"client_n": len(sends), "joined_n": len(parts["ttft"])}
    for k, v in parts.items():
        row[f"{k}_median_ms"] = median(v)
        row[f"{k}_mean_ms"] = mean(v)
    row["pauses"] = len(windows)
    row["pause_max_ms"] = max((1e3 * (b - a) for a, b in windows), default=None)
    row["calm_n"] = len(calm["pre"])
    row["poll_wait_ms"] = None if poll_s is None else 1e3 * poll_s

    def latency(pre: float | None, post: float | None) -> float | None:
        return None if poll_s is None or pre is None or post is None else pre - 1e3 * poll_s + post

    row["first_token_all_ms"] = latency(row["pre_mean_ms"], row["post_mean_ms"])
    row["first_token_ms"] = latency(mean(calm["pre"]), mean(calm["post"]))
    return row


def ttft_split_rows(label: str, folder: Path,
                    runs: list[tuple[RunWindow, list[Record]]]) -> list[dict]:
    """ttft_split of each run (its window and the scheduler records inside it) of a
    bench_e2e.py result folder whose client records its logs.tar.gz holds; only a ladder run
    gets a poll wait, and with it a first_token_ms."""
    archive = folder / "logs.tar.gz"
    try:
        tar = tarfile.open(archive)
    except (OSError, tarfile.TarError):
        return []
    rows: list[dict] = []
    with tar:
        for w, seg in runs:
            sends = client_requests(tar, str(archive), w.config, w.name)
            if not sends:
                continue
            joined = ttft_split(request_times(seg),
                                [(w.start + s, w.start + f) for s, f in sends],
                                # a burst's requests all arrive at once: no random moment
                                poll_wait_s(seg) if w.ladder else None)
            rows.append({"label": label, "run": w.name, "config": w.config or label, **joined})
    return rows


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def compare_rows(rows: list[dict]) -> list[dict]:
    """Every other label's one-token extend host times minus the first label's, per
    (file position, kept segment number); pairs missing on either side are left out."""
    if not rows:
        return []
    base_label = rows[0]["label"]
    base = {(r["part"], r["segment"]): r for r in rows if r["label"] == base_label}
    out: list[dict] = []
    for r in rows:
        if r["label"] == base_label:
            continue
        b = base.get((r["part"], r["segment"]))
        if b is None:
            continue
        out.append({
            "label": r["label"],
            "base": base_label,
            "part": r["part"],
            "segment": r["segment"],
            "one_token_n": r["one_token_n"],
            "base_one_token_n": b["one_token_n"],
            "d_one_token_median_ms": _diff(r["one_token_median_ms"], b["one_token_median_ms"]),
            "d_one_token_mean_ms": _diff(r["one_token_mean_ms"], b["one_token_mean_ms"]),
        })
    return out


class Report(NamedTuple):
    rows: list[dict]                      # segment_rows of every file
    splits: list[dict]                    # ttft_split_rows of every result folder's runs
    launches: dict[str, list[float]]      # ladder one-prompt launches (ms) by configuration
    eager: dict[str, list[tuple[int, float]]]  # eager_points by configuration (or label)
    turnarounds: dict[str, list[float]]   # ladder turnaround_ms by configuration


def report_rows(runs: list[tuple[str, str]], gap_s: float, min_s: float,
                graph_max_bs: int | None = None) -> Report:
    """segment_rows for every LABEL=PATH, each file apart, start times from the label's
    first record; the TTFT split of each run of the bench_e2e.py result folders; their
    ladder runs' one-prompt extend launches (ms) pooled by server configuration; and, given
    ``graph_max_bs``, the eager decode iterations of every file pooled by configuration (a
    result folder's) or label."""
    rows: list[dict] = []
    splits: list[dict] = []
    launches: dict[str, list[float]] = {}
    eager: dict[str, list[tuple[int, float]]] = {}
    turnarounds: dict[str, list[float]] = {}
    for label, path in runs:
        results = Path(path) / "results.json"
        windows = run_windows(results) if results.is_file() else None
        files = label_files(Path(path) / "loop" if windows is not None else path)
        traces = []
        for f in files:
            try:
                traces.append(read_loop_trace(f))
            except (OSError, ValueError) as e:
                raise ReportInputError(str(e)) from e
        starts = [t[0].t0 for t in traces if t]
        t_ref = min(starts) if starts else None
        for part, (f, recs) in enumerate(zip(files, traces, strict=True)):
            rows += segment_rows(recs, label, gap_s, min_s, t_ref=t_ref, file=str(f), part=part,
                                 windows=windows, graph_max_bs=graph_max_bs)
        if windows is not None:
            merged = sorted((r for t in traces for r in t), key=lambda r: r.t0)
            runs_in = [(w, w.records(merged)) for w in windows]
            splits += ttft_split_rows(label, Path(path), runs_in)
            for w, seg in runs_in:
                if w.ladder:
                    launches.setdefault(w.config or label, []).extend(one_prompt_ms(seg))
                    turnarounds.setdefault(w.config or label, []).extend(turnaround_ms(seg))
                if graph_max_bs:
                    eager.setdefault(w.config or label, []).extend(
                        eager_points(seg, graph_max_bs))
        elif graph_max_bs:
            for recs in traces:
                eager.setdefault(label, []).extend(eager_points(recs, graph_max_bs))
    return Report(rows, splits, launches, eager, turnarounds)


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _pair(a: float | None, b: float | None, spec: str) -> str:
    return f"{_f(a, spec)}/{_f(b, spec)}"


def _names(rows: list[dict]) -> dict[tuple[str, int], str]:
    """Printed label of each (label, part): LABEL, or LABEL:loop-PID when it has several."""
    parts: dict[str, set[int]] = {}
    for r in rows:
        parts.setdefault(r["label"], set()).add(r["part"])
    return {(r["label"], r["part"]):
            r["label"] if len(parts[r["label"]]) == 1 else f"{r['label']}:{Path(r['file']).stem}"
            for r in rows}


def _seg_width(rows: list[dict]) -> int:
    return max([3] + [len(str(r["segment"])) for r in rows])


def _label_columns(rows: list[dict]) -> tuple[dict[tuple[str, int], str], int, int]:
    """The printed names of ``rows``' labels, and the widths of the label and segment
    columns."""
    names = _names(rows)
    return names, max([5] + [len(n) for n in names.values()]), _seg_width(rows)


def _spans(spans: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in spans.items()) or "-"


def format_segments(rows: list[dict]) -> list[str]:
    names, w, sw = _label_columns(rows)
    head = (f"{'label':{w}} {'seg':>{sw}} {'start s':>7} {'dur s':>6} {'pref':>5} "
            f"{'queue ms':>15} {'step ms':>15} {'ext it':>6} {'1tok n':>6} "
            f"{'1tok run ms p10/med/mean':>24} {'dec it':>6} {'wall':>6} {'wait':>6} "
            f"{'run':>6}  1tok spans ms")
    lines = [head, "-" * len(head)]
    for r in rows:
        one = (f"{_f(r['one_token_p10_ms'], '.2f')}/{_f(r['one_token_median_ms'], '.2f')}/"
               f"{_f(r['one_token_mean_ms'], '.2f')}")
        lines.append(
            f"{names[(r['label'], r['part'])]:{w}} {r['segment']!s:>{sw}} {r['start_s']:7.1f} "
            f"{r['duration_s']:6.1f} {r['prefills']:5d} "
            f"{_pair(r['queue_median_ms'], r['queue_mean_ms'], '.1f'):>15} "
            f"{_pair(r['step_median_ms'], r['step_mean_ms'], '.1f'):>15} "
            f"{r['extend_iterations']:6d} {r['one_token_n']:6d} {one:>24} "
            f"{r['decode_iterations']:6d} {_f(r['decode_wall_ms'], '.2f'):>6} "
            f"{_f(r['decode_wait_ms'], '.2f'):>6} {_f(r['decode_run_ms'], '.2f'):>6}  "
            f"{_spans(r['one_token_spans_ms'])}")
    lines.append(
        "seg: kept segment; start s: after the label's first record; pref: prefills finished; "
        "queue ms: received -> prefill launched, step ms: launched -> first token streamed "
        "(median/mean per request); ext it: extend iterations; 1tok: run_batch host ms of "
        f"extends with <= {ONE_TOKEN_MAX} new tokens; dec it: decode iterations; wall, wait, "
        "run: decode iteration mean ms (iteration start to the next, wait for the previous "
        "batch's tokens, run_batch); 1tok spans: mean host ms inside a one-token extend's "
        "run_batch of each timed method")
    return lines


def format_edges(rows: list[dict]) -> list[str]:
    names, w, sw = _label_columns(rows)
    head = (f"{'label':{w}} {'seg':>{sw}} {'graphed n':>9} {'median ms':>9} {'eager n':>7} "
            f"{'median ms':>9} {'eager - graphed':>15} {'bands':>5} {'host ms':>8} "
            f"{'us/req':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        g, e = r["graphed_edge_median_ms"], r["eager_edge_median_ms"]
        lines.append(
            f"{names[(r['label'], r['part'])]:{w}} {r['segment']!s:>{sw}} "
            f"{r['graphed_edge_n']:9d} {_f(g, '.2f'):>9} {r['eager_edge_n']:7d} "
            f"{_f(e, '.2f'):>9} {_f(None if g is None or e is None else e - g, '+.2f'):>15} "
            f"{r['eager_host_bands']:5d} {_f(r['eager_host_base_ms'], '.2f'):>8} "
            f"{_f(r['eager_host_per_req_us'], '.1f'):>7}")
    lines.append(
        f"decode iterations either side of the largest CUDA graph N: graphed, batch N/{EDGE:g} "
        f"to N; eager, N+1 to {EDGE:g} N (median wall: iteration start to the next); where "
        "the eager steps are host-bound, their median is eager_decode_host_s. host ms + "
        f"us/req x batch: a line through the mean walls of the eager iterations in bands "
        f"of N/{HOST_BANDS} requests (eager_decode_host_s and "
        "eager_decode_host_per_req_s)")
    return lines


def format_compare(rows: list[dict], seg_rows: list[dict]) -> list[str]:
    names, w, sw = _label_columns(seg_rows)
    head = (f"{'label':{w}} {'vs':{w}} {'seg':>{sw}} {'1tok n':>6} {'base n':>6} "
            f"{'d median ms':>11} {'d mean ms':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{names[(r['label'], r['part'])]:{w}} {names[(r['base'], r['part'])]:{w}} "
            f"{r['segment']!s:>{sw}} {r['one_token_n']:6d} {r['base_one_token_n']:6d} "
            f"{_f(r['d_one_token_median_ms'], '+.2f'):>11} "
            f"{_f(r['d_one_token_mean_ms'], '+.2f'):>9}")
    lines.append(
        "d median/mean ms: run_batch host ms of one-token extends, label minus vs, in the same "
        "segment (kept segment number, or run); '-' where a side has none")
    return lines


def launch_rows(launches: dict[str, list[float]], splits: Sequence[dict] = (),
                turnarounds: dict[str, list[float]] | None = None) -> list[dict]:
    """Per configuration: how many one-prompt extends its ladder runs launched, and their mean,
    median, 10th and 90th percentile host ms (the mean is eager_prefill_launch_s: the
    model's steps pay it on average); from ``splits`` (ttft_split_rows, which give only
    ladder runs a first_token_ms), that latency averaged over the joined requests that met no
    GC pause (first_token_latency_s); and the median of ``turnarounds`` (turnaround_ms of every
    extend, eager_prefill_turnaround_s)."""
    turnarounds = turnarounds or {}
    first: dict[str, tuple[float, int]] = {}
    for r in splits:
        if r["first_token_ms"] is not None:
            total, n = first.get(r["config"], (0.0, 0))
            first[r["config"]] = (total + r["first_token_ms"] * r["calm_n"],
                                  n + r["calm_n"])
    rows = []
    for cfg, v in launches.items():
        if not v:
            continue
        total, n = first.get(cfg, (0.0, 0))
        rows.append({"config": cfg, "n": len(v), "mean_ms": mean(v), "median_ms": median(v),
                     "p10_ms": percentile(v, 10), "p90_ms": percentile(v, 90),
                     "first_token_n": n, "first_token_ms": total / n if n else None,
                     "turnaround_n": len(turnarounds.get(cfg, [])),
                     "turnaround_ms": median(turnarounds.get(cfg, []))})
    return rows


def format_launches(rows: list[dict]) -> list[str]:
    w = max([6] + [len(r["config"]) for r in rows])
    head = (f"{'config':{w}} {'n':>6} {'mean ms':>8} {'p10/median/p90 ms':>20} "
            f"{'requests':>8} {'first-token ms':>14} {'turns':>6} {'turnaround ms':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = (f"{_f(r['p10_ms'], '.1f')}/{_f(r['median_ms'], '.1f')}/"
                  f"{_f(r['p90_ms'], '.1f')}")
        lines.append(f"{r['config']:{w}} {r['n']:6d} {_f(r['mean_ms'], '.2f'):>8} {spread:>20} "
                     f"{r['first_token_n']:8d} {_f(r['first_token_ms'], '.2f'):>14} "
                     f"{r['turnaround_n']:6d} {_f(r['turnaround_ms'], '.2f'):>13}")
    lines.append(
        "one-prompt extends (run_batch of a prefill of one prompt, any length) in the ladder "
        "runs of every result folder given, pooled by server configuration; the mean is "
        "the simulator's eager_prefill_launch_s. first-token: the ladder "
        "runs' pre less the poll wait, plus post, over their joined requests "
        "(first_token_latency_s). turnaround: median host ms from an extend's launches to "
        "the next step's launch, over every extend followed by one "
        "(eager_prefill_turnaround_s)")
    return lines


def host_line_rows(eager: dict[str, list[tuple[int, float]]], graph_max_bs: int) -> list[dict]:
    """Per configuration: its eager decode iterations and their host_line."""
    return [{"config": cfg, "n": len(v), **host_line(v, graph_max_bs)}
            for cfg, v in eager.items() if v]


def format_host_lines(rows: list[dict], graph_max_bs: int) -> list[str]:
    w = max([6] + [len(r["config"]) for r in rows])
    head = f"{'config':{w}} {'eager n':>7} {'bands':>5} {'host ms':>8} {'us/req':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:{w}} {r['n']:7d} {r['eager_host_bands']:5d} "
                     f"{_f(r['eager_host_base_ms'], '.2f'):>8} "
                     f"{_f(r['eager_host_per_req_us'], '.1f'):>7}")
    lines.append(
        f"decode iterations above the largest CUDA graph ({graph_max_bs}) of every run given, "
        "pooled by server configuration: host ms + us/req x batch through their mean walls "
        f"in bands of {graph_max_bs // HOST_BANDS} requests, the simulator's "
        "eager_decode_host_s and eager_decode_host_per_req_s")
    return lines


def _pauses(r: dict) -> str:
    return f"{r['pauses']}/{_f(r['pause_max_ms'], '.0f')}" if r["pauses"] else "-"


def format_splits(rows: list[dict]) -> list[str]:
    w = max([5] + [len(r["label"]) for r in rows])
    rw = max([3] + [len(r["run"]) for r in rows])
    head = (f"{'label':{w}} {'run':{rw}} {'joined':>9} {'client TTFT ms':>15} {'pre ms':>11} "
            f"{'queue ms':>9} {'step ms':>11} {'post ms':>9} {'poll ms':>7} {'pauses':>10} "
            f"{'first-token ms':>14} {'(all)':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['label']:{w}} {r['run']:{rw}} {str(r['joined_n']) + '/' + str(r['client_n']):>9} "
            f"{_pair(r['ttft_median_ms'], r['ttft_mean_ms'], '.1f'):>15} "
            f"{_pair(r['pre_median_ms'], r['pre_mean_ms'], '.1f'):>11} "
            f"{_pair(r['queue_median_ms'], r['queue_mean_ms'], '.1f'):>9} "
            f"{_pair(r['step_median_ms'], r['step_mean_ms'], '.1f'):>11} "
            f"{_pair(r['post_median_ms'], r['post_mean_ms'], '.1f'):>9} "
            f"{_f(r['poll_wait_ms'], '.1f'):>7} "
            f"{_pauses(r):>10} "
            f"{_f(r['first_token_ms'], '.2f'):>14} {_f(r['first_token_all_ms'], '.2f'):>6}")
    lines.append(
        "median/mean per request of the client's requests joined with the scheduler's receipts "
        "in time order (joined/streamed); pre: client send -> scheduler received (HTTP, "
        "tokenizer manager, the wait for the loop's next poll); queue: -> prefill launched; "
        "step: -> first token streamed; post: -> the client's first token (detokenizer, HTTP); "
        "poll: the mean wait of a request that reaches the scheduler at a random moment for "
        "the loop's next poll (the iterations' sum of squares over twice their sum); "
        f"pauses: the tokenizer manager's GC pauses (a pre or post over {PAUSE_MIN_S:g} s), "
        "count/longest ms; first-token: mean pre less poll, plus mean post, over the requests "
        "no pause met (all: over every request)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=label_path, metavar="LABEL=PATH",
                    help="a name for the run and its loop-*.jsonl[.gz] file or folder")
    ap.add_argument("--gap-s", type=float, default=0.3,
                    help="idle seconds that end a busy segment (default: %(default)s)")
    ap.add_argument("--min-s", type=float, default=5.0,
                    help="leave out segments shorter than this, s (default: %(default)s)")
    ap.add_argument("--graph-max-bs", type=int, default=None, metavar="N",
                    help="the servers' cuda_graph_max_bs: also time the decode iterations "
                         "either side of it (the eager ones' median is the simulator's "
                         "eager_decode_host_s); default: not timed")
    ap.add_argument("--json", type=Path, metavar="OUT",
                    help="also write every number here as JSON")
    a = ap.parse_args(argv)
    labels = [label for label, _ in a.runs]
    if a.graph_max_bs is not None and a.graph_max_bs < 1:
        ap.error(f"--graph-max-bs {a.graph_max_bs}: want the servers' cuda_graph_max_bs, an "
                 "integer >= 1")
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        ap.error(f"label given more than once: {', '.join(dup)}")
    try:
        rows, splits, launches, eager, turns = report_rows(a.runs, a.gap_s, a.min_s,
                                                           a.graph_max_bs)
    except ReportInputError as e:
        print(f"loop_trace_report: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_segments(rows)))
    if a.graph_max_bs:
        print("\n" + "\n".join(format_edges(rows)))
    comparison = compare_rows(rows) if len(a.runs) >= 2 else []
    if len(a.runs) >= 2:
        print()
        print("\n".join(format_compare(comparison, rows)))
    if splits:
        print()
        print("\n".join(format_splits(splits)))
    pooled = launch_rows(launches, splits, turns)
    if pooled:
        print()
        print("\n".join(format_launches(pooled)))
    lines = host_line_rows(eager, a.graph_max_bs) if a.graph_max_bs else []
    if lines:
        print()
        print("\n".join(format_host_lines(lines, a.graph_max_bs)))
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"gap_s": a.gap_s, "min_s": a.min_s, "segments": rows,
                                      "comparison": comparison, "ttft_split": splits,
                                      "one_prompt_launches": pooled,
                                      "eager_host_lines": lines},
                                     indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
