"""The DiffKV step profile's log lines (``SGLANG_DIFFKV_PROFILE=1``): their format, one source
of truth for the writer and the readers.

The SGLang layer's ``sglang_diffkv.sglang.step_profile.StepProfiler`` writes them with
``profile_line`` and ``host_line_text``; the bench reads them (``logstats``) and its CPU
stand-in server writes them (``fakeserver``); the simulator reads them beside its replay
(``diffkv-sim profile-run``). Per forward mode (``MODES``), one line of the
last log interval per step, then cumulative totals, in milliseconds of the buckets
(``BUCKETS``: ``step``, memory management ``mm`` = ``MM_BUCKETS`` summed, ``policy``; what
each times: the writer's docstring and docs/backend.md), and an optional ``host`` field; then
one host line (device allocations, gen-2 collections). ``PROFILE_LINE_RE`` /
``HOST_LINE_RE`` read them back, ``parse_profile_line`` into numbers. Shared layer
(``serving_io``: the bench and the simulator both read it): no sglang, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MM_BUCKETS = ("alloc", "reclaim", "free")
# where a prefill step's time goes, beside mm (their own line, ``parts_line``): attention
# (prompt attention and extend attention over stored tokens), whole prompts' score and
# compress, chunks before a prompt's last stored at the high tier (chunked prefill's and radix
# suffixes'), prompt ends over stored tokens (a last chunk, a radix suffix's last chunk)
# scored and stored compressed, and exporting completed prompts to the tree
PART_BUCKETS = ("attend", "compress", "chunk", "end", "export")
BUCKETS = ("step", *MM_BUCKETS, "policy", *PART_BUCKETS)
MODES = ("prefill", "decode")

_F = r"\d+(?:\.\d+)?"
# One source of truth for the line: ``profile_line`` writes it, this reads it.
PROFILE_LINE_RE = re.compile(
    rf"DiffKV profile (?P<mode>prefill|decode): (?P<steps>\d+) steps: "
    rf"mm (?P<mm_ms>{_F}) ms/step \((?P<mm_pct>{_F})% of step "
    rf"(?P<step_ms>{_F}) ms\) = alloc (?P<alloc_ms>{_F}) \+ reclaim "
    rf"(?P<reclaim_ms>{_F}) \+ free (?P<free_ms>{_F}), "
    rf"policy (?P<policy_ms>{_F}) ms/step \((?P<policy_pct>{_F})%\)"
    rf"(?:, host (?P<host_ms>{_F}) ms/step)?; "
    rf"total (?P<total_steps>\d+) steps: mm (?P<total_mm_ms>{_F}) ms "
    rf"\((?P<total_mm_pct>{_F})% of (?P<total_step_ms>{_F}) ms\), "
    rf"policy (?P<total_policy_ms>{_F}) ms \((?P<total_policy_pct>{_F})%\)"
)
_PARTS = " \\+ ".join(rf"{b} (?P<{b}_ms>{_F})" for b in PART_BUCKETS)
PARTS_LINE_RE = re.compile(
    rf"DiffKV profile (?P<mode>prefill|decode) parts: (?P<steps>\d+) steps: {_PARTS} "
    rf"ms/step of step (?P<step_ms>{_F}) ms")
# the host line (``host_line_text`` writes it, this reads it)
HOST_LINE_RE = re.compile(
    r"DiffKV host: (?P<device_allocs>\d+) device allocations, "
    r"(?P<gen2_collections>\d+) gen-2 collections")


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def profile_line(mode: str, steps: int, window: Mapping[str, float], total_steps: int,
                 total: Mapping[str, float], host_ms: float | None = None) -> str:
    """The profile line of one mode: the last interval per step, then cumulative totals.
    ``host_ms``: the interval's host time of its steps (the ``host`` field; lines written
    before it existed have none, hence optional in ``PROFILE_LINE_RE``)."""
    n = max(steps, 1)
    host = "" if host_ms is None else f", host {host_ms / n:.3f} ms/step"
    mm = sum(window[b] for b in MM_BUCKETS)
    t_mm = sum(total[b] for b in MM_BUCKETS)
    return (
        f"DiffKV profile {mode}: {steps} steps: mm {mm / n:.3f} ms/step "
        f"({_pct(mm, window['step']):.2f}% of step {window['step'] / n:.3f} ms) = "
        f"alloc {window['alloc'] / n:.3f} + reclaim {window['reclaim'] / n:.3f} + "
        f"free {window['free'] / n:.3f}, policy {window['policy'] / n:.3f} ms/step "
        f"({_pct(window['policy'], window['step']):.2f}%){host}; "
        f"total {total_steps} steps: mm {t_mm:.3f} ms ({_pct(t_mm, total['step']):.2f}% of "
        f"{total['step']:.3f} ms), policy {total['policy']:.3f} ms "
        f"({_pct(total['policy'], total['step']):.2f}%)"
    )


def parts_line(mode: str, steps: int, window: Mapping[str, float]) -> str:
    """Where the interval's steps went (``PART_BUCKETS``), ms per step."""
    n = max(steps, 1)
    parts = " + ".join(f"{b} {window[b] / n:.3f}" for b in PART_BUCKETS)
    return (f"DiffKV profile {mode} parts: {steps} steps: {parts} ms/step of step "
            f"{window['step'] / n:.3f} ms")


def parse_parts_line(line: str) -> dict[str, Any] | None:
    """The fields of a parts line (``mode`` a string, ``steps`` an int, the rest floats)."""
    return _fields(PARTS_LINE_RE.search(line))


def host_line_text(device_allocs: int, gen2_collections: int) -> str:
    """The host line: what the host did besides issuing work over one log interval."""
    return (f"DiffKV host: {device_allocs} device allocations, "
            f"{gen2_collections} gen-2 collections")


def parse_profile_line(line: str) -> dict[str, Any] | None:
    """The fields of a profile line (floats; ``mode`` a string, step counts ints)."""
    return _fields(PROFILE_LINE_RE.search(line))


def _fields(m: re.Match[str] | None) -> dict[str, Any] | None:
    """A matched line's groups: ``mode`` as is, step counts ints, the rest floats (an
    optional group that did not match stays None)."""
    if m is None:
        return None
    return {k: v if k == "mode" or v is None
            else int(v) if k in ("steps", "total_steps") else float(v)
            for k, v in m.groupdict().items()}
