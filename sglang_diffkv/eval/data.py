"""Evaluation text: wikitext-2 (raw, test), GSM8K questions, and the bundled excerpts.

The full files live outside the repo (``../shared/data/eval`` next to the checkout, or
``$SGLANG_DIFFKV_DATA``); small excerpts ship in ``sglang_diffkv/eval/data`` for tests and
are used when the full files are absent. Wikitext joining rule: CRLF -> LF, the file's
non-empty lines joined with a single newline (state it when quoting perplexities).

Splits: token windows for calibration are drawn from the first ``CALIBRATION_SHARE`` of the
tokenised text, evaluation windows from the rest, so thresholds are never tuned on the
tokens they are judged on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

PACKAGE_DATA = Path(__file__).parent / "data"
WIKITEXT = "wikitext2_raw_test.txt"
GSM8K = "gsm8k_test.jsonl"
EXCERPT = {WIKITEXT: "wikitext2_excerpt.txt", GSM8K: "gsm8k_excerpt.jsonl"}
CALIBRATION_SHARE = 0.3
log = logging.getLogger(__name__)


class DataError(FileNotFoundError):
    """An evaluation file is missing or too short for the requested windows."""


def data_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("SGLANG_DIFFKV_DATA"):
        dirs.append(Path(os.environ["SGLANG_DIFFKV_DATA"]))
    repo = Path(__file__).resolve().parents[2]
    dirs.append(repo.parent / "shared" / "data" / "eval")
    return dirs


def find(name: str, data_dir: str | Path | None = None, allow_excerpt: bool = True) -> Path:
    """The full file if available, else the bundled excerpt (when allowed)."""
    dirs = [Path(data_dir)] if data_dir else data_dirs()
    for d in dirs:
        if (d / name).is_file():
            return d / name
    if allow_excerpt and (PACKAGE_DATA / EXCERPT[name]).is_file():
        log.warning("%s not found in %s: using the bundled excerpt (smoke-test size only)",
                    name, [str(d) for d in dirs])
        return PACKAGE_DATA / EXCERPT[name]
    raise DataError(f"{name} not found in {[str(d) for d in dirs]} (set SGLANG_DIFFKV_DATA)")


def wikitext(path: Path) -> str:
    text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    return "\n".join(line for line in text.split("\n") if line.strip())


def token_windows(
    ids: torch.Tensor, count: int, length: int, split: str = "eval"
) -> torch.Tensor:
    """``count`` non-overlapping windows of ``length`` tokens, evenly spread over the split
    ('calibration': the first CALIBRATION_SHARE of ``ids``; 'eval': the rest; 'all')."""
    n = ids.shape[0]
    cut = int(n * CALIBRATION_SHARE)
    lo, hi = {"calibration": (0, cut), "eval": (cut, n), "all": (0, n)}[split]
    span = hi - lo
    if count < 1 or count * length > span:
        raise DataError(
            f"the {split} split has {span} tokens: cannot take {count} windows of {length}"
        )
    step = (span - length) // max(count - 1, 1) if count > 1 else 0
    return torch.stack([ids[lo + i * step : lo + i * step + length] for i in range(count)])


def gsm8k_questions(path: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) < count:
        raise DataError(f"{path} has {len(rows)} questions, {count} requested")
    return [r["question"] for r in rows[:count]]
