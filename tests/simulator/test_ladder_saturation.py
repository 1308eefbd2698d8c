"""A ladder run at absolute rates (``--ladder-abs-rates``, e.g. bf16's rates replayed on the
DiffKV server) carries no saturation rate; merged with a sharegpt run of the same configuration
it takes that run's, as the harness would have, so its rows get a load and (below 80% load) a
TTFT target."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_helpers import H100_DATA

from simulator.validation.harness import (
    HarnessRun,
    fill_ladder_saturation,
    load_harness,
    merge_harness,
    sharegpt_saturation_req_s,
)

DATA = H100_DATA
DIFFKV = [DATA / f"e2e-diffkv-mix-cuda-split-syncfree{s}" for s in ("", "-sharegpt", "-ladder")]


def _run(config: str, workload: str, label: str, client: dict, rate=None, sat=None,
         lengths_from: str = "sharegpt"):
    return HarnessRun(config, workload, label, Path("t.jsonl"), client, "", rate, sat,
                      lengths_from=lengths_from)


def test_sharegpt_saturation_is_the_harness_definition():
    whole = {"time_limited": False, "request_throughput": 25.0,
             "steady_request_throughput": 33.0}
    assert sharegpt_saturation_req_s(_run("a", "sharegpt", "sharegpt", whole)) == 25.0
    limited = {**whole, "time_limited": True}
    assert sharegpt_saturation_req_s(_run("a", "sharegpt", "sharegpt", limited)) == 33.0
    # time-limited with nothing steady: the whole-run rate; nothing at all: none
    assert sharegpt_saturation_req_s(_run("a", "sharegpt", "sharegpt", {
        "time_limited": True, "request_throughput": 4.0,
        "steady_request_throughput": 0.0})) == 4.0
    assert sharegpt_saturation_req_s(_run("a", "sharegpt", "sharegpt", {})) is None


def test_only_ladder_runs_without_one_take_their_configs_sharegpt_rate():
    sg = _run("dk", "sharegpt", "sharegpt", {"request_throughput": 25.0})
    lad = _run("dk", "ladder", "ladder@7.68rps", {}, rate=7.68)
    kept = _run("dk", "ladder", "ladder@0.5x", {}, rate=12.5, sat=30.0)
    other = _run("bf16", "ladder", "ladder@9rps", {}, rate=9.0)   # no bf16 sharegpt run
    fill_ladder_saturation([sg, lad, kept, other])
    assert lad.saturation_req_s == 25.0 and lad.raw["saturation_from"] == "dk/sharegpt"
    assert kept.saturation_req_s == 30.0 and "saturation_from" not in kept.raw
    assert other.saturation_req_s is None


def test_a_sharegpt_run_on_other_request_lengths_sets_no_ladders_load():
    # a burst of 8,000-token prompts on the same server saturates at 3.3 req/s: the ShareGPT
    # ladder's load is not measured against it, the azure-code ladder's against its own burst
    sg = _run("bf16", "sharegpt", "sharegpt", {"request_throughput": 33.2})
    long = _run("bf16", "sharegpt", "sharegpt#l", {"request_throughput": 3.3},
                lengths_from="long8000.jsonl")
    code = _run("bf16", "sharegpt", "sharegpt#z", {"request_throughput": 11.9},
                lengths_from="azure-code")
    lad = _run("bf16", "ladder", "ladder@15.35rps", {}, rate=15.35)
    lad_long = _run("bf16", "ladder", "ladder@0.5rps#l", {}, rate=0.5,
                    lengths_from="long8000.jsonl")
    lad_code = _run("bf16", "ladder", "ladder@8rps#z", {}, rate=8.0, lengths_from="azure-code")
    fill_ladder_saturation([long, code, sg, lad, lad_long, lad_code])
    assert lad.saturation_req_s == 33.2
    assert lad_long.saturation_req_s == 3.3 and lad_code.saturation_req_s == 11.9


@pytest.mark.skipif(not all((d / "results.json").exists() for d in DIFFKV),
                    reason="session-4 H100 data not in this checkout")
def test_the_diffkv_ladder_gets_the_diffkv_sharegpt_saturation(tmp_path):
    parts = [load_harness(d, tmp_path / d.name) for d in DIFFKV]
    assert all(r.saturation_req_s is None for r in parts[2].runs)
    h = merge_harness(parts)
    lad = sorted((r for r in h.runs if r.workload == "ladder"), key=lambda r: r.rate_req_s)
    assert [r.rate_req_s for r in lad] == [7.68, 15.35, 23.03]
    # the DiffKV sharegpt run completed inside its window: bench_serving's 25.09 req/s
    assert all(r.saturation_req_s == pytest.approx(25.09, abs=0.01) for r in lad)
    assert [round(r.rate_req_s / r.saturation_req_s, 2) for r in lad] == [0.31, 0.61, 0.92]
