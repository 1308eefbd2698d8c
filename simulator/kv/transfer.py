"""A request's KV on the wire from a prefill to a decode server: its bytes, per KV format.

The bytes are the pool's own units times the bytes of one unit, from the same numbers the
memory model sizes the pool with (``simulator.kv.formats``, which reads
``sglang_diffkv.layout``); no byte size is defined here.

- bf16, fp8 (and the uniform k8v4 / k4v2 tiers): the slots the prompt holds, each
  ``layers x KV heads per rank x bytes per token per head`` (SGLang's cell size; a uniform
  tier's bytes per token are its page over its tokens, so whole pages). SGLang's prefill
  server sends each chunk's KV when the chunk's forward ends (``send_kv_chunk``), so a
  chunked prompt goes out in pieces.
- diffkv: the unified pages the prompt holds after the prefill server compressed it to the
  request's tier mix, sent as stored (no re-encoding): ``page_bytes`` each, so a page's
  quantisation metadata, score and position segments, its unused tail and the partly filled
  last page of every (layer, KV head, tier) go whole. The tiers are decided only when the
  whole prompt has been scored, so the pages go out in one piece after the last chunk.

Bytes are per rank: with tensor parallelism each rank sends its own KV heads to the decode
replica's rank that holds them, over its own link (``simulator.engine.link``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.kv.formats import DiffKVFormat, KVFormat
from simulator.kv.pool import KVPool
from simulator.specs.model import ModelSpec


def unit_bytes(fmt: KVFormat, model: ModelSpec, tp: int) -> float:
    """Bytes of one pool unit on one rank: a token slot of a token pool (the cell size the
    pool was sized with), or one DiffKV unified page."""
    if isinstance(fmt, DiffKVFormat):
        return float(fmt.geometry.page_bytes)
    return model.num_layers * model.kv_heads_per_rank(tp) * fmt.bytes_per_token_head


@dataclass(frozen=True)
class KVTransfer:
    """The bytes one format's prompt KV puts on the wire, from its pool's units."""

    pool: KVPool
    unit_bytes: float
    # True: each prefill chunk's KV is sent when its forward ends; False: the whole prompt
    # once it is complete (DiffKV compresses only then)
    streams_chunks: bool

    @classmethod
    def for_format(cls, fmt: KVFormat, pool: KVPool, model: ModelSpec, tp: int) -> KVTransfer:
        return cls(pool, unit_bytes(fmt, model, tp), not isinstance(fmt, DiffKVFormat))

    def prefix_bytes(self, tokens: int) -> float:
        """Bytes of a prompt's first ``tokens`` tokens as the prefill server holds them
        (streamed formats: the chunks sent so far add up to this)."""
        return self.pool.prompt_units(0, tokens) * self.unit_bytes

    def prompt_bytes(self, tokens: int, prof: np.ndarray | None = None) -> float:
        """Bytes of a whole prompt as it arrives: the units the decode pool stores it in
        (DiffKV: compressed to the tier mix ``prof``, None: the pool's mean mix)."""
        kv = np.array([tokens], dtype=np.int64)
        units = self.pool.decode_units(kv, None if prof is None else prof[None])[0]
        return float(units) * self.unit_bytes
