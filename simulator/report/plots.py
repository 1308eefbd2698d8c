"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt():  # imported lazily: matplotlib costs ~0.5 s to import
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeseries(series: dict[str, dict[str, list[float]]], out_dir: str | Path,
                    title: str = "") -> Path:
    """Decode batch size and KV-pool usage over time, one line per KV format."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, ts in series.items():
        ax1.plot(ts["t"], ts["batch"], label=name, lw=1)
        ax2.plot(ts["t"], [100 * u for u in ts["kv_usage"]], label=name, lw=1)
    ax1.set_ylabel("running requests")
    ax2.set_ylabel("KV pool used (%)")
    ax2.set_xlabel("time (s)")
    ax1.legend()
    ax1.set_title(title or "batch size and KV usage over time")
    fig.tight_layout()
    path = _save(fig, out_dir, "timeseries.png")
    return path


def _save(fig: Any, out_dir: str | Path, name: str) -> Path:
    """Write ``fig`` as ``out_dir/name`` (the folder made if missing) and close it."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_sweep(rows: Sequence[dict[str, Any]], out_dir: str | Path, title: str = "") -> list[Path]:
    """Throughput and TTFT/TPOT p99 against request rate, one line per KV format."""
    plt = _plt()
    formats = sorted({r["format"] for r in rows}, key=[r["format"] for r in rows].index)
    out = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in formats:
        pts = [r for r in rows if r["format"] == f]
        ax.plot([r["rate"] for r in pts], [r["output_throughput"] for r in pts], "o-", label=f)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title or "throughput vs rate")
    ax.legend()
    fig.tight_layout()
    p = _save(fig, out_dir, "throughput_vs_rate.png")
    out.append(p)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for f in formats:
        pts = [r for r in rows if r["format"] == f]
        a1.plot([r["rate"] for r in pts], [r["ttft_p99_ms"] for r in pts], "o-", label=f)
        a2.plot([r["rate"] for r in pts], [r["tpot_p99_ms"] for r in pts], "o-", label=f)
    a1.set_yscale("log")
    a1.set_xlabel("request rate (req/s)")
    a1.set_ylabel("TTFT p99 (ms)")
    a2.set_xlabel("request rate (req/s)")
    a2.set_ylabel("TPOT p99 (ms)")
    a1.legend()
    fig.suptitle(title or "latency vs rate")
    fig.tight_layout()
    p = _save(fig, out_dir, "latency_vs_rate.png")
    out.append(p)
    return out


def plot_capacity(results: Sequence[dict[str, Any]], attainment: float, out_dir: str | Path,
                  title: str = "") -> Path:
    """The capacity search: each probe's SLO attainment against its rate (one marker per
    trace length), and each format's answer against the trace length (it levels off once
    the trace reaches steady state)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        line = None
        for n in sorted({p["requests"] for p in r["probes"]}):
            pts = sorted((p["rate"], p["attainment"]) for p in r["probes"] if p["requests"] == n)
            line, = a1.plot(*zip(*pts, strict=True), "o-", ms=3, lw=0.8,
                            color=None if line is None else line.get_color(),
                            label=f"{r['format']}" if line is None else None)
        lv = r["levels"]
        a2.plot([x["requests"] for x in lv], [x["max_rate"] for x in lv], "o-",
                color=None if line is None else line.get_color(), label=r["format"])
    a1.axhline(attainment, color="grey", ls="--", lw=0.8, label="SLO attainment")
    a1.set_xscale("log")
    a1.set_xlabel("request rate (req/s)")
    a1.set_ylabel("requests meeting the SLO")
    a1.legend(fontsize=8)
    a2.set_xscale("log")
    a2.set_xlabel("requests in the trace")
    a2.set_ylabel("max req/s per replica")
    a2.legend(fontsize=8)
    fig.suptitle(title or "capacity search")
    fig.tight_layout()
    p = _save(fig, out_dir, "capacity.png")
    return p


def plot_disagg(results: Sequence[dict[str, Any]], out_dir: str | Path,
                title: str = "") -> Path:
    """The disaggregation search (``diffkv-sim disagg``'s JSON results): per KV format, every
    (P, D) split replayed, as the longest trace that replayed it found it (a circle: met
    the SLO, a cross: missed it), the answer starred; then the GPUs of each format's answer
    beside the colocated one, labelled with the goodput per GPU."""
    plt = _plt()
    n = len(results)
    fig, axes = plt.subplots(1, n + 1, figsize=(3.3 * (n + 1), 3.6))
    most = max((p["prefill"] + p["decode"] for r in results for p in r["disagg"]["probes"]),
               default=2)
    for ax, r in zip(axes[:n], results, strict=True):
        d = r["disagg"]
        latest: dict[tuple[int, int], dict[str, Any]] = {}
        for p in sorted(d["probes"], key=lambda p: p["requests"]):
            latest[(p["prefill"], p["decode"])] = p
        pts = list(latest.values())
        longest = max((p["requests"] for p in pts), default=0)
        for met, marker in ((True, "o"), (False, "x")):
            sel = [p for p in pts if p["met"] == met]
            ax.scatter([p["prefill"] for p in sel], [p["decode"] for p in sel],
                       marker=marker, s=28, color="tab:green" if met else "tab:red",
                       label="meets SLO" if met else "misses")
        b = d["best"]
        if b is not None:
            ax.scatter([b["prefill"]], [b["decode"]], marker="*", s=220, color="gold",
                       edgecolor="black", zorder=3, label=f"answer {b['prefill']}:{b['decode']}")
        for total in range(2, most + 1):       # iso-GPU lines
            ax.plot([1, total - 1], [total - 1, 1], color="grey", lw=0.4, alpha=0.5)
        ax.set_xlim(0.5, most - 0.5)
        ax.set_ylim(0.5, most - 0.5)
        ax.set_xlabel("prefill replicas P")
        ax.set_ylabel("decode replicas D")
        ax.set_title(f"{r['format']} (traces up to {longest:,} requests)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    ax = axes[n]
    names = [r["format"] for r in results]
    x = list(range(n))
    dis = [r["disagg"]["gpus"] or 0 for r in results]
    col = [(r["colocated"] or {}).get("gpus") or 0 for r in results]
    ax.bar([i - 0.2 for i in x], dis, width=0.4, label="P/D")
    ax.bar([i + 0.2 for i in x], col, width=0.4, label="colocated")
    for i, r in enumerate(results):
        for off, part in ((-0.2, r["disagg"]), (0.2, r["colocated"])):
            g = (part or {}).get("goodput_per_gpu")
            if g:
                ax.text(i + off, ((part or {}).get("gpus") or 0) + 0.1, f"{g:.2f}",
                        ha="center", fontsize=7)
    ax.set_xticks(x, names)
    ax.set_ylabel("GPUs (label: goodput req/s per GPU)")
    ax.set_ylim(0, 1.25 * max(dis + col + [1]))
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(title or "P/D split search", fontsize=9)
    fig.tight_layout()
    return _save(fig, out_dir, "disagg.png")
