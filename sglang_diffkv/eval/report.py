"""Results -> a markdown table and the Pareto picture (quality vs physical bytes/token)."""

from __future__ import annotations

import math
from pathlib import Path


def pareto_front(points: list[tuple[float, float, str]]) -> list[str]:
    """Names on the lower-left frontier of (bytes, kl): no other point has <= bytes and
    <= kl with one of them strictly smaller."""
    front = []
    for b, k, n in points:
        dominated = any(
            (b2 <= b and k2 <= k) and (b2 < b or k2 < k) for b2, k2, n2 in points if n2 != n
        )
        if not dominated:
            front.append(n)
    return front


def table(results: dict) -> str:
    """Markdown table of a ``diffkv-eval run`` result file."""
    tf = results.get("teacher_forcing", {})
    gr = results.get("greedy", {})
    nd = results.get("needles", {})
    names = list(dict.fromkeys(["bf16", *tf, *gr, *nd]))
    pts = [(v["summary"]["bytes_per_token"], v["summary"]["kl_mean"], n) for n, v in tf.items()]
    front = set(pareto_front(pts))
    head = (
        "| config | bytes/token | vs bf16 | high/low/pruned | KL mean | KL p99 | KL max | top-1 "
        "| ppl (Δ ± se) | greedy exact / first div. | needle pass | Pareto |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|---|---|---:|:-:|\n"
    )
    lines = []
    for n in names:
        s = tf.get(n, {}).get("summary")
        g = gr.get(n)
        ne = nd.get(n)
        if s:
            mem = f"{s['bytes_per_token']:.1f} | {100 * s['ratio_vs_bf16']:.1f}%"
            # fractions come from 1 - high - low: clamp the -0.00 of rounding
            mix = "/".join(f"{max(s[k], 0.0):.2f}" for k in ("high", "low", "pruned"))
            q = (f"{s['kl_mean']:.4f} | {s['kl_p99']:.3f} | {s['kl_max']:.2f} | {s['top1']:.3f} | "
                 f"{s['ppl']:.3f} ({s['ppl_delta']:+.3f} ± {s['ppl_delta_se']:.3f})")
        elif n == "bf16":
            mem, mix, q = "256.0 | 100.0%", "1.00/0.00/0.00", "0 | 0 | 0 | 1.000 | ref"
        else:
            b = (g or ne or {}).get("bytes_per_token", float("nan"))
            mem, mix, q = f"{b:.1f} | ", "", " | | | | "
        gtxt = (f"{g['exact_match']:.2f} / {g['first_divergence_mean']:.1f} of {g['new_tokens']}"
                if g else "")
        ntxt = f"{ne['pass_rate']:.2f}" if ne else ""
        lines.append(f"| {n} | {mem} | {mix} | {q} | {gtxt} | {ntxt} | "
                     f"{'yes' if n in front else ''} |")
    return head + "\n".join(lines) + "\n"


def plot(results: dict, path: Path, mark: list[str] | None = None) -> Path:
    """Mean KL (log) vs bytes/token: baselines labelled, DiffKV threshold-grid points (names
    with '@') as small dots, ``mark``ed configs starred, the eval-split frontier dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tf = results["teacher_forcing"]
    bf16 = next(iter(tf.values()))["summary"]["bf16_bytes_per_token"]
    fig, ax = plt.subplots(figsize=(9, 6))
    pts = [(v["summary"]["bytes_per_token"], max(v["summary"]["kl_mean"], 1e-5), n)
           for n, v in tf.items()]
    front = sorted((p for p in pts if p[2] in set(pareto_front(pts))), key=lambda p: p[0])
    ax.plot([p[0] for p in front], [p[1] for p in front], "--", c="tab:green", lw=1,
            label="Pareto frontier")
    grid = [p for p in pts if "@" in p[2]]
    ax.scatter([p[0] for p in grid], [p[1] for p in grid], s=14, c="tab:red", alpha=0.45,
               label="DiffKV (alpha_h, alpha_l) grid")
    for b, k, n in pts:
        if "@" in n and n not in (mark or []):
            continue
        diff = n.startswith("diffkv")
        starred = n in (mark or [])
        ax.scatter([b], [k], s=220 if starred else 45, marker="*" if starred else "o",
                   c="tab:red" if diff else ("tab:purple" if n.startswith("prune") else
                                             "tab:blue"),
                   edgecolors="k" if starred else "none", zorder=3)
        ax.annotate(n, (b, k), textcoords="offset points", xytext=(6, 3), fontsize=8)
    ax.axvline(bf16, c="0.5", lw=0.8)
    ax.annotate("bf16 (reference)", (bf16, 1e-4), rotation=90, fontsize=8, color="0.4",
                xytext=(-10, 0), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlim(0, bf16 + 10)
    ax.set_xlabel("physical KV bytes per token per KV head (page layout, metadata included)")
    ax.set_ylabel("teacher-forced KL(bf16 || config), mean nats/token")
    m = results.get("meta", {})
    ax.set_title(f"Quality vs memory: {m.get('model', '')}, {m.get('windows', '?')} windows x "
                 f"({m.get('prompt_len', '?')} prefilled + {m.get('score_tokens', '?')} scored)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fmt_bytes_ratio(b: float, bf16: int) -> str:
    return f"{b:.1f} B ({100 * b / bf16:.1f}% of bf16, {bf16 / b if b else math.inf:.2f}x smaller)"
