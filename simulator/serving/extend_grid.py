"""The work SGLang's triton extend (prefill) attention kernel does on a chunk of several
sequences, relative to the same sequences launched one at a time.

``extend_attention_fwd`` (sglang 0.5.10, ``srt/layers/attention/triton_ops/extend_attention.py``)
launches a grid of (sequences, heads, cdiv(longest extend, BLOCK_M)) programs, and no program
returns early: every sequence runs as many query blocks as the chunk's longest one, and each
block scans the sequence's whole prefix in BLOCK_N-key tiles (stage 1) and min(extend,
(block + 1) * BLOCK_M) of its own keys (stage 2), masked where out of range. A short prompt
next to a long one, or a prompt's tail with its earlier chunks as prefix next to the head of
the next prompt, so computes tiles nobody needs. The calibration times one sequence per chunk
(``scripts/calibrate_gpu.py``), where no block is wasted; ``ExtendTiles.padding`` is the factor
a chunk's launch costs over that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExtendTiles:
    """Tile sizes of the kernel on one GPU architecture. Both are powers of two."""

    block_m: int
    block_n: int

    @classmethod
    def for_gpu(cls, compute_capability: tuple[int, int] | None, head_dim: int
                ) -> ExtendTiles | None:
        """SGLang's ``_get_block_sizes_for_extend_attention`` on CUDA (None: architecture not
        known, no padding modelled)."""
        if compute_capability is None:
            return None
        major, minor = compute_capability
        if major == 12:
            m, n = (64, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 32)
        elif major >= 9:
            m, n = (128, 64) if head_dim <= 256 else (32, 64)
        elif major == 8 and minor in (6, 9):
            m, n = (64, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 32)
        elif major == 8:
            m, n = (128, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 32)
        else:
            return None
        return cls(m, n)

    def _stage2_full_blocks(self, q: int) -> int:
        """Key tiles of query blocks 0..q-1 that end inside the sequence: block j scans
        cdiv((j + 1) * BLOCK_M, BLOCK_N) tiles."""
        bm, bn = self.block_m, self.block_n
        if bm % bn == 0:
            r = bm // bn
            return r * q * (q + 1) // 2
        s = bn // bm                       # sum over j = 1..q of cdiv(j, s)
        a, b = divmod(q, s)
        return s * a * (a + 1) // 2 + b * (a + 1)

    def tiles(self, extend: int, past: int, blocks: int) -> int:
        """Key tiles one head of a sequence computes when launched with ``blocks`` query
        blocks (>= its own cdiv(extend, BLOCK_M))."""
        q = extend // self.block_m
        return (blocks * _cdiv(past, self.block_n) + self._stage2_full_blocks(q)
                + (blocks - q) * _cdiv(extend, self.block_n))

    def padding(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Tiles of one launch over ``chunks`` ((extend, past) per sequence) over the tiles of
        the sequences launched one at a time; 1.0 for a single sequence."""
        if len(chunks) < 2:
            return 1.0
        blocks = max(_cdiv(e, self.block_m) for e, _ in chunks)
        launched = alone = 0
        for e, p in chunks:
            launched += self.tiles(e, p, blocks)
            alone += self.tiles(e, p, _cdiv(e, self.block_m))
        return launched / alone if alone else 1.0
