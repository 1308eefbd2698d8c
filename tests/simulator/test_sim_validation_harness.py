"""simulator/validation/runs.py on a synthetic harness-shaped results folder: the "real" runs
are simulated with a hidden per-step cost, written as the harness writes them (results.json,
server logs with server_args / pool / Prefill / Decode lines, Mooncake traces), then
validated: the fit on the fitting run recovers the hidden cost, the validated rows PASS, a
tampered measurement MISSes with the right error, and bad inputs are named."""

from __future__ import annotations

import datetime as dt
import gzip
import importlib
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl
from simulator.serving.settings import ServerSettings
from simulator.specs.calibration import load_calibration
from simulator.validation.harness import load_harness, row, windowed_summary
from simulator.validation.prompt_cache import served_blocks, with_prompt_ids

HIDDEN_STEP_S = 1.0e-3
T0 = dt.datetime(2026, 11, 22, 9, 0, 0)


def _script():
    return importlib.import_module("simulator.validation.runs")


def _log_lines(res, offset_s: float, window: float) -> list[str]:
    """SGLang-style scheduler lines from a simulated run (decode-log-interval 10) up to the
    window's end (where the harness cuts its log slice); #token = pool usage x capacity."""
    lg = res.replicas[0].log.arrays()
    cap = res.server.pool.token_capacity
    out, toks, t_int, n_dec = [], 0, 0.0, 0
    for t_end, dtime, kind, running, usage in zip(lg["t_end"], lg["dt"], lg["kind"],
                                                  lg["running"], lg["usage"], strict=True):
        if t_end > window:
            break
        ts = (T0 + dt.timedelta(seconds=offset_s + float(t_end))).strftime("%Y-%m-%d %H:%M:%S")
        t_int += float(dtime)
        if kind != 1:
            out.append(f"[{ts}] Prefill batch, #new-seq: 1, #new-token: 100, #cached-token: 0,"
                       f" token usage: 0.10, #running-req: {running}, #queue-req: 0")
            continue
        toks += int(running)
        n_dec += 1
        if n_dec % 10 == 0:
            out.append(f"[{ts}] Decode batch, #running-req: {running}, #token: "
                       f"{int(usage * cap)}, token usage: {usage:.2f}, cuda graph: "
                       f"{bool(running <= res.server.cost.graph_max)}, "
                       f"gen throughput (token/s): {toks / t_int:.3f}, #queue-req: 0")
            toks, t_int = 0, 0.0
    return out


def _write_records(res, path: Path, window: float) -> list[dict]:
    """The client's per-request records (bench_e2e's requests__CONFIG__LABEL.jsonl.gz) of a
    simulated run cut at ``window``; returns them as ``prompt_cache.read_records`` does."""
    lines, out = [], []
    for r in sorted(res.requests, key=lambda r: r.rid):
        started = 0 <= r.first_token <= window
        rec = {"index": r.rid, "input_len": r.input_len, "tokens": r.gen if started else 0,
               "first_token_s": r.first_token if started else None,
               "end_s": min(r.finish, window) if started else None,
               "completed": started and r.finish <= window}
        lines.append(json.dumps(rec))
        out.append({"index": r.rid, "input_len": r.input_len, "tokens": rec["tokens"],
                    "first": rec["first_token_s"], "end": rec["end_s"]})
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return out


def _trace(n: int, rate: float | None, seed: int, out_len: tuple[int, int]) -> Trace:
    rng = np.random.default_rng(seed)
    t = 0.0
    reqs = []
    for _ in range(n):
        if rate is not None:
            t += float(rng.exponential(1 / rate))
        reqs.append(TraceRequest(t, int(rng.integers(100, 600)),
                                 int(rng.integers(*out_len))))
    return Trace(tuple(reqs), name="fixture")


def make_results(root: Path) -> dict:
    """A harness-shaped folder: bf16 (longgen, sharegpt, ladder@0.5x) and diffkv (sharegpt)."""
    truth = replace(load_calibration("h100"), step_overhead_s=HIDDEN_STEP_S)
    settings = ServerSettings(mem_fraction_static=0.85, enable_piecewise_cuda_graph=False)
    (root / "logs" / "traces").mkdir(parents=True)
    configs, runs = {}, []
    sharegpt = _trace(1500, None, 2, (50, 300))
    plan = {"bf16": [("longgen", _trace(300, None, 1, (400, 600)), 10.0, None),
                     ("sharegpt", sharegpt, 8.0, None),
                     ("ladder@0.5x", None, 10.0, 0.5)],
                     "diffkv": [("sharegpt", sharegpt, 30.0, None)]}
    for cfg, workloads in plan.items():
        diffkv = cfg == "diffkv"
        cmd = ("python -m sglang.launch_server --model-path /tmp/m --mem-fraction-static 0.85 "
               "--disable-piecewise-cuda-graph --decode-log-interval 10"
               + (" --attention-backend diffkv" if diffkv else " --attention-backend triton"))
        s = replace(settings, disable_radix_cache=diffkv,
                    chunked_prefill_size=-1 if diffkv else None,
                    enable_piecewise_cuda_graph=False)
        sc = replace(scenario(), calibration=truth, settings=s)
        fmt = "diffkv" if diffkv else "bf16"
        srv = sc.server(fmt)
        head = [f"[{T0:%Y-%m-%d %H:%M:%S}] server_args=ServerArgs(model_path='/tmp/m', "
                "mem_fraction_static=0.85, chunked_prefill_size=8192, max_prefill_tokens=16384,"
                " disable_piecewise_cuda_graph=True, disable_cuda_graph=False, "
                "decode_log_interval=10)",
                f"[{T0:%Y-%m-%d %H:%M:%S}] max_total_num_tokens={srv.pool.token_capacity}, "
                "chunked_prefill_size=8192, max_running_requests=4096"]
        text = "\n".join(head) + "\n"
        configs[cfg] = {"command": cmd, "attention_backend": "diffkv" if diffkv else "triton",
                        "kv_cache_dtype": None, "max_total_num_tokens": srv.pool.token_capacity}
        saturation = None
        served: list[list[dict]] = []
        for i, (label, trace, window, frac) in enumerate(workloads):
            rate = None
            if trace is None:
                rate = frac * saturation
                base = _trace(int(rate * window * 2) + 20, rate, 3, (50, 300))
                trace = Trace(tuple(r for r in base.requests if r.arrival_s < window), "lad")
            tf = f"logs/traces/{cfg}__{label}.jsonl"
            write_mooncake_jsonl(trace, root / tf)
            # as a real server: the harness client's prompts, and the radix cache the
            # earlier runs on this server left (their request records)
            warm = [] if diffkv else served_blocks(served, 0)
            res = sc.run(with_prompt_ids(trace, 0), fmt, srv, warm_cache=warm)
            served.append(_write_records(res, root / "logs" / f"requests__{cfg}__{label}"
                                         ".jsonl.gz", window))
            w = windowed_summary(res, window)
            start = len(text.encode())
            text += "\n".join(_log_lines(res, 100.0 * (i + 1), window)) + "\n"
            client = {"output_throughput": w["output_throughput"],
                      "steady_output_throughput": w["steady_output_throughput"],
                      "request_throughput": w["request_throughput"],
                      "steady_request_throughput": w["steady_request_throughput"],
                      "mean_ttft_ms": w["mean_ttft_ms"], "mean_tpot_ms": w["mean_tpot_ms"],
                      "median_ttft_ms": w["median_ttft_ms"],
                      "window_s": window, "time_limited": True, "completed": w["completed"]}
            rec = {"config": cfg, "workload": label.split("@")[0], "label": label,
                   "trace_file": tf, "client": client,
                   "server_log": {"log_bytes": [start, len(text.encode())]}}
            if label == "sharegpt":
                saturation = w["steady_request_throughput"]
                rec["saturation_req_s"] = saturation
            if rate is not None:
                rec.update(rate_req_s=rate, saturation_req_s=saturation, rate_fraction=frac)
            runs.append(rec)
        (root / "logs" / f"server__{cfg}.log").write_text(text)
    data = {"environment": {"gpu": "synthetic"}, "configs": configs, "runs": runs}
    (root / "results.json").write_text(json.dumps(data))
    return data


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness")
    make_results(root)
    return root


def test_fit_on_the_fitting_run_and_validated_rows_pass(results, tmp_path):
    vs = _script()
    doc = tmp_path / "docs" / "simulator-validation.md"
    out_json = tmp_path / "rows.json"
    rc = vs.main([str(results), "--doc", str(doc), "--json", str(out_json)])
    assert rc == 0
    got = json.loads(out_json.read_text())
    fit = got["fit"]
    assert fit["run"] == "bf16/longgen"
    # the fitted costs reproduce the fitting run's steps; the split between the per-step and
    # the per-request cost is loose (the interval's batch is estimated from its end lines)
    assert fit["mape"] < 0.01 < fit["mape_before"]
    assert fit["step_overhead_s"] == pytest.approx(HIDDEN_STEP_S, rel=0.25)
    rows = got["rows"]
    # the fitting run is held out: its rows are in-sample, without a target or verdict
    fit_rows = [r for r in rows if r["run"] == "bf16/longgen"]
    assert fit_rows and all(r["in_sample"] and r["target"] is None and r["verdict"] == "-"
                            for r in fit_rows)
    by = {(r["metric"], r["run"]): r for r in rows}
    assert by[("KV pool tokens", "bf16")]["verdict"] == "PASS"
    assert by[("KV pool tokens", "bf16")]["error"] == pytest.approx(0.0)
    for key in [("saturation output tok/s (steady)", "bf16/sharegpt"),
                ("TPOT mean (ms)", "bf16/sharegpt"), ("TPOT mean (ms)", "bf16/ladder@0.5x"),
                ("TTFT mean (ms)", "bf16/ladder@0.5x"),
                ("saturation output tok/s (steady)", "diffkv/sharegpt")]:
        assert by[key]["verdict"] == "PASS", by[key]
    # the median TTFT is shown beside the mean, without a verdict
    median = by[("TTFT median (ms)", "bf16/ladder@0.5x")]
    assert median["target"] is None and median["verdict"] == "-"
    assert median["measured"] > 0 and abs(median["error"]) < 0.10
    ratio = by[("DiffKV / bf16 output tok/s", "diffkv/sharegpt : bf16/sharegpt")]
    assert ratio["absolute"] and abs(ratio["error"]) <= 0.05
    text = doc.read_text()
    assert "bf16/longgen" in text and "PASS" in text
    assert (doc.parent / "simulator-validation" / "latency_vs_rate.png").stat().st_size > 1000
    assert (doc.parent / "simulator-validation" / "batch_timeseries.png").exists()


def test_a_wrong_measurement_misses_with_its_error(results, tmp_path):
    data = json.loads((results / "results.json").read_text())
    root = tmp_path / "r"
    import shutil

    shutil.copytree(results, root)
    run = next(r for r in data["runs"] if r["config"] == "bf16" and r["label"] == "sharegpt")
    true_tpot = run["client"]["mean_tpot_ms"]
    run["client"]["mean_tpot_ms"] = true_tpot * 1.25
    (root / "results.json").write_text(json.dumps(data))
    out_json = tmp_path / "rows.json"
    assert _script().main([str(root), "--doc", str(tmp_path / "d.md"), "--json",
                           str(out_json)]) == 0
    r = next(r for r in json.loads(out_json.read_text())["rows"]
             if r["metric"] == "TPOT mean (ms)" and r["run"] == "bf16/sharegpt")
    assert r["verdict"] == "MISS"
    assert r["error"] == pytest.approx(r["predicted"] / (true_tpot * 1.25) - 1)
    assert r["error"] < -0.15


def test_row_arithmetic():
    assert row("m", "r", 100.0, 104.0, 0.05)["verdict"] == "PASS"
    r = row("m", "r", 100.0, 94.0, 0.05)
    assert r["verdict"] == "MISS" and r["error"] == pytest.approx(-0.06)
    r = row("ratio", "w", 1.80, 1.86, 0.05, absolute=True)
    assert r["verdict"] == "MISS" and r["error"] == pytest.approx(0.06)
    assert row("m", "r", 0.0, 1.0, 0.05)["verdict"] == "-"
    assert row("m", "r", None, 1.0, 0.05)["error"] is None
    assert row("m", "r", 1.0, math.nan, 0.05)["verdict"] == "-"
    assert row("m", "r", 1.0, 2.0, None)["verdict"] == "-"


def test_bad_inputs_are_named(tmp_path, results):
    with pytest.raises(InputError, match="results.json.*No such file"):
        load_harness(tmp_path)
    (tmp_path / "results.json").write_text('{"configs": {}, \n "runs": [oops]}')
    with pytest.raises(InputError, match="line 2: invalid JSON"):
        load_harness(tmp_path)
    data = json.loads((results / "results.json").read_text())
    data["runs"][1]["trace_file"] = "logs/traces/missing.jsonl"
    root = tmp_path / "r"
    import shutil

    shutil.copytree(results, root)
    (root / "results.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"runs\[1\]: trace file .*missing.jsonl"):
        load_harness(root)
    data["runs"][1]["trace_file"] = "logs/traces/bf16__sharegpt.jsonl"
    (root / "logs" / "traces" / "bf16__sharegpt.jsonl").write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 1, "input_length": -3, "output_length": 5}\n')
    (root / "results.json").write_text(json.dumps(data))
    h = load_harness(root)
    from sglang_diffkv.serving_io.loaders import load_trace

    with pytest.raises(InputError, match="line 2"):
        load_trace(h.runs[1].trace_path)
    assert _script().main([str(root), "--doc", str(tmp_path / "x.md")]) == 2
    del data["runs"][0]["server_log"]
    (root / "results.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"runs\[0\]: missing field 'server_log'"):
        load_harness(root)


def _split(results: Path, dest: Path) -> list[Path]:
    """The fixture folder split into one folder per configuration, as the GPU runs were."""
    import shutil

    data = json.loads((results / "results.json").read_text())
    out = []
    for cfg in data["configs"]:
        d = dest / f"e2e-{cfg}"
        shutil.copytree(results, d)
        part = {**data, "configs": {cfg: data["configs"][cfg]},
                "runs": [r for r in data["runs"] if r["config"] == cfg]}
        (d / "results.json").write_text(json.dumps(part))
        out.append(d)
    return out


def test_several_result_folders_are_merged_and_fitting_runs_stay_out(results, tmp_path):
    from simulator.validation.harness import merge_harness

    parts = _split(results, tmp_path)
    assert len(parts) == 2
    merged = merge_harness([load_harness(p) for p in parts])
    whole = load_harness(results)
    assert sorted(r.key for r in merged.runs) == sorted(r.key for r in whole.runs)
    assert set(merged.configs) == set(whole.configs) and merged.sources == parts
    for r in merged.runs:
        assert r.log_slice == whole.run(r.key).log_slice
    with pytest.raises(InputError, match="configuration 'bf16' is in both"):
        merge_harness([load_harness(parts[0]), load_harness(parts[0])])
    # the script on the split folders gives the rows of the single folder, fit held out
    out_json = tmp_path / "rows.json"
    assert _script().main([*map(str, parts), "--doc", str(tmp_path / "d.md"), "--json",
                           str(out_json)]) == 0
    got = json.loads(out_json.read_text())
    assert [f["run"] for f in got["fits"]] == ["bf16/longgen"]
    validated = {r["run"] for r in got["rows"] if r["verdict"] in ("PASS", "MISS")}
    assert "bf16/longgen" not in validated and "bf16/sharegpt" in validated
    assert all(r["target"] is None for r in got["rows"] if r["run"] == "bf16/longgen")
    assert "in-sample" in (tmp_path / "d.md").read_text()


def _log_with_args(tmp_path: Path, args: str) -> object:
    from sglang_diffkv.serving_io.sglang_log import parse_server_log

    p = tmp_path / "server.log"
    p.write_text(f"[{T0:%Y-%m-%d %H:%M:%S}] server_args=ServerArgs({args})\n"
                 "max_total_num_tokens=1000, max_running_requests=10\n")
    return parse_server_log(p)


def test_diffkv_graphs_follow_the_run_not_forced_eager(tmp_path):
    from simulator.validation.harness import server_settings

    cfg = {"command": "python -m sglang.launch_server --attention-backend diffkv",
           "attention_backend": "diffkv"}
    graphed = _log_with_args(tmp_path, "disable_cuda_graph=False, cuda_graph_max_bs=512, "
                                       "disable_overlap_schedule=False")
    s, fmt = server_settings(cfg, graphed)
    assert fmt == "diffkv" and not s.disable_cuda_graph and s.cuda_graph_max_bs == 512
    # still forced by the backend: no radix cache, no chunking, no piecewise prefill graphs
    assert s.disable_radix_cache and s.chunked_prefill_size == -1
    assert not s.enable_piecewise_cuda_graph
    eager = _log_with_args(tmp_path, "disable_cuda_graph=True, cuda_graph_max_bs=256")
    s, _ = server_settings(cfg, eager)
    assert s.disable_cuda_graph
    # no server args in the log: the command line; the torch reference path runs eagerly
    bare = _log_with_args(tmp_path, "")
    s, _ = server_settings(cfg, bare)
    assert not s.disable_cuda_graph and s.cuda_graph_max_bs is None
    ref = {**cfg, "env": {"SGLANG_DIFFKV_KERNELS": "0"}}
    assert server_settings(ref, bare)[0].disable_cuda_graph
    ref_cmd = {**cfg, "command": "SGLANG_DIFFKV_KERNELS=reference " + cfg["command"]}
    assert server_settings(ref_cmd, bare)[0].disable_cuda_graph


def test_same_configuration_in_two_folders_keeps_each_runs_log(results, tmp_path):
    import shutil

    from simulator.validation.harness import merge_harness

    parts = []
    for name, keep in (("a", {"longgen"}), ("b", {"sharegpt", "ladder"})):
        d = tmp_path / name
        shutil.copytree(results, d)
        data = json.loads((results / "results.json").read_text())
        data["runs"] = [r for r in data["runs"] if r["workload"] in keep]
        (d / "results.json").write_text(json.dumps(data))
        parts.append(d)
    merged = merge_harness([load_harness(p) for p in parts])
    assert sorted(r.key for r in merged.runs) == sorted(r.key for r in load_harness(results).runs)
    logs = {r.key: r.server_log for r in merged.runs}
    assert logs["bf16/longgen"].is_relative_to(parts[0])
    assert logs["bf16/sharegpt"].is_relative_to(parts[1])
    # a different launch under the same name is still refused
    data = json.loads((parts[1] / "results.json").read_text())
    data["configs"]["bf16"]["command"] += " --disable-cuda-graph"
    (parts[1] / "results.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="different command"):
        merge_harness([load_harness(p) for p in parts])


def test_a_tagged_folder_repeats_runs_under_its_own_keys(results, tmp_path):
    """The same workloads again (another lease): refused as a repeat untagged, merged under
    DIR#TAG with '#TAG' keys that --fit-run can name; the untagged run keeps the keys it had
    and stays the ladder's saturation source."""
    from simulator.validation.harness import merge_harness

    with pytest.raises(InputError, match="repeat"):
        merge_harness([load_harness(results), load_harness(results)])
    merged = merge_harness([load_harness(results), load_harness(results, tag="s8")])
    keys = [r.key for r in merged.runs]
    plain = [r.key for r in load_harness(results).runs]
    assert keys == plain + [f"{k}#s8" for k in plain]
    assert merged.run("bf16/sharegpt").key == "bf16/sharegpt"
    assert merged.run("bf16/sharegpt#s8").key == "bf16/sharegpt#s8"
    ladder = merged.run("bf16/ladder@0.5x#s8")
    assert ladder.raw.get("saturation_from", "bf16/sharegpt") == "bf16/sharegpt"
    with pytest.raises(InputError, match="run tag 'a b'"):
        load_harness(results, tag="a b")
    out_json = tmp_path / "rows.json"
    assert _script().main([str(results), f"{results}#s8", "--fit-run", "bf16/longgen#s8",
                           "--doc", str(tmp_path / "d.md"), "--json", str(out_json),
                           "--scratch", str(tmp_path / "scratch")]) == 0
    got = json.loads(out_json.read_text())
    assert [f["run"] for f in got["fits"]] == ["bf16/longgen#s8"]
    validated = {r["run"] for r in got["rows"] if r["verdict"] in ("PASS", "MISS")}
    assert "bf16/longgen" in validated and "bf16/longgen#s8" not in validated
    # the two copies repeat each other: grouped, with no spread; the longgen copy that fitted
    # leaves its twin alone
    reps = {(r["metric"], r["runs"][0]): r for r in got["repeats"]}
    tpot = reps["TPOT mean (ms)", "bf16/sharegpt"]
    assert tpot["runs"] == ["bf16/sharegpt", "bf16/sharegpt#s8"]
    assert tpot["measured_min"] == tpot["measured_max"] and tpot["spread"] == 0
    assert not any(r["group"].startswith("bf16/longgen") for r in got["repeats"])
    # on a radix-cache server a group also names what ran before (it decides the cache)
    assert tpot["group"].startswith("bf16/sharegpt after longgen [")
    assert "## Against the mean of repeated runs" in (tmp_path / "d.md").read_text()
    alone = got["fits"][0]["rows"]
    # a decode-only fitting run, a superseded run left out, an unknown one named
    args = [str(results), f"{results}#s8", "--fit-run", "bf16/longgen#s8",
            "--doc", str(tmp_path / "d.md"), "--scratch", str(tmp_path / "scratch")]
    assert _script().main([*args, "--fit-decode-run", "bf16/sharegpt#s8", "--skip-run",
                           "bf16/ladder@0.5x#s8", "--json", str(out_json)]) == 0
    got = json.loads(out_json.read_text())
    fit = got["fits"][0]
    assert fit["runs"] == ["bf16/longgen#s8", "bf16/sharegpt#s8"]
    assert fit["rows"] > alone        # the saturation run's decode intervals joined
    assert fit["by_kind"]["burst"]["rows"] == fit["by_kind"]["prefill-interval"]["rows"] == 0
    assert not any("ladder@0.5x#s8" in r["run"] for r in got["rows"])
    assert _script().main([*args, "--skip-run", "bf16/nope"]) == 2


def test_a_regenerated_report_keeps_the_hand_written_findings(tmp_path):
    mod = _script()
    doc = tmp_path / "v.md"
    assert mod.kept_findings(doc) == ""  # no doc yet
    doc.write_text("# old report\n| row |\n\n## Findings (hand-written, today)\n\nWhy X.\n")
    assert mod.kept_findings(doc) == "\n## Findings (hand-written, today)\n\nWhy X.\n"
    doc.write_text("# a report without findings\n")
    assert mod.kept_findings(doc) == ""


def test_folders_named_alike_unpack_to_their_own_scratch(tmp_path):
    mod = _script()
    a, b = tmp_path / "s24" / "c3" / "fp8", tmp_path / "s25" / "c3" / "fp8"
    name_a, name_b = mod.scratch_name(str(a)), mod.scratch_name(str(b))
    assert name_a != name_b
    assert name_a.startswith("c3--fp8--") and name_b.startswith("c3--fp8--")
    assert mod.scratch_name(str(a)) == name_a  # the same folder reuses its scratch
    assert mod.scratch_name(str(tmp_path / "s24" / "c3" / ".." / "c3" / "fp8")) == name_a


def test_a_log_only_flag_is_the_same_launch():
    """A server re-run with SGLang's per-request time stats on (log lines only) merges with
    its runs without; any other difference in the command, or in the environment, does not."""
    from simulator.validation.harness import same_launch

    base = {"command": "python -m sglang.launch_server --attention-backend triton", "env": {}}
    logged = {**base, "command": base["command"] + " --enable-request-time-stats-logging"}
    assert same_launch(base, logged)
    assert not same_launch(base, {**base, "command": base["command"] + " --kv-cache-dtype fp8"})
    assert not same_launch(base, {**logged, "env": {"X": "1"}})


def test_the_ratio_pairs_runs_of_one_trace_only(tmp_path):
    """DiffKV / bf16 is a ratio of two runs of the same requests: two traces under one
    workload name (ShareGPT and a drain trace, both run as 'sharegpt') are not paired."""
    from types import SimpleNamespace

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"timestamp": 0, "input_length": 5, "output_length": 7}\n')
    b.write_text('{"timestamp": 0, "input_length": 6, "output_length": 7}\n')

    def sim(fmt, trace, rate, config=None):
        run = SimpleNamespace(workload="sharegpt", trace_path=trace, config=config or fmt,
                              client={"output_throughput": rate})
        return {"run": run, "format": fmt, "in_sample": False,
                "full": {"output_throughput": rate * 1.1},
                "group": f"{config or fmt}/sharegpt [{trace.stem}]"}

    sims = {"diffkv/sharegpt#x": sim("diffkv", a, 200.0), "bf16/sharegpt": sim("bf16", a, 100.0),
            "bf16/sharegpt#y": sim("bf16", b, 50.0),
            # a bf16 server with other flags (more CUDA graphs) is no baseline
            "bf16-graphs/sharegpt#g": sim("bf16", a, 80.0, config="bf16-graphs")}
    rows = _script().ratio_rows(sims)
    assert [r["run"] for r in rows] == ["diffkv/sharegpt#x : bf16/sharegpt"]
    assert rows[0]["measured"] == pytest.approx(2.0)
    assert rows[0]["group"] == "diffkv : bf16/sharegpt [a]"   # pairings of one trace group


def test_a_renamed_configuration_merges_beside_the_default_one(results, tmp_path):
    """A server started with other flags is another launch under the harness's name 'bf16':
    DIR#TAG@bf16=NEW loads it as NEW, so it merges with the default server's runs."""
    import shutil

    from simulator.validation.harness import merge_harness

    other = tmp_path / "graphs"
    shutil.copytree(results, other)
    data = json.loads((other / "results.json").read_text())
    data["configs"]["bf16"]["command"] += " --cuda-graph-max-bs 1536"
    (other / "results.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="different command"):
        merge_harness([load_harness(results), load_harness(other, tag="g")])
    mod = _script()
    d, tag, rename = mod.results_arg(f"{other}#g@bf16=bf16-graphs")
    assert (d, tag, rename) == (str(other), "g", {"bf16": "bf16-graphs"})
    merged = merge_harness([load_harness(results), load_harness(d, tag=tag, rename=rename)])
    assert merged.configs["bf16-graphs"]["command"].endswith("--cuda-graph-max-bs 1536")
    run = merged.run("bf16-graphs/sharegpt#g")
    assert run.config == "bf16-graphs" and run.server_log.is_relative_to(other)
    assert "bf16-graphs" in merged.server_logs and merged.run("bf16/sharegpt").config == "bf16"
    with pytest.raises(InputError, match="no configuration fp8 to rename"):
        load_harness(other, tag="g", rename={"fp8": "x"})
    with pytest.raises(InputError, match="two configurations one name"):
        load_harness(other, tag="g", rename={"bf16": "diffkv"})
    with pytest.raises(InputError, match="configuration name 'a b'"):
        load_harness(other, tag="g", rename={"bf16": "a b"})
    for bad, why in ((f"{other}#g@bf16", "write OLD=NEW"), (f"{other}#g@=x", "write OLD=NEW"),
                     (f"{other}#@bf16=x", "needs a tag")):
        with pytest.raises(InputError, match=why):
            mod.results_arg(bad)
    assert mod.results_arg(str(other)) == (str(other), None, {})


def test_refinement_on_metrics_runs_on_the_fitting_runs_only(results, tmp_path):
    vs = _script()
    doc, out_json = tmp_path / "d.md", tmp_path / "rows.json"
    simulated: list[list[str]] = []
    validate = vs.validate

    def spy(h, calibs, model, gpu, fitting, held=None, **kw):
        simulated.append([r.key for r in h.runs])
        return validate(h, calibs, model, gpu, fitting, held, **kw)

    vs.validate = spy
    assert vs.main([str(results), "--doc", str(doc), "--json", str(out_json),
                    "--refine-on-metrics", "triton", "--refine-evals", "12"]) == 0
    payload = json.loads(out_json.read_text())
    fit = payload["fit"]
    how = fit["refine"]
    burst_ttft = next(r for r in payload["rows"] if r["metric"] == "TTFT mean (ms)"
                      and r["run"] == "bf16/sharegpt")
    assert burst_ttft["target"] is None and burst_ttft["fit_target"] == 0.10
    # the fitted terms, and the client's first-token latency that no log interval shows
    # (started at 0 here: the fitting run is a burst, whose TTFT has no target)
    assert set(how["names"]) == (set(fit["fitted"]) & set(how["before"])) | {
        "first_token_latency_s"}
    assert how["before"]["first_token_latency_s"] == 0.0
    assert 0 < how["evaluations"] <= 12 + len(how["names"])
    assert how["loss_after"] <= how["loss_before"]
    # every refinement simulation replays the fitting run alone; the last call is the report
    assert len(simulated) >= 2
    assert all(keys == ["bf16/longgen"] for keys in simulated[:-1])
    assert "bf16/sharegpt" in simulated[-1]
    # the fitted file sits in the folder named after the report (d.md -> d/), so two
    # reports written side by side keep their own
    assert Path(fit["file"]).parent == doc.with_suffix("")
    cal = json.loads(Path(fit["file"]).read_text())
    entry = next(iter(cal["gpus"].values()))
    assert "refined on the fitting runs'" in entry["provenance"]["refined"]
    for name, value in how["after"].items():
        assert entry[name] == pytest.approx(value)
    assert "then refined on the fitting runs'" in doc.read_text()
    assert vs.main([str(results), "--doc", str(doc), "--refine-on-metrics", "triton",
                    "--refine-evals", "1"]) == 2


def test_refinement_holds_the_terms_it_is_told_to(results, tmp_path):
    vs = _script()
    out_json = tmp_path / "rows.json"
    assert vs.main([str(results), "--doc", str(tmp_path / "d.md"), "--json", str(out_json),
                    "--refine-on-metrics", "triton", "--refine-evals", "12",
                    "--refine-hold", "decode_attention_scale"]) == 0
    fit = json.loads(out_json.read_text())["fit"]
    how = fit["refine"]
    assert "decode_attention_scale" in fit["fitted"]
    assert "decode_attention_scale" not in how["names"] and "step_overhead_s" in how["names"]
    # the file keeps the interval fit's scale while the refined terms are rewritten
    entry = next(iter(json.loads(Path(fit["file"]).read_text())["gpus"].values()))
    assert entry["decode_attention_scale"] == pytest.approx(fit["decode_attention_scale"],
                                                            rel=1e-3)
    # held for another backend only: the triton refinement moves it
    assert vs.main([str(results), "--doc", str(tmp_path / "d.md"), "--json", str(out_json),
                    "--refine-on-metrics", "triton", "--refine-evals", "12",
                    "--refine-hold", "diffkv:decode_attention_scale"]) == 0
    assert "decode_attention_scale" in json.loads(out_json.read_text())["fit"]["refine"]["names"]


def test_refine_hold_takes_a_term_for_every_backend_or_one(capsys, tmp_path):
    vs = _script()
    held = vs.refine_hold_arg(["decode_attention_scale", "diffkv:prefill_token_overhead_s"])
    assert held == {"triton": {"decode_attention_scale"},
                    "diffkv": {"decode_attention_scale", "prefill_token_overhead_s"}}
    assert vs.refine_hold_arg([]) == {"triton": frozenset(), "diffkv": frozenset()}
    for bad in ("first_token_latency_s", "flashinfer:step_overhead_s", "diffkv:speed"):
        with pytest.raises(InputError, match="--refine-hold"):
            vs.refine_hold_arg([bad])
    assert vs.main([str(tmp_path), "--doc", str(tmp_path / "d.md"),
                    "--refine-hold", "triton:first_token_latency_s"]) == 2
    err = capsys.readouterr().err
    assert "--refine-hold 'triton:first_token_latency_s'" in err and "BACKEND one of" in err


def test_a_given_first_token_latency_is_kept_by_the_refinement(results, tmp_path):
    vs = _script()
    out_json = tmp_path / "rows.json"
    doc = tmp_path / "d.md"
    assert vs.main([str(results), "--doc", str(doc), "--json", str(out_json),
                    "--refine-on-metrics", "triton", "--refine-evals", "12",
                    "--first-token-latency-s", "triton=0.0075"]) == 0
    fit = json.loads(out_json.read_text())["fit"]
    assert "first_token_latency_s" not in fit["refine"]["names"]
    assert "step_overhead_s" in fit["refine"]["names"]
    entry = next(iter(json.loads(Path(fit["file"]).read_text())["gpus"].values()))
    assert entry["first_token_latency_s"] == pytest.approx(0.0075)
    assert "first-token latency given: 7.5 ms" in doc.read_text()
    # without refinement the given latency still lands in the fitted file
    assert vs.main([str(results), "--doc", str(doc), "--json", str(out_json),
                    "--first-token-latency-s", "triton=0.004"]) == 0
    fit = json.loads(out_json.read_text())["fit"]
    entry = next(iter(json.loads(Path(fit["file"]).read_text())["gpus"].values()))
    assert entry["first_token_latency_s"] == pytest.approx(0.004)
    for bad in ("triton", "bf16=0.007", "diffkv=-1", "triton=x", "triton=7.5"):
        assert vs.main([str(results), "--doc", str(doc), "--first-token-latency-s",
                        bad]) == 2


def test_a_given_eager_decode_host_time_lands_in_the_fitted_file(results, tmp_path,
                                                                  capsys):
    vs = _script()
    out_json = tmp_path / "rows.json"
    doc = tmp_path / "d.md"
    # (fp8's own: the bf16 fitting run's eager intervals stay in the interval fit)
    assert vs.main([str(results), "--doc", str(doc), "--json", str(out_json),
                    "--eager-decode-host-s", "fp8=0.02",
                    "--eager-decode-host-s", "diffkv=0.0381"]) == 0
    fit = json.loads(out_json.read_text())["fit"]
    entry = next(iter(json.loads(Path(fit["file"]).read_text())["gpus"].values()))
    assert entry["eager_decode_host_s_by_format"] == {"fp8": pytest.approx(0.02)}
    assert "eager_decode_host_s" not in entry      # diffkv's value: not this backend's
    text = doc.read_text()
    assert "eager_decode_host_s_by_format.fp8 20 ms" in text
    assert "lasts at least" not in text
    # the backend's own: the fitting run's eager intervals leave the fit, too few remain
    assert vs.main([str(results), "--doc", str(doc), "--eager-decode-host-s",
                    "triton=0.0381"]) == 2
    assert "eager decode intervals left out" in capsys.readouterr().err


def test_backends_fitted_in_parallel_give_the_same_report(results, tmp_path):
    vs = _script()
    fits = ["--fit-run", "bf16/longgen", "--fit-run", "diffkv/sharegpt"]
    payloads = []
    for jobs in ("1", "2"):
        out = tmp_path / f"rows-{jobs}.json"
        assert vs.main([str(results), "--doc", str(tmp_path / f"d{jobs}.md"), "--json",
                        str(out), "--jobs", jobs, *fits]) == 0
        payloads.append(json.loads(out.read_text()))
    one, two = payloads
    assert [f["backend"] for f in two["fits"]] == ["triton", "diffkv"]
    assert two["rows"] == one["rows"] and len(one["rows"]) > 0
    for f1, f2 in zip(one["fits"], two["fits"], strict=True):
        assert f2["step_overhead_s"] == pytest.approx(f1["step_overhead_s"])
    assert vs.main([str(results), "--doc", str(tmp_path / "d.md"), "--jobs", "0"]) == 2


def test_a_burst_that_finished_is_simulated_to_its_own_end(tmp_path):
    # the client stopped at its last completion: the simulated twin is measured to its own
    # end, so a simulator slower than the server still counts its small-batch tail
    from simulator.validation.harness import HarnessRun

    trace = _trace(200, None, 5, (20, 400))
    res = scenario().run(trace, "bf16")
    makespan = max(r.finish for r in res.requests)
    done = HarnessRun("bf16", "sharegpt", "sharegpt", tmp_path / "t.jsonl",
                      {"window_s": 0.8 * makespan, "time_limited": False}, "", None, None)
    assert done.simulated_window_s is None
    cut_run = replace(done, client={"window_s": 0.8 * makespan, "time_limited": True})
    assert cut_run.simulated_window_s == pytest.approx(0.8 * makespan)
    whole = windowed_summary(res, done.simulated_window_s)
    cut = windowed_summary(res, cut_run.simulated_window_s)
    assert whole["completed"] == 200 > cut["completed"]
    # the tail's decode steps carry the fewest requests: leaving them out raises the mean
    assert whole["mean_batch"] < cut["mean_batch"]
    outs = [r.gen for r in res.requests]
    assert whole["peak_batch"] == 200
    assert whole["mean_batch"] == pytest.approx((sum(outs) - 200) / (max(outs) - 1), rel=0.05)


def test_given_inputs_reach_a_backend_without_fitting_runs(results, tmp_path):
    vs = _script()
    out_json = tmp_path / "rows.json"

    def ttft(*extra: str) -> dict[str, float]:
        assert vs.main([str(results), "--doc", str(tmp_path / "d.md"), "--json",
                        str(out_json), "--fit-run", "none", *extra]) == 0
        return {r["run"]: r["predicted"] for r in json.loads(out_json.read_text())["rows"]
                if r["metric"] == "TTFT mean (ms)"}

    plain, given = ttft(), ttft("--first-token-latency-s", "triton=0.05")
    assert plain and plain.keys() == given.keys()
    # the file's costs, plus the given client latency on triton's first tokens: all of an
    # open-loop run's, some of a burst's inside its window, none of DiffKV's
    assert given["bf16/ladder@0.5x"] - plain["bf16/ladder@0.5x"] == pytest.approx(50.0, abs=0.5)
    assert given["bf16/sharegpt"] > plain["bf16/sharegpt"]
    assert given["diffkv/sharegpt"] == plain["diffkv/sharegpt"]


@pytest.mark.slow
def test_a_recipe_gives_the_report_its_command_line_gives(results, tmp_path):
    from simulator.cli import main as cli_main

    doc = tmp_path / "by-options.md"
    assert _script().main([str(results), "--doc", str(doc), "--json", str(tmp_path / "a.json"),
                           "--fit-run", "none"]) == 0
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"_about": "the same run", "results": [str(results)],
                                  "fit_run": ["none"],
                                  "doc": str(tmp_path / "by-recipe.md")}))
    assert cli_main(["validate-runs", "--recipe", str(recipe), "--json",
                     str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text())["rows"] for f in ("a.json", "b.json"))
    assert a == b and any(r["verdict"] == "PASS" for r in a)
    # the report names the short command it was run with
    assert f"diffkv-sim validate-runs --recipe {recipe}" in (tmp_path / "by-recipe.md").read_text()
