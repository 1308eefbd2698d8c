"""Time spent in DiffKV memory management per forward step (``SGLANG_DIFFKV_PROFILE=1``).

Off by default, and then nothing is recorded and nothing synchronises. On: the SGLang
backend marks spans with CUDA events (host ``perf_counter`` on other devices) and the
periodic metrics line gets one profile line per forward mode (format:
``sglang_diffkv.serving_io.profile_lines``, whose ``profile_line`` this writes and the bench parses;
documented in docs/backend.md). Events are only read when a line is written (one
synchronisation per log interval), or every ``MAX_PENDING`` spans when lines are off.

Buckets (milliseconds):

- ``step``: ``init_forward_metadata`` to the end of the last layer's attention (it leaves out
  the last layer's MLP, the logits and sampling, so the shares below are upper bounds), plus
  any memory-management span that ran between steps (request frees);
- memory management ``mm`` = ``alloc`` (decode: ``begin_decode``, the step's page room;
  prefill: ``begin_prefill``'s all-high allocation) + ``reclaim`` (``end_prefill``: giving
  back what compression freed and moving low pages right, the compaction) + ``free`` (a
  finished request's pages back to the free list, between steps; counted in the next step);
- ``policy``: the decode policy step of every layer (``ops.decode_store``: evict / demote /
  store the new token): per-layer tier management, reported apart from ``mm``;
- prefill parts (their own line, ``parts_line``; ``PART_BUCKETS``): ``attend`` (prompt and
  extend attention), ``compress`` (whole prompts scored and stored), ``chunk`` (chunks before
  a prompt's last, at the high tier), ``end`` (prompt ends over stored tokens: last chunks and
  radix suffixes scored and stored compressed), ``export`` (completed prompts copied into the
  tree's handles; also inside ``reclaim``, which spans the whole end of the step);
- ``host`` (host clock, not events): the same ``step`` interval as the host saw it, i.e. the
  time to issue the step's work, any host synchronisation inside it included. ``host``
  close to ``step`` means the step is bound by its host work (the GPU waited for
  launches); well below it, by the GPU.

CUDA events time the stream between the two marks, so a span also counts the host work and
any synchronisation inside it (``begin_decode`` reads its success flag on the host).

SGLang layer (``pool`` and ``backend`` open the spans); imports torch, never sglang.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from sglang_diffkv.serving_io.profile_lines import (
    BUCKETS,
    MODES,
    PART_BUCKETS,
    host_line_text,
    parts_line,
    profile_line,
)

PROFILE_ENV = "SGLANG_DIFFKV_PROFILE"
MAX_PENDING = 65536  # spans kept unread before a forced read (only when lines are off)


def profiling_enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    value = env.get(PROFILE_ENV, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{PROFILE_ENV}={value!r}: use 1 (profile) or 0 (off, the default)")


class StepProfiler:
    """Spans of memory-management work and of whole forward steps, per forward mode."""

    def __init__(self, device: torch.device | str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._clock = clock  # host seconds: ``host``, and spans off CUDA (injectable for tests)
        self._step_start: Any = None
        self._host_start = 0.0
        self._open: list[tuple[str, Any, Any]] = []  # spans of the step under way
        self._done: list[tuple[str, str, Any, Any]] = []  # (mode, bucket, start, end) unread
        self.window = {m: dict.fromkeys(BUCKETS, 0.0) for m in MODES}
        self.total = {m: dict.fromkeys(BUCKETS, 0.0) for m in MODES}
        self.window_host = dict.fromkeys(MODES, 0.0)  # host ms of the interval's steps
        self.window_steps = dict.fromkeys(MODES, 0)
        self.total_steps = dict.fromkeys(MODES, 0)
        self._host_counts = self.host_counts()

    @classmethod
    def from_env(cls, device: torch.device | str,
                 environ: Mapping[str, str] | None = None) -> StepProfiler | None:
        return cls(device) if profiling_enabled(environ) else None

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._clock()

    def begin_step(self) -> None:
        self._host_start = self._clock()
        self._step_start = self.mark()

    def add(self, bucket: str, start: Any) -> None:
        """Close a span opened with ``mark()`` now. Outside a step (request frees) the span
        also counts as step time: it is work of the serving loop the step clock missed."""
        if bucket not in BUCKETS:
            raise ValueError(f"profile bucket {bucket!r}; allowed: {BUCKETS}")
        end = self.mark()
        self._open.append((bucket, start, end))
        if self._step_start is None:
            self._open.append(("step", start, end))

    def end_step(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"profile mode {mode!r}; allowed: {MODES}")
        if self._step_start is None:
            return
        self._open.append(("step", self._step_start, self.mark()))
        self.window_host[mode] += (self._clock() - self._host_start) * 1e3
        self._step_start = None
        self._done.extend((mode, b, s, e) for b, s, e in self._open)
        self._open.clear()
        self.window_steps[mode] += 1
        self.total_steps[mode] += 1
        if len(self._done) > MAX_PENDING:
            self._read()

    def _read(self) -> None:
        if not self._done:
            return
        if self.cuda:
            self._done[-1][3].synchronize()  # the stream is in order: all earlier ones too
        for mode, bucket, start, end in self._done:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            self.window[mode][bucket] += ms
            self.total[mode][bucket] += ms
        self._done.clear()

    def host_counts(self) -> tuple[int, int]:
        """(device allocations PyTorch's caching allocator made, Python gen-2 collections)
        so far: each may stall a host-bound step (a cudaMalloc synchronises the device)."""
        allocs = 0
        if self.cuda:
            allocs = int(torch.cuda.memory_stats().get("num_device_alloc", 0))
        return allocs, int(gc.get_stats()[2]["collections"])

    def host_line(self) -> str:
        """What the host did besides issuing work since the last call (one line per log
        interval: reading the counters costs ~0.1 ms, too much for every step)."""
        now = self.host_counts()
        allocs, gcs = (a - b for a, b in zip(now, self._host_counts, strict=True))
        self._host_counts = now
        return host_line_text(allocs, gcs)

    def lines(self) -> list[str]:
        """One line per mode that ran since the last call, then the host line; starts a new
        interval."""
        self._read()
        out = []
        for mode in MODES:
            if self.window_steps[mode]:
                out.append(profile_line(mode, self.window_steps[mode], self.window[mode],
                                        self.total_steps[mode], self.total[mode],
                                        self.window_host[mode]))
                if any(self.window[mode][b] for b in PART_BUCKETS):
                    out.append(parts_line(mode, self.window_steps[mode], self.window[mode]))
            self.window[mode] = dict.fromkeys(BUCKETS, 0.0)
            self.window_host[mode] = 0.0
            self.window_steps[mode] = 0
        if out:
            out.append(self.host_line())
        return out


_NO_SPAN = contextlib.nullcontext()


def span(profiler: StepProfiler | None, bucket: str) -> contextlib.AbstractContextManager:
    """``with span(prof, "alloc"): ...`` adds the block's time to ``bucket``. Without a
    profiler (the default) it is a shared no-op context: no event, no sync."""
    return _NO_SPAN if profiler is None else _span(profiler, bucket)


@contextlib.contextmanager
def _span(profiler: StepProfiler, bucket: str) -> Iterator[None]:
    start = profiler.mark()
    yield  # an exception leaves the span unrecorded, as the step it belongs to is lost
    profiler.add(bucket, start)
