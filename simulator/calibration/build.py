"""Turn kernel micro-benchmark measurements into a calibration file (the schema
``simulator.specs.calibration`` loads), with provenance.

``scripts/calibrate_gpu.py`` writes the raw measurements (``measurements.json``) on the GPU and
calls ``build_calibration`` on them; the same function rebuilds the file on a CPU machine
(``python -m simulator.calibration.build measurements.json --out cal.json``). Every eta is
speed-of-light time / measured time, with the speed-of-light times of the cost model itself
(``CostModel.gemm_sol`` / ``decode_attention_sol`` / ``prefill_attention_sol``), so at a grid
point the simulator reproduces the measured time exactly.

Measurements schema (one JSON object):

  {"gpu": "h100", "model": "llama-3-8b", "provenance": {...},
   "gemm":    [{"op": "qkv", "m": 64, "time_s": 3.1e-5}, ...],
   "decode":  [{"format": "bf16", "batch": 32, "context": 1024, "time_s": 1.2e-4,
                "read_bytes": 6.7e7 (optional: physical bytes the kernel read; default: the
                simulator pool's bytes for that format)}, ...],
   "prefill": [{"format": "bf16", "chunk": 2048, "past": 0, "time_s": 3e-4}, ...]}

``format`` is a calibration key (bf16, fp8, K8V4, K4V2, diffkv); ``time_s`` is per layer (one
kernel call) and may be null for a point that was not measured (skipped for memory or time):
such points take the eta of the nearest measured point of the same row (batch / chunk), then
column, i.e. the grid holds its edge values, as it does outside its range.

A later decode kernel timed on its own (``--decode-grid``: a kernel comparison file such as
``docs/data/h100-2026-11-22/kernels/cuda-split/grid_cuda_vs_asm.json``, whose ``decode`` rows
carry variant, batch, context, mix, ``ms`` per layer call and ``stored_mb``, the KV bytes the
call read) replaces the decode grids of the formats it measured: the rows of one variant
(``--decode-variant``, default ``cuda``, the DiffKV backend's default decode) become decode
measurement rows, mix ``30/50/20`` -> ``diffkv``, ``K8V4`` -> ``K8V4``, ``K4V2`` -> ``K4V2``
(``KERNEL_GRID_MIXES``), and every row those keys had in ``measurements.json`` is dropped.
``--decode-grid`` may be given several times (e.g. ``grid_cuda_vs_asm.json`` for batch
8-128 and ``grid_large_batch.json`` for batch 256/512): the grid is the union of their rows,
and a (format, batch, context) point measured in two files is an error. An unmeasured cell
between measured cells of its batch row (e.g. context 2048 at batch 8 when only the large-batch
file has 2048) is interpolated in log2(context) like the loader does; cells outside the
measured range are held. The files stay the one source of those numbers: the calibration is
rebuilt from them, with their paths, variant, date and GPU in the provenance.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from simulator.errors import SimulatorInputError
from simulator.kv.formats import make_format
from simulator.serving.cost import CostModel
from simulator.serving.server import Deployment, ResolvedServer
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration import GEMM_OPS, Calibration, load_calibration
from simulator.specs.gpu import load_gpu
from simulator.specs.model import load_model

# calibration key -> the simulator format whose pool and cost model count its bytes
KEY_FORMAT = {"bf16": "bf16", "fp8": "fp8", "K8V4": "k8v4", "K4V2": "k4v2", "diffkv": "diffkv"}
# a kernel comparison file's mix -> calibration key (30/50/20 is the benchmark mix that
# scripts/calibrate_gpu.py times as "diffkv")
KERNEL_GRID_MIXES = {"30/50/20": "diffkv", "K8V4": "K8V4", "K4V2": "K4V2"}


def _cost_models(model: str, gpu: str, base: Calibration) -> dict[str, CostModel]:
    # built without simulator.studies (which imports simpy): the GPU machine may lack it
    g, m = load_gpu(gpu), load_model(model)
    return {key: ResolvedServer(Deployment(m, g, make_format(fmt, m.head_dim), ServerSettings(),
                                           base)).cost
            for key, fmt in KEY_FORMAT.items()}


def gemm_ops(cost: CostModel) -> dict[str, tuple[float, int, int, int]]:
    """(weight bytes, params, k = in width, n = out width) of each GEMM, by op name."""
    return {**dict(zip(cost.gemm_names, cost.gemms, strict=True)), "lm_head": cost.lm_head}


def _positive(row: dict[str, Any], key: str, where: str, nullable: bool = False
              ) -> float | None:
    v = row.get(key)
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise SimulatorInputError(f"{where}: {key}={v!r} must be a positive number"
                                  + (" or null" if nullable else ""))
    return float(v)


def _time(row: dict[str, Any], where: str) -> float | None:
    return _positive(row, "time_s", where, nullable=True)


def _int(row: dict[str, Any], key: str, where: str, minimum: int = 1) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SimulatorInputError(f"{where}: {key}={v!r} must be an integer >= {minimum}")
    return v


def _fill_held(eta: np.ndarray, ys: Sequence[float] | None = None) -> np.ndarray:
    """Unmeasured cells (nan) between two measured cells of their row are interpolated
    linearly in log2 of the column coordinate ``ys`` (the loader's interpolation); the others
    take the nearest measured cell of their row, else of their column. A grid with no measured
    cell at all is an error upstream."""
    out = eta.copy()
    ly = np.log2(np.maximum(np.asarray(ys, float), 1.0)) if ys is not None else None
    for i in range(out.shape[0]):
        row = out[i]
        ok = np.flatnonzero(~np.isnan(row))
        if ok.size:
            for j in np.flatnonzero(np.isnan(row)):
                lo, hi = ok[ok < j], ok[ok > j]
                if ly is not None and lo.size and hi.size:
                    a, b = lo[-1], hi[0]
                    w = (ly[j] - ly[a]) / (ly[b] - ly[a])
                    row[j] = row[a] * (1 - w) + row[b] * w
                else:
                    row[j] = row[ok[np.argmin(np.abs(ok - j))]]
    for j in range(out.shape[1]):
        col = out[:, j]
        ok = np.flatnonzero(~np.isnan(col))
        for i in np.flatnonzero(np.isnan(col)):
            col[i] = col[ok[np.argmin(np.abs(ok - i))]]
    return out


def _grid2d(rows: list[tuple[int, int, float | None, float]],
            names: tuple[str, str]) -> dict[str, Any]:
    """rows of (x, y, time or None, speed-of-light time) -> a grid object with eta."""
    xs = sorted({r[0] for r in rows})
    ys = sorted({r[1] for r in rows})
    eta = np.full((len(xs), len(ys)), np.nan)
    times: list[list[float | None]] = [[None] * len(ys) for _ in xs]
    for x, y, t, sol in rows:
        i, j = xs.index(x), ys.index(y)
        if t is not None:
            eta[i, j] = sol / t
            times[i][j] = t
    # the loader interpolates in log space, so a zero coordinate (no past) is stored as 1
    return {names[0]: [max(x, 1) for x in xs], names[1]: [max(y, 1) for y in ys],
            "eta": np.round(_fill_held(eta, ys), 5).tolist(), "time_s": times,
            "measured": (~np.isnan(eta)).tolist()}


def measured_grids(meas: dict[str, Any], costs: dict[str, CostModel]) -> dict[str, Any]:
    out: dict[str, Any] = {"gemm": {}, "decode_attention": {}, "prefill_attention": {}}
    ops = gemm_ops(costs["bf16"])
    by_op: dict[str, list[tuple[int, float | None]]] = {}
    for n, row in enumerate(meas.get("gemm", []), start=1):
        where = f"measurements gemm row {n}"
        op = row.get("op")
        if op not in GEMM_OPS:
            raise SimulatorInputError(f"{where}: op={op!r}; allowed {', '.join(GEMM_OPS)}")
        by_op.setdefault(op, []).append((_int(row, "m", where), _time(row, where)))
    for op, pts in by_op.items():
        pts.sort()
        shape = ops[op]
        ms = [m for m, t in pts if t is not None]
        if not ms:
            continue        # nothing measured (budget): the scalar etas stay in charge
        etas = [costs["bf16"].gemm_sol(m, shape) / t for m, t in pts if t is not None]
        out["gemm"][op] = {"n": int(shape[3]), "k": int(shape[2]), "m": ms,
                           "eta": [round(e, 5) for e in etas],
                           "time_s": [t for _, t in pts if t is not None]}
    for kind, axes in (("decode", ("batch", "context")), ("prefill", ("chunk", "past"))):
        groups: dict[str, list[tuple[int, int, float | None, float]]] = {}
        for n, row in enumerate(meas.get(kind, []), start=1):
            where = f"measurements {kind} row {n}"
            key = row.get("format")
            if key not in costs:
                raise SimulatorInputError(f"{where}: format={key!r}; allowed "
                                          f"{', '.join(costs)}")
            cost = costs[key]
            x = _int(row, axes[0], where)
            y = _int(row, axes[1], where, minimum=0 if kind == "prefill" else 1)
            t = _time(row, where)
            if t is None:
                # skipped point (e.g. over the memory cap; calibrate_gpu.py writes no
                # read_bytes for it): recorded as unmeasured, its eta held at its neighbours
                groups.setdefault(key, []).append((x, y, None, 0.0))
                continue
            if kind == "decode":
                rb = row.get("read_bytes")
                if rb is None and key != "diffkv":
                    # token pools read linearly in tokens (one source of byte sizes: the pool)
                    rb = cost.write_bpt * x * y
                if isinstance(rb, bool) or not isinstance(rb, (int, float)) or not rb > 0:
                    raise SimulatorInputError(f"{where}: read_bytes={rb!r} must be the positive "
                                              f"physical bytes the kernel read (required for "
                                              f"{key})")
                sol = cost.decode_attention_sol(x, x * y, float(rb))
            else:
                sol = cost.prefill_attention_sol(x, y, x * y + x * x / 2)
            groups.setdefault(key, []).append((x, y, t, sol))
        name = "decode_attention" if kind == "decode" else "prefill_attention"
        for key, rows in groups.items():
            if any(r[2] is not None for r in rows):   # else the scalar eta stays in charge
                out[name][key] = _grid2d(rows, axes)
    return {k: v for k, v in out.items() if v}


def kernel_grid_decode_rows(grid: Any, variant: str, where: str) -> list[dict[str, Any]]:
    """Decode measurement rows (the ``measurements.json`` schema) from a kernel comparison
    file's ``decode`` rows of one variant; its mixes map to calibration keys by
    ``KERNEL_GRID_MIXES`` (other mixes are not calibration formats and are skipped)."""
    rows = grid.get("decode") if isinstance(grid, dict) else None
    if not isinstance(rows, list):
        raise SimulatorInputError(f"{where}: expected an object with a 'decode' list")
    out = []
    for n, r in enumerate(rows, start=1):
        if not isinstance(r, dict) or r.get("variant") != variant:
            continue
        key = KERNEL_GRID_MIXES.get(r.get("mix"))
        if key is None:
            continue
        w = f"{where}: decode row {n} ({variant}, {r.get('mix')})"
        ms, mb = _positive(r, "ms", w), _positive(r, "stored_mb", w)
        out.append({"format": key, "batch": _int(r, "batch", w),
                    "context": _int(r, "context", w), "time_s": ms / 1e3,
                    "read_bytes": mb * 1e6})
    if not out:
        raise SimulatorInputError(f"{where}: no decode rows of variant {variant!r} with a mix "
                                  f"in {', '.join(KERNEL_GRID_MIXES)}")
    return out


def with_decode_grid(meas: dict[str, Any], grid: Any, variant: str, source: str,
                     date: str | None = None) -> dict[str, Any]:
    """``meas`` with the decode rows of every key the kernel comparison file(s) measured (for
    ``variant``) replaced by their rows, and a provenance entry naming files, variant, date
    and GPU. ``grid``/``source`` are one file and its path, or lists of both (the union of
    their rows; a point in two files is an error). The date is each file's ``meta.date`` or
    ``date`` (required if one has none); the files must agree on date and GPU."""
    grids = grid if isinstance(grid, list) else [grid]
    sources = source if isinstance(source, list) else [source]
    if len(grids) != len(sources) or not grids:
        raise SimulatorInputError("with_decode_grid: one source path per kernel grid")
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, int, int], str] = {}
    metas, dates = [], set()
    for g, src in zip(grids, sources, strict=True):
        got = kernel_grid_decode_rows(g, variant, src)
        for r in got:
            pt = (r["format"], r["batch"], r["context"])
            if pt in seen:
                raise SimulatorInputError(
                    f"{src}: {pt[0]} batch {pt[1]} context {pt[2]} is also in {seen[pt]}; "
                    "each point must come from one file")
            seen[pt] = src
        rows += got
        meta = g.get("meta", {}) if isinstance(g.get("meta"), dict) else {}
        d = meta.get("date") or date
        if not d:
            raise SimulatorInputError(f"{src}: no meta.date; give the measurement date")
        metas.append(meta)
        dates.add(d)
    gpus = {m.get("gpu", "?") for m in metas}
    if len(gpus) > 1:
        raise SimulatorInputError(f"{', '.join(sources)}: measured on different GPUs "
                                  f"({', '.join(sorted(gpus))})")
    keys = sorted({r["format"] for r in rows})
    out = dict(meas)
    out["decode"] = [r for r in meas.get("decode", []) if r.get("format") not in keys] + rows
    prov = dict(meas.get("provenance", {}))
    files = " + ".join(sources)
    prov["decode_overrides"] = {
        "keys": keys, "file": files, "files": list(sources), "variant": variant,
        "date": ", ".join(sorted(dates)), "gpu": metas[0].get("gpu", "?"),
        "torch": metas[0].get("torch"),
        "copy_tbs": [m.get("copy_tbs") for m in metas] if len(metas) > 1
        else metas[0].get("copy_tbs"),
        "what": f"decode_attention[{', '.join(keys)}] from the {variant!r} rows of {files} "
                "(ms per layer call, graph-replayed; read_bytes = stored_mb); the rows "
                "these keys had in the measurements are dropped"}
    out["provenance"] = prov
    return out


def build_calibration(meas: dict[str, Any], base_path: str | Path | None = None,
                      source: str = "measurements") -> dict[str, Any]:
    """A calibration file: the base calibration's GPU entry (scalars, fixed costs, memory)
    with the measured grids and a provenance block added."""
    if not isinstance(meas, dict):
        raise SimulatorInputError(f"{source}: expected a JSON object")
    gpu = meas.get("gpu", "h100")
    model = meas.get("model", "llama-3-8b")
    base = load_calibration(gpu, base_path)
    costs = _cost_models(model, gpu, base)
    grids = measured_grids(meas, costs)
    entry = base.to_dict()
    prov = dict(meas.get("provenance", {}))
    entry["measured"] = {**grids, "provenance": prov}
    entry["provenance"] = {
        **base.provenance,
        "source": f"kernel micro-benchmarks ({source}) on top of {base.source_file}",
        "measured_on": prov.get("gpu_name", gpu),
        "date": prov.get("date", dt.date.today().isoformat()),
        "kernels": ("grids: " + ", ".join(f"{k}[{', '.join(v)}]" for k, v in grids.items())
                    + "; eta = speed-of-light time (datasheet) / measured time per call"
                    + (f"; decode_attention[{', '.join(o['keys'])}]: {o['variant']} kernel, "
                       f"{o['file']} ({o['date']}, {o['gpu']})"
                       if (o := prov.get("decode_overrides")) else "")),
        "fixed_costs": (base.provenance.get("fixed_costs", "") + " | not yet fitted: run "
                        "diffkv-sim calibrate --fit fixed on a fitting run's server log"),
    }
    cal = {"_about": "Calibration with kernel grids measured by scripts/calibrate_gpu.py; "
                     "scalars and fixed costs from the base file until fitted from a server log.",
           "version": 2, "created": entry["provenance"]["date"],
           "sglang_version": prov.get("sglang", "0.5.10.post1"),
           "gpus": {gpu: entry}}
    # round-trip through the loader: a file we write must load
    tmp = copy.deepcopy(cal)
    Calibration.from_dict(gpu, tmp["gpus"][gpu], source)
    return cal


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild a calibration file from "
                                             "scripts/calibrate_gpu.py's measurements.json.")
    ap.add_argument("measurements")
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default=None, help="base calibration (default: the shipped one)")
    ap.add_argument("--decode-grid", action="append", default=None,
                    help="kernel comparison JSON (decode rows with variant, batch, context, "
                         "mix, ms, stored_mb) whose rows replace the decode grids of the mixes "
                         "it measured (30/50/20 -> diffkv, K8V4, K4V2); repeatable: the grid "
                         "is the union of the files' rows")
    ap.add_argument("--decode-variant", default="cuda",
                    help="which variant's rows of --decode-grid (default: %(default)s)")
    ap.add_argument("--decode-grid-date", default=None,
                    help="measurement date of --decode-grid when its meta has none")
    a = ap.parse_args(argv)
    try:
        meas = json.loads(Path(a.measurements).read_text())
        source = a.measurements
        if a.decode_grid:
            grids = [json.loads(Path(g).read_text()) for g in a.decode_grid]
            meas = with_decode_grid(meas, grids, a.decode_variant, list(a.decode_grid),
                                    a.decode_grid_date)
            source = " + ".join([a.measurements, *a.decode_grid])
        cal = build_calibration(meas, a.base, source)
    except (OSError, json.JSONDecodeError, SimulatorInputError) as e:
        print(f"calibration build: error: {e}", file=sys.stderr)
        return 2
    Path(a.out).write_text(json.dumps(cal, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
