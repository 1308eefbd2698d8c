"""Regenerate the bundled traces in ``traces/`` from the full traces in a data folder:
``python -m simulator.workload.bundle [DATA_DIR]`` (default ``../shared/data/traces``).

Real traces are cut, not altered: the first 10 minutes of each Azure file (header + rows with
timestamp < first + 600 s) and the first N lines of each Mooncake file. Synthetic traces come
from the fitted length models with fixed seeds. Files are gzip level 9 with mtime 0, so the
output is byte-reproducible.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

from sglang_diffkv.serving_io.loaders import _azure_day_seconds, _azure_time
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl
from simulator.workload.generate import synthetic_trace
from simulator.workload.lengths import length_model

OUT = Path(__file__).resolve().parents[2] / "traces"


def _gz(path: Path, text: str) -> None:
    path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))


def _azure_window(src: Path, dest: Path, seconds: float) -> int:
    lines = [x for x in gzip.decompress(src.read_bytes()).decode().split("\n") if x]
    header, rows = lines[0], lines[1:]
    ref = _azure_day_seconds(rows[0].split(",")[0])[0]
    t0 = _azure_time(rows[0].split(",")[0], ref)
    keep = [r for r in rows if _azure_time(r.split(",")[0], ref) - t0 < seconds]
    _gz(dest, "\n".join([header, *keep]) + "\n")
    return len(keep)


def _head_lines(src: Path, dest: Path, n: int) -> int:
    lines = [x for x in gzip.decompress(src.read_bytes()).decode().split("\n") if x][:n]
    _gz(dest, "\n".join(lines) + "\n")
    return len(lines)


def build(data: Path, out: Path = OUT) -> dict[str, int]:
    counts = {
        "azure2023_conv_10min.csv.gz": _azure_window(
            data / "azure2023_conv_full.csv.gz", out / "azure2023_conv_10min.csv.gz", 600.0),
        "azure2023_code_10min.csv.gz": _azure_window(
            data / "azure2023_code_first30min.csv.gz", out / "azure2023_code_10min.csv.gz",
            600.0),
        "mooncake_conversation_1k.jsonl.gz": _head_lines(
            data / "mooncake_conversation_trace.jsonl.gz",
            out / "mooncake_conversation_1k.jsonl.gz", 1000),
        "mooncake_synthetic_500.jsonl.gz": _head_lines(
            data / "mooncake_synthetic_trace.jsonl.gz", out / "mooncake_synthetic_500.jsonl.gz",
            500),
    }
    share = synthetic_trace(length_model("sharegpt"), 2000, 64.0, seed=2026)
    write_mooncake_jsonl(share, out / "sharegpt_shaped.jsonl.gz")
    longgen = synthetic_trace(length_model("long-generation"), 600, 8.0, seed=2027)
    write_mooncake_jsonl(longgen, out / "long_generation.jsonl.gz")
    counts["sharegpt_shaped.jsonl.gz"] = len(share)
    counts["long_generation.jsonl.gz"] = len(longgen)
    return counts


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    data = Path(args[0]) if args else OUT.parent / "../shared/data/traces"
    for name, n in build(data.resolve()).items():
        print(f"{name}: {n} requests, {(OUT / name).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
