"""The P:D search returns the cheapest split that meets the SLO (checked against every
cheaper split), the colocated search the fewest replicas, and `diffkv-sim disagg` prints,
writes and plots them, with one clear line for bad input."""

from __future__ import annotations

import io
import json

import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.arrivals import resample_arrivals
from simulator.cli import main
from simulator.metrics.slo import SLO
from simulator.specs.link import load_link
from simulator.studies.disagg_search import (
    cheapest_colocated,
    cheapest_split,
    probe_fleet,
    probe_split,
)
from simulator.workload.generate import resized, synthetic_trace
from simulator.workload.lengths import length_model

SLO_ = SLO(ttft_s=0.2, tpot_s=0.015)
N, RATE = 300, 60.0


@pytest.fixture(scope="module")
def setup():
    """Azure-code lengths (long prompts, short outputs), drawn afresh: prefill-bound, so
    the answer needs several prefill replicas."""
    sc = scenario()
    trace = synthetic_trace(length_model("azure-code"), N, RATE, seed=0)
    return sc, trace, resample_arrivals(resized(trace, N, 0), RATE, 0)


@pytest.mark.parametrize("fmt", ["bf16", "diffkv"])
def test_the_split_found_is_the_cheapest_that_meets_the_slo(setup, fmt):
    sc, trace, load = setup
    srv, link = sc.server(fmt), load_link("rdma-100")
    found = cheapest_split(srv, trace, SLO_, link, RATE, start_requests=N, max_requests=N)
    best = found["best"]
    assert best is not None and best.met and best.replicas >= 5
    assert found["gpus"] == best.replicas
    assert found["goodput_per_gpu"] == pytest.approx(best.summary["goodput"] / best.replicas)
    # the same replay gives the same answer, and every split of fewer GPUs misses
    again = probe_split(srv, load, SLO_, best.prefill, best.decode, link)
    assert again.met and again.attainment == best.attainment
    for total in range(2, best.replicas):
        for p in range(1, total):
            assert not probe_split(srv, load, SLO_, p, total - p, link).met, (p, total - p)


def test_the_colocated_answer_is_the_fewest_replicas_that_meet_the_slo(setup):
    sc, trace, load = setup
    srv = sc.server("bf16")
    found = cheapest_colocated(srv, trace, SLO_, RATE, start_requests=N, max_requests=N)
    k = found["best"].replicas
    assert found["best"].met and k >= 2 and found["gpus"] == k
    assert not probe_fleet(srv, load, SLO_, k - 1).met


def test_no_split_is_reported_when_the_slo_is_out_of_reach(setup):
    sc, trace, _ = setup
    # a 20 ms TTFT is below a long prompt's own prefill: more replicas stop helping
    found = cheapest_split(sc.server("fp8"), trace, SLO(ttft_s=0.02), load_link("rdma-100"),
                           RATE, start_requests=N, max_requests=N, max_replicas=12)
    assert found["best"] is None and found["gpus"] is None
    assert found["note"]


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_disagg_command_prints_writes_and_plots(tmp_path):
    rc, text = _run("disagg", "--formats", "bf16,diffkv", "--rate", "16", "--start-requests",
                    "150", "--max-requests", "300", "--slo-ttft-ms", "300", "--json",
                    str(tmp_path / "d.json"), "--plot", str(tmp_path / "p"))
    assert rc == 0
    lines = text.splitlines()
    assert "replayed at 16 req/s (--rate)" in lines[1] and "RDMA 100 Gb/s" in lines[1]
    assert lines[2].split()[:3] == ["format", "P:D", "GPUs"] and "coloc GPUs" in lines[2]
    rows = {ln.split()[0]: ln.split() for ln in lines[4:6]}
    assert set(rows) == {"bf16", "diffkv"}
    assert "bf16: P:D by trace length" in text and "colocated replicas by trace" in text
    data = json.loads((tmp_path / "d.json").read_text())
    assert [r["format"] for r in data["results"]] == ["bf16", "diffkv"]
    for r in data["results"]:
        d = r["disagg"]
        assert d["gpus"] == d["best"]["prefill"] + d["best"]["decode"]
        assert rows[r["format"]][1] == f"{d['best']['prefill']}:{d['best']['decode']}"
        assert r["colocated"]["gpus"] == r["colocated"]["best"]["replicas"]
    kv = {r["format"]: r["disagg"]["best"]["kv"]["bytes"] for r in data["results"]}
    assert kv["bf16"] > 3.5 * kv["diffkv"]
    assert (tmp_path / "p" / "disagg.png").stat().st_size > 5000
    rc, text = _run("disagg", "--formats", "fp8", "--split", "2:1", "--start-requests", "100",
                    "--link", "nvlink4", "--link-scope", "gpu")
    assert rc == 0 and "fp8     2:1" in text and "replayed as given" in text


@pytest.mark.parametrize("argv, needle", [
    (["--split", "0:1"], "--split '0:1' must be P:D"),
    (["--split", "2"], "--split '2' must be P:D"),
    (["--link", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
    (["--max-gpus", "1"], "--max-gpus 1 must be >= 2"),
    (["--rate", "inf"], "disagg needs a finite rate"),
    (["--closed-loop", "4"], "disagg needs an open-loop trace"),
    (["--formats", "bf17"], "unknown ['bf17']"),
    (["--trace-arrivals"], "--trace-arrivals replays one deployment"),
    (["--replicas", "3"], "--replicas 3: disagg chooses the replicas"),
])
def test_bad_disagg_input_is_one_clear_error(argv, needle, capsys):
    rc, _ = _run("disagg", "-n", "20", "--start-requests", "20", *argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.startswith("diffkv-sim: error:")
    assert err.count("\n") == 1


def test_a_split_replays_the_traces_own_arrivals_for_a_measured_run():
    rc, text = _run("disagg", "--formats", "bf16", "--split", "1:1", "--trace-arrivals",
                    "-n", "60", "--colocated", "none")
    assert rc == 0 and "replayed at its own arrival times" in text
    assert "the split 1:1 on 60 requests" in text


def test_the_colocated_answer_can_be_the_capacity_commands(tmp_path):
    rc, text = _run("disagg", "--formats", "fp8", "--colocated", "capacity", "--rate", "12",
                    "--start-requests", "120", "--max-requests", "120", "--slo-ttft-ms",
                    "1000", "--json", str(tmp_path / "c.json"))
    assert rc == 0 and "colocated (capacity):" in text and "req/s per replica" in text
    colo = json.loads((tmp_path / "c.json").read_text())["results"][0]["colocated"]
    assert colo["max_rate_per_replica"] > 0 and colo["gpus"] >= 1
    assert colo["best"]["replicas"] == colo["gpus"]


def test_the_searches_in_parallel_answer_as_one_after_another(tmp_path):
    # each format's split search and its colocated one run as jobs of their own; taken
    # back together they are the serial answers, probe for probe
    base = ("disagg", "--formats", "bf16,diffkv", "--rate", "16", "--start-requests", "120",
            "--max-requests", "240", "--slo-ttft-ms", "300")
    payloads = []
    for jobs in ("1", "3"):
        path = tmp_path / f"j{jobs}.json"
        rc, _ = _run(*base, "--jobs", jobs, "--json", str(path))
        assert rc == 0
        data = json.loads(path.read_text())
        data.pop("elapsed_s")
        payloads.append(data)
    assert payloads[0] == payloads[1]
    assert all(r["disagg"]["probes"] and r["colocated"]["probes"]
               for r in payloads[0]["results"])
