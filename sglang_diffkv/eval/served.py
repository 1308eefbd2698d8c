"""The served-path quality harness (``diffkv-eval served``): the same prompts, greedy, to a
reference server (stock bf16) and a candidate (fp8, a DiffKV preset, ...), both already
running; per task and prompt length, the pass rates with 95 % Wilson intervals, and for
continuations the agreement of the candidate's greedy tokens with the reference's and,
optionally, the KL of its next-token distributions against the reference's.

It speaks SGLang's native HTTP API with the standard library only, a few requests in flight
per server: ``POST /generate`` (``{"text", "sampling_params"}``, not streamed; the answer's
``text``, ``output_ids``, ``meta_info.prompt_tokens`` and, with ``return_logprob`` and
``top_logprobs_num``, ``meta_info.output_top_logprobs``), ``POST /tokenize`` (``{"prompt":
[texts]}`` -> ``{"count": [n]}``, SGLang 0.5.17) to size the prompts, and ``GET
/server_info`` (``context_length``, ``max_req_input_len``) for the context they must fit.

Prompt sizing (``size_cases``): every case is rebuilt at a rescaled character count until the
reference's own token count lies within ``tolerance`` under its target, the target being the
asked length or, when that does not fit, the most the served context allows with the answer's
tokens. The report shows the servers' token counts.

Errors: a prompt a server answers with an HTTP error (400 for a prompt over the context, say)
is recorded (one line naming the server, the case and the server's error text) and counted in
its row's error column, and the run goes on; a server that does not answer at all is a
``ServedError`` before the run (one line), or, once the run is under way, every remaining
prompt to it is an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_diffkv.eval.served_tasks import CHARS_PER_TOKEN, TaskCase, build, passed

log = logging.getLogger(__name__)

Z95 = 1.959963984540054  # the two-sided 95 % normal quantile
SIZE_TOLERANCE = 0.03  # a sized prompt lies within 3 % under its target
SIZE_ROUNDS = 12
TOKENIZE_BATCH = 8  # prompts per /tokenize request
# SGLang (tokenizer manager, scheduler): the prompt must stay under max_req_input_len
# (context - 6 when the pool is not smaller) and prompt + max_new_tokens within the context
INPUT_RESERVE = 6
# the prompt token count in SGLang's over-long-prompt errors (0.5.17 tokenizer_manager)
_COUNT_IN_ERROR = re.compile(r"The input \((\d+) tokens\)|(\d+) tokens from the input")


class ServedError(RuntimeError):
    """A server cannot be used at all (one line naming the server and the reason)."""


class RequestError(RuntimeError):
    """One request failed: ``status`` is the HTTP status, None when no answer came."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (n = 0: the whole [0, 1])."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error_text(e: urllib.error.HTTPError) -> str:
    """The server's own error message (SGLang: {"error": {"message": ...}}), one line."""
    try:
        raw = e.read().decode(errors="replace")
    except OSError:
        raw = ""
    msg = raw
    try:
        body = json.loads(raw)
        if isinstance(body, dict):
            err = body.get("error", body.get("detail", body.get("message")))
            if isinstance(err, dict):
                err = err.get("message", err)
            msg = err if isinstance(err, str) else json.dumps(err)
    except ValueError:
        pass
    return _one_line(f"HTTP {e.code}: {msg or e.reason}")


def _request(url: str, path: str, body: Any | None, timeout_s: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise RequestError(e.code, _error_text(e)) from None
    except (urllib.error.URLError, OSError) as e:
        raise RequestError(None, _one_line(getattr(e, "reason", None) or e)) from None
    try:
        return json.loads(raw)
    except ValueError:
        raise RequestError(200, f"not JSON: {_one_line(raw[:120])!r}") from None


def check_reachable(url: str, timeout_s: float = 10.0) -> None:
    """ServedError unless the server answers HTTP at all (GET /health)."""
    try:
        _request(url, "/health", None, timeout_s)
    except RequestError as e:
        if e.status is None:
            raise ServedError(f"{url}: not reachable: {e}") from None


def healthy(url: str, timeout_s: float = 10.0) -> str | None:
    """None when GET /health answers 200 within ``timeout_s``, else why not (one line)."""
    try:
        _request(url, "/health", None, timeout_s)
    except RequestError as e:
        return f"{url}: /health: {e}" if e.status is not None else f"{url}: not reachable: {e}"
    return None


def server_limits(url: str, timeout_s: float = 30.0) -> dict[str, int | None]:
    """SGLang's /server_info: the context length and the longest prompt it accepts
    (None where the server does not say)."""
    try:
        info = _request(url, "/server_info", None, timeout_s)
    except RequestError:
        return {"context_length": None, "max_req_input_len": None}
    info = info if isinstance(info, dict) else {}

    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    return {"context_length": whole(info.get("context_length")),
            "max_req_input_len": whole(info.get("max_req_input_len"))}


def token_cap(context_length: int | None, max_req_input_len: int | None,
              max_new_tokens: int) -> int | None:
    """The most prompt tokens a request of ``max_new_tokens`` may have (None: no limit
    known): under max_req_input_len and, with the answer, within the context."""
    caps = []
    if context_length is not None:
        caps.append(context_length - max_new_tokens)
        if max_req_input_len is None:
            max_req_input_len = context_length - INPUT_RESERVE
    if max_req_input_len is not None:
        caps.append(max_req_input_len - 1)
    return max(min(caps), 1) if caps else None


def _probe_count(url: str, prompt: str, timeout_s: float) -> int | None:
    """The prompt's token count from a one-token generation (or from the over-long-prompt
    error's text); None when the server gives neither."""
    try:
        out = _request(url, "/generate", {"text": prompt, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 1}}, timeout_s)
    except RequestError as e:
        if e.status is None:
            raise ServedError(f"{url}: sizing prompts: {e}") from None
        m = _COUNT_IN_ERROR.search(str(e))
        return int(m.group(1) or m.group(2)) if m else None
    out = out[0] if isinstance(out, list) and out else out
    n = ((out or {}).get("meta_info") or {}).get("prompt_tokens")
    return n if isinstance(n, int) else None


NOT_SENT = "not sent: "  # the error of a prompt not sent to a server found down
_NO_TOKENIZE: set[str] = set()  # servers whose /tokenize failed once (probed since)


def count_tokens(url: str, prompts: Sequence[str], timeout_s: float = 120.0,
                 inflight: int = 4) -> list[int | None]:
    """Each prompt's token count by the server's own tokenizer: SGLang's /tokenize (with
    special tokens, as /generate counts them), else a one-token /generate per prompt."""
    batches = [list(prompts[i:i + TOKENIZE_BATCH]) for i in range(0, len(prompts),
                                                                   TOKENIZE_BATCH)]

    def tokenize(batch: list[str]) -> list[int]:
        out = _request(url, "/tokenize", {"prompt": batch, "add_special_tokens": True},
                       timeout_s)
        counts = out.get("count") if isinstance(out, dict) else None
        if not (isinstance(counts, list) and len(counts) == len(batch)
                and all(isinstance(c, int) for c in counts)):
            raise RequestError(200, f"/tokenize answered {_one_line(str(out)[:120])!r}")
        return counts

    with ThreadPoolExecutor(max_workers=max(inflight, 1)) as pool:
        if url not in _NO_TOKENIZE:
            try:
                return [n for counts in pool.map(tokenize, batches) for n in counts]
            except RequestError as e:
                if e.status is None:
                    raise ServedError(f"{url}: sizing prompts: {e}") from None
                log.info("%s: /tokenize unusable (%s): counting with one-token generations",
                         url, e)
                _NO_TOKENIZE.add(url)
        return list(pool.map(lambda p: _probe_count(url, p, timeout_s), prompts))


def size_cases(cases: Sequence[TaskCase], filler: str, seed: int,
               counter: Callable[[list[str]], list[int | None]],
               cap: Callable[[TaskCase], int | None] = lambda c: None,
               tolerance: float = SIZE_TOLERANCE, rounds: int = SIZE_ROUNDS
               ) -> list[TaskCase]:
    """Every case rebuilt (same task, key, depth, answer) so that ``counter`` (the server's
    token count) puts it within ``tolerance`` under its target: ``length``, or ``cap(case)``
    when smaller. Each round rescales the characters of the cases still outside the band by
    target / count; a case that does not converge keeps its largest version under the
    target (its first one if none was). The cases carry ``tokens`` and ``target``."""
    targets = [c.length if cap(c) is None else min(c.length, cap(c)) for c in cases]
    chars = [c.length * CHARS_PER_TOKEN for c in cases]
    # the bracket found so far: most characters whose prompt fits, fewest whose does not
    # (a prompt's token count is not exactly proportional to its characters, so a
    # proportional step can jump over the band; it then bisects the bracket)
    fits: list[int] = [0] * len(cases)
    over: list[int | None] = [None] * len(cases)
    cur = list(cases)
    counts = counter([c.prompt for c in cur])
    best: list[tuple[TaskCase, int] | None] = [None] * len(cases)
    todo = list(range(len(cases)))
    for r in range(rounds + 1):
        again = []
        for i in todo:
            n = counts[i]
            if n is not None and n <= targets[i]:
                fits[i] = max(fits[i], chars[i])
                if best[i] is None or n > best[i][1]:
                    best[i] = (cur[i], n)
                if n >= targets[i] * (1 - tolerance):
                    continue
            elif n is not None:
                over[i] = chars[i] if over[i] is None else min(over[i], chars[i])
            if r == rounds:
                continue
            goal = targets[i] * (1 - tolerance / 2)
            new = max(int(chars[i] * (goal / n if n else 0.5)), 1)
            hi = over[i]
            if hi is not None and not fits[i] < new < hi:
                new = (fits[i] + hi) // 2
            if new == chars[i]:
                continue  # (the case cannot change size any more)
            chars[i] = new
            c = cases[i]
            cur[i] = build(c.task, c.length, c.index, c.depth, filler, seed, chars=new)
            again.append(i)
        if not again:
            break
        for i, n in zip(again, counter([cur[i].prompt for i in again]), strict=True):
            counts[i] = n
        todo = again
    out = []
    for i, c in enumerate(cases):
        got, n = best[i] if best[i] is not None else (cur[i], counts[i])
        if best[i] is None:
            log.warning("%s: no size found under %d tokens (last: %s)", c.key, targets[i], n)
        out.append(dataclasses.replace(got, tokens=n, target=targets[i]))
    return out


@dataclass(frozen=True)
class Answer:
    text: str
    output_ids: tuple[int, ...] | None
    prompt_tokens: int | None
    error: str | None = None  # the server's error (one line), or why nothing was asked
    # per output position, token id -> logprob of the server's top-k (when asked for)
    top_logprobs: tuple[dict[int, float] | None, ...] | None = None



def _top_logprobs(meta: dict[str, Any]) -> tuple[dict[int, float] | None, ...] | None:
    """SGLang's ``output_top_logprobs``: per position a list of [logprob, token id, text]."""
    rows = meta.get("output_top_logprobs")
    if not isinstance(rows, list):
        return None
    out: list[dict[int, float] | None] = []
    for row in rows:
        if not isinstance(row, list):
            out.append(None)
            continue
        out.append({int(e[1]): float(e[0]) for e in row
                    if isinstance(e, (list, tuple)) and len(e) >= 2 and e[0] is not None})
    return tuple(out)


def generate(url: str, case: TaskCase, timeout_s: float, top_k: int = 0) -> Answer:
    """One greedy answer; an HTTP error is the Answer's ``error``; no answer at all raises
    RequestError (status None)."""
    body: dict[str, Any] = {"text": case.prompt, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": case.max_new_tokens}}
    if top_k > 0:
        body.update(return_logprob=True, top_logprobs_num=top_k)
    try:
        out = _request(url, "/generate", body, timeout_s)
    except RequestError as e:
        if e.status is None:
            raise
        return Answer("", None, None, error=str(e))
    if isinstance(out, list) and out:  # SGLang answers a batch with a list
        out = out[0]
    if not isinstance(out, dict) or not isinstance(out.get("text"), str):
        return Answer("", None, None,
                      error=f"no 'text' in the answer {_one_line(str(out)[:120])!r}")
    ids = out.get("output_ids")
    meta = out.get("meta_info") or {}
    n = meta.get("prompt_tokens")
    return Answer(out["text"], tuple(ids) if isinstance(ids, list) else None,
                  n if isinstance(n, int) else None,
                  top_logprobs=_top_logprobs(meta) if top_k > 0 else None)


def ask_all(url: str, cases: Sequence[TaskCase], inflight: int, timeout_s: float,
            top_k: Callable[[TaskCase], int] = lambda c: 0,
            on_error: Callable[[TaskCase, str], None] = lambda c, e: None) -> list[Answer]:
    """Every case, ``inflight`` at a time. A request with no answer (refused, reset, timed
    out) is an error row; if the server then does not answer /health with 200 within 10 s
    either, it is down (or hung) and every prompt not yet sent is an error row too, without
    being sent."""
    down: list[str] = []
    lock = threading.Lock()

    def one(c: TaskCase) -> Answer:
        if down:
            a = Answer("", None, None, error=f"{NOT_SENT}{down[0]}")
            on_error(c, a.error)
            return a
        try:
            a = generate(url, c, timeout_s, top_k(c))
        except RequestError as e:
            a = Answer("", None, None, error=f"no answer: {e}")
            why = healthy(url, 10.0)
            if why is not None:
                with lock:
                    if not down:
                        down.append(f"{why} (after {c.key})")
        if a.error is not None:
            on_error(c, a.error)
        return a

    with ThreadPoolExecutor(max_workers=max(inflight, 1)) as pool:
        return list(pool.map(one, cases))


def first_divergence(a: tuple | str, b: tuple | str) -> int:
    """Index of the first differing element (the shorter length when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def kl_topk(ref: dict[int, float], cand: dict[int, float]) -> float:
    """KL(reference || candidate) in nats from two top-k logprob lists, coarse-grained: each
    token in both lists is its own outcome, every other token is pooled into one "rest"
    outcome whose probability is 1 minus the listed ones' (for each server). Both sides are
    exact probabilities of the same partition of the vocabulary, so this is the KL of the
    coarse-grained distributions: never above the full-vocabulary KL (log-sum inequality),
    equal to it when the lists cover the vocabulary."""
    both = ref.keys() & cand.keys()
    kl = 0.0
    p_in = q_in = 0.0
    for t in both:
        lp, lq = ref[t], cand[t]
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_in += p
        q_in += math.exp(lq)
    p_rest, q_rest = max(1.0 - p_in, 0.0), max(1.0 - q_in, 0.0)
    if p_rest > 1e-12:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-30)))
    return max(kl, 0.0)


def kl_positions(ref: Answer, cand: Answer, tokens: int) -> list[tuple[int, float]]:
    """(position, KL) over the first ``tokens`` output positions while both servers' greedy
    tokens before it agree (after a divergence the two distributions condition on different
    text). Position 0 is the prefill's next token, later ones are decode steps."""
    if ref.top_logprobs is None or cand.top_logprobs is None:
        return []
    a, b = ref.output_ids or (), cand.output_ids or ()
    out = []
    n = min(tokens, len(ref.top_logprobs), len(cand.top_logprobs))
    for t in range(n):
        if t > 0 and (t > min(len(a), len(b)) or a[:t] != b[:t]):
            break
        p, q = ref.top_logprobs[t], cand.top_logprobs[t]
        if p is None or q is None:
            break
        out.append((t, kl_topk(p, q)))
    return out


def kl_summary(pairs: Sequence[tuple[Answer, Answer]], tokens: int, top_k: int
               ) -> dict[str, Any] | None:
    """Mean KL of the decode positions (1..tokens-1) per prompt, its mean over prompts and
    the standard error over prompts; the prefill position (0) apart."""
    per_prompt, prefill, positions = [], [], 0
    for r, c in pairs:
        kls = kl_positions(r, c, tokens)
        if kls and kls[0][0] == 0:
            prefill.append(kls[0][1])
        dec = [k for t, k in kls if t > 0]
        if dec:
            per_prompt.append(sum(dec) / len(dec))
            positions += len(dec)
    if not per_prompt and not prefill:
        return None

    def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
        if not xs:
            return None, None
        m = sum(xs) / len(xs)
        if len(xs) < 2:
            return m, None
        var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
        return m, math.sqrt(var / len(xs))

    dm, dse = mean_se(per_prompt)
    pm, pse = mean_se(prefill)
    return {"decode": {"mean": dm, "se": dse, "prompts": len(per_prompt),
                       "positions": positions},
            "prefill": {"mean": pm, "se": pse, "prompts": len(prefill)},
            "tokens": tokens, "top_k": top_k}


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson(k, n)
    return {"passed": k, "n": n, "rate": k / n if n else None, "ci95": [lo, hi]}


def compare(cases: Sequence[TaskCase], ref: Sequence[Answer], cand: Sequence[Answer],
            kl_tokens: int = 0, top_k: int = 0) -> dict[str, Any]:
    """Per task and length: pass rates of both servers over the cases both answered (tasks
    with answers), or greedy agreement (continuation: exact match of the whole continuation
    with its interval, mean first divergence in tokens, or characters when a server gives no
    output_ids, and the KL when asked for); the errors of each server."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.task, c.length), []).append(i)
    rows = []
    for (task, length), idx in groups.items():
        ok = [i for i in idx if ref[i].error is None and cand[i].error is None]
        tokens = [x.prompt_tokens for i in ok for x in (ref[i], cand[i])
                  if x.prompt_tokens is not None]
        if not tokens:  # (no answer: what sizing counted)
            tokens = [cases[i].tokens for i in idx if cases[i].tokens is not None]
        row: dict[str, Any] = {
            "task": task, "length": length, "cases": len(idx),
            "prompt_tokens": sum(tokens) / len(tokens) if tokens else None,
            "prompt_tokens_range": [min(tokens), max(tokens)] if tokens else None,
            "errors": {"reference": sum(ref[i].error is not None for i in idx),
                       "candidate": sum(cand[i].error is not None for i in idx)}}
        if task == "continuation":
            seqs = [(ref[i].output_ids, cand[i].output_ids)
                    if ref[i].output_ids is not None and cand[i].output_ids is not None
                    else (ref[i].text, cand[i].text) for i in ok]
            same = sum(a == b for a, b in seqs)
            row["exact"] = _rate(same, len(ok))
            row["first_divergence_mean"] = (sum(first_divergence(a, b) for a, b in seqs)
                                            / len(ok) if ok else None)
            row["unit"] = "tokens" if all(isinstance(a, tuple) for a, _ in seqs) else "chars"
            if kl_tokens > 0:
                row["kl"] = kl_summary([(ref[i], cand[i]) for i in ok], kl_tokens, top_k)
        else:
            row["reference"] = _rate(sum(passed(cases[i], ref[i].text) for i in ok), len(ok))
            row["candidate"] = _rate(sum(passed(cases[i], cand[i].text) for i in ok), len(ok))
        rows.append(row)
    result: dict[str, Any] = {"rows": rows}
    if kl_tokens > 0:
        pairs = [(ref[i], cand[i]) for i, c in enumerate(cases) if c.task == "continuation"
                 and ref[i].error is None and cand[i].error is None]
        result["kl"] = kl_summary(pairs, kl_tokens, top_k)
    return result


def offline_kl(path: str | Path, names: Sequence[str]) -> dict[str, Any] | None:
    """The offline harness's mean KL(bf16 || config) for the first of ``names`` a results
    file holds: ``diffkv-eval run --out`` (teacher_forcing.<name>.summary), ``diffkv-eval
    calibrate --results`` (grid rows) or a preset's provenance file (its eval-split metrics,
    else the calibration metrics; the file is about one preset, so no name is needed)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        return None

    def found(name: str, row: dict[str, Any], where: str) -> dict[str, Any]:
        return {"file": str(path), "config": name, "kl_mean": row.get("kl_mean"),
                "tokens": row.get("tokens"), "where": where}

    tf = data.get("teacher_forcing")
    if isinstance(tf, dict):
        for n in names:
            summary = (tf.get(n) or {}).get("summary")
            if isinstance(summary, dict):
                return found(n, summary, "diffkv-eval run, teacher-forced eval windows")
    grid = data.get("grid")
    if isinstance(grid, list):
        by_name = {r.get("name"): r for r in grid if isinstance(r, dict)}
        for n in names:
            if n in by_name:
                return found(n, by_name[n], "diffkv-eval calibrate, calibration windows")
    for key, where in (("eval_split_metrics", "preset provenance, eval split"),
                       ("chosen_metrics", "preset provenance, calibration split"),
                       ("calibration_metrics", "preset provenance, calibration split")):
        row = data.get(key)
        if isinstance(row, dict) and "kl_mean" in row:
            return found(str(row.get("name", key)), row, where)
    return None


def offline_names(label: str) -> list[str]:
    """Config names the offline harness may give the candidate's config (its run names a
    DiffKV config 'diffkv-<preset or file stem>')."""
    stem = Path(label).name.removesuffix(".json") if label else ""
    return [n for n in dict.fromkeys([label, stem, f"diffkv-{stem}"]) if n]


def table(result: dict[str, Any]) -> str:
    """Markdown: one line per task and length."""
    lines = ["| task | length | prompt tokens | reference | candidate | errors (ref / cand) |",
             "|---|---|---|---|---|---|"]

    def fmt(r: dict[str, Any]) -> str:
        if not r["n"]:
            return "–"
        lo, hi = r["ci95"]
        return f"{r['passed']}/{r['n']} [{lo:.2f}, {hi:.2f}]"

    for row in result["rows"]:
        tokens = ""
        if row["prompt_tokens"] is not None:
            lo, hi = row["prompt_tokens_range"]
            tokens = f"{row['prompt_tokens']:.0f}" + (f" ({lo}–{hi})" if lo != hi else "")
        err = row["errors"]
        errors = f"{err['reference']} / {err['candidate']}" if any(err.values()) else ""
        if row["task"] == "continuation":
            if row["exact"]["n"]:
                cand = (f"exact {fmt(row['exact'])}, first divergence "
                        f"{row['first_divergence_mean']:.1f} {row['unit']}")
                kl = (row.get("kl") or {}).get("decode") or {}
                if kl.get("mean") is not None:
                    cand += f", KL {kl['mean']:.4f}"
            else:
                cand = "no case answered by both"
            lines.append(f"| continuation | {row['length']} | {tokens} | (reference) | {cand} "
                         f"| {errors} |")
        else:
            lines.append(f"| {row['task']} | {row['length']} | {tokens} | "
                         f"{fmt(row['reference'])} | {fmt(row['candidate'])} | {errors} |")
    if result.get("kl") is not None or "kl_tokens" in result:
        lines += ["", kl_text(result)]
    return "\n".join(lines)


def kl_text(result: dict[str, Any]) -> str:
    """The KL paragraph under the table (served, and the offline harness's when given)."""
    kl = result.get("kl")
    if kl is None:
        text = ("KL: no continuation answered by both servers with top logprobs "
                "(does the server return meta_info.output_top_logprobs?).")
    else:
        d, p = kl["decode"], kl["prefill"]

        def val(x: dict[str, Any]) -> str:
            if x["mean"] is None:
                return "n/a"
            se = "" if x["se"] is None else f" ± {x['se']:.4f}"
            return f"{x['mean']:.4f}{se}"

        text = (f"KL(reference ‖ candidate), nats/token, over the first {kl['tokens']} "
                f"generated tokens of the continuation prompts while the greedy tokens agree, "
                f"from each server's top-{kl['top_k']} logprobs (tokens in both lists apart, "
                "the rest pooled into one outcome per server: a lower bound of the "
                f"full-vocabulary KL): decode steps {val(d)} (mean over {d['prompts']} "
                f"prompts ± s.e., {d['positions']} positions); the prefill's token "
                f"{val(p)} ({p['prompts']} prompts).")
    off = result.get("offline")
    if off is not None:
        if off.get("kl_mean") is None:
            text += f" Offline harness: {off['note']}."
        else:
            text += (f" Offline harness ({off['where']}, {off['file']}: {off['config']}, "
                     f"{off.get('tokens') or '?'} scored tokens, its own fp32 reference): "
                     f"{off['kl_mean']:.4f}.")
    return text


def run(reference: str, candidate: str, cases: Sequence[TaskCase], inflight: int = 4,
        timeout_s: float = 600.0, kl_tokens: int = 0, top_k: int = 20,
        on_error: Callable[[str, TaskCase, str], None] = lambda who, c, e: None
        ) -> dict[str, Any]:
    """Every case on both servers (one after the other, so they do not share a GPU's time
    when they run on one machine); the comparison, the answers and the errors."""
    t0 = time.perf_counter()
    if not any(c.task == "continuation" for c in cases):
        kl_tokens = 0
    k = top_k if kl_tokens > 0 else 0

    def top(c: TaskCase) -> int:
        return k if c.task == "continuation" else 0

    answers = {}
    for who, url in (("reference", reference), ("candidate", candidate)):
        answers[who] = ask_all(url, cases, inflight, timeout_s, top,
                               lambda c, e, who=who: on_error(who, c, e))
    ref, cand = answers["reference"], answers["candidate"]
    result = compare(cases, ref, cand, kl_tokens, k)
    if kl_tokens > 0:
        result["kl_tokens"] = kl_tokens
    result["answers"] = [{"case": c.key, "depth": c.depth, "expected": list(c.expected),
                          "target_tokens": c.target, "sized_tokens": c.tokens,
                          "reference": r.text, "candidate": a.text,
                          "reference_error": r.error, "candidate_error": a.error}
                         for c, r, a in zip(cases, ref, cand, strict=True)]
    result["errors"] = [{"server": who, "case": c.key, "tokens": c.tokens, "error": a.error}
                        for who, ans in (("reference", ref), ("candidate", cand))
                        for c, a in zip(cases, ans, strict=True) if a.error is not None]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
