"""The time of SGLang's triton extend (prefill) attention kernel on a chunk of sequences, from
the work its launch really does.

``extend_attention_fwd`` (sglang 0.5.10, ``srt/layers/attention/triton_ops/extend_attention.py``)
launches a grid of (sequences, heads, cdiv(longest extend, BLOCK_M)) programs, and no program
returns early: every sequence runs as many query blocks as the chunk's longest one, and each
block scans the sequence's whole prefix in BLOCK_N-key tiles (stage 1) and min(extend,
(block + 1) * BLOCK_M) of its own keys (stage 2), masked where out of range. So the work is
counted in key tiles, not in query-key pairs: a one-token extend against an 8,000-token cached
prefix runs a full 128-query block over 125 tiles (as long as 128 queries would), a short
prompt beside a long one runs the long one's blocks, and twenty 400-token prompts cost their
diagonal tiles in full.

``ExtendTileTimes`` prices a launch as ``ExtendWork.units`` (tiles of one head, plus
``BLOCK_OVERHEAD_TILES`` per query block for loading its queries and writing its outputs)
times a per-unit time looked up at (query rows launched, mean past): the rows say how many
programs share the GPU (below one wave a unit costs a whole program's serial step, above it
the SMs share them), the past how much of the work is stage 1's gathered prefix tiles. The
per-unit times come from the calibration's one-sequence grid (``scripts/calibrate_gpu.py``),
so the model reproduces every grid point, and are interpolated in log space, where both
regimes are straight lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from simulator.specs.calibration import LogBilinear

# A query block's fixed work in units of one key tile: fitted on chunks of equal prompts with
# no past (20 x 400 and 40 x 200 tokens, H200: 21.6 ns per tile and head, the grid's rate at
# 8,192 tokens, plus ~21 ns per block and head); benchmarks.md, session 21.
BLOCK_OVERHEAD_TILES = 1.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExtendWork:
    """What one launch computes, per attention head."""

    units: float    # key tiles, plus BLOCK_OVERHEAD_TILES per query block
    rows: int       # query rows launched: sequences x blocks x BLOCK_M


@dataclass(frozen=True)
class ExtendTiles:
    """Tile sizes of the kernel on one GPU architecture. Both are powers of two."""

    block_m: int
    block_n: int

    @classmethod
    def for_gpu(cls, compute_capability: tuple[int, int] | None, head_dim: int
                ) -> ExtendTiles | None:
        """SGLang's ``_get_block_sizes_for_extend_attention`` on CUDA (None: architecture not
        known, the chunk priced from its query-key pairs)."""
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

    def work(self, chunks: Sequence[tuple[int, int]]) -> ExtendWork:
        """One launch over ``chunks`` ((extend, past) per sequence, extend >= 1)."""
        blocks = max(_cdiv(e, self.block_m) for e, _ in chunks)
        tiles = sum(self.tiles(e, p, blocks) for e, p in chunks)
        return ExtendWork(tiles + BLOCK_OVERHEAD_TILES * blocks * len(chunks),
                          len(chunks) * blocks * self.block_m)

    def padding(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Work of one launch over ``chunks`` over the sequences' work launched one at a time;
        1.0 for one sequence or none."""
        if len(chunks) < 2:
            return 1.0
        alone = sum(self.work([c]).units for c in chunks)
        return self.work(chunks).units / alone


@dataclass(frozen=True)
class ExtendTileTimes:
    """Seconds per work unit over (query rows launched, mean past per sequence), log-log
    bilinear, held at the edges."""

    tiles: ExtendTiles
    log_unit_s: LogBilinear   # ln(seconds per unit) over (rows, past)

    @classmethod
    def from_grid(cls, tiles: ExtendTiles, chunks: Sequence[int], pasts: Sequence[float],
                  seconds: Callable[[int, int], float]) -> ExtendTileTimes:
        """From a one-sequence grid: ``seconds(chunk, past)`` at each point. A past axis value
        of at most 1 is the calibration's stand-in for no past (log axes have no zero): it is
        timed and counted as 0."""
        log_s = np.empty((len(chunks), len(pasts)))
        for i, c in enumerate(chunks):
            for j, p in enumerate(pasts):
                past = 0 if p <= 1 else int(p)
                w = tiles.work([(int(c), past)])
                log_s[i, j] = math.log(seconds(int(c), past) / w.units)
        rows = np.array([tiles.work([(int(c), 0)]).rows for c in chunks], float)
        return cls(tiles, LogBilinear(rows, np.asarray(pasts, float), log_s))

    def unit_s(self, rows: float, past: float) -> float:
        return math.exp(self.log_unit_s(rows, past))

    def __call__(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of one launch (one layer) over ``chunks``."""
        w = self.tiles.work(chunks)
        return w.units * self.unit_s(w.rows, sum(p for _, p in chunks) / len(chunks))
