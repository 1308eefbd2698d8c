"""Which host-side terms of a shipped calibration earn their place: each validation run of a
recipe replayed with the calibration ``diffkv-sim --gpu GPU`` loads (one host, nothing
fitted), then again with one host-side term removed, and the held-out rows (the runs that
are not the recipe's fitting runs) scored both ways. CPU only.

    diffkv-sim ablate-host-terms --recipe h200 [--jobs 2] [--json OUT]

A term that does not raise the held-out passes, nor cut an error that matters, is a knob the
model does without. Removing a term keeps the others at their fitted values (no refit): the
table says what the shipped files lose without it, which is what a user would see.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.errors import InputError
from simulator.errors import SimulatorInputError
from simulator.specs.calibration import Calibration
from simulator.specs.calibration_set import load_calibration_set
from simulator.specs.gpu import load_gpu
from simulator.validation.harness import HarnessResults, load_harness, merge_harness
from simulator.validation.held_out import held_out_runs
from simulator.validation.recipe import load_recipe
from simulator.validation.repeats import repeat_rows


def _no_prefill_launch(c: Calibration) -> Calibration:
    # the turnaround and the loop hold count from the launches: they go with them
    return replace(c, eager_prefill_launch_s=0.0, eager_prefill_launch_s_by_format={},
                   eager_prefill_turnaround_s=0.0, eager_prefill_turnaround_s_by_format={},
                   eager_launch_holds_loop=False)


# each host-side term of the calibration, by its field name (its JSON key; a term's
# per-format values go with it; eager_decode_host_s takes its per-request term along, and
# eager_prefill_launch_s its turnaround and loop hold, which count from the launches), and
# the calibration without it; isolated_prefill_scale is the GPU's, for comparison
HOST_TERMS: dict[str, Callable[[Calibration], Calibration]] = {
    "eager_prefill_launch_s": _no_prefill_launch,
    "eager_prefill_turnaround_s": lambda c: replace(
        c, eager_prefill_turnaround_s=0.0, eager_prefill_turnaround_s_by_format={}),
    "eager_launch_holds_loop": lambda c: replace(c, eager_launch_holds_loop=False),
    "eager_decode_host_s": lambda c: replace(
        c, eager_decode_host_s=0.0, eager_decode_host_s_by_format={},
        eager_decode_host_per_req_s=0.0, eager_decode_host_per_req_s_by_format={}),
    "eager_decode_host_per_req_s": lambda c: replace(
        c, eager_decode_host_per_req_s=0.0, eager_decode_host_per_req_s_by_format={}),
    "first_token_latency_s": lambda c: replace(c, first_token_latency_s=0.0),
    "release_overhead_s": lambda c: replace(c, release_overhead_s=0.0),
    "isolated_prefill_scale": lambda c: replace(
        c, isolated_prefill_scale=1.0),
}
ALL_TERMS = "none (as shipped)"


def is_used(term: str, calibs: dict[str, Calibration]) -> bool:
    """Whether removing ``term`` changes any of the calibrations (a term at zero is not)."""
    return any(HOST_TERMS[term](c) != c for c in calibs.values())


# set in the parent before the pool forks: the workers inherit them
_STATE: dict[str, Any] = {}


def _score(term: str) -> tuple[str, list[dict], list[dict]]:
    from simulator.validation.runs import validate
    calibs: dict[str, Calibration] = _STATE["calibs"]
    if term != ALL_TERMS:
        calibs = {k: HOST_TERMS[term](c) for k, c in calibs.items()}
    rows, _ = validate(_STATE["h"], calibs, _STATE["model"], _STATE["gpu"],
                       _STATE["fitting"], _STATE["held"])
    print(f"ablate-host-terms: scored {term}", file=sys.stderr, flush=True)
    return term, rows, repeat_rows(rows)


def _passes(rows: list[dict]) -> tuple[int, int]:
    scored = [r for r in rows if r["verdict"] in ("PASS", "MISS")]
    return sum(r["verdict"] == "PASS" for r in scored), len(scored)


def _largest_change(base: list[dict], other: list[dict]) -> dict[str, Any] | None:
    """The held-out row with a target whose error moves most without the term."""
    best = None
    for a, b in zip(base, other, strict=True):
        if a["target"] is None or a["error"] is None or b["error"] is None:
            continue
        d = abs(b["error"] - a["error"])
        if best is None or d > best["change"]:
            best = {"metric": a["metric"], "run": a["run"], "with": a["error"],
                    "without": b["error"], "absolute": a["absolute"], "change": d}
    return best


def ablate(h: HarnessResults, calibs: dict[str, Calibration], model: str, gpu: str,
           fitting: set[str], jobs: int = 1, terms: list[str] | None = None,
           held: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One result per term (the shipped calibration ``calibs`` first): held-out PASS /
    scored rows, the same against the mean of repeats, the rows held out by construction
    (``held``, the recipe's ``held_out``) alone, and the row whose error moves most."""
    todo = [ALL_TERMS] + [t for t in (terms or list(HOST_TERMS)) if is_used(t, calibs)]
    _STATE.update(h=h, calibs=calibs, model=model, gpu=gpu, fitting=fitting, held=held or {})
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            scored = pool.map(_score, todo, chunksize=1)
    else:
        scored = [_score(t) for t in todo]
    _, base_rows, base_reps = scored[0]
    out = []
    for term, rows, reps in scored:
        out.append({"term": term, "rows": _passes(rows), "repeats": _passes(reps),
                    "held_out_rows": _passes([r for r in rows if r.get("held_out")]),
                    "largest_change": None if term == ALL_TERMS
                    else _largest_change(base_rows, rows),
                    "repeats_largest_change": None if term == ALL_TERMS
                    else _largest_change(base_reps, reps)})
    return out


def _err(r: dict[str, Any], key: str) -> str:
    v = r[key]
    return f"{v:+.3f}" if r["absolute"] else f"{100 * v:+.1f}%"


def ablation_table(results: list[dict[str, Any]]) -> str:
    """Markdown: term, held-out rows passing with / without, repeats the same, the largest
    error change."""
    lines = ["| term removed | validated rows PASS (of scored) | against the mean of repeats | "
             "held out by construction | largest error change (row: with -> without) |",
             "|---|---|---|---|---|"]
    for r in results:
        p, n = r["rows"]
        rp, rn = r["repeats"]
        hp, hn = r.get("held_out_rows", (0, 0))
        c = r["largest_change"]
        change = "" if c is None else (f"{c['metric']}, {c['run']}: {_err(c, 'with')} -> "
                                       f"{_err(c, 'without')}")
        lines.append(f"| {r['term']} | {p} / {n} | {rp} / {rn} | {hp} / {hn} | {change} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="diffkv-sim ablate-host-terms",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True,
                    help="a validation recipe (a JSON file, or a shipped one: h100, h200): "
                         "its result folders, fitting runs (held out of the score), GPU")
    ap.add_argument("--jobs", type=int, default=1,
                    help="terms scored at once, one process each (default: %(default)s)")
    ap.add_argument("--term", action="append", default=None, choices=list(HOST_TERMS),
                    help="score only these terms (repeatable; default: every one in use)")
    ap.add_argument("--json", default=None, help="write the results as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.jobs < 1:
            raise SimulatorInputError(f"--jobs {a.jobs} must be >= 1")
        r = load_recipe(a.recipe)
        from simulator.validation.runs import is_fitting_run, results_arg, scratch_name
        scratch = Path(r.get("scratch", "results/validation-logs"))
        parts = []
        for arg in r["results"]:
            d, tag, rename = results_arg(arg)
            parts.append(load_harness(d, scratch / scratch_name(d), tag=tag, rename=rename))
        h = merge_harness(parts)
        skip = set(r.get("skip_run", []))
        h.runs = [x for x in h.runs if x.key not in skip]
        gpu = r.get("gpu", "h100")
        shipped = load_calibration_set(load_gpu(gpu).key)
        calibs = {"base": shipped.for_key("bf16"), **shipped.by_backend}
        fitting = set(r.get("fit_run", [])) | set(r.get("fit_decode_run", []))
        held = held_out_runs(h, r.get("held_out", []),
                             [x for x in h.runs if is_fitting_run(x, fitting)])
        results = ablate(h, calibs, r.get("model", "llama-3-8b"), gpu, fitting, a.jobs,
                         a.term, held)
    except InputError as e:
        print(f"diffkv-sim ablate-host-terms: error: {e}", file=sys.stderr)
        return 2
    print(ablation_table(results))
    if a.json:
        import json
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
