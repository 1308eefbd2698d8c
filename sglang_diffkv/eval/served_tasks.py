"""Text prompts with known answers for the served-path harness (``diffkv-eval served``).

Each case is plain text (servers tokenise it themselves). ``build`` sizes it to ``chars``
characters, by default ``length`` tokens at CHARS_PER_TOKEN characters a token; that is only a
first guess (a numbered word list takes about twice the tokens of prose per character), so
``diffkv-eval served`` rescales every case until the server's own token count is just under
``length`` (sglang_diffkv.eval.served.size_cases). Tasks, after RULER's synthetic ones:

- ``needle``: one passkey sentence at a depth of the filler; the answer is the passkey.
- ``multikey``: several passkeys with different names; the question asks for one.
- ``vartrack``: a chain of assignments (VAR A = 41736, VAR B = VAR A, ...) spread through
  the filler; the answer is every variable holding the value.
- ``cwe``: common-word extraction: a list of words in which three occur most often; the
  answer is those three.
- ``continuation``: the filler alone; greedy continuations are compared between the servers.

A case passes when every expected string occurs in the answer (case-insensitive).
Everything is seeded: the same arguments give the same prompts.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # wikitext in Llama / Qwen / SmolLM2 tokenisers: ~4 characters a token
TASKS = ("needle", "multikey", "vartrack", "cwe", "continuation")
ANSWER_TOKENS = {"needle": 12, "multikey": 12, "vartrack": 30, "cwe": 24, "continuation": 32}
MULTIKEY_KEYS = 4
VARTRACK_HOPS = 4
CWE_WORDS = ("apple", "river", "candle", "forest", "marble", "violet", "engine", "harbor",
             "pepper", "silver", "window", "garden", "rocket", "ladder", "copper", "meadow")


@dataclass(frozen=True)
class TaskCase:
    task: str
    length: int  # target prompt length in tokens (what --lengths asked for)
    index: int
    depth: float
    prompt: str
    expected: tuple[str, ...]  # empty for continuation
    max_new_tokens: int
    tokens: int | None = None  # the server's token count of the prompt, once sized
    target: int | None = None  # the count sizing aimed under: length, or less near the context

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


def passed(case: TaskCase, answer: str) -> bool:
    low = answer.lower()
    return all(e.lower() in low for e in case.expected)


def _filler(text: str, chars: int) -> str:
    """``chars`` characters of ``text`` (repeated when short), cut at a sentence end if one
    lies in the last 2 %, else at a word end (so the length follows ``chars`` closely)."""
    if chars <= 0:
        return ""
    body = (text * (chars // max(len(text), 1) + 1))[:chars]
    cut = body.rfind(". ")
    if cut >= chars * 0.98:
        return body[:cut + 1]
    cut = body.rfind(" ")
    return body[:cut] if cut > chars // 2 else body


def _insert(filler: str, piece: str, depth: float) -> str:
    """``piece`` at the sentence boundary nearest ``depth`` of ``filler``."""
    at = int(depth * len(filler))
    dot = filler.rfind(". ", 0, at)
    at = 0 if depth == 0 or dot < 0 else dot + 2
    return filler[:at] + piece + " " + filler[at:]


def _key(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def build(task: str, length: int, index: int, depth: float, filler_text: str,
          seed: int = 0, chars: int | None = None) -> TaskCase:
    """One case of ``task`` of about ``chars`` characters (default ``length`` tokens at
    CHARS_PER_TOKEN), its needle(s) at ``depth``. The answer (passkeys, names, common words)
    and the continuation's start depend on (seed, task, length, index) only, so resizing a
    case keeps them."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is unknown; choose from {', '.join(TASKS)}")
    if not 0 <= depth <= 1:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    budget = length * CHARS_PER_TOKEN if chars is None else chars
    new = ANSWER_TOKENS[task]
    if task == "continuation":
        start = rng.randrange(len(filler_text))  # (not of the size: resizing keeps the start)
        return TaskCase(task, length, index, depth, _filler(filler_text[start:] + filler_text,
                                                            budget), (), new)
    if task == "needle":
        key = _key(rng)
        piece = f"The secret passkey is {key}. Remember it: the secret passkey is {key}."
        question = "\n\nWhat is the secret passkey? The secret passkey is"
        body = _insert(_filler(filler_text, budget - len(piece) - len(question)), piece, depth)
        return TaskCase(task, length, index, depth, body + question, (key,), new)
    if task == "multikey":
        names = [_name(rng) for _ in range(MULTIKEY_KEYS)]
        keys = [_key(rng) for _ in names]
        pieces = [f"The passkey for {n} is {k}." for n, k in zip(names, keys, strict=True)]
        asked = rng.randrange(len(names))
        question = f"\n\nWhat is the passkey for {names[asked]}? The passkey for {names[asked]} is"
        body = _filler(filler_text, budget - sum(len(p) + 1 for p in pieces) - len(question))
        spread = [depth] + [rng.random() for _ in pieces[1:]]
        order = list(range(len(pieces)))
        order.insert(0, order.pop(asked))  # the asked key goes at ``depth``
        for i, d in zip(order, spread, strict=True):
            body = _insert(body, pieces[i], d)
        return TaskCase(task, length, index, depth, body + question, (keys[asked],), new)
    if task == "vartrack":
        value = _key(rng)
        names = [_name(rng) for _ in range(VARTRACK_HOPS + 1)]
        pieces = [f"VAR {names[0]} = {value}."] + [
            f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
        question = (f"\n\nQuestion: find all variables that are assigned the value {value}. "
                    "Answer: the variables are")
        body = _filler(filler_text, budget - sum(len(p) + 1 for p in pieces) - len(question))
        # in order through the text, the first at ``depth``
        depths = [depth + (1 - depth) * i / (len(pieces)) for i in range(len(pieces))]
        for p, d in sorted(zip(pieces, depths, strict=True), key=lambda x: -x[1]):
            body = _insert(body, p, d)
        return TaskCase(task, length, index, depth, body + question, tuple(names), new)
    # cwe: three words fill half the list, the other 13 the rest (each ~4x rarer)
    words = rng.sample(CWE_WORDS, len(CWE_WORDS))
    common, rare = words[:3], words[3:]
    question = ("\n\nQuestion: what are the three most common words in the list above? "
                "Answer: the three most common words are")
    head = "Below is a numbered list of words. Memorise the ones that occur most often.\n"
    n = max((budget - len(head) - len(question)) // 12, 40)
    listed = [rng.choice(common) if rng.random() < 0.5 else rng.choice(rare) for _ in range(n)]
    lines = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
    return TaskCase(task, length, index, depth, head + lines + question, tuple(common), new)


def cases(tasks: list[str], lengths: list[int], per_length: int, filler_text: str,
          seed: int = 0) -> list[TaskCase]:
    """``per_length`` cases of each task at each length, depths spread evenly over [0, 1]."""
    out = []
    for task in tasks:
        for length in lengths:
            for i in range(per_length):
                depth = i / max(per_length - 1, 1)
                out.append(build(task, length, i, depth, filler_text, seed))
    return out
