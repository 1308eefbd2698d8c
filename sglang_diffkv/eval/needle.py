"""Needle in a haystack: a passkey sentence at a chosen depth of filler text, then a
question; pass when the greedy answer contains the passkey.

Built at the token level so that every depth of one length gives exactly the same number
of tokens (a batch without padding): filler tokens are cut to make room for the needle and
the question, and the needle is inserted at the sentence boundary nearest the depth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

NEEDLE = "The secret passkey is {key}. Remember it: the secret passkey is {key}."
QUESTION = "\n\nWhat is the secret passkey? The secret passkey is"


@dataclass(frozen=True)
class NeedleCase:
    length: int
    depth: float  # 0 = start of the haystack, 1 = just before the question
    key: str
    ids: torch.Tensor  # [length]


def _boundary(filler: list[int], pos: int, period_ids: set[int]) -> int:
    """Index just after the sentence end at or before ``pos`` (``pos`` if none close)."""
    for i in range(pos, max(pos - 200, 0), -1):
        if filler[i - 1] in period_ids:
            return i
    return pos


def build_cases(
    tokenizer, filler_ids: torch.Tensor, lengths: list[int], depths: list[float], seed: int = 0
) -> list[NeedleCase]:
    rng = random.Random(seed)
    q = tokenizer(QUESTION, add_special_tokens=False).input_ids
    period_ids = {i for t, i in tokenizer.get_vocab().items() if t.endswith(".")}
    cases = []
    for length in lengths:
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"depth={depth} must be in [0, 1]")
            key = str(rng.randint(10000, 99999))
            needle = tokenizer(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False)
            n_fill = length - len(needle.input_ids) - len(q)
            if n_fill < 1 or n_fill > filler_ids.shape[0]:
                raise ValueError(f"length {length} does not fit filler of {filler_ids.shape[0]}")
            filler = filler_ids[:n_fill].tolist()
            at = _boundary(filler, int(round(depth * n_fill)), period_ids) if depth > 0 else 0
            ids = filler[:at] + needle.input_ids + filler[at:] + q
            cases.append(NeedleCase(length, depth, key, torch.tensor(ids)))
    return cases


def passed(tokenizer, case: NeedleCase, answer_ids: torch.Tensor) -> bool:
    return case.key in tokenizer.decode(answer_ids.tolist())
