"""The diffkv-sim command line: every subcommand runs, writes JSON and plots, explains its
options, and turns bad input into one clear error line."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys

import pytest

from sglang_diffkv.serving_io.loaders import load_trace
from simulator.cli import build_parser, main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(list(argv), out=out)
    return rc, out.getvalue()


def test_compare_defaults_print_the_three_formats(tmp_path):
    defaults = build_parser().parse_args(["compare"])
    assert (defaults.trace, defaults.model, defaults.gpu, defaults.formats, defaults.mix) == (
        "long-generation", "llama-3-8b", "h100", "bf16,fp8,diffkv", "0.3,0.5,0.2")
    rc, text = run("compare", "--trace", "sharegpt", "-n", "120", "--json",
                   str(tmp_path / "c.json"), "--plot", str(tmp_path / "plots"))
    assert rc == 0
    lines = text.splitlines()
    assert "llama-3-8b on NVIDIA H100" in lines[0] and "sharegpt" in lines[0]
    rows = {ln.split()[0] for ln in lines[3:6]}
    assert rows == {"bf16", "fp8", "diffkv"}
    data = json.loads((tmp_path / "c.json").read_text())
    assert [s["kv_format"] for s in data["summaries"]] == ["bf16", "fp8", "diffkv"]
    assert all(s["completed"] + s["rejected"] == 120 for s in data["summaries"])
    pools = [s["kv_pool_tokens"] for s in data["summaries"]]
    assert pools[0] < pools[1] < pools[2]
    assert (tmp_path / "plots" / "timeseries.png").stat().st_size > 1000


def test_replay_sweep_capacity_and_export(tmp_path):
    rc, text = run("replay", "--trace", "azure-conv", "-n", "200", "--format", "fp8",
                   "--slo-ttft-ms", "500", "--json", str(tmp_path / "r.json"))
    assert rc == 0 and "Output token throughput" in text and "Goodput" in text
    rep = json.loads((tmp_path / "r.json").read_text())
    assert len(rep["requests"]) == 200 and rep["summary"]["kv_format"] == "fp8"
    rc, text = run("sweep", "-n", "100", "--rates", "5,20", "--formats", "bf16,diffkv",
                   "--plot", str(tmp_path / "sw"), "--trace", "sharegpt")
    assert rc == 0 and text.count("diffkv") >= 2
    assert (tmp_path / "sw" / "throughput_vs_rate.png").is_file()
    assert (tmp_path / "sw" / "latency_vs_rate.png").is_file()
    rc, text = run("capacity", "--trace", "sharegpt", "-n", "80", "--formats", "fp8",
                   "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--max-replicas", "4",
                   "--rate-bracket", "1,64", "--start-requests", "100", "--max-requests",
                   "200", "--plot", str(tmp_path / "cap"), "--json", str(tmp_path / "k.json"))
    assert rc == 0 and "GPUs" in text and "TTFT p99 ms" in text
    assert "fp8: max req/s by trace length" in text and "(200 req)" in text
    assert (tmp_path / "cap" / "capacity.png").stat().st_size > 1000
    cap = json.loads((tmp_path / "k.json").read_text())["results"][0]
    assert [lv["requests"] for lv in cap["levels"]] == [100, 200]
    # the GPU count is the per-replica maximum's: ceil(rate / max)
    rate = json.loads((tmp_path / "k.json").read_text())["rate"]
    assert cap["replicas"] == -(-rate // cap["max_rate_per_replica"])
    out = tmp_path / "t.jsonl"
    rc, _ = run("export", str(out), "--synthetic", "sharegpt", "--rate", "2", "-n", "30")
    assert rc == 0 and len(load_trace(out)) == 30
    rc, text = run("replay", "--trace", str(out), "--model", "qwq-32b", "--gpu", "h200",
                   "--format", "diffkv", "--diffkv-config", "qwq-32b", "--closed-loop", "4")
    assert rc == 0 and "closed loop, 4 users" in text
    rc, text = run("list")
    assert rc == 0 and "sharegpt" in text and "h200" in text


@pytest.mark.parametrize("argv,needle", [
    (["compare", "--formats", "bf16,int3"], "unknown ['int3']"),
    (["compare", "--mix", "0.9,0.9"], "exceeds 1"),
    (["replay", "--trace", "no/such/file.jsonl"], "neither a bundled trace"),
    (["replay", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["capacity", "-n", "10"], "give an SLO"),
    (["sweep", "--rates", "4,x"], "--rates"),
    (["compare", "--diffkv-config", "nope"], "unknown preset"),
    (["replay", "--synthetic", "sharegpt"], "needs --rate"),
    (["replay", "--tp", "3"], "tp=3"),
    (["replay", "-n", "0"], "n=0 must be >= 1"),
    (["replay", "--rate", "-2"], "rate=-2.0 must be > 0"),
    (["replay", "--replicas", "0", "-n", "5"], "replicas=0"),
    (["replay", "--gpu", "tpu"], "unknown GPU 'tpu'"),
    (["replay", "--closed-loop", "0", "-n", "5"], "users=0"),
])
def test_bad_input_is_one_clear_error(argv, needle, capsys):
    rc, _ = run(*argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.startswith("diffkv-sim: error:")


def test_every_option_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest} lacks help"


def test_module_entry_point_runs():
    p = subprocess.run([sys.executable, "-m", "simulator", "replay", "--help"],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0 and "--diffkv-config" in p.stdout and "--slo-ttft-ms" in p.stdout
