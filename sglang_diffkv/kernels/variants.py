"""The launch parameters of the prefill / extend step's Triton kernels that follow the batch,
picked in one place and bounded.

Triton compiles a kernel once per distinct specialisation: its constexpr values, plus, for
every other argument, its type, whether an int is 1 or a multiple of 16 and whether a
pointer is 16-byte aligned. A variant first needed while serving compiles inside that
prefill step: seconds on an H200 for the extend attention kernel, so a constexpr that
followed the batch kept stalling prefill steps until every value had come up once. Hence:

- a launch parameter that depends on a step's batch (request counts, token counts, max
  lengths) is either a runtime argument (``do_not_specialize`` where it is an int that can
  be 1 or a multiple of 16) or a constexpr rounded to a small fixed set, picked here;
- the index tensors a step uploads start 16-byte aligned (``sglang.ops.upload``), so a
  pointer's alignment does not follow the request count either.

Only extend attention picks a constexpr from the batch. The other prefill / extend kernels
(``prefill``: the LSE and column-sum scoring passes, classify, store; ``extend_store``:
gather, classify and store a span; ``store``: chunk tokens) take constexprs from the model
shape, the page layout and the config alone, and pass batch sizes as runtime ints Triton
does not specialise. ``tests/kernels/test_launch_variants.py`` drives the serving path over
hundreds of random batches and bounds every kernel's compiled variants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

EXTEND_BLOCK_M = 64  # query rows per extend attention tile (fresh tokens x GQA group)
MIN_BLOCK_M = 16  # tl.dot's smallest tile
MAX_SPLITS = 32  # extend attention programs per (tile, KV head)
PROGRAMS_PER_SM = 4  # extend attention programs per SM the splits aim for
CPU_SMS = 2  # the interpreter's pretend SM count (the splits still get exercised)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count (read once: a property query per layer costs host time)."""
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_shape(group: int, max_new: int, block_m: int = EXTEND_BLOCK_M) -> tuple[int, int]:
    """(BLOCK_M, QT): query rows per tile (a power of two >= 16) and the fresh tokens they
    hold (QT * group <= BLOCK_M; a group wider than ``block_m`` gets one token per tile).
    Short extends (max_new * group < block_m rows) take the smallest tile that holds them:
    BLOCK_M is one of 16, 32, ..., max(block_m, group rounded up): log2(block_m / 16) + 1
    values whatever max_new is (3 at the default 64)."""
    rows = min(block_m, max(1, max_new) * group)
    bm = max(MIN_BLOCK_M, triton.next_power_of_2(max(rows, group)))
    return bm, bm // group


def default_splits(programs: int, sms: int) -> int:
    """Splits per (tile, head) so that about ``PROGRAMS_PER_SM`` programs per SM run (1 when
    the tiles alone fill the GPU: no scratch, no merge launch). Any of 1 .. MAX_SPLITS: a
    runtime argument of the kernels, so it costs no compile."""
    return max(1, min(MAX_SPLITS, (PROGRAMS_PER_SM * sms) // max(1, programs)))


@dataclass(frozen=True)
class ExtendLaunch:
    """One extend attention launch: the grid is (batch * tiles, Hkv, splits)."""

    block_m: int  # constexpr BLOCK_M: query rows per tile
    qt: int  # constexpr QT: fresh tokens per tile
    tiles: int  # runtime: query tiles per request, cdiv(max_new, qt)
    splits: int  # runtime: programs per (tile, head)

    @property
    def split(self) -> bool:
        """Constexpr SPLIT: the programs write partial results for the merge kernel."""
        return self.splits > 1

    def constexprs(self) -> dict[str, int | bool]:
        """What the extend kernel is compiled for (the merge kernel takes BLOCK_M / QT):
        at most 2 x the tile shapes' count (``tile_shape``) tuples per model shape."""
        return {"BLOCK_M": self.block_m, "QT": self.qt, "SPLIT": self.split}


def extend_launch(group: int, batch: int, num_kv_heads: int, max_new: int, sms: int, *,
                  block_m: int = EXTEND_BLOCK_M, splits: int | None = None) -> ExtendLaunch:
    """The extend attention launch for ``batch`` requests of at most ``max_new`` fresh
    tokens each (GQA ``group``, ``num_kv_heads``) on ``sms`` SMs; ``splits`` overrides
    ``default_splits``."""
    bm, qt = tile_shape(group, max_new, block_m)
    tiles = triton.cdiv(max_new, qt)
    if splits is None:
        splits = default_splits(batch * tiles * num_kv_heads, sms)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return ExtendLaunch(bm, qt, tiles, splits)
