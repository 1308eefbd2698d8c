"""Session 37: a DiffKV server's forward steps in a torch-profiler trace, kernel time by kind.

Steps are ``scripts/profile_server_step.py``'s (``cut_steps``: at each sampling argmax; a step
that launches DiffKV's prefill store is a prefill step). Per kind of step (prefill, decode
after a decode, decode after a prefill): medians of the span, the GPU busy time, the kernel ms
of the GEMMs, DiffKV's decode attention (split-K and merge), its policy kernel and the rest,
and the captured batch (the attention kernel's grid).

    python docs/data/h200-2026-11-25/s37-prof/step_kernels.py \
        docs/data/h200-2026-11-25/s37-prof/prof/trace-t*/*.trace.json.gz
"""

from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))

from profile_server_step import busy_ms, cut_steps, is_prefill  # noqa: E402

PARTS = ("gemm", "attention", "policy", "other")


def part(name: str) -> str:
    if name.startswith("nvjet") or "cublasLt" in name:
        return "gemm"
    if "decode_split" in name or name == "_merge_kernel":
        return "attention"
    if name == "_policy_kernel":
        return "policy"
    return "other"


def steps(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = []
    for step, end in cut_steps([e for e in events if e.get("cat") == "kernel" and "dur" in e]):
        ms = collections.Counter()
        for k in step:
            ms[part(k["name"])] += float(k["dur"]) / 1e3
        grid = [k["args"]["grid"][0] for k in step if "decode_split" in k["name"]]
        out.append({"span": (end - float(step[0]["ts"])) / 1e3, "busy": busy_ms(step),
                    "prefill": is_prefill(step), "batch": grid[0] if grid else 0, **ms})
    for a, b in zip(out, out[1:], strict=False):
        b["after"] = "prefill" if a["prefill"] else "decode"
    return out[1:]   # the first step's predecessor was cut


def main() -> None:
    for path in map(Path, sys.argv[1:]):
        st = steps(path)
        print(path.parent.name)
        for kind, sel in (("prefill", lambda s: s["prefill"]),
                          ("decode after a decode",
                           lambda s: not s["prefill"] and s["after"] == "decode"),
                          ("decode after a prefill",
                           lambda s: not s["prefill"] and s["after"] == "prefill")):
            g = [s for s in st if sel(s)]
            if not g:
                continue

            def med(key: str, g: list[dict] = g) -> float:
                return statistics.median(s.get(key, 0.0) for s in g)

            print(f"  {kind}: n={len(g)} batch {med('batch'):.0f} span {med('span'):.2f} "
                  f"busy {med('busy'):.2f} " + " ".join(f"{p} {med(p):.2f}" for p in PARTS))


if __name__ == "__main__":
    main()
