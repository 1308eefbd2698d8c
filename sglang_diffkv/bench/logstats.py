"""Per-workload statistics from the server log.

The harness notes the log's byte size right before a workload starts and right when its window
ends, so each workload's lines are one byte slice of the file: no clock alignment between the
client and the log's 1-second timestamps is needed. The scheduler lines are parsed by
``sglang_diffkv.serving_io.sglang_log.parse_server_log`` (Decode/Prefill batch lines, pool size);
this module adds what that parser does not keep:

- SGLang 0.5.10's retraction warning ``KV cache pool is full. Retract requests. #retracted_reqs:
  N`` (not matched by the simulator's retraction pattern) and ``#queue-req`` of decode lines;
- DiffKV's step lines (``DiffKV decode: batch B, tokens high x% / low y% / pruned z%; pages in
  use U/T (...; a bf16 cache would need P), active requests A holding N tokens``);
- DiffKV's profile lines (``SGLANG_DIFFKV_PROFILE=1``, parsed by
  ``sglang_diffkv.serving_io.profile_lines.parse_profile_line``): memory-management (mm),
  policy and step ms per step for each forward mode, averaged over the slice weighted by each
  line's steps;
- any other DiffKV line with millisecond figures, read generically as ``<name> <number> ms`` /
  ``<name>_ms=<number>`` and averaged per name (so a reworded line still gives numbers);
- every other DiffKV line, kept raw (first and last few) so nothing new is lost.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.bench.admission import logged_disable_radix
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.profile_lines import (
    HOST_LINE_RE,
    PART_BUCKETS,
    parse_parts_line,
    parse_profile_line,
)
from sglang_diffkv.serving_io.sglang_log import parse_server_log

_PREFIX = re.compile(r"^\[[^\]]*\]\s*")
_RETRACTED = re.compile(r"#retracted_reqs: (\d+)")
_QUEUE = re.compile(r"Decode batch.*#queue-req: (\d+)")
_KV_ALLOC = re.compile(r"KV Cache is allocated.*")
_STEP = re.compile(
    r"DiffKV (prefill|decode): batch (\d+), tokens high ([\d.]+)% / low ([\d.]+)% / pruned "
    r"([\d.]+)%; pages in use (\d+)/(\d+)")
_BF16_PAGES = re.compile(r"a bf16 cache would need (\d+)")
_ACTIVE = re.compile(r"active requests (\d+) holding (\d+) tokens")
_MS_WORDS = re.compile(r"([A-Za-z][A-Za-z _/-]*?)\s*[:=]?\s*(\d+(?:\.\d+)?)\s*ms\b")
_MS_KEYVAL = re.compile(r"([A-Za-z][\w-]*?)_ms\s*[:=]\s*(\d+(?:\.\d+)?)")
_ERROR = re.compile(r"Traceback|Error|Exception|leak", re.IGNORECASE)
# harmless start-up noise of a stripped SGLang install (absent optional kernels and packages)
_HARMLESS = re.compile(r"Ignore import error|openai_harmony|OpenAIServingResponses|RLIMIT|FA3|"
                       r"yes/no token IDs|BaseImageProcessorFast|destroy_process_group")
RAW_KEEP = 10


def strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line.strip())


def read_slice(path: str | Path, start: int = 0, end: int | None = None) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(None if end is None else max(0, end - start))
    return data.decode(errors="replace")


def ms_figures(line: str) -> dict[str, float]:
    """``{name: ms}`` of every millisecond figure in a line, names lower-cased."""
    out: dict[str, float] = {}
    for m in _MS_KEYVAL.finditer(line):
        out[m.group(1).strip().lower().replace("_", " ")] = float(m.group(2))
    for m in _MS_WORDS.finditer(line):
        key = m.group(1).strip().lower().rstrip(" /-")
        if key and key not in out:
            out[key] = float(m.group(2))
    return out


def pick_ms(ms: dict[str, float], words: tuple[str, ...]) -> float | None:
    """The first figure whose name contains one of ``words`` (as a word or a prefix)."""
    for w in words:
        for key, v in ms.items():
            if re.search(rf"\b{re.escape(w)}", key):
                return v
    return None


def mm_ms_per_step(stats: dict[str, Any], mode: str = "decode") -> float | None:
    """DiffKV memory-management ms per step (of ``mode``) from the profile lines, else from
    generic millisecond figures, if any were logged."""
    prof = (stats.get("diffkv_profile") or {}).get(mode)
    if prof:
        return float(prof["mm_ms"])
    return pick_ms(stats.get("diffkv_ms") or {}, ("mm", "memory", "manage"))


_PROFILE_FIELDS = ("mm_ms", "step_ms", "alloc_ms", "reclaim_ms", "free_ms", "policy_ms")


def _profile_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode: steps covered and each per-step figure averaged with the lines' step counts
    as weights (a line reports its last log interval's mean)."""
    out: dict[str, dict[str, float]] = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        w = np.array([max(r["steps"], 1) for r in rs], dtype=float)
        d: dict[str, float] = {"lines": len(rs), "steps": int(sum(r["steps"] for r in rs))}
        for f in _PROFILE_FIELDS:
            d[f] = float(np.average([r[f] for r in rs], weights=w))
        timed = [i for i, r in enumerate(rs) if r.get("host_ms") is not None]
        if timed:  # lines written before the host field have none
            d["host_ms"] = float(np.average([rs[i]["host_ms"] for i in timed], weights=w[timed]))
        d["mm_pct"] = 100.0 * d["mm_ms"] / d["step_ms"] if d["step_ms"] > 0 else 0.0
        d["policy_pct"] = 100.0 * d["policy_ms"] / d["step_ms"] if d["step_ms"] > 0 else 0.0
        out[mode] = d
    return out


def _diffkv_stats(lines: list[str]) -> dict[str, Any]:
    host = np.zeros(2, dtype=np.int64)
    steps: list[tuple[float, ...]] = []
    ms_vals: dict[str, list[float]] = defaultdict(list)
    profile: list[dict[str, Any]] = []
    parts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    other: list[str] = []
    for ln in lines:
        if (prof := parse_profile_line(ln)) is not None:
            profile.append(prof)
            continue
        if (part := parse_parts_line(ln)) is not None:
            parts[part["mode"]].append(part)
            continue
        if h := HOST_LINE_RE.search(ln):
            host += [int(h.group(1)), int(h.group(2))]
            continue
        if m := _STEP.search(ln):
            bf = _BF16_PAGES.search(ln)
            act = _ACTIVE.search(ln)
            steps.append((float(m.group(1) == "decode"), int(m.group(2)), float(m.group(3)),
                          float(m.group(4)), float(m.group(5)), int(m.group(6)),
                          int(m.group(7)), float(bf.group(1)) if bf else np.nan,
                          float(act.group(2)) if act else np.nan))
            continue
        figs = ms_figures(ln)
        for k, v in figs.items():
            ms_vals[k].append(v)
        if not figs:
            other.append(ln)
    out: dict[str, Any] = {}
    if steps:
        a = np.array(steps, dtype=float)
        dec = a[a[:, 0] == 1.0]
        use = dec if dec.size else a
        used, total = use[:, 5], use[:, 6]
        out.update({
            "diffkv_step_lines": int(a.shape[0]),
            "diffkv_mean_high_pct": float(use[:, 2].mean()),
            "diffkv_mean_low_pct": float(use[:, 3].mean()),
            "diffkv_mean_pruned_pct": float(use[:, 4].mean()),
            "diffkv_peak_pages_used": int(a[:, 5].max()),
            "diffkv_pages_total": int(a[:, 6].max()),
            "diffkv_peak_page_usage": float((a[:, 5] / np.maximum(a[:, 6], 1)).max()),
            "diffkv_mean_page_usage": float((used / np.maximum(total, 1)).mean()),
            "diffkv_peak_active_tokens": (None if np.isnan(a[:, 8]).all()
                                          else int(np.nanmax(a[:, 8]))),
        })
        ratio = use[:, 7] / np.maximum(use[:, 5], 1)
        ok = ~np.isnan(ratio) & (use[:, 5] > 0)
        if ok.any():
            # what the same tokens would take in bf16 / what they take here
            out["diffkv_mean_compression_vs_bf16"] = float(ratio[ok].mean())
    if profile:
        out["diffkv_profile"] = _profile_summary(profile)
        out["diffkv_device_allocs"], out["diffkv_gen2_collections"] = map(int, host)
    if parts:
        # per mode, ms per step over the slice's steps (each line weighted by its steps)
        out["diffkv_parts"] = {
            mode: {f"{b}_ms": sum(x[f"{b}_ms"] * x["steps"] for x in xs)
                   / max(sum(x["steps"] for x in xs), 1) for b in (*PART_BUCKETS, "step")}
            for mode, xs in parts.items()}
    if ms_vals:
        out["diffkv_ms"] = {k: float(np.mean(v)) for k, v in ms_vals.items()}
        out["diffkv_ms_lines"] = max(len(v) for v in ms_vals.values())
    if other:
        out["diffkv_other_lines"] = len(other)
        out["diffkv_other_raw"] = (other if len(other) <= 2 * RAW_KEEP
                                   else other[:RAW_KEEP] + ["..."] + other[-RAW_KEEP:])
    return out


def slice_stats(path: str | Path, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """Statistics of the log bytes [start, end)."""
    text = read_slice(path, start, end)
    out: dict[str, Any] = {"log_bytes": [start, start + len(text.encode())]}
    fd, tmp = tempfile.mkstemp(suffix=".log")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            log = parse_server_log(tmp)
        except InputError:
            log = None
    finally:
        os.unlink(tmp)
    lines = [strip_prefix(ln) for ln in text.splitlines()]
    queues = [int(m.group(1)) for ln in lines if (m := _QUEUE.search(ln))]
    retracted = sum(int(m.group(1)) for ln in lines if (m := _RETRACTED.search(ln)))
    if log is not None and log.decode_running:
        run = np.array(log.decode_running, dtype=float)
        tok = np.array(log.decode_tokens, dtype=float)
        out.update({
            "decode_lines": int(run.size),
            "mean_running": float(run.mean()),
            "peak_running": int(run.max()),
            "mean_tokens_used": float(tok.mean()),
            "peak_tokens_used": int(tok.max()),
            "mean_token_usage": float(np.mean(log.decode_usage)),
            "peak_token_usage": float(np.max(log.decode_usage)),
            "mean_gen_throughput_log": (float(np.mean(log.decode_gen_throughput))
                                        if log.decode_gen_throughput else None),
        })
    else:
        out["decode_lines"] = 0
    if queues:
        out["peak_queue"] = max(queues)
    if log is not None:
        out["prefill_batches"] = len(log.prefill_new_tokens)
        out["prefill_new_tokens"] = int(sum(log.prefill_new_tokens))
        out["prefill_cached_tokens"] = int(sum(log.prefill_cached_tokens))
        out["prefix_hit_rate_log"] = log.prefix_hit_rate
    out["retractions"] = max(retracted, log.retractions if log is not None else 0)
    out.update(_diffkv_stats([ln for ln in lines if "diffkv" in ln.lower()]))
    errs = [ln for ln in lines if _ERROR.search(ln) and not _HARMLESS.search(ln)]
    out["error_lines"] = len(errs)
    if errs:
        out["first_error_lines"] = errs[:5]
    return out


def startup_info(path: str | Path, end: int | None = None) -> dict[str, Any]:
    """Pool size, max running requests, the resolved ``disable_radix_cache`` (None where the
    log has no ``server_args`` line), the KV allocation line and DiffKV's start-up report."""
    text = read_slice(path, 0, end)
    lines = [strip_prefix(ln) for ln in text.splitlines()]
    out: dict[str, Any] = {"max_total_num_tokens": None, "max_running_requests": None,
                           "disable_radix_cache": None}
    try:
        log = parse_server_log(path)
        out["max_total_num_tokens"] = log.max_total_num_tokens
        out["max_running_requests"] = log.max_running_requests
        out["disable_radix_cache"] = logged_disable_radix(log.server_args)
    except InputError:
        pass
    out["kv_alloc"] = next((m.group(0) for ln in lines if (m := _KV_ALLOC.search(ln))), None)
    seen: set[str] = set()
    report = []
    for ln in lines:
        if ("DiffKV KV cache" in ln or ln.startswith("diffkv:")) and ln not in seen:
            seen.add(ln)
            report.append(ln)
    out["diffkv_report"] = report
    return out
