"""Validate diffkv-sim against the end-to-end harness's real SGLang runs. CPU only.

    diffkv-sim validate-runs --recipe h200          # a shipped report's recipe
    diffkv-sim validate-runs RESULTS_DIR [RESULTS_DIR ...] \
        --calibration results/calibration/calibration.json \
        [--fit-run bf16/longgen --fit-run diffkv-mix/longgen] [--doc results/report.md]

(``python -m simulator.validation.runs`` takes the same arguments.) ``--recipe`` reads the
result folders, fitting runs and options from a JSON file (``simulator/validation/recipe.py``;
the shipped reports' recipes are in ``simulator/validation/recipes/``); options given after it
add to its lists and replace its single values.

Each RESULTS_DIR is one ``scripts/bench_e2e.py --out`` (results.json, bench_serving.jsonl,
logs/ or logs.tar.gz; layout in simulator/validation/harness.py); several folders (one per GPU
call) are merged, their configuration names must differ. Packed logs are unpacked into
``--scratch`` (the result folders are not written to). Steps:

1. calibration: the kernel-grid calibration from scripts/calibrate_gpu.py (``--calibration``);
   its fixed step costs (per step and per request, and for prefill steps per step, request
   and prompt token) are fitted here from the FITTING runs (``--fit-run``, repeatable,
   default bf16/longgen; ``none`` keeps the file's): every Decode interval of their logs,
   with the prefill steps logged inside it, and their back-to-back prefill bursts
   (``simulator/validation/step_fit.py``). A backend's fitting runs are fitted together and
   the fit applies to its runs (triton: bf16 and fp8; diffkv: every DiffKV mix), so the
   DiffKV backend (its own decode kernels and host-side step work, under CUDA graphs up to
   its cuda_graph_max_bs) gets its own costs; only Decode lines whose ``cuda graph:`` flag
   matches the run's graph setting are used. A long-generation run gives large decode
   batches; an open-loop run at a low rate that is not validated (``ladder@4rps``) gives
   small batches and isolated prefill steps. The overlap scheduler's one-step admission lag
   is simulated (``simulator/engine/replica.py``). The fitted files are written next to the
   report. Fitting runs are never validated: their rows are reported apart, in-sample,
   without a verdict. With ``--refine-on-metrics BACKEND`` the backend's fitted terms are then
   moved until its fitting runs' simulated metrics match the measured ones
   (``simulator/validation/refine.py``).
2. every other run (sharegpt saturation, ladder rates; bf16, fp8, diffkv) is replayed from its
   exact trace file with the server settings from its log, and measured vs predicted rows are
   built over the run's window: KV pool, saturation output tok/s and req/s, mean and peak
   running batch, TPOT, TTFT (target only below 80% load), the DiffKV/bf16 throughput ratio;
   each with its error, the target and PASS/MISS.
3. the report (markdown with provenance and commands) and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import ServerLog, parse_server_log
from simulator.errors import SimulatorInputError
from simulator.kv.mix import TierMix
from simulator.metrics.summary import summarize
from simulator.specs.calibration import (
    ISOLATED_PREFILL_MIN,
    PREFILL_CLOCK_RECOVERY_MAX_S,
    Calibration,
    load_calibration,
)
from simulator.specs.calibration_set import (
    BACKENDS,
    backend_of,
    load_calibration_set,
)
from simulator.specs.gpu import load_gpu
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario
from simulator.validation.fit import calibration_file, write_calibration
from simulator.validation.harness import (
    TARGETS,
    TTFT_MAX_LOAD,
    HarnessResults,
    HarnessRun,
    diffkv_mix,
    load_harness,
    measured_series,
    merge_harness,
    row,
    server_settings,
    windowed_summary,
)
from simulator.validation.held_out import band, band_table, held_out_runs
from simulator.validation.recipe import expand_recipe
from simulator.validation.refine import (
    DEFAULT_MAX_EVALS,
    UNITS,
    first_token_latency_guess,
    refine_costs,
)
from simulator.validation.repeats import group_label, repeat_key, repeat_rows
from simulator.validation.step_fit import (
    OUTLIER_FACTOR,
    StepRows,
    fit_step_costs,
    step_rows,
)

# the repository root: git provenance, relative paths in the report, default output folders
ROOT = Path(__file__).resolve().parents[2]
PROG = "diffkv-sim validate-runs"  # the command, in messages and in the report

_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One line on stderr, with the seconds since the start: fitting and replaying every run
    takes minutes."""
    print(f"{PROG} [{time.monotonic() - _T0:6.0f} s] {msg}", file=sys.stderr, flush=True)



def slice_log(run: HarnessRun, whole: Path) -> ServerLog:
    """The run's slice of the server log, with the start-up lines (pool, server args) of the
    whole log."""
    head = parse_server_log(whole)
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(f"max_total_num_tokens={head.max_total_num_tokens or 0}\n")
        f.write(run.log_slice)
        name = f.name
    try:
        log = parse_server_log(name)
    finally:
        Path(name).unlink()
    log.server_args = head.server_args
    log.max_total_num_tokens = head.max_total_num_tokens
    log.max_running_requests = head.max_running_requests
    return log


# what backend() returns: each fits its own step costs. Which fixed costs a KV format shares:
# SGLang's triton backend (bf16, fp8) or the DiffKV backend (its own decode kernels and
# per-step host work; both decode under CUDA graphs up to cuda_graph_max_bs, the run's server
# args say)
backend = backend_of


def scenario(model: str, gpu: str, calib: Calibration, settings: Any,
             h: HarnessResults | None = None, config: str | None = None) -> Scenario:
    """The run's scenario; for a DiffKV configuration with its tiers, window and mix (the
    server's SGLANG_DIFFKV_CONFIG, benchmark-mode mix)."""
    dcfg, mix = diffkv_mix(h.configs[config]) if h is not None and config else (None, None)
    return Scenario(load_model(model), load_gpu(gpu), calib, settings, diffkv_config=dcfg,
                    mix=TierMix(mix[0], mix[1]) if mix else None)


# an open-loop fitting run starts on a fresh server (16 warm-up requests before it): its first
# half is left out, as the harness's steady rates are (the low-rate runs of 2026-11-22 ran
# their first ~20 s slower: DiffKV prefill steps 57 ms, then 31-37 ms; bf16 TTFT 50-65 ms,
# then 32 ms)
OPEN_LOOP_WARMUP_FRACTION = 0.5


def fit(h: HarnessResults, keys: list[str], model: str, gpu: str, calib: Calibration,
        out_dir: Path, prefill: bool = True, decode_only: frozenset[str] = frozenset()
        ) -> tuple[str, Calibration, dict[str, Any]]:
    """Fixed step costs of one backend from its fitting runs (``step_fit``): (backend,
    fitted calibration, fit info). Without ``prefill`` only the decode-only intervals are
    used and the prefill costs stay as given; the runs in ``decode_only`` give only those."""
    rows = StepRows()
    backends = set()
    for key in keys:
        run = h.run(key)
        log = slice_log(run, run.server_log or h.server_logs[run.config])
        settings, fmt = server_settings(h.configs[run.config], log)
        backends.add(backend(fmt))
        srv = scenario(model, gpu, calib, settings, h, run.config).server(fmt)
        mine = step_rows(srv, log, run.key, None,
                         skip_fraction=OPEN_LOOP_WARMUP_FRACTION if run.workload == "ladder"
                         else 0.0)
        if key in decode_only:
            mine = mine.of_kinds("decode")
        rows.extend(mine)
    if len(backends) > 1:
        raise SimulatorInputError(f"fitting runs {', '.join(keys)} mix the backends "
                                  f"{', '.join(sorted(backends))}; give each its own")
    res = fit_step_costs(srv, rows if prefill else rows.of_kinds("decode"))
    runs = ", ".join(keys)
    data = calibration_file(srv, {**res, "fixed_only": True, "samples": res["rows"],
                                  "how": step_costs_note(res, runs)}, runs)
    path = write_calibration(out_dir / f"calibration-fitted-{backend(fmt)}.json", data)
    return backend(fmt), load_calibration(load_gpu(gpu).key, path), {
        **res, "run": runs, "runs": keys, "backend": backend(fmt), "file": str(path)}


KV_FORMAT_KEYS = ("bf16", "fp8", "diffkv")  # the calibration keys of the KV formats
LAUNCH_KEYS = (*BACKENDS, "bf16", "fp8")  # backends, or a triton KV format


# the measured inputs given on the command line, each an option named by its calibration field
# (one name per knob: ``--eager-prefill-launch-s`` sets ``eager_prefill_launch_s``, in seconds
# as the field is) as KEY=S items: KEY a backend (triton, diffkv) sets the field, KEY a triton
# KV format (bf16, fp8) its own entry in the field's ``_by_format`` map where it has one
GIVEN_SECONDS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "eager_prefill_launch_s": (LAUNCH_KEYS, "eager_prefill_launch_s_by_format"),
    "eager_prefill_turnaround_s": (LAUNCH_KEYS, "eager_prefill_turnaround_s_by_format"),
    "eager_decode_host_s": (LAUNCH_KEYS, "eager_decode_host_s_by_format"),
    "eager_decode_host_per_req_s": (LAUNCH_KEYS, "eager_decode_host_per_req_s_by_format"),
    "first_token_latency_s": (BACKENDS, None),
    "prefill_step_overhead_s": (BACKENDS, None),
}
# options renamed to their calibration field (and its unit): named in one line when given
RENAMED_OPTIONS = {
    "--eager-prefill-launch-ms": "--eager-prefill-launch-s",
    "--eager-prefill-turnaround-ms": "--eager-prefill-turnaround-s",
    "--eager-decode-host-ms": "--eager-decode-host-s",
    "--eager-decode-host-per-req-us": "--eager-decode-host-per-req-s",
    "--first-token-latency-ms": "--first-token-latency-s",
    "--launch-holds-loop": "--eager-launch-holds-loop",
    "--diffkv-prefill-step-ms": "--prefill-step-overhead-s diffkv=S",
    "--prefill-clock-recovery-ms": "--prefill-clock-recovery-s",
}


def option_of(field: str) -> str:
    return "--" + field.replace("_", "-")


def key_seconds_arg(field: str, items: list[str]) -> dict[str, float]:
    """The ``--FIELD KEY=S`` items as {key: seconds}, each KEY one of the field's keys
    (``GIVEN_SECONDS``), S in [0, 1)."""
    keys = GIVEN_SECONDS[field][0]
    out: dict[str, float] = {}
    for item in items:
        key, sep, text = item.partition("=")
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not sep or key not in keys or not 0 <= value < 1:
            raise SimulatorInputError(
                f"{option_of(field)} {item!r}: want KEY=S, KEY one of {', '.join(keys)}, S "
                f"the calibration field {field} in seconds, in [0, 1)")
        out[key] = value
    return out


def renamed_option(argv: list[str]) -> str | None:
    """The first option of ``argv`` that was renamed, as a one-line message naming the new."""
    for word in argv:
        old = word.partition("=")[0]
        if old in RENAMED_OPTIONS:
            return (f"{old} is now {RENAMED_OPTIONS[old]} (one name per knob: the option is "
                    "its calibration field, in the field's unit: seconds)")
    return None


HOLDABLE = tuple(n for n in UNITS if n != "first_token_latency_s")


def refine_hold_arg(items: list[str]) -> dict[str, frozenset[str]]:
    """``--refine-hold [BACKEND:]TERM`` items as {backend: terms held}: a bare TERM holds for
    every backend, BACKEND:TERM for that one."""
    out: dict[str, set[str]] = {be: set() for be in BACKENDS}
    for item in items:
        be, sep, term = item.rpartition(":")
        if term not in HOLDABLE or (sep and be not in BACKENDS):
            raise SimulatorInputError(
                f"--refine-hold {item!r}: want TERM or BACKEND:TERM, BACKEND one of "
                f"{', '.join(BACKENDS)}, TERM one of {', '.join(HOLDABLE)}")
        for b in ([be] if sep else BACKENDS):
            out[b].add(term)
    return {be: frozenset(terms) for be, terms in out.items()}


def with_given_seconds(base: Calibration, be: str, given: dict[str, float], field: str
                       ) -> Calibration:
    """``base`` with a ``--FIELD KEY=S`` option's values for backend ``be``: KEY ``be`` sets
    ``field``, KEY a KV format its entry in the field's ``_by_format`` map."""
    if be in given:
        base = replace(base, **{field: given[be]})
    own = {k: v for k, v in given.items() if k not in BACKENDS}
    by_format = GIVEN_SECONDS[field][1]
    if own and by_format is not None:
        base = replace(base, **{by_format: {**getattr(base, by_format), **own}})
    return base


def with_given(calib: Calibration, be: str, a: argparse.Namespace) -> Calibration:
    """Backend ``be``'s calibration with the measured inputs the options give it (launches,
    host iterations, the loop hold, the first-token latency), fitted or not."""
    base = calib
    for field in GIVEN_SECONDS:
        base = with_given_seconds(base, be, getattr(a, field), field)
    for fmt in (f for f in KV_FORMAT_KEYS if backend(f) == be):
        if base.prefill_turnaround_s(fmt) > 0.0 and base.prefill_launch_s(fmt) == 0.0:
            raise SimulatorInputError(
                f"--eager-prefill-turnaround-s gives {fmt} a turnaround but {fmt} has no eager "
                "prefill launch time (--eager-prefill-launch-s, or the calibration's): the "
                "turnaround counts from the end of those launches")
    if be in a.eager_launch_holds_loop:
        base = replace(base, eager_launch_holds_loop=True)
    return base


# the inputs a fit takes as given, measured (GIVEN_SECONDS's fields, their per-format maps and
# the loop hold), reported by field name
GIVEN_FIELDS = (*(f for field, (_, m) in GIVEN_SECONDS.items() for f in (field, m) if f),
                "eager_launch_holds_loop")


def given_note(given: dict[str, Any]) -> str:
    """The report's words for a backend's measured inputs (``fit_backend``'s ``given``): each
    phrase names its calibration field, which is also its option."""
    def ms(v: float) -> str:
        return f"{1e3 * v:.1f} ms"
    phrases = {
        "prefill_step_overhead_s": lambda v: f"the prefill step cost given: {ms(v)} (from the "
                                             "backend profile; kept only if not fitted)",
        "eager_prefill_launch_s": lambda v: f"an eager prefill step lasts max({ms(v)} of "
                                            "launches, its kernels and per-token cost)",
        "eager_prefill_turnaround_s": lambda v: f"the host's turnaround after them {ms(v)}",
        "eager_decode_host_s": lambda v: "a decode step above the largest CUDA graph lasts at "
                                         f"least the host's iteration, {ms(v)}, in place of "
                                         "its per-layer term",
        "eager_decode_host_per_req_s": lambda v: f"that iteration adds {1e6 * v:.1f} us per "
                                                 "request",
        "eager_launch_holds_loop": lambda v: "its eager prefill launches hold the overlap loop",
        "first_token_latency_s": lambda v: f"the client's first-token latency given: {ms(v)}",
    }
    out = []
    for field, v in given.items():
        if isinstance(v, dict):
            out += [f"{field}.{k} {1e3 * x:.4g} ms" for k, x in v.items()]
        else:
            out.append(f"{phrases[field](v)} ({field})")
    return "".join(f"; {x}" for x in out)


def fit_backend(h: HarnessResults, a: argparse.Namespace, calib: Calibration,
                job: tuple[str, list[str]]) -> tuple[str, Calibration, dict[str, Any]]:
    """One backend's step costs from its fitting runs ``job`` = (backend, run keys): the
    interval fit, then the refinement where ``--refine-on-metrics`` asks for it."""
    be, keys = job
    progress(f"{be}: fitting step costs on {len(keys)} run(s): {', '.join(keys)}")
    base = with_given(calib, be, a)
    first_token = a.first_token_latency_s.get(be)
    hold = a.refine_hold[be]
    if first_token is not None:
        # measured: the refinement keeps it, as it keeps a held term
        hold |= {"first_token_latency_s"}
    be, fitted_cal, info = fit(h, keys, a.model, a.gpu, base, plot_dir_of(a),
                               prefill=a.prefill_fit == "all",
                               decode_only=frozenset(a.fit_decode_run))
    if be in a.refine_on_metrics:
        fitted_cal, info = refine(h, info, fitted_cal, calib, a.model, a.gpu, a.refine_evals,
                                  hold=hold)
    # the measured inputs this backend was given, by calibration field (= option name)
    given = {f: getattr(base, f) for f in GIVEN_FIELDS
             if getattr(base, f) and (f != "first_token_latency_s" or first_token is not None)
             and (f != "prefill_step_overhead_s"
                  or base.prefill_step_overhead_s != calib.prefill_step_overhead_s)}
    if given:
        info["given"] = {f: dict(v) if isinstance(v, dict) else v for f, v in given.items()}
    return be, fitted_cal, info


def in_forked_processes(fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    """``[fn(job) for job in jobs]``, one forked process per job. Forked children inherit
    ``fn`` and what it holds (this script is loaded by path, so its functions cannot be
    pickled); only the results, or an exception, travel back."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()

    def work(i: int, job: Any) -> None:
        try:
            queue.put((i, True, fn(job)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the parent
            queue.put((i, False, e))

    procs = [ctx.Process(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for p in procs:
        p.start()
    results = dict((i, (ok, value)) for i, ok, value in (queue.get() for _ in procs))
    for p in procs:
        p.join()
    for ok, value in results.values():
        if not ok:
            raise value
    return [results[i][1] for i in range(len(jobs))]


def plot_dir_of(a: argparse.Namespace) -> Path:
    """Where plots and fitted calibration files go: --plots, or the folder beside --doc named
    after it (docs/simulator-validation.md -> docs/simulator-validation/), so two reports never
    overwrite each other's fitted files."""
    return Path(a.plots) if a.plots else Path(a.doc).with_suffix("")


def is_fitting_run(run: HarnessRun, fitting: set[str]) -> bool:
    """Whether ``run`` is a fitting run: its key, or its config/workload, was fitted."""
    return run.key in fitting or f"{run.config}/{run.workload}" in fitting


def refine(h: HarnessResults, info: dict[str, Any], fitted: Calibration, base: Calibration,
           model: str, gpu: str, max_evals: int, hold: frozenset[str] = frozenset()
           ) -> tuple[Calibration, dict[str, Any]]:
    """The interval fit ``fitted`` of one backend, refined on its fitting runs' metrics
    (``refine.refine_costs``), with the client's first-token latency, which no log interval
    shows, started from the open-loop TTFT residual; the terms in ``hold`` keep ``fitted``'s
    values (``first_token_latency_s`` among them where it was measured). The calibration file
    is rewritten with the refined terms."""
    be = info["backend"]
    fitting = set(info["runs"])
    runs = [r for r in h.runs if is_fitting_run(r, fitting)]
    sub = replace(h, runs=runs)

    evals = 0

    def evaluate(c: Calibration) -> list[dict]:
        nonlocal evals
        evals += 1
        if evals == 1 or evals % 5 == 0:
            progress(f"{be}: refinement evaluation {evals} (at most {max_evals}) of "
                     f"{len(runs)} run(s)")
        # no run counts as fitting here, so the rows carry the targets they would have
        return validate(sub, {"base": base, be: c}, model, gpu, set())[0]

    names = [n for n in info["fitted"] if n in UNITS and n not in hold]
    if "first_token_latency_s" not in hold:
        names.append("first_token_latency_s")
        fitted = replace(fitted,
                         first_token_latency_s=first_token_latency_guess(evaluate(fitted)))
    refined, how = refine_costs(fitted, names, evaluate, max_evals)
    print(f"{PROG}: {be}: {how.note()}", file=sys.stderr)
    path = Path(info["file"])
    data = json.loads(path.read_text())
    entry = next(iter(data["gpus"].values()))
    entry.update(how.after)
    if refined.decode_attention_scale_by_format:
        entry["decode_attention_scale_by_format"] = refined.decode_attention_scale_by_format
    entry["provenance"]["refined"] = how.note()
    write_calibration(path, data)
    return load_calibration(load_gpu(gpu).key, path), {**info, "refinement": how.note(),
                                                       "refine": asdict(how)}


def _gain(g: float | None) -> str:
    return "" if g is None else f" (it cuts the decode rows' error by {100 * g:.0f}%)"


def step_costs_note(res: dict[str, Any], runs: str) -> str:
    """One line on a step-cost fit: the costs, what they were fitted on, how well."""
    k = res["by_kind"]
    parts = [f"{n} {k[n]['rows']} (MAPE {100 * (k[n]['mape_before'] or 0):.1f}% -> "
             f"{100 * (k[n]['mape'] or 0):.1f}%)" for n in k if k[n]["rows"]]
    scales = res.get("decode_attention_scale_by_format") or {}
    attn = (", ".join(f"{f} x{v:.3f}" for f, v in scales.items()) if len(scales) > 1
            else f"x{res['decode_attention_scale']:.3f}")
    return (f"decode attention {attn} its grid; "
            f"per step {1e3 * res['step_overhead_s']:.3f} ms, per request "
            f"{1e6 * res['seq_overhead_s']:.2f} us; prefill step "
            f"{1e3 * res['prefill_step_overhead_s']:.2f} ms, per prefill request "
            f"{1e3 * res['prefill_seq_overhead_s']:.3f} ms, per prompt token "
            f"{1e6 * res['prefill_token_overhead_s']:.2f} us{_floors(res)}; per released request "
            f"{1e3 * res['release_overhead_s']:.2f} ms{_gain(res.get('release_gain'))}; "
            "eager decode "
            f"{1e6 * res['eager_decode_layer_overhead_s']:.1f} us per layer; fitted "
            f"{', '.join(res['fitted'])}, kept {', '.join(res['kept']) or 'nothing'}; from "
            f"{runs}: rows {'; '.join(parts)}; all {res['rows']} rows MAPE "
            f"{100 * res['mape_before']:.1f}% -> {100 * res['mape']:.1f}%; dropped "
            f"{len(res['dropped'])} rows off the fit by > {OUTLIER_FACTOR:g}x")


def _floors(res: dict[str, Any]) -> str:
    """How many prefill steps the fit found their launches outlasting (step_fit's
    LaunchFloors), where launches are timed."""
    if not res.get("launch_floored_steps"):
        return ""
    return (f" ({res['launch_bound_steps']} of {res['launch_floored_steps']} prefill steps "
            f"launch-bound, settled in {res['floor_passes']} passes"
            f"{'' if res['floor_settled'] else ', not settled'})")


def _mean(xs: list[int]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def validate(h: HarnessResults, calibs: dict[str, Calibration], model: str, gpu: str,
             fitting: set[str], held: dict[str, str] | None = None, *,
             report_progress: bool = False) -> tuple[list[dict], dict[str, Any]]:
    """Rows for every run; a fitting run's rows are marked in-sample and carry no target; a
    held-out run's (``held``: run key -> kind, ``held_out.held_out_runs``) are marked
    ``held_out`` with its kind; every row of a run carries its load and load band."""
    held = held or {}
    rows: list[dict] = []
    sims: dict[str, Any] = {}
    pools_done: set[str] = set()
    base = calibs["base"]
    for i, run in enumerate(h.runs):
        if report_progress:
            progress(f"replaying run {i + 1}/{len(h.runs)}: {run.key}")
        in_sample = is_fitting_run(run, fitting)
        log = slice_log(run, run.server_log or h.server_logs[run.config])
        settings, fmt = server_settings(h.configs[run.config], log)
        calib = calibs.get(backend(fmt), base)
        trace, warm = run.replay_inputs(radix_cache=not settings.disable_radix_cache)
        sc = scenario(model, gpu, calib, settings, h, run.config)
        res = sc.run(trace, fmt, warm_cache=warm)
        s = windowed_summary(res, run.simulated_window_s)
        # with a radix cache, what ran before decides which prompts are cached
        after = "" if settings.disable_radix_cache else ", ".join(
            f"{r.workload}@{r.rate_req_s:.2f}rps" if r.rate_req_s else r.workload
            for r in run.earlier)
        group = repeat_key(run.config, run.workload, run.rate_req_s, trace, after)
        load = (run.rate_req_s / run.saturation_req_s
                if run.rate_req_s and run.saturation_req_s else None)
        sims[run.key] = {"summary": s, "format": fmt, "run": run, "in_sample": in_sample,
                         "full": summarize(res), "group": group,
                         "held_out": held.get(run.key)}
        c = run.client

        def tg(name: str, in_sample: bool = in_sample) -> float | None:
            return None if in_sample else TARGETS.get(name)
        tag = "in-sample (fitting run)" if in_sample else ""

        def add(metric: str, measured: float | None, predicted: float | None,
                target: float | None, note: str = "", key: str = run.key, tag: str = tag,
                in_sample: bool = in_sample, group: str = group,
                fit_target: float | None = None, absolute: bool = False,
                load: float | None = load, where: str = band(load, run.workload)) -> None:
            r = row(metric, key, measured, predicted, target, absolute=absolute,
                    note="; ".join(x for x in (note, tag) if x))
            r["in_sample"] = in_sample
            r["group"] = group
            r["held_out"] = held.get(key)
            r["load"] = load
            r["band"] = where
            if fit_target is not None:
                r["fit_target"] = fit_target
            rows.append(r)

        if run.config not in pools_done:
            pools_done.add(run.config)
            measured_pool = h.configs[run.config].get("max_total_num_tokens") \
                or log.max_total_num_tokens
            r = row("KV pool tokens", run.config, measured_pool, s["kv_pool_tokens"],
                    TARGETS["kv_pool"],
                    note="" if fmt != "diffkv" else "DiffKV: SGLang's logical slots at the "
                    "planning mix vs the simulated pool's tokens at the run's mix")
            r["in_sample"] = False   # start-up arithmetic: nothing is fitted to it
            r["held_out"], r["load"], r["band"] = None, None, None
            rows.append(r)
        if s["prefix_hit_rate"] is not None and log.prefix_hit_rate is not None:
            # an input, not a prediction: the cache the replay rebuilt (prompt_cache) against
            # the #cached-token the server logged
            add("radix-cache hits (% of prompt tokens)", 100 * log.prefix_hit_rate,
                100 * s["prefix_hit_rate"], None,
                "rebuilt from the client's prompts and the server's earlier runs", absolute=True)
        mb = _mean(log.decode_running)
        pk = float(max(log.decode_running)) if log.decode_running else None
        if run.workload == "sharegpt" and not c.get("time_limited"):
            # every request finished inside the window: bench_serving's whole-run rates
            # (tokens / duration, each side its own duration); the second half of a window
            # that ends at the last completion is mostly the drain tail
            full = sims[run.key]["full"]
            add("saturation output tok/s", c.get("output_throughput"),
                full["output_throughput"], tg("throughput"), "whole run (all completed)")
            add("saturation req/s", c.get("request_throughput"), full["request_throughput"],
                tg("throughput"), "whole run (all completed)")
        elif run.workload == "sharegpt":
            add("saturation output tok/s (steady)", c.get("steady_output_throughput"),
                s["steady_output_throughput"], tg("throughput"), "window's second half")
            add("saturation req/s (steady)", c.get("steady_request_throughput"),
                s["steady_request_throughput"], tg("throughput"), "window's second half")
        if run.workload == "sharegpt":
            add("mean running batch", mb, s["mean_batch"], tg("mean_batch"), "Decode lines")
            add("peak running batch", pk, float(s["peak_batch"]), None, "Decode lines")
            add("TPOT mean (ms)", c.get("mean_tpot_ms"), s["mean_tpot_ms"], tg("tpot"),
                "completed requests")
            # no target to validate on, but a burst's TTFT is the time to prefill the
            # prompts ahead: the refinement's one direct reading of prefill throughput
            add("TTFT mean (ms)", c.get("mean_ttft_ms"), s["mean_ttft_ms"], None,
                "saturation (all at t=0): no target", fit_target=TARGETS["ttft"])
        elif run.workload == "ladder":
            sims[run.key]["load"] = load
            lt = (f"{run.rate_req_s:.2f} req/s = {load:.0%} of the sharegpt steady req/s"
                  if load is not None else "load ?")
            ttft_target = tg("ttft") if load is not None and load < TTFT_MAX_LOAD else None
            add("TTFT mean (ms)", c.get("mean_ttft_ms"), s["mean_ttft_ms"], ttft_target, lt)
            # no target: where a mean misses, the median tells a shifted distribution from a
            # tail of slow requests (a server's stalls, which the model has no term for)
            add("TTFT median (ms)", c.get("median_ttft_ms"), s["median_ttft_ms"], None, lt)
            add("TPOT mean (ms)", c.get("mean_tpot_ms"), s["mean_tpot_ms"], tg("tpot"), lt)
            add("mean running batch", mb, s["mean_batch"], tg("mean_batch"), lt)
            add("output tok/s (window)", c.get("output_throughput"), s["output_throughput"],
                None, lt)
        else:
            # partial window (few or no completions): the steady rate and the Decode batch
            add("steady output tok/s", c.get("steady_output_throughput"),
                s["steady_output_throughput"], tg("throughput"),
                f"{run.workload}: window's second half")
            add("mean running batch", mb, s["mean_batch"], tg("mean_batch"),
                f"{run.workload}: Decode lines")
            add("peak running batch", pk, float(s["peak_batch"]), None,
                f"{run.workload}: Decode lines")
            add("retractions", float(log.retractions), float(s["retractions"]), None,
                f"{run.workload}: whole run (simulated: to its end)")
    rows += ratio_rows(sims)
    return rows, sims


def _rate(sim: dict[str, Any], measured: bool) -> float:
    c = sim["run"].client
    if not c.get("time_limited"):
        return float((c.get("output_throughput") if measured
                      else sim["full"]["output_throughput"]) or 0)
    return float((c.get("steady_output_throughput") if measured
                  else sim["summary"]["steady_output_throughput"]) or 0)


def _trace_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


BASELINE_CONFIG = "bf16"


def ratio_rows(sims: dict[str, Any]) -> list[dict]:
    """DiffKV / bf16 output tok/s on the same workload and the same trace (equal request
    files: a run on another trace under the same workload name is not paired), every DiffKV
    configuration against every run of the bf16 baseline (the configuration named
    ``BASELINE_CONFIG``, SGLang's defaults; a renamed variant such as one with more CUDA graphs
    is no baseline): the window's steady (second-half) rate, or
    bench_serving's whole-run rate for a run that completed inside its window; a target only
    when neither run is a fitting run."""
    out = []
    groups: dict[tuple[str, str], dict[str, list[tuple[str, dict]]]] = {}
    for key, s in sims.items():
        if s["format"] == "bf16" and s["run"].config != BASELINE_CONFIG:
            continue
        if s["run"].workload in ("longgen", "sharegpt"):
            group = (s["run"].workload, _trace_digest(s["run"].trace_path))
            groups.setdefault(group, {}).setdefault(s["format"], []).append((key, s))
    for by_fmt in groups.values():
        for dkey, d in by_fmt.get("diffkv", []):
            for bkey, b in by_fmt.get("bf16", []):
                m = _rate(d, measured=True) / max(_rate(b, measured=True), 1e-9)
                p = _rate(d, measured=False) / max(_rate(b, measured=False), 1e-9)
                fitted = [k for k, x in ((dkey, d), (bkey, b)) if x["in_sample"]]
                note = "error in ratio points"
                if fitted:
                    note += f"; in-sample ({', '.join(fitted)} fitted)"
                r = row("DiffKV / bf16 output tok/s", f"{dkey} : {bkey}", m, p,
                        None if fitted else TARGETS["ratio_pp"], absolute=True, note=note)
                r["in_sample"] = bool(fitted)
                r["group"] = f"{d['run'].config} : {b['group']}"
                # held out when both runs are: the kind of the DiffKV run's
                both = d.get("held_out") and b.get("held_out")
                r["held_out"] = d["held_out"] if both else None
                r["load"], r["band"] = None, "saturation"
                out.append(r)
    return out


# ---- report ---------------------------------------------------------------------------------
def fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def err_str(r: dict) -> str:
    if r["error"] is None:
        return "-"
    return f"{r['error']:+.3f}" if r["absolute"] else f"{100 * r['error']:+.1f}%"


def target_str(r: dict) -> str:
    if r["target"] is None:
        return "-"
    return f"±{r['target']:.2f}" if r["absolute"] else f"±{100 * r['target']:.0f}%"


def verdict_cell(r: dict) -> str:
    return f"**{r['verdict']}**" if r["verdict"] == "MISS" else r["verdict"]


def table(rows: list[dict]) -> str:
    out = ["| metric | run | measured | predicted | error | target | verdict | note |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['metric']} | {r['run']} | {fmt(r['measured'])} | "
                   f"{fmt(r['predicted'])} | {err_str(r)} | {target_str(r)} | "
                   f"{verdict_cell(r)} | {r['note']} |")
    return "\n".join(out)


def repeats_table(reps: list[dict]) -> str:
    out = ["| metric | runs | n | measured mean | measured range | run-to-run ± | predicted | "
           "error vs mean | target | verdict | inside range |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reps:
        spread = (f"±{r['spread']:.3f}" if r["absolute"] else f"±{100 * r['spread']:.1f}%") \
            if r["spread"] is not None else "-"
        out.append(f"| {r['metric']} | {group_label(r['group'])} | {len(r['runs'])} | "
                   f"{fmt(r['measured_mean'])} | {fmt(r['measured_min'])} – "
                   f"{fmt(r['measured_max'])} | {spread} | {fmt(r['predicted'])} | "
                   f"{err_str(r)} | {target_str(r)} | {verdict_cell(r)} | "
                   f"{'yes' if r['within_range'] else 'no'} |")
    return "\n".join(out)


def plots(sims: dict[str, Any], h: HarnessResults, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    ladders: dict[str, list] = {}
    for s in sims.values():
        run = s["run"]
        if run.workload == "ladder" and run.rate_req_s:
            ladders.setdefault(run.config, []).append((run.rate_req_s, run.client, s["summary"]))
    if ladders:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for cfg, pts in sorted(ladders.items()):
            pts.sort(key=lambda p: p[0])
            rates = [p[0] for p in pts]
            for ax, key in ((a1, "mean_ttft_ms"), (a2, "mean_tpot_ms")):
                line, = ax.plot(rates, [p[1].get(key) or math.nan for p in pts], "o-",
                                label=f"{cfg} measured")
                ax.plot(rates, [p[2][key] for p in pts], "s--", color=line.get_color(),
                        label=f"{cfg} simulated")
        a1.set_ylabel("TTFT mean (ms)")
        a2.set_ylabel("TPOT mean (ms)")
        for ax in (a1, a2):
            ax.set_xlabel("request rate (req/s)")
        a1.legend(fontsize=8)
        fig.suptitle("ladder: measured vs simulated")
        fig.tight_layout()
        p = out_dir / "latency_vs_rate.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    sat = [(k, s) for k, s in sims.items() if s["run"].workload in ("sharegpt",)]
    if sat:
        fig, axes = plt.subplots(len(sat), 1, figsize=(9, 2.6 * len(sat)), squeeze=False)
        for ax, (key, s) in zip(axes[:, 0], sat, strict=True):
            t, b = measured_series(s["run"].log_slice)
            ax.plot(t, b, label="measured (Decode lines)", lw=1)
            ax.plot(s["summary"]["series_t"], s["summary"]["series_batch"], label="simulated",
                    lw=1)
            ax.set_title(key, fontsize=9)
            ax.set_ylabel("running batch")
        axes[-1, 0].set_xlabel("time in window (s)")
        axes[0, 0].legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "batch_timeseries.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _score(rows: list[dict]) -> tuple[int, int]:
    scored = [r for r in rows if r["verdict"] in ("PASS", "MISS")]
    return sum(r["verdict"] == "PASS" for r in scored), len(scored)


def held_out_summary(rows: list[dict], reps: list[dict]) -> list[str]:
    """The report's second line: the held-out rows' score, and at 50-80% load."""
    out = [r for r in rows if r.get("held_out")]
    if not out:
        return []
    p, n = _score(out)
    rp, rn = _score([r for r in reps if r.get("held_out")])
    mp, mn = _score([r for r in out if r.get("band") == "50-80%"])
    return [f"Held out by construction (`--held-out`; below): **{p} PASS, {n - p} MISS** of "
            f"{n} rows with a target; at 50-80% load {mp} / {mn}; against the mean of "
            f"held-out repeats {rp} / {rn}.", ""]


def held_out_section(rows: list[dict], reps: list[dict], held: dict[str, str]) -> list[str]:
    """The report's held-out rows, apart: a score by load band (held-out trace, held-out load
    level, the mean of held-out repeats, and the validated runs that are not held out), the
    runs, and their rows."""
    out = [r for r in rows if r.get("held_out")]
    rest = [r for r in rows if not r.get("held_out")]
    kinds = {k: sorted(run for run, kind in held.items() if kind == k)
             for k in ("trace", "load level")}
    groups = {"held-out trace": [r for r in out if r["held_out"] == "trace"],
              "held-out load level": [r for r in out if r["held_out"] == "load level"],
              "held out, mean of repeats": [r for r in reps if r.get("held_out")],
              "not held out": rest}
    return [
        "## Held out by construction",
        "",
        "The recipe's held-out runs (`--held-out`, `simulator/validation/held_out.py`): no "
        "fitting run matches them, and none replays their request files. A *held-out trace* "
        "draws its request lengths from a trace no fitting run draws from; a *held-out load "
        "level* draws from a fitted trace at a rate or request count no fitting run ran. "
        "Load: a ladder's request rate over its server's ShareGPT saturation rate; "
        "saturation: bursts (every request at t = 0) and partial windows. PASS / rows with a "
        "target:",
        "",
        band_table(groups),
        "",
        f"- held-out traces ({len(kinds['trace'])} runs): {', '.join(kinds['trace']) or 'none'}",
        f"- held-out load levels ({len(kinds['load level'])} runs): "
        f"{', '.join(kinds['load level']) or 'none'}",
        "",
        table(out) if out else "none",
        "",
        "## Validated, not held out",
        "",
        "Runs neither fitted nor held out: other server starts of a fitted trace at a fitted "
        "rate, bursts on request files a fitting run replays, the KV pools.",
        "",
        table(rest) if rest else "none",
    ]


def report(all_rows: list[dict], reps: list[dict], h: HarnessResults, calib: Calibration,
           fitinfos: list[dict], plot_paths: list[Path], doc: Path, argv: list[str],
           held: dict[str, str] | None = None) -> str:
    rows = [r for r in all_rows if not r.get("in_sample")]
    insample = [r for r in all_rows if r.get("in_sample")]
    n_pass = sum(r["verdict"] == "PASS" for r in rows)
    n_miss = sum(r["verdict"] == "MISS" for r in rows)
    r_pass = sum(r["verdict"] == "PASS" for r in reps)
    r_inside = sum(r["within_range"] for r in reps)
    env = h.environment
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    fitted = sorted(f["run"] for f in fitinfos)
    validated = sorted({r["run"] for r in rows if "/" in r["run"] and " : " not in r["run"]})
    lines = [
        "# Simulator validation against real SGLang runs",
        "",
        f"Generated by `simulator/validation/runs.py` on {dt.date.today().isoformat()} "
        f"(commit {commit[:12]}): **{n_pass} PASS, {n_miss} MISS** of {n_pass + n_miss} rows "
        "with a target. Against the mean of repeated runs (the same command on the same "
        f"requests, on several server starts): **{r_pass} PASS, {len(reps) - r_pass} MISS** of "
        f"{len(reps)} rows; {r_inside} predictions lie inside the measured range.",
        "",
        *held_out_summary(rows, reps),
        "Targets (issue 8): KV pool within 1%; saturation throughput and mean batch within 5%; "
        "TPOT within 5%; TTFT within 10% below 80% load; DiffKV/bf16 throughput ratio within "
        "5 points. Error = predicted / measured - 1 (the ratio: predicted - measured).",
        "",
        *(held_out_section(rows, reps, held) if held else [table(rows)]),
        "",
        "## Against the mean of repeated runs",
        "",
        "Rows of runs that repeat one command on one request list (configuration, workload, "
        "rate and the trace's request lengths agree; fitting runs left out), scored against "
        "the mean of their measurements. *Run-to-run ±* is half the measured range over the "
        "mean: the spread of the real servers themselves (`simulator/validation/repeats.py`). "
        "The DiffKV / bf16 rows average every DiffKV : bf16 pairing.",
        "",
        repeats_table(reps) if reps else "none",
        "",
        "## In-sample rows (fitting runs: no verdict)",
        "",
        table(insample) if insample else "none",
        "",
        "## Runs",
        "",
        f"- fitting (never validated): {', '.join(fitted) or 'none (calibration as given)'}",
        f"- validated: {', '.join(validated)}",
        "- harness results: " + ", ".join(f"`{_rel(p)}`" for p in (h.sources or [h.root]))
        + f"; GPU {env.get('gpu', '?')}, sglang {env.get('sglang', env.get('versions', '?'))}",
        "",
        "## Calibration",
        "",
        f"- file: `{calib.source_file}`; kernel grids: "
        f"{', '.join(f'{k}' for k in calib.measured.to_dict() if calib.measured.to_dict()[k])}"
        if calib.measured else f"- file: `{calib.source_file}` (no kernel grids)",
        f"- provenance: {json.dumps(calib.provenance.get('kernels', calib.provenance['source']))}",
        "- a prefill step long after the last one: kernels "
        f"x{calib.isolated_prefill_scale:.3g}"
        + (" (below the power limit the grids and back-to-back steps run at), back to back "
           "x1, " + (f"the clocks recovering in {calib.prefill_clock_recovery_s * 1e3:.3g} ms "
                     "(exponential) in between"
                     if calib.prefill_clock_recovery_s else "any step in between: alone")
           + "; simulator/calibration/sustained_prefill.py"
           if calib.isolated_prefill_scale != 1.0 else " (not measured for this GPU)"),
    ]
    if calib.measured_raw.get("provenance"):
        p = calib.measured_raw["provenance"]
        lines.append(f"- measured on {p.get('gpu_name')} (driver {p.get('driver')}, CUDA "
                     f"{p.get('cuda')}, torch {p.get('torch')}, triton {p.get('triton')}, "
                     f"sglang {p.get('sglang')}) on {p.get('date')}, commit "
                     f"{p.get('git_commit')}: `{p.get('command')}`")
    for fi in fitinfos:
        lines.append(f"- {fi['backend']} step costs (`{_rel(Path(fi['file']))}`): "
                     + step_costs_note(fi, fi["run"])
                     + given_note(fi.get("given", {})))
        if fi.get("refinement"):
            lines.append(f"  - then {fi['refinement']}")
        if fi["dropped"]:
            lines.append(f"  - dropped: {'; '.join(fi['dropped'][:8])}"
                         + (f"; and {len(fi['dropped']) - 8} more" if len(fi["dropped"]) > 8
                            else ""))
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.relative_to(doc.parent)})" for p in plot_paths]
    lines += ["", "## Command", "", "```", f"{PROG} " + " ".join(argv), "```", ""]
    return "\n".join(lines)


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


FINDINGS_HEADING = "## Findings (hand-written"


def kept_findings(doc: Path) -> str:
    """The doc's hand-written findings section (from its heading to the end), which a
    regenerated report keeps; empty if there is none."""
    if not doc.exists():
        return ""
    text = doc.read_text()
    at = text.find(FINDINGS_HEADING)
    return "" if at < 0 else "\n" + text[at:].rstrip() + "\n"


def scratch_name(results_dir: str) -> str:
    """Where a folder's packed logs are unpacked under --scratch: its parent's name and its
    own, to read, and a digest of its whole path, so that two folders called alike
    (s24-loop/c3/fp8, s25-pin/c3/fp8) never share one (they would read each other's traces)."""
    p = Path(results_dir).resolve()
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:8]
    return f"{p.parent.name}--{p.name}--{digest}"


def results_arg(arg: str) -> tuple[str, str | None, dict[str, str]]:
    """``DIR[#TAG[@OLD=NEW,...]]`` as (folder, tag, configuration renames)."""
    d, _, rest = arg.partition("#")
    tag, at, spec = rest.partition("@")
    rename: dict[str, str] = {}
    for pair in spec.split(",") if at else []:
        old, eq, new = pair.partition("=")
        if not (eq and old and new):
            raise SimulatorInputError(f"{arg}: rename {pair!r}: write OLD=NEW "
                                      "(e.g. bf16=bf16-graphs1536)")
        rename[old] = new
    if at and not tag:
        raise SimulatorInputError(f"{arg}: a renamed folder needs a tag (DIR#TAG@OLD=NEW)")
    return d, tag or None, rename


def build_parser() -> argparse.ArgumentParser:
    """The options of ``diffkv-sim validate-runs`` (a recipe's keys are their names)."""
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", metavar="NAME|FILE",
                    help="read the result folders and options from a JSON recipe: a file, or "
                         "a shipped one (h100, h200: their validation reports); options given "
                         "after it add to its lists and replace its single values")
    ap.add_argument("results", nargs="+",
                    help="scripts/bench_e2e.py --out directories (several are merged); "
                         "DIR#TAG appends #TAG to the labels of DIR's runs, so a workload run "
                         "again (another lease, another commit) keeps its own key, e.g. "
                         "--fit-run diffkv-mix/ladder@4rps#s8; DIR#TAG@OLD=NEW[,OLD=NEW] "
                         "also renames DIR's configuration OLD to NEW (a server started with "
                         "other flags, e.g. DIR#s13g@bf16=bf16-graphs1536)")
    ap.add_argument("--calibration", default=None,
                    help="calibration JSON (scripts/calibrate_gpu.py's calibration.json); "
                         "default: the shipped one")
    ap.add_argument("--shipped", action="store_true",
                    help="score what a user gets: replay every run with the calibration "
                         "`diffkv-sim --gpu GPU` uses by default (simulator/calibration/"
                         "GPU-{triton,diffkv}.json for a measured GPU, default.json for "
                         "another), nothing fitted (no --fit-run, --calibration or measured "
                         "inputs), at the files' host times as diffkv-sim runs them")
    ap.add_argument("--fit-run", action="append", default=None,
                    help="CONFIG/WORKLOAD (e.g. bf16/longgen, bf16/ladder@4rps) whose log "
                         "fits the fixed step costs of its backend (triton or diffkv); "
                         "repeatable: a backend's runs are fitted together; never validated; "
                         "'none' keeps the file's (default: bf16/longgen)")
    ap.add_argument("--held-out", action="append", default=[], metavar="PATTERN",
                    help="runs kept out of the fit by construction, as a shell pattern on run "
                         "keys CONFIG/LABEL (e.g. '*/ladder@23.03rps#*': a load level; '*#z': "
                         "one folder's runs); a fitting run that one matches, or that replays "
                         "a held-out run's request file, is refused; the report scores them "
                         "apart, by load band (simulator/validation/held_out.py); repeatable")
    ap.add_argument("--skip-run", action="append", default=[],
                    help="CONFIG/LABEL of a run in the given folders to leave out entirely "
                         "(e.g. one superseded by a run of a later commit); repeatable")
    ap.add_argument("--fit-decode-run", action="append", default=[],
                    help="like --fit-run, but only the run's decode-only intervals are "
                         "fitted: a saturation run whose large and eager decode batches the "
                         "open-loop runs do not reach, while its prefill bursts (long prompts, "
                         "full chunks) are left out of the prefill costs; never validated")
    ap.add_argument("--eager-prefill-launch-s", action="append", default=[],
                    metavar="KEY=S",
                    help="host time, s, to launch an eager prefill step's kernels, for KEY: a "
                         "backend (triton or diffkv) or a triton KV format (bf16, fp8) whose "
                         "launches differ (calibration fields eager_prefill_launch_s and "
                         "eager_prefill_launch_s_by_format): its step lasts max(launches, "
                         "kernels + the per-prompt-token cost) instead of their sum; from "
                         "diffkv-sim prefill-probes or a loop trace's run_batch host time of an "
                         "extend; triton's launches begin under the decode step before (the "
                         "overlap scheduler), DiffKV's after it (its prefill allocation waits "
                         "for that step); repeatable; default: the calibration's (0: the sum)")
    ap.add_argument("--eager-prefill-turnaround-s", action="append", default=[],
                    metavar="KEY=S",
                    help="the host's time, s, from the end of an eager prefill's launches to "
                         "the next step's launch (it streams the step before's tokens and "
                         "forms and prepares the next batch), for KEY as in "
                         "--eager-prefill-launch-s, which KEY needs (calibration fields "
                         "eager_prefill_turnaround_s and eager_prefill_turnaround_s_by_format): "
                         "the GPU idles through it, so a launch-bound prefill step lasts "
                         "launches + this; measured as python -m "
                         "sglang_diffkv.bench.loop_trace_report's median turnaround over the "
                         "ladders' extends; repeatable; default: the calibration's (0: none)")
    ap.add_argument("--eager-decode-host-s", action="append", default=[],
                    metavar="KEY=S",
                    help="the host's time, s, for a scheduler iteration around a decode step "
                         "that no CUDA graph runs (batch above cuda_graph_max_bs), for KEY as "
                         "in --eager-prefill-launch-s (calibration fields eager_decode_host_s "
                         "and eager_decode_host_s_by_format): such a step lasts max(this, its "
                         "kernels and fixed costs) instead of kernels + a fitted cost per "
                         "layer, and its Decode intervals leave the interval fit; measured as "
                         "loop_trace_report --graph-max-bs's eager median on a fitting run, or "
                         "the intercept of its line over the eager batches "
                         "(--eager-decode-host-per-req-s); repeatable; default: the "
                         "calibration's (0: the per-layer cost)")
    ap.add_argument("--eager-decode-host-per-req-s", action="append", default=[],
                    metavar="KEY=S",
                    help="what that host iteration adds per request in the batch, s, for KEY "
                         "as in --eager-prefill-launch-s (calibration fields "
                         "eager_decode_host_per_req_s and "
                         "eager_decode_host_per_req_s_by_format): the floor is "
                         "--eager-decode-host-s + this x batch; measured with the intercept, as "
                         "loop_trace_report --graph-max-bs's line over a fitting run's eager "
                         "iterations; repeatable; default: the calibration's (0: a flat floor)")
    ap.add_argument("--eager-launch-holds-loop", action="append", default=[], choices=BACKENDS,
                    metavar="BACKEND",
                    help="BACKEND's eager prefill launches (--eager-prefill-launch-s) also "
                         "hold the overlap loop: the next batch is formed once they end, and "
                         "the step before's tokens stream only then (calibration field "
                         "eager_launch_holds_loop); repeatable; default: the calibration's "
                         "(off)")
    ap.add_argument("--prefill-step-overhead-s", action="append", default=[],
                    metavar="BACKEND=S",
                    help="fixed cost, s, of a prefill step beyond the modelled kernels "
                         "(calibration field prefill_step_overhead_s), e.g. the DiffKV extend "
                         "path's scoring/compression launches from the backend profile, for "
                         "when BACKEND's fitting runs hold no prefill steps to fit it from "
                         "(kept only if not fitted); repeatable; default: the calibration's")
    ap.add_argument("--isolated-prefill-scale", type=float, default=None,
                    help="factor on the kernel time of a prefill step that follows no prefill "
                         "step (it runs below the power limit that the kernel grids and a "
                         "burst's back-to-back chunks run at), measured by "
                         "simulator/calibration/sustained_prefill.py: a step's time alone over its "
                         "time back to back; default: the calibration's (1 when it has none)")
    ap.add_argument("--prefill-clock-recovery-s", type=float, default=None,
                    help="how fast, s, the clocks come back after a prefill step (calibration "
                         "field prefill_clock_recovery_s): a prefill step GAP s after the "
                         "previous one runs at isolated + (1 - isolated) * "
                         "exp(-GAP / this); 0: at once (any step in between and it runs at "
                         "--isolated-prefill-scale); default: the calibration's (0 when it has "
                         "none). simulator/calibration/sustained_prefill.py --duty measures it")
    ap.add_argument("--prefill-fit", choices=("all", "none"), default="all",
                    help="all: fit the prefill-only costs (per step / request / prompt token) "
                         "from the fitting runs' Decode intervals that hold prefill steps and "
                         "their back-to-back Prefill bursts; none: decode-only intervals, the "
                         "calibration's prefill costs kept (default: %(default)s)")
    ap.add_argument("--refine-on-metrics", action="append", default=[],
                    choices=BACKENDS,
                    help="after the interval fit, move BACKEND's fitted step costs until its "
                         "fitting runs' simulated metrics (throughput, batch, TPOT, TTFT) "
                         "match their measured ones (simulator/validation/refine.py); "
                         "repeatable; each simulation replays every fitting run of the "
                         "backend, so this takes minutes")
    ap.add_argument("--refine-hold", action="append", default=[],
                    metavar="[BACKEND:]TERM",
                    help="a fitted term the refinement leaves at the interval fit's value, "
                         "for every backend or, as BACKEND:TERM, for one, e.g. "
                         "decode_attention_scale: the Decode intervals time the decode "
                         "attention across batch and context, while the fitting runs' metrics "
                         "barely move with it below the batches a burst runs; TERM one of "
                         f"{', '.join(HOLDABLE)}; repeatable")
    ap.add_argument("--first-token-latency-s", action="append", default=[],
                    metavar="BACKEND=S",
                    help="the client's first-token latency, s, beyond the scheduler (HTTP, "
                         "tokenizer and detokenizer processes) for BACKEND (triton or "
                         "diffkv; calibration field first_token_latency_s), measured, e.g. "
                         "loop_trace_report's pre + post at low load; the refinement keeps it "
                         "instead of fitting it to the fitting runs' TTFT; repeatable; default: "
                         "fitted")
    ap.add_argument("--refine-evals", type=int, default=DEFAULT_MAX_EVALS,
                    help="simulations the refinement may run per backend "
                         "(default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="fit the backends (triton, diffkv) in this many processes at once; "
                         "their refinements take most of the time (default: %(default)s)")
    ap.add_argument("--scratch", default=str(ROOT / "results" / "validation-logs"),
                    help="where packed logs (logs.tar.gz) are unpacked (default: %(default)s)")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h100")
    # the default stays out of git (results/ is ignored): a report of new runs must not
    # replace a shipped one, which its recipe names (--recipe h100 / h200)
    ap.add_argument("--doc", default=str(ROOT / "results" / "simulator-validation.md"),
                    help="the report to write (default: %(default)s; the shipped reports' "
                         "recipes write docs/simulator-validation*.md)")
    ap.add_argument("--plots", default=None,
                    help="folder for the plots and the fitted calibration files (default: "
                         "beside --doc, named after it: DOC.md -> DOC/)")
    ap.add_argument("--json", default=None, help="write the rows as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args_used = list(argv if argv is not None else sys.argv[1:])
    try:
        argv = expand_recipe(args_used, PROG)
        renamed = renamed_option(argv)
        if renamed:
            raise SimulatorInputError(renamed)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    ap = build_parser()
    # intermixed: a recipe's folders come first, the caller's may follow its options
    a = ap.parse_intermixed_args(argv)
    try:
        if a.isolated_prefill_scale is not None and not (
                ISOLATED_PREFILL_MIN <= a.isolated_prefill_scale <= 1.0):
            raise SimulatorInputError(
                f"--isolated-prefill-scale {a.isolated_prefill_scale:g} must be in "
                f"[{ISOLATED_PREFILL_MIN:g}, 1]")
        for field in GIVEN_SECONDS:
            setattr(a, field, key_seconds_arg(field, getattr(a, field)))
        a.refine_hold = refine_hold_arg(a.refine_hold)
        recovery = a.prefill_clock_recovery_s
        if recovery is not None and not 0 <= recovery <= PREFILL_CLOCK_RECOVERY_MAX_S:
            raise SimulatorInputError(
                f"--prefill-clock-recovery-s {recovery:g} must be in "
                f"[0, {PREFILL_CLOCK_RECOVERY_MAX_S:g}]")
        parts = []
        for arg in a.results:
            d, tag, rename = results_arg(arg)
            parts.append(load_harness(d, Path(a.scratch) / scratch_name(d), tag=tag,
                                      rename=rename))
        h = merge_harness(parts)
        unknown = sorted(set(a.skip_run) - {r.key for r in h.runs})
        if unknown:
            raise SimulatorInputError(f"--skip-run {', '.join(unknown)}: no such run; runs "
                                      f"are {', '.join(r.key for r in h.runs)}")
        h.runs = [r for r in h.runs if r.key not in a.skip_run]
        calib = load_calibration(load_gpu(a.gpu).key, a.calibration)
        if a.isolated_prefill_scale is not None:
            calib = replace(calib, isolated_prefill_scale=a.isolated_prefill_scale)
        if recovery is not None:
            calib = replace(calib, prefill_clock_recovery_s=recovery)
        doc = Path(a.doc)
        plot_dir = plot_dir_of(a)
        plot_dir.mkdir(parents=True, exist_ok=True)
        fitinfos: list[dict] = []
        fitting: set[str] = set()
        calibs: dict[str, Calibration] = {"base": calib}
        if a.jobs < 1:
            raise SimulatorInputError(f"--jobs {a.jobs} must be >= 1")
        if a.shipped and (a.calibration or a.fit_run or a.fit_decode_run):
            raise SimulatorInputError("--shipped scores the shipped calibration as it is: "
                                      "give no --calibration, --fit-run or --fit-decode-run")
        fit_runs = [] if a.shipped else [
            k for k in (a.fit_run or ["bf16/longgen"]) if k.lower() != "none"]
        fit_runs += a.fit_decode_run
        # held out by construction: checked before anything is fitted
        fit_keys = set(fit_runs)
        held = held_out_runs(h, a.held_out, [r for r in h.runs if is_fitting_run(r, fit_keys)])
        by_backend: dict[str, list[str]] = {}
        for key in fit_runs:
            cfg = h.configs.get(h.run(key).config, {})
            is_diffkv = cfg.get("attention_backend") == "diffkv"
            by_backend.setdefault("diffkv" if is_diffkv else "triton", []).append(key)
        jobs = list(by_backend.items())
        if a.jobs > 1 and len(jobs) > 1:
            # each backend's fit and refinement is independent of the other's
            fitted = in_forked_processes(partial(fit_backend, h, a, calib), jobs)
        else:
            fitted = [fit_backend(h, a, calib, job) for job in jobs]
        for be, fitted_cal, info in fitted:
            calibs[be] = fitted_cal
            fitinfos.append(info)
            fitting.update(info["runs"])
        for be in set(BACKENDS) - set(by_backend):
            calibs[be] = with_given(calib, be, a)   # no fitting runs: the file's costs
        if a.shipped:
            shipped = load_calibration_set(load_gpu(a.gpu).key)
            calibs = {"base": shipped.for_key("bf16"), **shipped.by_backend}
            calib = calibs["base"]
        rows, sims = validate(h, calibs, a.model, a.gpu, fitting, held, report_progress=True)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    paths = plots(sims, h, plot_dir)
    doc.parent.mkdir(parents=True, exist_ok=True)
    reps = repeat_rows(rows)
    doc.write_text(report(rows, reps, h, calib, fitinfos, paths, doc, args_used, held)
                   + kept_findings(doc))
    print(f"wrote {doc} and {len(paths)} plot(s) in {plot_dir}")
    if a.json:
        payload = {"rows": rows, "repeats": reps, "held_out": held,
                   "fit": fitinfos[0] if fitinfos else None, "fits": fitinfos}
        Path(a.json).write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
