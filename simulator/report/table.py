"""Plain-text tables that read well in a terminal."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt_num(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) < 10:
            return f"{v:.3g}"      # small values keep three significant digits
        return f"{v:.{digits}f}"
    return str(v)


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    cells = [[fmt_num(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    def line(vals: Sequence[str]) -> str:
        first = vals[0].ljust(widths[0])
        rest = (v.rjust(w) for v, w in zip(vals[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()
    out = [title] if title else []
    out += [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


COMPARE_COLUMNS = (
    ("format", lambda s: s["kv_format"]),
    ("KV pool tok", lambda s: s["kv_pool_tokens"]),
    ("out tok/s", lambda s: s["output_throughput"]),
    ("req/s", lambda s: s["request_throughput"]),
    ("mean batch", lambda s: s["mean_batch"]),
    ("peak batch", lambda s: s["peak_batch"]),
    ("TTFT p50 ms", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p99 ms", lambda s: s["ttft_ms"]["p99"]),
    ("TPOT p50 ms", lambda s: s["tpot_ms"]["p50"]),
    ("TPOT p99 ms", lambda s: s["tpot_ms"]["p99"]),
    ("KV use", lambda s: f"{s['mean_kv_usage']:.0%}"),
    ("retract", lambda s: s["retractions"]),
    ("rejected", lambda s: s["rejected"]),
)


def compare_table(summaries: Sequence[dict[str, Any]], title: str = "") -> str:
    """One row per KV format; "x first" is output throughput relative to the first row."""
    base = summaries[0]["output_throughput"] if summaries else 0.0
    headers = [h for h, _ in COMPARE_COLUMNS]
    headers.insert(3, f"x {summaries[0]['kv_format']}" if summaries else "x")
    rows = []
    for s in summaries:
        row = [get(s) for _, get in COMPARE_COLUMNS]
        row.insert(3, f"{s['output_throughput'] / base:.2f}" if base > 0 else "-")
        rows.append(row)
    return render(headers, rows, title)


def summary_table(s: dict[str, Any]) -> str:
    """One run in bench_serving's layout."""
    rows: list[list[Any]] = [
        ["KV format", s["kv_format"]],
        ["Requests (completed / rejected / total)",
         f"{s['completed']:,} / {s['rejected']:,} / {s['requests']:,}"],
        ["Duration (s)", s["duration_s"]],
        ["Request throughput (req/s)", s["request_throughput"]],
        ["Input token throughput (tok/s)", s["input_throughput"]],
        ["Output token throughput (tok/s)", s["output_throughput"]],
        ["Concurrency", s["concurrency"]],
        ["Mean / peak decode batch", f"{fmt_num(s['mean_batch'])} / {s['peak_batch']}"],
        ["Mean / peak KV usage", f"{s['mean_kv_usage']:.1%} / {s['peak_kv_usage']:.1%}"],
        ["KV pool (tokens)", s["kv_pool_tokens"]],
        ["Retractions", s["retractions"]],
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[name]
        label = name.split("_")[0].upper()
        rows.append([f"{label} mean / p50 / p90 / p99 (ms)",
                     " / ".join(fmt_num(st[k]) for k in ("mean", "p50", "p90", "p99"))])
    if "slo" in s:
        rows.append([f"SLO ({s['slo']})", f"attained by {s['slo_attainment']:.1%}"])
        rows.append(["Goodput (req/s)", s["goodput"]])
    return render(["metric", "value"], rows)


# Eager decode steps (batch above the largest CUDA graph) ran host-bound on some server starts:
# the same bf16 ShareGPT saturation run measured 7,228 / 6,425 / 7,257 output tok/s on three
# starts, all of the difference in those steps (docs/simulator-validation.md, session 13)
EAGER_SPREAD = 0.11
EAGER_NOTE_MIN_SHARE = 0.05


def eager_note(s: dict[str, Any]) -> str | None:
    """A caveat when much of the decode time is in steps no CUDA graph runs, else None."""
    share = s.get("eager_decode_share", 0.0)
    if share < EAGER_NOTE_MIN_SHARE:
        return None
    limit = s.get("cuda_graph_max_bs", 0)
    where = (f"above the largest CUDA graph (batch {limit})" if limit
             else "with CUDA graphs off")
    advice = (f"; --cuda-graph-max-bs {s['peak_batch']} covers the peak batch (its graphs "
              "take memory from the KV pool: rerun to see)" if limit else "")
    return (f"note ({s['kv_format']}): {share:.0%} of decode time is in steps {where}. "
            f"SGLang runs them eagerly, and their speed varied by up to {EAGER_SPREAD:.0%} of "
            f"throughput between server starts in validation{advice}.")


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=_json_default, allow_nan=True) + "\n")
    return p


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot serialise {type(o).__name__}")
