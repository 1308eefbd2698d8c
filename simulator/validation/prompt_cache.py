"""The radix cache a harness run really started with, rebuilt for its replay.

The harness client (``sglang_diffkv.bench.client.prompt_ids``) sends request ``index`` of a
trace the prompt drawn from a generator seeded by ``(seed, index)``, and the draw is
prefix-stable: a prompt's first k ids do not depend on its length. Runs on one server reuse
indices (a ladder replays the ShareGPT trace's lengths in order; the long-generation run starts
at index 0 too), so SGLang's radix cache serves a request the prefix it shares with an earlier
request of the same index, left cached by an earlier run or an earlier request of this one:
about half the prompt tokens of the 15 and 23 req/s bf16 ladders, and all of a ladder that
follows a burst of its own trace. Requests of different indices share nothing (random ids).

So block ``k`` of request ``index`` is named by ``(seed, index, k)``, and a run's replay gets:

  * ``with_prompt_ids``: its trace with those prefix ids, in blocks of ``PROMPT_BLOCK_TOKENS``
    (SGLang matches single tokens; the model rounds a match down to whole blocks);
  * ``served_blocks``: what the earlier runs on the same server start left in the cache, one
    entry per request that got a first token (prompt blocks, then blocks for its outputs, which
    SGLang caches too and which take room), in the order their streams ended, from the client's
    request records. The scheduler caches them oldest first and evicts to fit its pool
    (``Scheduler.warm_cache``). The warm-up requests use another seed and are left out.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path

from sglang_diffkv.serving_io.trace import Trace
from simulator.errors import SimulatorInputError

PROMPT_BLOCK_TOKENS = 16


def prompt_block_ids(seed: int, index: int, input_len: int,
                     block: int = PROMPT_BLOCK_TOKENS) -> tuple[int, ...]:
    """Ids of the full ``block``-token blocks of request ``index``'s prompt."""
    return tuple(hash((seed, index, k)) for k in range(input_len // block))


def with_prompt_ids(trace: Trace, seed: int, block: int = PROMPT_BLOCK_TOKENS) -> Trace:
    """``trace`` (request i sent as index i) with its prompts' prefix ids."""
    return trace.with_prefix_ids(
        [prompt_block_ids(seed, i, r.input_tokens, block) for i, r in enumerate(trace.requests)],
        block)


def read_records(path: Path) -> list[dict]:
    """The client's per-request records of one run (``requests__CONFIG__LABEL.jsonl.gz``)."""
    try:
        with gzip.open(path, "rt") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SimulatorInputError(f"cannot read the request records {path}: {e}") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append({"index": int(rec["index"]), "input_len": int(rec["input_len"]),
                        "tokens": int(rec.get("tokens") or 0),
                        "first": rec.get("first_token_s"), "end": rec.get("end_s")})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SimulatorInputError(f"{path}: line {n}: not a request record ({e})") from e
    return out


def served_blocks(runs: Iterable[list[dict]], seed: int, block: int = PROMPT_BLOCK_TOKENS
                  ) -> list[tuple[int, ...]]:
    """What earlier runs (their request records, oldest run first) left in the radix cache,
    one entry per prefilled request, in the order their streams ended. Output blocks get ids
    no prompt has (they only take room and age)."""
    entries: list[tuple[int, ...]] = []
    for j, records in enumerate(runs):
        started = [r for r in records if r["first"] is not None]
        started.sort(key=lambda r: (r["end"] if r["end"] is not None else r["first"]))
        for r in started:
            ids = prompt_block_ids(seed, r["index"], r["input_len"], block)
            tail = r["input_len"] % block + max(r["tokens"] - 1, 0)
            outs = tuple(hash((-1, j, r["index"], k)) for k in range(tail // block))
            entries.append(ids + outs)
    return entries
