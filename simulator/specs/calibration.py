"""Calibration: the efficiency factors and fixed costs of the cost model, per GPU, with their
provenance. Defaults ship in ``simulator/calibration/default.json``; a fitted file with the same
schema replaces them (``--calibration PATH``).

A GPU entry may also carry ``measured`` grids from kernel micro-benchmarks
(``scripts/calibrate_gpu.py``): an efficiency eta = speed-of-light time / measured time per
grid point, for the weight GEMMs over the token count m, decode attention per KV format over
batch x mean context, prefill attention per KV format over chunk x past. The cost model then
uses eta(m) or eta(x, y), interpolated linearly in log2 of the coordinates and held at the
edge value outside the grid: a measured efficiency is a property of the kernel's regime and
stays sensible past the grid, whereas extrapolating a raw time would not (a bigger GEMM cannot
run at a negative or sub-roofline time). Scalars remain the fallback for anything without a
grid. Grid schema (every list strictly increasing, every eta in (0, ETA_GRID_MAX]):

  "measured": {
    "gemm": {"qkv": {"n": 6144, "k": 4096, "m": [1, 2, ...], "eta": [...]}, ...},
    "decode_attention": {"bf16": {"batch": [...], "context": [...], "eta": [[...], ...]}},
    "prefill_attention": {"bf16": {"chunk": [...], "past": [...], "eta": [[...], ...]}}
  }

(other keys in a grid object, e.g. the raw ``time_s``, are kept for provenance and ignored).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.json_file import parse_json, read_json
from simulator.errors import SimulatorInputError

ETA_FIELDS = ("eta_mem_gemm", "eta_comp_gemm", "eta_comp_prefill_attention",
              "eta_comp_decode_attention", "eta_interconnect")
SECONDS_FIELDS = ("allreduce_latency_s", "layer_overhead_s", "eager_layer_overhead_s",
                  "step_overhead_s", "seq_overhead_s")
GIB_FIELDS = ("cuda_context_gib", "post_load_overhead_gib")
# optional seconds (0 when absent, so older files load unchanged): costs of a step that
# computes prompt tokens beyond its modelled kernels, e.g. the DiffKV extend path's scoring
# and compression (per prefill step, per prompt chunk in it, per prompt token in it); and the
# cost a step pays per request released (finished, aborted or retracted) since the previous
# step, beyond the kernels (the DiffKV server's steps grow by ~3 ms per finished request)
# ``first_token_latency_s`` is no step cost: the latency a client sees on top of the server's
# steps (the request's way into the scheduler, the first token's way back out through the
# detokenizer and HTTP; with --skip-tokenizer-init), the same for every request, so it adds to
# TTFT and end-to-end latency and occupies nothing
# ``eager_prefill_launch_s`` is the host's time to launch an eager prefill step's kernels
# (about 400 for a Llama-3-8B forward), which the GPU runs as they arrive: a short prompt's
# step lasts as long as its launches, a long one's as long as its kernels, so the step pays
# max(launches, kernels) in place of kernels + layers * ``eager_layer_overhead_s``.
# diffkv-sim prefill-probes estimates it from lone prefills of several lengths;
# 0 (the default): the sum
# ``eager_prefill_turnaround_s`` is the host's time from the end of those launches to the
# next step's launch: it streams the step before's tokens, forms the next batch and prepares
# it (a decode step's metadata and graph replay, a prefill's allocation). The GPU idles
# through it when the launches bound the step, so such a step lasts max(launches +
# turnaround, kernels) (H200 loop traces, session 37: 2-4.5 ms median on DiffKV ladders,
# 1.3-3 ms on triton's; the torch profiler saw 3.6-4.1 ms of GPU idle at the head of every
# DiffKV decode step after an extend). Only with a timed launch; 0 (the default): none.
# scripts/loop_trace_report.py measures it (the median over a ladder's extends)
# ``eager_decode_host_s`` is the host's time for one scheduler iteration around a decode step
# that no CUDA graph runs (a batch above the largest captured size): the step's eager
# launches, the next batch's scheduling and the previous step's results, which a CUDA graph
# step hides under its kernels. Such a step lasts the longer of that and its kernels with the
# fixed costs, in place of kernels + layers * ``eager_decode_layer_overhead_s``.
# scripts/loop_trace_report.py --graph-max-bs measures it (the median iteration just above
# the largest graph); 0 (the default): the sum
# ``eager_decode_host_per_req_s`` is what that iteration adds per request in the batch (the
# eager path's metadata and the results it streams are per request: on the H200 DiffKV
# server the iteration grows from 33-38 ms at 513-640 requests to 58-75 ms at 1,409-1,536,
# session 35), so the floor is ``eager_decode_host_s`` + this x batch; loop_trace_report.py
# --graph-max-bs fits both over the eager iterations; 0 (the default): a flat floor
OPTIONAL_SECONDS_FIELDS = ("prefill_step_overhead_s", "prefill_seq_overhead_s",
                           "prefill_token_overhead_s", "release_overhead_s",
                           "first_token_latency_s", "eager_prefill_launch_s",
                           "eager_prefill_turnaround_s", "eager_decode_host_s",
                           "eager_decode_host_per_req_s")
# removed terms, each refused in one line: held out, they scored no better without
# (docs/simulator.md, "Host-side terms, measured"): a list of probe hosts' speeds that a
# validation prediction averaged over (diffkv-sim always ran one host), and the tokenizer
# manager's garbage-collection pauses
_GC_REMOVED = ("the front-end GC pauses were removed (no held-out row scored better with "
               "them)")
REMOVED_FIELDS = {"host_speed_factors": "the mean over probe hosts was removed (it scored no "
                                        "better than one host at the pooled times)",
                  "frontend_gc_pause_s": _GC_REMOVED, "frontend_gc_first_reqs": _GC_REMOVED,
                  "frontend_gc_every_reqs": _GC_REMOVED}
# optional: the per-layer cost of a decode step that no CUDA graph runs (a batch above the
# largest captured size), when it differs from a prefill step's (``eager_layer_overhead_s``):
# a backend's eager decode path launches other kernels, and more host work, than its extend
# path. Absent: the same as ``eager_layer_overhead_s``
EAGER_DECODE_FIELD = "eager_decode_layer_overhead_s"
# optional: a factor on the modelled decode attention time (1 when absent), fitted from
# server logs where the kernel in a serving step runs slower or faster than its grid measured
# in isolation (a different split count, caches warm or cold)
ATTENTION_SCALE_FIELD = "decode_attention_scale"
# optional: the same factor for one KV format (calibration key) where it differs from the
# default above, e.g. SGLang's triton backend on an fp8 cache vs a bf16 one
ATTENTION_SCALES_FIELD = "decode_attention_scale_by_format"
ATTENTION_SCALE_MAX = 4.0
# optional: ``eager_prefill_launch_s`` for one KV format (calibration key) where it differs,
# e.g. SGLang's triton backend on an fp8 cache, whose KV store launches four more kernels a
# layer (session 22's profile: 469 launches a prefill step against bf16's 405)
PREFILL_LAUNCHES_FIELD = "eager_prefill_launch_s_by_format"
# optional: ``eager_prefill_turnaround_s`` for one KV format where it differs
PREFILL_TURNAROUNDS_FIELD = "eager_prefill_turnaround_s_by_format"
# optional: ``eager_decode_host_s`` for one KV format (calibration key) where it differs
DECODE_HOST_FIELD = "eager_decode_host_s_by_format"
# optional: ``eager_decode_host_per_req_s`` for one KV format where it differs
DECODE_HOST_PER_REQ_FIELD = "eager_decode_host_per_req_s_by_format"
# optional (false when absent): whether an eager prefill's timed launches
# (``eager_prefill_launch_s``) also hold SGLang's overlap loop: the host forms the next batch
# only after launching the step, and streams the step before's tokens only after it
# (``Replica``). The H200 loop traces show both (session 30); off unless asked for, as a file
# that times no launches has nothing to hold (the H200 recipe asks, validate-runs'
# --eager-launch-holds-loop)
LAUNCH_HOLDS_LOOP_FIELD = "eager_launch_holds_loop"
# optional: a factor (<= 1; 1 when absent) on the kernel time of a prefill step long after the
# last one. Compute-bound work runs the GPU at its power limit, below its boost clock, within
# one step: the kernel grids (timed in loops) and a burst's back-to-back chunks run there, a
# prefill step between decode steps runs faster; simulator/calibration/sustained_prefill.py measures
# the ratio (alone / back to back)
ISOLATED_PREFILL_FIELD = "isolated_prefill_scale"
ISOLATED_PREFILL_MIN = 0.5
# optional: how fast the clocks come back after a prefill step (seconds, exponential): a
# prefill step ``gap`` seconds after the previous one ended runs its kernels at
# isolated + (1 - isolated) * exp(-gap / recovery); 0 (the default): at once, any other step
# in between and the prefill runs at ``isolated_prefill_scale``. The probe's --duty measured
# 25 ms on an H200 (one 45-ms prefill between 1 and 64 synthetic decode steps), but the H200
# serving runs fit better with 0 (benchmarks.md and simulator-validation-h200.md, session 21)
PREFILL_CLOCK_RECOVERY_FIELD = "prefill_clock_recovery_s"
PREFILL_CLOCK_RECOVERY_S = 0.0
PREFILL_CLOCK_RECOVERY_MAX_S = 10.0
# a measured efficiency may exceed 1 where the datasheet peak understates this GPU (boost
# clocks, an HBM part above spec); more than this is a units error in the calibration file
ETA_GRID_MAX = 1.5
GEMM_OPS = ("qkv", "o", "gate_up", "down", "lm_head")


def _axis(values: Any, where: str) -> np.ndarray:
    if not isinstance(values, list) or not values:
        raise SimulatorInputError(f"{where} must be a non-empty list of positive numbers, got "
                                  f"{values!r}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
           or not math.isfinite(v) or v <= 0]
    if bad:
        raise SimulatorInputError(f"{where} has {bad[:3]!r}: coordinates must be numbers > 0 "
                                  "(they are interpolated in log space)")
    a = np.asarray(values, dtype=float)
    if (np.diff(a) <= 0).any():
        raise SimulatorInputError(f"{where}={values!r} must be strictly increasing")
    return a


def _etas(values: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    try:
        a = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as e:
        raise SimulatorInputError(f"{where} must be numbers of shape {shape}: {e}") from e
    if a.shape != shape:
        raise SimulatorInputError(f"{where} has shape {a.shape}; its axes give {shape}")
    bad = a[~((a > 0) & (a <= ETA_GRID_MAX))]
    if bad.size:
        raise SimulatorInputError(f"{where} has eta {float(bad.flat[0])!r}: every measured eta "
                                  f"must be in (0, {ETA_GRID_MAX}]")
    return a


def log2_axis(axis: np.ndarray) -> tuple[float, ...]:
    """``axis`` in log2, as the lookups take it: computed once per grid, since the cost model
    looks a grid up on every simulated step."""
    return tuple(math.log2(v) for v in axis)


def _interp_index(log_axis: Sequence[float], x: float) -> tuple[int, int, float]:
    """Neighbours and weight for x on an axis given in log2; clamped (held) outside it."""
    lx = math.log2(max(x, 1e-12))
    if lx <= log_axis[0]:
        return 0, 0, 0.0
    n = len(log_axis) - 1
    if lx >= log_axis[n]:
        return n, n, 0.0
    i = bisect.bisect_right(log_axis, lx) - 1
    return i, i + 1, (lx - log_axis[i]) / (log_axis[i + 1] - log_axis[i])


@dataclass(frozen=True)
class LogBilinear:
    """``table`` [len(x), len(y)] over two positive axes, bilinear in log2 of both, held
    outside them; the axes' log2 are taken once (the cost model looks tables up every step)."""

    x: np.ndarray
    y: np.ndarray
    table: np.ndarray
    _log_x: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _log_y: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_log_x", log2_axis(self.x))
        object.__setattr__(self, "_log_y", log2_axis(self.y))

    def __call__(self, x: float, y: float) -> float:
        i0, i1, wx = _interp_index(self._log_x, x)
        j0, j1, wy = _interp_index(self._log_y, y)
        t = self.table
        top = t[i0, j0] * (1 - wy) + t[i0, j1] * wy
        bot = t[i1, j0] * (1 - wy) + t[i1, j1] * wy
        return float(top * (1 - wx) + bot * wx)

    def at_x(self, x: float) -> Callable[[float], float]:
        """The table along y at a fixed ``x``: ``f(y) == self(x, y)`` to the last bit, with
        x's neighbours found once (the engine looks one batch size up along a run of
        decode steps)."""
        i0, i1, wx = _interp_index(self._log_x, x)
        r0, r1 = self.table[i0].tolist(), self.table[i1].tolist()
        log_y = self._log_y
        first, n = log_y[0], len(log_y) - 1
        end = log_y[n]
        search = bisect.bisect_right

        def f(y: float) -> float:
            # _interp_index(log_y, y), inline: this runs for every step of a run of decode
            # steps
            ly = math.log2(max(y, 1e-12))
            if ly <= first:
                j0 = j1 = 0
                wy = 0.0
            elif ly >= end:
                j0 = j1 = n
                wy = 0.0
            else:
                j0 = search(log_y, ly) - 1
                j1 = j0 + 1
                wy = (ly - log_y[j0]) / (log_y[j1] - log_y[j0])
            top = r0[j0] * (1 - wy) + r0[j1] * wy
            bot = r1[j0] * (1 - wy) + r1[j1] * wy
            return top * (1 - wx) + bot * wx
        return f


@dataclass(frozen=True)
class EtaGrid1D:
    """eta over one coordinate (GEMM token count m), for one GEMM of shape (n, k)."""

    x: np.ndarray
    eta: np.ndarray
    n: int = 0
    k: int = 0
    _log_x: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_log_x", log2_axis(self.x))

    @classmethod
    def from_dict(cls, d: Any, where: str) -> EtaGrid1D:
        if not isinstance(d, dict) or not {"m", "eta"} <= set(d):
            raise SimulatorInputError(f"{where} must be an object with 'm' and 'eta' lists")
        x = _axis(d["m"], f"{where}.m")
        nk = []
        for f in ("n", "k"):
            v = d.get(f, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SimulatorInputError(f"{where}.{f}={v!r} must be a GEMM dimension >= 1")
            nk.append(v)
        return cls(x, _etas(d["eta"], x.shape, f"{where}.eta"), nk[0], nk[1])

    def __call__(self, x: float) -> float:
        i, j, w = _interp_index(self._log_x, x)
        return float(self.eta[i] * (1 - w) + self.eta[j] * w)

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "k": self.k, "m": self.x.tolist(), "eta": self.eta.tolist()}


@dataclass(frozen=True)
class EtaGrid2D:
    """eta over two coordinates (decode: batch x mean context; prefill: chunk x past),
    bilinear in log2 of both, held at the edges. A zero second coordinate (no past) uses the
    smallest grid value."""

    x: np.ndarray
    y: np.ndarray
    eta: np.ndarray
    names: tuple[str, str]
    _lookup: LogBilinear = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", LogBilinear(self.x, self.y, self.eta))

    @classmethod
    def from_dict(cls, d: Any, names: tuple[str, str], where: str) -> EtaGrid2D:
        if not isinstance(d, dict) or not {*names, "eta"} <= set(d):
            raise SimulatorInputError(f"{where} must be an object with {names[0]!r}, "
                                      f"{names[1]!r} and 'eta' (a {names[0]} x {names[1]} "
                                      "table)")
        x = _axis(d[names[0]], f"{where}.{names[0]}")
        y = _axis(d[names[1]], f"{where}.{names[1]}")
        return cls(x, y, _etas(d["eta"], (len(x), len(y)), f"{where}.eta"), names)

    def __call__(self, x: float, y: float) -> float:
        return self._lookup(x, y)

    def at_x(self, x: float) -> Callable[[float], float]:
        """``LogBilinear.at_x``: eta along the second coordinate at a fixed first one."""
        return self._lookup.at_x(x)

    def to_dict(self) -> dict[str, Any]:
        return {self.names[0]: self.x.tolist(), self.names[1]: self.y.tolist(),
                "eta": self.eta.tolist()}


DECODE_AXES = ("batch", "context")
PREFILL_AXES = ("chunk", "past")


@dataclass(frozen=True)
class MeasuredGrids:
    gemm: dict[str, EtaGrid1D] = field(default_factory=dict)
    decode_attention: dict[str, EtaGrid2D] = field(default_factory=dict)
    prefill_attention: dict[str, EtaGrid2D] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> MeasuredGrids:
        if not isinstance(d, dict):
            raise SimulatorInputError(f"{where} must be an object")
        unknown = set(d) - {"gemm", "decode_attention", "prefill_attention", "provenance"}
        if unknown:
            raise SimulatorInputError(f"{where} has unknown grid kind(s) {sorted(unknown)}; "
                                      "allowed: gemm, decode_attention, prefill_attention")

        def table(kind: str) -> dict[str, Any]:
            t = d.get(kind, {})
            if not isinstance(t, dict):
                raise SimulatorInputError(f"{where}.{kind} must map names to grids")
            return t

        gemm = table("gemm")
        bad = set(gemm) - set(GEMM_OPS)
        if bad:
            raise SimulatorInputError(f"{where}.gemm has unknown op(s) {sorted(bad)}; allowed: "
                                      f"{', '.join(GEMM_OPS)}")
        return cls(
            gemm={k: EtaGrid1D.from_dict(v, f"{where}.gemm.{k}") for k, v in gemm.items()},
            decode_attention={k: EtaGrid2D.from_dict(v, DECODE_AXES,
                                                     f"{where}.decode_attention.{k}")
                              for k, v in table("decode_attention").items()},
            prefill_attention={k: EtaGrid2D.from_dict(v, PREFILL_AXES,
                                                      f"{where}.prefill_attention.{k}")
                               for k, v in table("prefill_attention").items()})

    def __bool__(self) -> bool:
        return bool(self.gemm or self.decode_attention or self.prefill_attention)

    def gemm_grid(self, op: str, n: int, k: int) -> EtaGrid1D | None:
        """The grid measured for this op at this shape; for another shape (another model, or
        tp > 1) the measured GEMM whose weight size n*k is nearest in log space, since GEMM
        efficiency follows the matrix size far more than the op's role; None without grids."""
        g = self.gemm.get(op)
        if g is not None and (g.n, g.k) == (n, k):
            return g
        shaped = [g for g in self.gemm.values() if g.n and g.k]
        if not shaped:
            return g
        return min(shaped, key=lambda g: abs(math.log(g.n * g.k) - math.log(max(n * k, 1))))

    def to_dict(self) -> dict[str, Any]:
        return {"gemm": {k: v.to_dict() for k, v in self.gemm.items()},
                "decode_attention": {k: v.to_dict() for k, v in self.decode_attention.items()},
                "prefill_attention": {k: v.to_dict() for k, v in self.prefill_attention.items()}}


def _optional_seconds(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise SimulatorInputError(f"{where}={v!r} must be a number >= 0")
    return float(v)


def _attention_scale(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= ATTENTION_SCALE_MAX:
        raise SimulatorInputError(f"{where}={v!r} must be in (0, {ATTENTION_SCALE_MAX:g}]")
    return float(v)


def _check_turnarounds(default: float, by_format: dict[str, float], launch: float,
                       launches: dict[str, float], where: str) -> None:
    """A turnaround follows timed launches: one given where no launch is (the default without
    ``eager_prefill_launch_s``, a format whose launch is 0) would never be used."""
    if default > 0.0 and launch == 0.0 and not launches:
        raise SimulatorInputError(
            f"{where}.eager_prefill_turnaround_s={default!r} needs eager_prefill_launch_s (the "
            "turnaround counts from the end of the timed launches)")
    for key, v in by_format.items():
        if v > 0.0 and launches.get(key, launch) == 0.0:
            raise SimulatorInputError(
                f"{where}.{PREFILL_TURNAROUNDS_FIELD}.{key}={v!r} needs a launch time for "
                f"{key!r} (eager_prefill_launch_s or {PREFILL_LAUNCHES_FIELD}.{key})")


def _by_format(d: dict[str, Any], name: str, value: Callable[[Any, str], float], what: str,
               where: str) -> dict[str, float]:
    """Optional field ``name`` of ``d``: KV format -> a value that ``value`` checks."""
    by_format = d.get(name, {})
    if not isinstance(by_format, dict):
        raise SimulatorInputError(f"{where}.{name} must map KV formats to {what}, "
                                  f"got {by_format!r}")
    return {str(k): value(v, f"{where}.{name}.{k}") for k, v in by_format.items()}


@dataclass(frozen=True)
class Calibration:
    gpu: str
    eta_mem_gemm: float
    eta_comp_gemm: float
    eta_comp_prefill_attention: float
    eta_comp_decode_attention: float
    eta_interconnect: float
    eta_mem_decode_attention: dict[str, float]
    allreduce_latency_s: float
    layer_overhead_s: float
    eager_layer_overhead_s: float
    step_overhead_s: float
    seq_overhead_s: float
    cuda_context_gib: float
    post_load_overhead_gib: float
    provenance: dict[str, Any]
    source_file: str
    prefill_step_overhead_s: float = 0.0
    prefill_seq_overhead_s: float = 0.0
    prefill_token_overhead_s: float = 0.0
    release_overhead_s: float = 0.0
    first_token_latency_s: float = 0.0
    eager_prefill_launch_s: float = 0.0
    eager_prefill_launch_s_by_format: dict[str, float] = field(default_factory=dict)
    eager_prefill_turnaround_s: float = 0.0
    eager_prefill_turnaround_s_by_format: dict[str, float] = field(default_factory=dict)
    eager_decode_host_s: float = 0.0
    eager_decode_host_s_by_format: dict[str, float] = field(default_factory=dict)
    eager_decode_host_per_req_s: float = 0.0
    eager_decode_host_per_req_s_by_format: dict[str, float] = field(default_factory=dict)
    eager_launch_holds_loop: bool = False
    decode_attention_scale: float = 1.0
    decode_attention_scale_by_format: dict[str, float] = field(default_factory=dict)
    isolated_prefill_scale: float = 1.0
    prefill_clock_recovery_s: float = PREFILL_CLOCK_RECOVERY_S
    eager_decode_layer_overhead_s: float | None = None
    measured: MeasuredGrids = field(default_factory=MeasuredGrids)
    # the "measured" object as read (raw times, masks, provenance): written back unchanged
    measured_raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def eager_decode_layer_s(self) -> float:
        """Per-layer cost of a decode step outside the CUDA graphs."""
        v = self.eager_decode_layer_overhead_s
        return self.eager_layer_overhead_s if v is None else v

    def prefill_clock_scale(self, gap_s: float) -> float:
        """The factor on a prefill step's kernel time ``gap_s`` seconds after the previous
        prefill step ended (0: back to back, at the grids' clocks: 1)."""
        s = self.isolated_prefill_scale
        if s == 1.0 or gap_s <= 0.0:
            return 1.0
        if self.prefill_clock_recovery_s == 0.0:
            return s
        return s + (1.0 - s) * math.exp(-gap_s / self.prefill_clock_recovery_s)

    def attention_scale(self, key: str) -> float:
        """The in-server decode attention factor of KV format ``key`` (its own where the
        file gives one, else the default ``decode_attention_scale``)."""
        return self.decode_attention_scale_by_format.get(key, self.decode_attention_scale)

    def prefill_launch_s(self, key: str) -> float:
        """The host's time to launch an eager prefill step on KV format ``key`` (its own
        where the file gives one, else ``eager_prefill_launch_s``; 0: not timed)."""
        return self.eager_prefill_launch_s_by_format.get(key, self.eager_prefill_launch_s)

    def prefill_turnaround_s(self, key: str) -> float:
        """The host's time from an eager prefill's launches to the next step's launch on KV
        format ``key`` (its own where the file gives one, else
        ``eager_prefill_turnaround_s``; 0: not timed)."""
        return self.eager_prefill_turnaround_s_by_format.get(key, self.eager_prefill_turnaround_s)

    def decode_host_s(self, key: str) -> float:
        """The host's time for an iteration around an eager decode step on KV format ``key``
        (its own where the file gives one, else ``eager_decode_host_s``; 0: not timed)."""
        return self.eager_decode_host_s_by_format.get(key, self.eager_decode_host_s)

    def decode_host_per_req_s(self, key: str) -> float:
        """What that iteration adds per request in the batch on KV format ``key`` (its own
        where the file gives one, else ``eager_decode_host_per_req_s``; 0: a flat floor)."""
        return self.eager_decode_host_per_req_s_by_format.get(key, self.eager_decode_host_per_req_s)

    def attention_eta(self, key: str) -> float:
        if key not in self.eta_mem_decode_attention:
            raise SimulatorInputError(
                f"calibration {self.source_file} for {self.gpu} has no decode-attention eta for "
                f"KV format {key!r}; it has {sorted(self.eta_mem_decode_attention)}"
            )
        return self.eta_mem_decode_attention[key]

    @classmethod
    def from_dict(cls, gpu: str, d: dict[str, Any], source: str) -> Calibration:
        where = f"{source}: gpus.{gpu}"
        missing = [f for f in (*ETA_FIELDS, *SECONDS_FIELDS, *GIB_FIELDS,
                               "eta_mem_decode_attention", "provenance") if f not in d]
        if missing:
            raise SimulatorInputError(f"{where} lacks field(s) {missing}")
        for f, why in REMOVED_FIELDS.items():
            if f in d:
                raise SimulatorInputError(f"{where}.{f}: {why}; delete the key")
        for f in ETA_FIELDS:
            v = d[f]
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise SimulatorInputError(f"{where}.{f}={v!r} must be in (0, 1]")
        etas = d["eta_mem_decode_attention"]
        if not isinstance(etas, dict) or not etas:
            raise SimulatorInputError(f"{where}.eta_mem_decode_attention must map formats to eta")
        for k, v in etas.items():
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise SimulatorInputError(f"{where}.eta_mem_decode_attention.{k}={v!r} must be "
                                          "in (0, 1]")
        for f in (*SECONDS_FIELDS, *GIB_FIELDS):
            v = d[f]
            if not isinstance(v, (int, float)) or v < 0:
                raise SimulatorInputError(f"{where}.{f}={v!r} must be a number >= 0")
        if not isinstance(d["provenance"], dict) or "source" not in d["provenance"]:
            raise SimulatorInputError(f"{where}.provenance must be an object with a 'source'")
        optional = {f: _optional_seconds(d.get(f, 0.0), f"{where}.{f}")
                    for f in OPTIONAL_SECONDS_FIELDS}
        scale = _attention_scale(d.get(ATTENTION_SCALE_FIELD, 1.0),
                                 f"{where}.{ATTENTION_SCALE_FIELD}")
        scales = _by_format(d, ATTENTION_SCALES_FIELD, _attention_scale, "factors", where)
        launches = _by_format(d, PREFILL_LAUNCHES_FIELD, _optional_seconds, "seconds", where)
        turnarounds = _by_format(d, PREFILL_TURNAROUNDS_FIELD, _optional_seconds, "seconds",
                                 where)
        _check_turnarounds(optional["eager_prefill_turnaround_s"], turnarounds,
                           optional["eager_prefill_launch_s"], launches, where)
        hosts = _by_format(d, DECODE_HOST_FIELD, _optional_seconds, "seconds", where)
        per_req = _by_format(d, DECODE_HOST_PER_REQ_FIELD, _optional_seconds, "seconds", where)
        isolated = d.get(ISOLATED_PREFILL_FIELD, 1.0)
        if (isinstance(isolated, bool) or not isinstance(isolated, (int, float))
                or not ISOLATED_PREFILL_MIN <= isolated <= 1.0):
            raise SimulatorInputError(f"{where}.{ISOLATED_PREFILL_FIELD}={isolated!r} must be "
                                      f"in [{ISOLATED_PREFILL_MIN:g}, 1]")
        recovery = d.get(PREFILL_CLOCK_RECOVERY_FIELD, PREFILL_CLOCK_RECOVERY_S)
        if (isinstance(recovery, bool) or not isinstance(recovery, (int, float))
                or not 0 <= recovery <= PREFILL_CLOCK_RECOVERY_MAX_S):
            raise SimulatorInputError(f"{where}.{PREFILL_CLOCK_RECOVERY_FIELD}={recovery!r} "
                                      f"must be seconds in [0, {PREFILL_CLOCK_RECOVERY_MAX_S:g}]")
        holds_loop = d.get(LAUNCH_HOLDS_LOOP_FIELD, False)
        if not isinstance(holds_loop, bool):
            raise SimulatorInputError(f"{where}.{LAUNCH_HOLDS_LOOP_FIELD}={holds_loop!r} must "
                                      "be true or false")
        eager_decode = d.get(EAGER_DECODE_FIELD)
        if eager_decode is not None:
            eager_decode = _optional_seconds(eager_decode, f"{where}.{EAGER_DECODE_FIELD}")
        raw = d.get("measured", {})
        measured = MeasuredGrids.from_dict(raw, f"{where}.measured")
        return cls(gpu=gpu, eta_mem_decode_attention={k: float(v) for k, v in etas.items()},
                   provenance=dict(d["provenance"]), source_file=source, measured=measured,
                   measured_raw=dict(raw) if isinstance(raw, dict) else {},
                   decode_attention_scale=scale, decode_attention_scale_by_format=scales,
                   eager_prefill_launch_s_by_format=launches,
                   eager_prefill_turnaround_s_by_format=turnarounds,
                   eager_decode_host_s_by_format=hosts,
                   eager_decode_host_per_req_s_by_format=per_req,
                   eager_launch_holds_loop=holds_loop,
                   eager_decode_layer_overhead_s=eager_decode,
                   isolated_prefill_scale=float(isolated),
                   prefill_clock_recovery_s=float(recovery),
                   **{f: float(d[f]) for f in (*ETA_FIELDS, *SECONDS_FIELDS, *GIB_FIELDS)},
                   **optional)

    def to_dict(self) -> dict[str, Any]:
        """The GPU entry as JSON (the schema ``from_dict`` reads)."""
        d: dict[str, Any] = {"provenance": dict(self.provenance)}
        d.update({f: getattr(self, f) for f in (*ETA_FIELDS, *SECONDS_FIELDS, *GIB_FIELDS)})
        d.update({f: getattr(self, f) for f in OPTIONAL_SECONDS_FIELDS if getattr(self, f)})
        if self.eager_decode_layer_overhead_s is not None:
            d[EAGER_DECODE_FIELD] = self.eager_decode_layer_overhead_s
        if self.decode_attention_scale != 1.0:
            d[ATTENTION_SCALE_FIELD] = self.decode_attention_scale
        if self.decode_attention_scale_by_format:
            d[ATTENTION_SCALES_FIELD] = dict(self.decode_attention_scale_by_format)
        if self.eager_prefill_launch_s_by_format:
            d[PREFILL_LAUNCHES_FIELD] = dict(self.eager_prefill_launch_s_by_format)
        if self.eager_prefill_turnaround_s_by_format:
            d[PREFILL_TURNAROUNDS_FIELD] = dict(self.eager_prefill_turnaround_s_by_format)
        if self.eager_decode_host_s_by_format:
            d[DECODE_HOST_FIELD] = dict(self.eager_decode_host_s_by_format)
        if self.eager_decode_host_per_req_s_by_format:
            d[DECODE_HOST_PER_REQ_FIELD] = dict(self.eager_decode_host_per_req_s_by_format)
        if self.eager_launch_holds_loop:
            d[LAUNCH_HOLDS_LOOP_FIELD] = True
        if self.isolated_prefill_scale != 1.0:
            d[ISOLATED_PREFILL_FIELD] = self.isolated_prefill_scale
        if self.prefill_clock_recovery_s != PREFILL_CLOCK_RECOVERY_S:
            d[PREFILL_CLOCK_RECOVERY_FIELD] = self.prefill_clock_recovery_s
        d["eta_mem_decode_attention"] = dict(self.eta_mem_decode_attention)
        if self.measured:
            # raw extras (time_s, masks) kept; the parsed grids are the authority for eta
            raw = {k: v for k, v in self.measured_raw.items()}
            parsed = self.measured.to_dict()
            for kind, grids in parsed.items():
                merged = dict(raw.get(kind, {}))
                for name, g in grids.items():
                    merged[name] = {**merged.get(name, {}), **g}
                raw[kind] = merged
            d["measured"] = raw
        return d


def load_calibration(gpu: str, path: str | Path | None = None) -> Calibration:
    if path is None:
        text = resources.files("simulator.calibration").joinpath("default.json").read_text()
        source = "simulator/calibration/default.json"
        data = parse_json(text, source, SimulatorInputError)
    else:
        source = str(path)
        data = read_json(path, "calibration", SimulatorInputError)
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(gpus, dict):
        raise SimulatorInputError(f"{source}: expected an object with a 'gpus' mapping")
    if gpu not in gpus:
        raise SimulatorInputError(f"{source} has no calibration for GPU {gpu!r}; it has "
                                  f"{sorted(gpus)}")
    return Calibration.from_dict(gpu, gpus[gpu], source)
