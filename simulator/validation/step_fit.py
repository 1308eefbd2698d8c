"""Fit a backend's fixed step costs from the Decode intervals of one or more server logs,
including the intervals that hold prefill steps (open-loop arrivals at a low rate).

Between two Decode lines SGLang runs exactly ``decode_log_interval`` decode steps plus the
prefill steps whose Prefill lines were logged in between, and the later line's ``gen
throughput`` is the interval's decode tokens over its wall time. So each interval is one
equation (``fit.py``'s module docstring has the details):

    wall = sum over its steps of the model's kernel time other than decode attention
           + s_attn * the model's decode attention time
           + steps * c_step + decode tokens and prefill chunks * c_seq
           + prefill steps * p_step + prefill chunks * p_seq + prompt tokens * p_tok
           + requests released in the interval * c_rel
           + layers of the decode steps no CUDA graph runs * c_eager

where the kernel times come from the calibration's grids and the eight terms are what is fitted
(``c_step``/``c_seq``: every step, ``step_overhead_s``/``seq_overhead_s``; ``p_*``: prefill
steps only, ``prefill_{step,seq,token}_overhead_s``; ``c_rel``: ``release_overhead_s``, per
request that finished, counted in decode-only intervals as how far the batch shrank from the
earlier line to the later one (an interval with prefills gets no count: its joins and
finishes cannot be told apart), fitted when enough decode intervals have releases and enough
have none, and kept only when it cuts the decode rows' error by ``RELEASE_GAIN``; ``c_eager``:
``eager_decode_layer_overhead_s``, the per-layer cost of a decode step above the largest
captured batch, which runs outside the CUDA graphs: its launches and host work, fitted when the
rows hold enough eager and graphed decode intervals (where the calibration times the host's
iteration around such a step, ``eager_decode_host_s``, the step lasts the longer of that and
its kernels, which no linear term fits: its intervals are left out and ``c_eager`` is neither
fitted nor used; the refinement sees those steps whole, in the fitting runs' metrics); a
prefill step keeps the calibration's
``eager_layer_overhead_s`` in its kernel time (or, with ``eager_prefill_launch_s``, lasts the
longer of its launches, with the host's turnaround after them (``eager_prefill_turnaround_s``),
and its kernels with ``p_tok`` per prompt token, the launches begun a
decode step's kernel time before it, as the overlap scheduler launches a prefill while a decode
step runs: which side holds depends on ``p_tok`` itself, so the fit iterates to a fixed point,
``LaunchFloors``) and its own terms absorb the rest; ``s_attn``:
``decode_attention_scale``, the decode attention kernel in a serving step against its grid
measured alone: long contexts at a large batch weigh it, short ones at a small batch hardly).
An interval's decode tokens are approximated by the interval times the mean of its two lines'
``#running-req`` (a prefill adds its requests somewhere inside). Back-to-back Prefill lines
outside any used interval (a burst of whole prompts before decoding starts) each give one more
equation with a single prefill step (``fit.prefill_samples``). Under the overlap scheduler
every line is logged one step late, which shifts an interval by one step but keeps its step
count; a burst's first gap is the step before it, and an interval that spans idle time is no
step time at all: rows off the fit by more than ``OUTLIER_FACTOR`` are dropped (two passes,
named in the result).

Non-negative least squares in relative error, so a short decode interval and a long prefill
burst count alike. A term whose column is zero on every row (no prefill rows: the prefill
costs; no decode rows: the decode ones and the attention scale) or that the rows cannot
separate keeps the calibration's value: ``c_seq`` when the decode batch barely varies (a
single long-generation run), ``p_seq`` and ``p_tok`` when the prompts or the tokens per prefill
step barely vary; with neither varying, ``p_step`` is kept too and the residual is charged per
prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.sglang_log import ServerLog, decode_intervals
from simulator.errors import SimulatorInputError
from simulator.serving.cost import StepShape
from simulator.serving.server import ResolvedServer
from simulator.validation.fit import SPREAD_MIN, _nnls, _shape, prefill_samples, prefill_shape

COSTS = ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
         "prefill_seq_overhead_s", "prefill_token_overhead_s", "release_overhead_s",
         "eager_decode_layer_overhead_s", "decode_attention_scale")
ATTN = len(COSTS) - 1      # the attention column, one per KV format in the fit
TOKEN = COSTS.index("prefill_token_overhead_s")
EAGER = ATTN - 1
RELEASE = EAGER - 1
# decode intervals on each side (eager and graphed; with and without releases) needed to fit
# c_eager, or c_rel, apart from the per-step and the prefill-step costs
MIN_SPLIT_ROWS = 3
# relative cut in the decode rows' error that c_rel must bring to be fitted
RELEASE_GAIN = 0.05
MIN_ROWS = 8
# passes of the fit over which steps their launches bound (LaunchFloors) before it stops
MAX_FLOOR_PASSES = 8
OUTLIER_FACTOR = 1.5
DEFAULT_DECODE_LOG_INTERVAL = 40


@dataclass
class StepRows:
    """Equations from logs: measured wall seconds ``y``, the model's kernel time ``base`` for
    the same steps (no fitted cost in it), the count behind each cost in COSTS (``feats``),
    and where each row came from."""

    y: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)
    feats: list[list[float]] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)     # decode | prefill-interval | burst
    fmt: list[str] = field(default_factory=list)      # KV format: whose attention scale
    # per row, (launches less kernels, prompt tokens) of each prefill step a launch floor
    # may bound: ``base`` and the token count hold its kernel-bound side (``LaunchFloors``)
    floors: list[tuple[tuple[float, float], ...]] = field(default_factory=list)
    host_bound: int = 0   # eager decode intervals left out: eager_decode_host_s bounds them

    def add(self, y: float, base: float, feats: list[float], where: str, kind: str,
            fmt: str, floors: tuple[tuple[float, float], ...] = ()) -> None:
        self.y.append(y)
        self.base.append(base)
        self.feats.append(feats)
        self.where.append(where)
        self.kind.append(kind)
        self.fmt.append(fmt)
        self.floors.append(floors)

    def __len__(self) -> int:
        return len(self.y)

    def rows(self) -> zip:
        """Each row as ``add``'s arguments."""
        return zip(self.y, self.base, self.feats, self.where, self.kind, self.fmt, self.floors,
                   strict=True)

    def extend(self, other: StepRows) -> None:
        for row in other.rows():
            self.add(*row)
        self.host_bound += other.host_bound

    def of_kinds(self, *kinds: str) -> StepRows:
        out = StepRows(host_bound=self.host_bound)
        for row in self.rows():
            if row[4] in kinds:
                out.add(*row)
        return out


def _kernels(server: ResolvedServer, shape: StepShape
             ) -> tuple[float, float, float, float | None]:
    """The model's step time without any of the fitted terms, its decode attention time at
    scale 1, the layers that pay the eager decode launch cost (0 for a CUDA-graph step and
    for a prefill step, whose own eager cost stays in the time: the prefill-step terms
    absorb any difference), and for a prefill step that a launch floor may bound, how far
    its launches and the turnaround after them (``CostModel.launch_floor_s``) outlast that
    time (None for any other step): the time is then its
    kernel-bound side, as if the launches never held it back."""
    cal, cost = server.deployment.calibration, server.cost
    t = cost.step_time(shape, launch_floor=False)
    t -= cal.step_overhead_s + cal.seq_overhead_s * (shape.decode_reqs + shape.prefill_seqs)
    t -= cal.release_overhead_s * shape.released_reqs
    if shape.prefill_tokens:
        t -= (cal.prefill_step_overhead_s + cal.prefill_seq_overhead_s * shape.prefill_seqs
              + cal.prefill_token_overhead_s * shape.prefill_tokens)
    eager_layers = float(cost.layers) if cost.eager_decode(shape) else 0.0
    t -= eager_layers * cal.eager_decode_layer_s
    attn = 0.0
    if shape.decode_reqs:
        attn = cost.layers * cost.decode_attention_time(
            shape.decode_reqs, shape.decode_kv_tokens, shape.decode_read_bytes)
    floor = (cost.launch_floor_s(shape) - t
             if shape.prefill_tokens and cost.prefill_launch_s > 0.0 else None)
    return t - attn, attn / cost.attention_scale, eager_layers, floor


def decode_log_interval(log: ServerLog) -> int:
    v = log.server_args.get("decode_log_interval")
    return int(v) if v and v.isdigit() else DEFAULT_DECODE_LOG_INTERVAL


def step_rows(server: ResolvedServer, log: ServerLog, name: str, graphed: bool | None,
              rows: StepRows | None = None, skip_fraction: float = 0.0) -> StepRows:
    """Append the equations of one log (``name`` labels its rows). ``graphed``: keep only
    intervals whose two Decode lines carry this ``cuda graph:`` flag (None: all).
    ``skip_fraction``: leave out the first part of the Decode lines (a server still warming
    up: its first prompts of each new length allocate, its first steps run slower)."""
    if not 0.0 <= skip_fraction < 1.0:
        raise SimulatorInputError(f"skip_fraction={skip_fraction!r} must be in [0, 1)")
    rows = rows if rows is not None else StepRows()
    fmt = server.cost.attention_key
    n = decode_log_interval(log)
    used: list[tuple[int, int]] = []
    first = max(1, int(skip_fraction * len(log.decode_running)))
    start_line = log.decode_line_no[first - 1] if log.decode_running else 0
    overlapped = (server.cost.prefill_launch_s > 0.0 and server.cost.prefill_launch_overlaps
                  and not server.deployment.settings.disable_overlap_schedule)
    for iv in decode_intervals(log, n, first):
        a, b = iv.first_line, iv.last_line
        flags = {log.decode_cuda_graph[iv.index - 1], log.decode_cuda_graph[iv.index]} - {None}
        if graphed is not None and flags - {graphed}:
            continue
        b0, b1 = iv.running
        if not (b0 > 0 and b1 > 0):
            continue
        dec = _shape(server, iv.batch, iv.tokens)
        # the model must run the interval's steps the way the server did (a batch crossing
        # the largest captured size inside the interval, or a mixed pair of flags, is both)
        if len(flags) > 1 or (flags and server.cost.graphed(dec) not in flags):
            continue
        if server.cost.host_bound_floor(dec):
            rows.host_bound += 1  # max(host, kernels): not linear in the terms (docstring)
            continue
        rest, attn, eager, _ = _kernels(server, dec)
        base = n * rest
        feats = [float(n), n * float(dec.decode_reqs), 0.0, 0.0, 0.0, 0.0, n * eager, n * attn]
        if not iv.prefills:
            feats[RELEASE] = float(max(0, b0 - b1))
        floors: list[tuple[float, float]] = []
        for j in iv.prefills:
            seqs = log.prefill_new_seqs[j]
            tok = log.prefill_new_tokens[j]
            if seqs <= 0 or tok <= 0:
                continue
            # launched while a decode step ran (the overlap scheduler): its launches had
            # that step's kernel time of head start (the fitted fixed terms left out)
            shape = replace(prefill_shape(server, seqs, tok, log.prefill_cached_tokens[j]),
                            launch_head_start_s=rest + attn * server.cost.attention_scale
                            if overlapped else 0.0)
            p_rest, _, _, floor = _kernels(server, shape)
            base += p_rest
            if floor is not None:
                floors.append((floor, float(shape.prefill_tokens)))
            feats[0] += 1
            feats[1] += shape.prefill_seqs
            feats[2] += 1
            feats[3] += shape.prefill_seqs
            feats[4] += shape.prefill_tokens
        used.append((a, b))
        rows.add(iv.wall_s, base, feats, f"{name} lines {a}-{b}",
                 "prefill-interval" if feats[2] else "decode", fmt, tuple(floors))
    for seqs, tok, cached, secs, no in prefill_samples(log):
        if no < start_line or any(a < no < b for a, b in used):
            continue
        # a burst's steps run back to back, at the grids' clocks (no isolated_prefill_scale)
        shape = replace(prefill_shape(server, int(seqs), int(tok), int(cached)),
                        prefill_gap_s=0.0)
        p_rest, _, _, floor = _kernels(server, shape)
        rows.add(float(secs), p_rest,
                 [1.0, float(shape.prefill_seqs), 1.0, float(shape.prefill_seqs), float(tok),
                  0.0, 0.0, 0.0],
                 f"{name} line {int(no)}", "burst", fmt,
                 ((floor, float(shape.prefill_tokens)),) if floor is not None else ())
    return rows


@dataclass(frozen=True)
class LaunchFloors:
    """The prefill steps of the rows that a launch floor may bound, flattened: step ``i`` of
    row ``row[i]`` lasts max(kernels + p_tok * ``tokens[i]``, kernels + ``gap[i]``), its
    launches. Which side holds depends on p_tok, the fit's own unknown: at a given p_tok a
    launch-bound step adds ``gap`` to its row's base and takes its tokens out of the p_tok
    column, which keeps every row linear; ``fit_step_costs`` iterates to a fixed point."""

    row: np.ndarray
    gap: np.ndarray
    tokens: np.ndarray
    rows: int

    @classmethod
    def of(cls, rows: StepRows) -> LaunchFloors:
        steps = np.array([(r, gap, tok) for r, floors in enumerate(rows.floors)
                          for gap, tok in floors], dtype=float).reshape(-1, 3)
        return cls(steps[:, 0].astype(int), steps[:, 1], steps[:, 2], len(rows))

    def bound(self, p_tok: float) -> np.ndarray:
        """Which steps their launches outlast at per-token cost ``p_tok``."""
        return self.gap > p_tok * self.tokens

    def apply(self, base: np.ndarray, x: np.ndarray, bound: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        """``base`` and ``x`` with the ``bound`` steps lasting their launches."""
        r = self.row[bound]
        x = x.copy()
        x[:, TOKEN] -= np.bincount(r, weights=self.tokens[bound], minlength=self.rows)
        return base + np.bincount(r, weights=self.gap[bound], minlength=self.rows), x


def _solve(x: np.ndarray, y: np.ndarray, base: np.ndarray, given: np.ndarray,
           free: list[int]) -> np.ndarray:
    fixed = [j for j in range(x.shape[1]) if j not in free]
    target = y - base - (x[:, fixed] @ given[fixed] if fixed else 0.0)
    theta = given.copy()
    theta[free] = _nnls(x[:, free] / y[:, None], target / y)
    return theta


def _fit_dropping_outliers(x: np.ndarray, y: np.ndarray, base: np.ndarray, given: np.ndarray,
                           free: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(theta, rows kept, prediction): two passes that drop rows off the fit by more than
    OUTLIER_FACTOR, then the fit on the rest."""
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        if keep.sum() < MIN_ROWS:
            raise SimulatorInputError(
                f"need at least {MIN_ROWS} rows within a factor {OUTLIER_FACTOR:g} of the "
                f"fit; {int(keep.sum())} of {len(y)} are")
        theta = _solve(x[keep], y[keep], base[keep], given, free)
        keep = np.abs(np.log(y / (base + x @ theta))) <= np.log(OUTLIER_FACTOR)
    theta = _solve(x[keep], y[keep], base[keep], given, free)
    return theta, keep, base + x @ theta


def fit_step_costs(server: ResolvedServer, rows: StepRows) -> dict[str, Any]:
    """The terms of COSTS over ``rows`` (see the module docstring), the attention scale once
    per KV format in the rows (their fixed costs are shared: one backend); ``server`` gives
    the calibration whose values the terms that cannot be fitted keep."""
    if len(rows) < MIN_ROWS:
        left_out = (f" ({rows.host_bound} eager decode intervals left out: the calibration "
                    "times their host iteration, eager_decode_host_s)" if rows.host_bound
                    else "")
        raise SimulatorInputError(
            f"need at least {MIN_ROWS} timed intervals or prefill steps; the logs have "
            f"{len(rows)}{left_out}")
    cal = server.deployment.calibration
    y, base = np.array(rows.y), np.array(rows.base)
    xf = np.array(rows.feats, dtype=float)
    fmts = np.array(rows.fmt)
    # decode rows' formats, the most frequent first (its factor becomes the file's default)
    names, counts = np.unique(fmts[xf[:, ATTN] > 0], return_counts=True)
    formats = [str(f) for f in names[np.argsort(-counts, kind="stable")]]
    attn = ATTN + np.arange(len(formats))
    x = np.column_stack([xf[:, :ATTN]] + [xf[:, ATTN] * (fmts == f) for f in formats])
    given = np.array([cal.eager_decode_layer_s if j == EAGER else getattr(cal, k)
                      for j, k in enumerate(COSTS[:ATTN])]
                     + [cal.attention_scale(f) for f in formats], dtype=float)

    def spread(v: np.ndarray) -> float:
        return float(np.std(v) / np.mean(v)) if v.size else 0.0

    dec = xf[:, ATTN] > 0
    batch_spread = spread(x[dec, 1] / x[dec, 0])
    free = ([0, *attn] + ([1] if batch_spread >= SPREAD_MIN else [])) if dec.any() else []
    pf = x[:, 2] > 0
    seq_spread = spread(x[pf, 3] / x[pf, 2])
    tok_spread = spread(x[pf, 4] / x[pf, 2])
    if pf.any():
        varying = [j for j, v in ((3, seq_spread), (4, tok_spread)) if v >= SPREAD_MIN]
        free += [2, *varying] if varying else [4]
    # eager decode steps: their per-layer cost apart from the per-step cost (which the graphed
    # decode steps pay without it)
    eager_dec = dec & (xf[:, EAGER] > 0.5)
    eager_rows = int(eager_dec.sum())
    if eager_rows >= MIN_SPLIT_ROWS and int((dec & ~eager_dec).sum()) >= MIN_SPLIT_ROWS:
        free.append(EAGER)
    free = sorted(int(j) for j in free)

    def mape(p: np.ndarray, m: np.ndarray) -> float | None:
        return float(np.mean(np.abs(p[m] / y[m] - 1))) if m.any() else None

    def fit(base: np.ndarray, x: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], float | None]:
        theta, keep, pred = _fit_dropping_outliers(x, y, base, given, free)
        # c_rel only where it earns its place: releases come with prefills and batch changes,
        # so a backend whose releases cost nothing still gets a value from noise (which then
        # moves the prefill terms); keep it when it cuts the decode rows' error by
        # RELEASE_GAIN
        releasing = dec & (xf[:, RELEASE] > 0)
        if not (int(releasing.sum()) >= MIN_SPLIT_ROWS
                and int((dec & ~releasing).sum()) >= MIN_SPLIT_ROWS):
            return theta, keep, pred, free, None
        with_rel = _fit_dropping_outliers(x, y, base, given, sorted([*free, RELEASE]))
        e0 = mape(pred, keep & dec) or 0.0
        e1 = mape(with_rel[2], with_rel[1] & dec) or 0.0
        gain = 1.0 - e1 / e0 if e0 > 0 else 0.0
        if gain >= RELEASE_GAIN:
            return *with_rel, sorted([*free, RELEASE]), gain
        return theta, keep, pred, free, gain

    # which prefill steps their launches bound follows the fitted p_tok: refit until the
    # set stops changing. A fit whose steps are all launch-bound has no token column to
    # move p_tok with (a fixed point at any p_tok), so the fit begins from several p_tok:
    # the calibration's, none on the launch side, and the deciles of the per-token costs
    # at which a step turns kernel-bound; it keeps the one whose result, with each step's
    # side at its own p_tok, fits best
    floors = LaunchFloors.of(rows)
    calibrated = floors.bound(given[TOKEN])
    base_b, x_b = floors.apply(base, x, calibrated)
    before = base_b + x_b @ given

    def settle(bound: np.ndarray) -> dict[str, Any]:
        passes = 0
        while True:
            passes += 1
            base_p, x_p = floors.apply(base, x, bound)
            theta, keep, pred, fitted, gain = fit(base_p, x_p)
            settled = floors.bound(theta[TOKEN])
            same = bool(np.array_equal(settled, bound))
            if same or passes == MAX_FLOOR_PASSES:
                # judged with each step on the side its fitted p_tok puts it
                b, xs = (base_p, x_p) if same else floors.apply(base, x, settled)
                return {"theta": theta, "keep": keep, "pred": pred, "fitted": fitted,
                        "release_gain": gain, "base": base_p, "x": x_p, "bound": bound,
                        "passes": passes, "settled": same, "mape": mape(b + xs @ theta, keep)}
            bound = settled

    turning = floors.gap > 0
    turns = floors.gap[turning] / floors.tokens[turning]
    starts: dict[bytes, np.ndarray] = {}
    for p_tok in [given[TOKEN], np.inf,
                  *(np.quantile(turns, np.linspace(0.1, 0.9, 9)) if turns.size else ())]:
        bound = floors.bound(p_tok)
        starts.setdefault(bound.tobytes(), bound)
    best = min((settle(b) for b in starts.values()), key=lambda r: r["mape"] or 0.0)
    theta, keep, pred, fitted = best["theta"], best["keep"], best["pred"], best["fitted"]
    kinds = np.array(rows.kind)

    by_kind = {k: {"rows": int((keep & (kinds == k)).sum()),
                   "mape": mape(pred, keep & (kinds == k)),
                   "mape_before": mape(before, keep & (kinds == k))}
               for k in ("decode", "prefill-interval", "burst")}
    scales = {f: float(theta[j]) for f, j in zip(formats, attn, strict=True)}
    return {**{k: float(v) for k, v in zip(COSTS[:ATTN], theta[:ATTN], strict=True)},
            "decode_attention_scale": (scales[formats[0]] if formats
                                       else cal.decode_attention_scale),
            "decode_attention_scale_by_format": scales,
            "fitted": [COSTS[j] for j in fitted if j <= ATTN],
            "kept": [COSTS[j] for j in range(len(COSTS)) if j not in fitted],
            "eager_decode_rows": eager_rows,
            "release_gain": best["release_gain"],
            "rows": int(keep.sum()), "by_kind": by_kind,
            "dropped": [f"{w}: {1e3 * m:.1f} ms measured vs {1e3 * p:.1f} ms fitted"
                        for w, m, p, k in zip(rows.where, y, pred, keep, strict=True) if not k],
            "mape": mape(pred, keep), "mape_before": mape(before, keep),
            "kernel_share": float(np.mean(
                (best["base"][keep] + best["x"][keep, ATTN:] @ theta[ATTN:]) / y[keep])),
            "launch_bound_steps": int(best["bound"].sum()),
            "launch_floored_steps": len(best["bound"]),
            "floor_passes": best["passes"], "floor_settled": best["settled"],
            "decode_batch_spread": batch_spread, "prefill_seqs_per_step_spread": seq_spread,
            "prefill_tokens_per_step_spread": tok_spread}
