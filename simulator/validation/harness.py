"""Validate the simulator against the end-to-end harness's real SGLang runs
(``scripts/bench_e2e.py``, docs/e2e.md): replay each run's exact trace through the simulator
with the same server settings and compare, over the same measurement window.

Input: the harness's ``--out`` directory:

  results.json         {"configs": {NAME: {"command": str, "attention_backend": str,
                        "kv_cache_dtype": str|None, "max_total_num_tokens": int, ...}},
                        "runs": [{"config", "workload" (longgen|sharegpt|ladder), "label",
                        "trace_file" (relative), "client": {bench_serving metrics +
                        time_limited, window_s, steady_*}, "server_log": {"log_bytes":
                        [start, end], ...}, "rate_req_s", "saturation_req_s"}, ...],
                        "environment": {...}}
  logs/server__NAME.log  (or logs.tar.gz holding logs/)
  logs/traces/*.jsonl    the exact traces (Mooncake JSONL)

Server settings come from the run's server log (``server_args=ServerArgs(...)``) or, failing
that, from the recorded command line; the DiffKV backend's forced settings (radix cache off, no
chunked prefill, no piecewise prefill graphs) are applied for ``attention_backend == "diffkv"``.
Its decode CUDA graphs follow the run's own ``disable_cuda_graph`` / ``cuda_graph_max_bs``
(the backend captures decode graphs, up to 512 by default, except on the torch reference path,
``SGLANG_DIFFKV_KERNELS=0``, which forces them off). The overlap scheduler is not modelled for
any backend (``serving/scheduler.py``): its effect stays in the fitted fixed costs.

The measured runs stop at a window W (``client.window_s``) while the simulator runs every
request to its end, so simulated quantities are taken over the same window: output tokens and
completions with time <= W (and over [W/2, W] for the steady rates), batch sizes of decode
steps ending <= W, TTFT/TPOT over requests that finished <= W (bench_serving's completed
requests). A run whose every request finished before W (not ``time_limited``: a burst) ends
at its last completion, so its simulated twin is taken to its own end
(``HarnessRun.simulated_window_s``). Fitting runs (default ``bf16/longgen``) are never validated.
"""

from __future__ import annotations

import math
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.json_file import read_json
from sglang_diffkv.serving_io.launch_args import launch_args
from sglang_diffkv.serving_io.loaders import load_trace
from sglang_diffkv.serving_io.sglang_log import ServerLog
from sglang_diffkv.serving_io.trace import Trace
from simulator.engine.cluster import RunResult
from simulator.errors import SimulatorInputError
from simulator.metrics.summary import per_request_arrays
from simulator.serving.settings import ServerSettings
from simulator.validation.prompt_cache import read_records, served_blocks, with_prompt_ids

# issue 8's targets: (relative error bound, or absolute for the ratio); None = reported only
TARGETS = {"kv_pool": 0.01, "throughput": 0.05, "mean_batch": 0.05, "tpot": 0.05,
           "ttft": 0.10, "ratio_pp": 0.05}
TTFT_MAX_LOAD = 0.8
_TS = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)")


@dataclass
class HarnessRun:
    config: str
    workload: str
    label: str
    trace_path: Path
    client: dict[str, Any]
    log_slice: str
    rate_req_s: float | None
    saturation_req_s: float | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    server_log: Path | None = None      # the whole server log its slice comes from
    seed: int = 0                       # the client's prompt seed (bench_e2e --seed)
    # the runs served before this one by the same server start, oldest first
    earlier: tuple[HarnessRun, ...] = field(repr=False, default=())
    lengths_from: str = "sharegpt"      # the trace its request lengths come from
    _trace: Trace | None = field(repr=False, default=None, compare=False)
    _warm: list[tuple[int, ...]] | None = field(repr=False, default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.config}/{self.label}"

    @property
    def records_path(self) -> Path | None:
        """The client's per-request records (``requests__CONFIG__LABEL.jsonl.gz``)."""
        if self.server_log is None:
            return None
        raw_label = self.raw.get("label", self.raw.get("workload", self.workload))
        p = self.server_log.parent / f"requests__{self.raw.get('config')}__{raw_label}.jsonl.gz"
        return p if p.exists() else None

    def replay_inputs(self, radix_cache: bool = True) -> tuple[Trace, list[tuple[int, ...]]]:
        """What the simulator replays: the run's trace with its prompts' prefix ids, and
        what the radix cache held at its start (``prompt_cache``; nothing for a server without
        one); each computed once."""
        if self._trace is None:
            trace = with_prompt_ids(load_trace(self.trace_path), self.seed)
            own = self.records_path
            for rec in read_records(own) if own is not None else []:
                i = rec["index"]
                if i >= len(trace) or trace.requests[i].input_tokens != rec["input_len"]:
                    raise SimulatorInputError(
                        f"{own}: request {i} ({rec['input_len']} prompt tokens) is not "
                        f"request {i} of {self.trace_path}")
            self._trace = trace
        if not radix_cache:
            return self._trace, []
        if self._warm is None:
            history = []
            for r in self.earlier:
                p = r.records_path
                if p is None:
                    raise SimulatorInputError(
                        f"{self.key}: the run before it on its server ({r.key}) has no "
                        "request records (requests__CONFIG__LABEL.jsonl.gz), so the radix "
                        "cache it left is unknown")
                history.append(read_records(p))
            self._warm = served_blocks(history, self.seed)
        return self._trace, self._warm

    @property
    def window_s(self) -> float | None:
        w = self.client.get("window_s")
        return float(w) if isinstance(w, (int, float)) and w > 0 else None

    @property
    def simulated_window_s(self) -> float | None:
        """The window the simulated run is measured over: the client's W when it stopped the
        run there; None (the simulator's own end) when every request finished first, since
        then the measured window is the real run's own makespan and cutting the simulated run
        at it would drop (or pad) its tail whenever the two makespans differ."""
        return self.window_s if self.client.get("time_limited", True) else None


@dataclass
class HarnessResults:
    root: Path
    configs: dict[str, dict[str, Any]]
    runs: list[HarnessRun]
    environment: dict[str, Any]
    server_logs: dict[str, Path]
    sources: list[Path] = field(default_factory=list)   # the harness folders merged here

    def run(self, key: str) -> HarnessRun:
        """The run named ``key``: its exact key (``config/label``), else the first run of
        ``config/workload``."""
        for r in self.runs:
            if r.key == key:
                return r
        for r in self.runs:
            if f"{r.config}/{r.workload}" == key:
                return r
        raise SimulatorInputError(f"{self.root}: no run {key!r}; runs are "
                                  f"{', '.join(r.key for r in self.runs)}")


def _need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SimulatorInputError(f"{where}: missing field {key!r}")
    return d[key]


TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def load_harness(root: str | Path, extract_to: str | Path | None = None,
                 tag: str | None = None, rename: dict[str, str] | None = None
                 ) -> HarnessResults:
    """One harness ``--out`` folder. ``logs.tar.gz`` (when there is no ``logs/``) is unpacked
    into ``extract_to`` (default: the folder itself), e.g. a scratch folder for committed
    results that should stay untouched. ``tag`` is appended to every run's label
    (``ladder@4rps#s8``): the same workload run again on another lease or commit merges with
    the first under its own key. ``rename`` maps the folder's configuration names to new ones
    (``{"bf16": "bf16-graphs1536"}``): the harness names a configuration by its backend, so a
    server started with other flags needs its own name to merge with the default one."""
    if tag is not None and not TAG_RE.match(tag):
        raise SimulatorInputError(f"run tag {tag!r}: use letters, digits, '.', '_' or '-' "
                                  "(starting with a letter or digit)")
    rename = rename or {}
    for new in rename.values():
        if not TAG_RE.match(new):
            raise SimulatorInputError(f"configuration name {new!r}: use letters, digits, '.', "
                                      "'_' or '-' (starting with a letter or digit)")
    root = Path(root)
    res_path = root / "results.json"
    if not res_path.exists():
        # the usual mistake is a directory that is not a harness run: say how to make one
        raise SimulatorInputError(f"cannot read {res_path}: No such file or directory (the "
                                  "harness's results.json; run scripts/bench_e2e.py --out DIR)")
    data = read_json(res_path, "the harness's results.json", SimulatorInputError)
    logs = root / "logs"
    tar = root / "logs.tar.gz"
    base = root
    if not logs.is_dir() and tar.exists():
        base = Path(extract_to) if extract_to is not None else root
        logs = base / "logs"
        if not logs.is_dir():
            with tarfile.open(tar) as t:
                members = [m for m in t.getmembers() if m.isfile()
                           and not Path(m.name).is_absolute() and ".." not in Path(m.name).parts]
                t.extractall(base, members=members, filter="data")
    configs = _need(data, "configs", str(res_path))
    if not isinstance(configs, dict):
        raise SimulatorInputError(f"{res_path}: 'configs' must be an object")
    server_logs: dict[str, Path] = {}
    for name in configs:
        p = logs / f"server__{name}.log"
        if p.exists():
            server_logs[name] = p
    unknown = sorted(set(rename) - set(configs))
    if unknown:
        raise SimulatorInputError(f"{res_path}: no configuration {', '.join(unknown)} to "
                                  f"rename; it has {', '.join(configs)}")
    names = [rename.get(k, k) for k in configs]
    if len(set(names)) < len(names):
        raise SimulatorInputError(f"{res_path}: renaming {rename} gives two configurations "
                                  f"one name ({', '.join(names)})")
    seed = _client_seed(data)
    lengths_from = _lengths_from(data)
    runs: list[HarnessRun] = []
    for i, r in enumerate(_need(data, "runs", str(res_path))):
        where = f"{res_path}: runs[{i}]"
        if not isinstance(r, dict):
            raise SimulatorInputError(f"{where} must be an object")
        cfg = _need(r, "config", where)
        tf = base / _need(r, "trace_file", where)
        if not tf.exists():
            raise SimulatorInputError(f"{where}: trace file {tf} does not exist")
        if cfg not in server_logs:
            raise SimulatorInputError(f"{where}: no server log {logs / f'server__{cfg}.log'} "
                                      f"(nor in {tar})")
        span = _need(_need(r, "server_log", where), "log_bytes", where + ".server_log")
        with open(server_logs[cfg], "rb") as f:
            f.seek(int(span[0]))
            text = f.read(int(span[1]) - int(span[0])).decode(errors="replace")
        label = r.get("label", r["workload"]) + (f"#{tag}" if tag else "")
        # one folder starts each configuration's server once and runs its workloads in order
        earlier = tuple(x for x in runs if x.raw.get("config") == cfg)
        runs.append(HarnessRun(rename.get(cfg, cfg), _need(r, "workload", where), label, tf,
                               _need(r, "client", where), text, r.get("rate_req_s"),
                               r.get("saturation_req_s"), r, server_logs[cfg], seed, earlier,
                               lengths_from=lengths_from))
    configs = {rename.get(k, k): v for k, v in configs.items()}
    server_logs = {rename.get(k, k): v for k, v in server_logs.items()}
    return HarnessResults(root, configs, runs, data.get("environment", {}), server_logs,
                          [root])


def _lengths_from(data: dict[str, Any]) -> str:
    """The trace bench_e2e took its sharegpt and ladder request lengths from (its
    --sharegpt-trace; the bundled ShareGPT one when not recorded)."""
    opt = data.get("options")
    v = opt.get("sharegpt_trace") if isinstance(opt, dict) else None
    return str(v) if v else "sharegpt"


def _client_seed(data: dict[str, Any]) -> int:
    """bench_e2e's --seed (its prompts' seed): from the recorded options, else the recorded
    argv, else the default 0."""
    opt = data.get("options")
    if isinstance(opt, dict) and isinstance(opt.get("seed"), int):
        return int(opt["seed"])
    argv = [str(a) for a in data.get("argv") or []]
    given = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--seed"]
    given += [a.split("=", 1)[1] for a in argv if a.startswith("--seed=")]
    if given and given[-1].lstrip("-").isdigit():
        return int(given[-1])
    return 0


# launch_server flags that only add log lines: a server started with them serves the same
# way, so its runs merge with those of a server started without them
LOG_ONLY_FLAGS = ("--enable-request-time-stats-logging",)


def same_launch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two configurations are one launch: equal environment, and equal commands
    once the log-only flags are left out."""
    def cmd(c: dict[str, Any]) -> list[str]:
        return [w for w in str(c.get("command", "")).split() if w not in LOG_ONLY_FLAGS]
    return a.get("env") == b.get("env") and cmd(a) == cmd(b)


def merge_harness(parts: list[HarnessResults]) -> HarnessResults:
    """Several harness folders (one per GPU call) as one: configurations, runs and server
    logs joined. A configuration name may appear in several folders when it is the same
    launch (``same_launch``, e.g. one server re-run on other workloads) and its
    run keys do not repeat; each run keeps its own folder's server log (``run.server_log``),
    whose start-up lines give its server settings."""
    if not parts:
        raise SimulatorInputError("no harness results given")
    if len(parts) == 1:
        return parts[0]
    configs: dict[str, dict[str, Any]] = {}
    logs: dict[str, Path] = {}
    where: dict[str, Path] = {}
    keys: set[str] = set()
    for h in parts:
        for name, cfg in h.configs.items():
            if name in configs:
                same = same_launch(cfg, configs[name])
                clash = {r.key for r in h.runs if r.config == name} & keys
                if not same or clash:
                    why = (f"runs {', '.join(sorted(clash))} repeat" if same
                           else "different command or environment")
                    raise SimulatorInputError(
                        f"configuration {name!r} is in both {where[name]} and {h.root} "
                        f"({why}): merged results need distinct names")
                continue
            configs[name] = cfg
            where[name] = h.root
        keys |= {r.key for r in h.runs}
        for name, p in h.server_logs.items():
            logs.setdefault(name, p)
    roots = [p for h in parts for p in h.sources]
    common = Path(*Path(roots[0]).resolve().parts)
    for p in roots[1:]:
        while common not in (Path(p).resolve(), *Path(p).resolve().parents):
            common = common.parent
    env = dict(parts[0].environment)
    runs = [r for h in parts for r in h.runs]
    fill_ladder_saturation(runs)
    return HarnessResults(common, configs, runs, env, logs, roots)


def sharegpt_saturation_req_s(run: HarnessRun) -> float | None:
    """A sharegpt run's saturation rate as the harness defines it for its ladder
    (``sglang_diffkv.bench.e2e``): the window's steady req/s when the run was time-limited
    (and completed something), else bench_serving's whole-run req/s."""
    c = run.client
    steady = c.get("steady_request_throughput")
    if c.get("time_limited") and isinstance(steady, (int, float)) and steady > 0:
        return float(steady)
    whole = c.get("request_throughput")
    return float(whole) if isinstance(whole, (int, float)) and whole > 0 else None


def fill_ladder_saturation(runs: list[HarnessRun]) -> None:
    """Ladder runs at absolute rates (``--ladder-abs-rates``, e.g. another backend's rates)
    carry no saturation rate, so their load is unknown. When the merged results hold a
    sharegpt run of the same configuration (the same launch: merge_harness checks command and
    environment) on request lengths from the same trace, its saturation rate is used, as the
    harness would have; the run's ``raw["saturation_from"]`` names it. Runs that have one keep
    theirs."""
    # an untagged sharegpt run over a tagged one (a tag marks a repeat, e.g. a fitting run)
    sat = {(r.config, r.lengths_from): (r, v)
           for r in sorted(runs, key=lambda r: "#" not in r.label)
           if r.workload == "sharegpt" and (v := sharegpt_saturation_req_s(r)) is not None}
    for r in runs:
        key = (r.config, r.lengths_from)
        if r.workload == "ladder" and r.saturation_req_s is None and key in sat:
            src, v = sat[key]
            r.saturation_req_s = v
            r.raw["saturation_from"] = src.key


# ---- server settings ------------------------------------------------------------------------
def _opt_int(v: str | None) -> int | None:
    if v is None or v in ("None", ""):
        return None
    return int(float(v))


def _opt_float(v: str | None) -> float | None:
    return None if v is None or v in ("None", "") else float(v)


def _flag(v: str | None) -> bool:
    return v == "True"


# sglang_diffkv.sglang.ops: KERNELS_ENV and REFERENCE_MODES (the torch reference path, which
# the backend runs without CUDA graphs and without the overlap scheduler)
_KERNELS_ENV = "SGLANG_DIFFKV_KERNELS"
_REFERENCE_MODES = ("0", "false", "off", "reference")


def _diffkv_reference(cfg: dict[str, Any]) -> bool:
    """Whether a DiffKV configuration ran the torch reference path (env or command line)."""
    mode = (cfg.get("env") or {}).get(_KERNELS_ENV)
    if mode is None:
        m = re.search(_KERNELS_ENV + r"=('[^']*'|\S+)", cfg.get("command", ""))
        mode = m.group(1).strip("'") if m else "auto"
    return str(mode).strip().lower() in _REFERENCE_MODES


def server_settings(cfg: dict[str, Any], log: ServerLog) -> tuple[ServerSettings, str]:
    """The simulator's settings for one harness configuration, and the KV format name."""
    args = launch_args(cfg.get("command", ""))
    args.update(log.server_args)          # SGLang's own resolved values win
    backend = cfg.get("attention_backend") or args.get("attention_backend")
    dtype = cfg.get("kv_cache_dtype") or args.get("kv_cache_dtype")
    diffkv = backend == "diffkv"
    fmt = "diffkv" if diffkv else ("fp8" if dtype and "fp8" in str(dtype) else "bf16")
    chunk = _opt_int(args.get("chunked_prefill_size"))
    reference = diffkv and _diffkv_reference(cfg)
    s = ServerSettings(
        chunked_prefill_size=-1 if diffkv else chunk,
        max_prefill_tokens=_opt_int(args.get("max_prefill_tokens")) or 16384,
        cuda_graph_max_bs=_opt_int(args.get("cuda_graph_max_bs")),
        disable_cuda_graph=reference or _flag(args.get("disable_cuda_graph")),
        enable_piecewise_cuda_graph=not (diffkv or _flag(args.get(
            "disable_piecewise_cuda_graph"))),
        enable_mixed_chunk=_flag(args.get("enable_mixed_chunk")),
        disable_overlap_schedule=reference or _flag(args.get("disable_overlap_schedule")),
        schedule_conservativeness=_opt_float(args.get("schedule_conservativeness")) or 1.0,
        mem_fraction_static=_opt_float(args.get("mem_fraction_static")),
        max_total_tokens=_opt_int(args.get("max_total_tokens")),
        max_running_requests=_opt_int(args.get("max_running_requests")),
        context_len=_opt_int(args.get("context_length")),
        disable_radix_cache=diffkv or _flag(args.get("disable_radix_cache")))
    return s, fmt


def diffkv_mix(cfg: dict[str, Any]) -> tuple[Any, tuple[float, float] | None]:
    """(DiffKVConfig, (high, low) benchmark-mode mix) of a DiffKV configuration, from its
    SGLANG_DIFFKV_CONFIG (env or command line); (None, None) for other backends."""
    if cfg.get("attention_backend") != "diffkv":
        return None, None
    from sglang_diffkv.config import ConfigError, DiffKVConfig

    spec = (cfg.get("env") or {}).get("SGLANG_DIFFKV_CONFIG")
    if spec is None:
        m = re.search(r"SGLANG_DIFFKV_CONFIG=('[^']*'|\S+)", cfg.get("command", ""))
        spec = m.group(1).strip("'") if m else None
    if spec is None:
        return None, None
    try:
        dcfg = DiffKVConfig.from_env({"SGLANG_DIFFKV_CONFIG": spec})
    except ConfigError as e:
        raise SimulatorInputError(f"SGLANG_DIFFKV_CONFIG={spec!r}: {e}") from e
    mix = (dcfg.bench_mix[0], dcfg.bench_mix[1]) if dcfg.bench_mix else None
    return dcfg, mix


# ---- windowed simulator metrics -------------------------------------------------------------
def windowed_summary(res: RunResult, window: float | None) -> dict[str, Any]:
    """The simulator's run measured like the harness measured the real one: over [0, W]."""
    arrs = per_request_arrays(res)
    lg = res.replicas[0].log.arrays()
    t_end, running = lg["t_end"], lg["running"]
    first = np.array([r.first_token for r in res.requests if r.first_token >= 0])
    w = window if window is not None else (float(t_end.max()) if t_end.size else 0.0)
    t0 = min(r.arrival for r in res.requests)
    end = t0 + w
    done = (arrs["arrival"] + arrs["e2e"]) <= end + 1e-9

    def tokens_until(t: float) -> float:
        return float(running[t_end <= t].sum()) + float((first <= t).sum())

    half = t0 + w / 2
    dec = (running > 0) & (t_end <= end)
    prefilled = [r for r in res.requests if 0 <= r.first_token <= end]
    prompt = sum(r.input_len for r in prefilled)
    ttft = arrs["ttft"][done] * 1e3
    tpot = arrs["tpot"][done]
    tpot = tpot[~np.isnan(tpot)] * 1e3
    finish = arrs["arrival"] + arrs["e2e"]
    return {
        "window_s": w,
        "output_throughput": tokens_until(end) / w if w > 0 else math.nan,
        "steady_output_throughput": ((tokens_until(end) - tokens_until(half)) / (w / 2)
                                     if w > 0 else math.nan),
        "request_throughput": float(done.sum()) / w if w > 0 else math.nan,
        "steady_request_throughput": (float(((finish > half) & (finish <= end)).sum())
                                      / (w / 2) if w > 0 else math.nan),
        "completed": int(done.sum()),
        "mean_ttft_ms": float(ttft.mean()) if ttft.size else math.nan,
        "median_ttft_ms": float(np.median(ttft)) if ttft.size else math.nan,
        "mean_tpot_ms": float(tpot.mean()) if tpot.size else math.nan,
        "mean_batch": float(running[dec].mean()) if dec.any() else math.nan,
        "peak_batch": int(running[dec].max()) if dec.any() else 0,
        "kv_pool_tokens": res.server.pool.token_capacity,
        # prompt tokens the radix cache served, of the requests prefilled in the window
        "prefix_hit_rate": (sum(r.cached for r in prefilled) / prompt
                            if prompt and res.server.prefix_cache_enabled else None),
        "retractions": int(sum(rep.scheduler.retractions for rep in res.replicas)),
        "series_t": (t_end[t_end <= end] - t0).tolist(),
        "series_batch": lg["batch"][t_end <= end].tolist(),
    }


def measured_series(log_slice: str) -> tuple[list[float], list[int]]:
    """(seconds from the slice's first Decode line, #running-req) from timestamped lines."""
    from sglang_diffkv.serving_io.sglang_log import _DECODE

    ts, bs = [], []
    import datetime as dt

    for ln in log_slice.splitlines():
        m = _DECODE.search(ln)
        t = _TS.search(ln)
        if m and t:
            ts.append(dt.datetime.fromisoformat(t.group(1).replace("T", " ")).timestamp())
            bs.append(int(m.group(1)))
    return [t - ts[0] for t in ts] if ts else [], bs


# ---- comparison rows ------------------------------------------------------------------------
def row(metric: str, run: str, measured: float | None, predicted: float | None,
        target: float | None, absolute: bool = False, note: str = "") -> dict[str, Any]:
    """One comparison: error = predicted / measured - 1 (absolute: predicted - measured);
    PASS when |error| <= target, MISS otherwise, '-' without a target or a value."""
    ok = (measured is not None and predicted is not None and math.isfinite(measured)
          and math.isfinite(predicted) and (absolute or measured != 0))
    err = None
    if ok:
        err = predicted - measured if absolute else predicted / measured - 1
    verdict = "-" if err is None or target is None else ("PASS" if abs(err) <= target
                                                         else "MISS")
    return {"metric": metric, "run": run, "measured": measured, "predicted": predicted,
            "error": err, "absolute": absolute, "target": target, "verdict": verdict,
            "note": note}
