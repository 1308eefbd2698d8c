"""Write a Trace as Mooncake JSONL: the file that drives both diffkv-sim and
``python -m sglang.bench_serving --dataset-name mooncake --dataset-path F
--use-trace-timestamps``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import MOONCAKE_BLOCK_TOKENS, Trace


def mooncake_lines(trace: Trace) -> list[str]:
    if (trace.prefix_block_tokens != MOONCAKE_BLOCK_TOKENS
            and any(r.prefix_hash_ids for r in trace.requests)):
        raise InputError(
            f"trace {trace.name!r} has prefix ids of {trace.prefix_block_tokens}-token blocks; "
            f"Mooncake's hash_ids name {MOONCAKE_BLOCK_TOKENS}-token blocks")
    lines = []
    for r in trace.requests:
        obj: dict[str, object] = {
            "timestamp": round(r.arrival_s * 1000.0, 3),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.prefix_hash_ids),
        }
        if r.max_new_tokens is not None:
            obj["max_new_tokens"] = r.max_new_tokens
        if r.session_id is not None:
            obj["session_id"] = r.session_id
        lines.append(json.dumps(obj, separators=(", ", ": ")))
    return lines


def write_mooncake_jsonl(trace: Trace, path: str | Path) -> Path:
    """Writes ``path`` (gzip with mtime 0 when it ends in .gz, so output is reproducible)."""
    p = Path(path)
    data = ("\n".join(mooncake_lines(trace)) + "\n").encode()
    if p.suffix == ".gz":
        data = gzip.compress(data, compresslevel=9, mtime=0)
    p.write_bytes(data)
    return p
