"""The served-path quality harness (``diffkv-eval served``): the same prompts, greedy, to a
reference server (stock bf16) and a candidate (fp8, a DiffKV preset, ...), both already
running; per task and prompt length, the pass rates with 95 % Wilson intervals, and for
continuations the agreement of the candidate's greedy tokens with the reference's.

It speaks SGLang's native ``POST /generate`` (``{"text", "sampling_params"}``, not streamed;
the answer's ``text``, ``output_ids`` and ``meta_info.prompt_tokens``), with the standard
library only, a few requests in flight per server.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sglang_diffkv.eval.served_tasks import TaskCase, passed

Z95 = 1.959963984540054  # the two-sided 95 % normal quantile


class ServedError(RuntimeError):
    """A server did not answer a prompt (one line naming the server and the reason)."""


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (n = 0: the whole [0, 1])."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Answer:
    text: str
    output_ids: tuple[int, ...] | None
    prompt_tokens: int | None


def generate(url: str, case: TaskCase, timeout_s: float) -> Answer:
    body = json.dumps({"text": case.prompt, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": case.max_new_tokens}}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            out = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServedError(f"{url}: {case.key}: {e}") from None
    if isinstance(out, list):  # SGLang answers a batch with a list
        out = out[0]
    if not isinstance(out, dict) or not isinstance(out.get("text"), str):
        raise ServedError(f"{url}: {case.key}: no 'text' in the answer {str(out)[:120]!r}")
    ids = out.get("output_ids")
    meta = out.get("meta_info") or {}
    return Answer(out["text"], tuple(ids) if isinstance(ids, list) else None,
                  meta.get("prompt_tokens"))


def ask_all(url: str, cases: list[TaskCase], inflight: int, timeout_s: float
            ) -> list[Answer]:
    with ThreadPoolExecutor(max_workers=inflight) as pool:
        return list(pool.map(lambda c: generate(url, c, timeout_s), cases))


def first_divergence(a: tuple | str, b: tuple | str) -> int:
    """Index of the first differing element (the shorter length when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson(k, n)
    return {"passed": k, "n": n, "rate": k / n if n else None, "ci95": [lo, hi]}


def compare(cases: list[TaskCase], ref: list[Answer], cand: list[Answer]) -> dict[str, Any]:
    """Per task and length: pass rates of both servers (tasks with answers), or greedy
    agreement (continuation: exact match of the whole continuation with its interval, mean
    first divergence in tokens, or characters when a server gives no output_ids)."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.task, c.length), []).append(i)
    rows = []
    for (task, length), idx in groups.items():
        tokens = [x.prompt_tokens for i in idx for x in (ref[i], cand[i])
                  if x.prompt_tokens is not None]
        row: dict[str, Any] = {"task": task, "length": length,
                               "prompt_tokens": sum(tokens) / len(tokens) if tokens else None}
        if task == "continuation":
            seqs = [(ref[i].output_ids, cand[i].output_ids)
                    if ref[i].output_ids is not None and cand[i].output_ids is not None
                    else (ref[i].text, cand[i].text) for i in idx]
            same = sum(a == b for a, b in seqs)
            row["exact"] = _rate(same, len(idx))
            row["first_divergence_mean"] = sum(first_divergence(a, b) for a, b in seqs) / len(idx)
            row["unit"] = "tokens" if all(isinstance(a, tuple) for a, _ in seqs) else "chars"
        else:
            row["reference"] = _rate(sum(passed(cases[i], ref[i].text) for i in idx), len(idx))
            row["candidate"] = _rate(sum(passed(cases[i], cand[i].text) for i in idx), len(idx))
        rows.append(row)
    return {"rows": rows}


def table(result: dict[str, Any]) -> str:
    """Markdown: one line per task and length."""
    lines = ["| task | length | prompt tokens | reference | candidate |", "|---|---|---|---|---|"]

    def fmt(r: dict[str, Any]) -> str:
        lo, hi = r["ci95"]
        return f"{r['passed']}/{r['n']} [{lo:.2f}, {hi:.2f}]"

    for row in result["rows"]:
        tokens = "" if row["prompt_tokens"] is None else f"{row['prompt_tokens']:.0f}"
        if row["task"] == "continuation":
            cand = (f"exact {fmt(row['exact'])}, first divergence "
                    f"{row['first_divergence_mean']:.1f} {row['unit']}")
            lines.append(f"| continuation | {row['length']} | {tokens} | (reference) | {cand} |")
        else:
            lines.append(f"| {row['task']} | {row['length']} | {tokens} | "
                         f"{fmt(row['reference'])} | {fmt(row['candidate'])} |")
    return "\n".join(lines)


def run(reference: str, candidate: str, cases: list[TaskCase], inflight: int = 4,
        timeout_s: float = 600.0) -> dict[str, Any]:
    """Every case on both servers (one after the other, so they do not share a GPU's time
    when they run on one machine); the comparison and the answers."""
    t0 = time.perf_counter()
    ref = ask_all(reference, cases, inflight, timeout_s)
    cand = ask_all(candidate, cases, inflight, timeout_s)
    result = compare(cases, ref, cand)
    result["answers"] = [{"case": c.key, "depth": c.depth, "expected": list(c.expected),
                          "reference": r.text, "candidate": a.text}
                         for c, r, a in zip(cases, ref, cand, strict=True)]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
