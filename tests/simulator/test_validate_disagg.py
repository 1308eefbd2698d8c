"""``diffkv-sim validate-disagg`` on a synthetic results folder (data/pd_run, written by its
make_fixture.py as scripts/gpu_pd_run.sh would bring it back from two GPU calls): the files
parse, the measured statistics follow the rows, the link is the probe's, the simulated side is
what ``diffkv-sim disagg --split 1:1 --trace-arrivals`` gives, and bad inputs are one clear
error."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.pd_run import (
    fit_link,
    latency_stats,
    link_rows,
    load_pd_results,
    measured_arrays,
    transfer_means,
)
from simulator import cli
from simulator.validation import disagg_real as dr

DATA = Path(__file__).resolve().parent / "data" / "pd_run"
CALLS = [DATA / "call1", DATA / "call2"]
# the synthetic link make_fixture.py's Mooncake rows and P/D times follow
BW, LAT = 1.5e9, 0.002


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def result() -> dict:
    return dr.validate(CALLS)


def test_the_files_of_both_calls_load_and_the_measured_statistics_follow_the_rows():
    res = load_pd_results(CALLS)
    assert {r.deployment for r in res.replays} == {"pd", "colocated"}
    assert len(res.links) == 2
    colo = res.replay("colocated")
    assert colo is not None and [r.rate for r in colo.runs] == [2.0, 4.0]
    # the 4 req/s control was cut at its limit: its last request never answered
    cut = colo.runs[1]
    assert cut.time_limited and sum(r.completed for r in cut.requests) == 15
    raw = _raw(DATA / "call1" / "pd_runs_colocated.json")["runs"][1]["requests"]
    done = [r for r in raw if r[8]]
    ttft = np.array([r[5] - r[4] for r in done])
    a = measured_arrays(cut)
    assert a["index"].tolist() == [r[0] for r in done]
    s = latency_stats(a["arrival"], a["ttft"], a["e2e"], a["tpot"], a["output"])
    assert s["n"] == 15
    assert s["ttft_p50_ms"] == pytest.approx(1e3 * np.percentile(ttft, 50), rel=1e-9)
    assert s["ttft_p90_ms"] == pytest.approx(1e3 * np.percentile(ttft, 90), rel=1e-9)
    # make_fixture's colocated TPOT is 8 ms for every request (rows rounded to 10 us)
    assert s["tpot_p50_ms"] == pytest.approx(8.0, abs=0.01)
    span = max(r[1] + r[6] - r[4] for r in done) - min(r[1] for r in done)
    assert s["req_s"] == pytest.approx(15 / span, rel=1e-6)
    assert s["out_tok_s"] == pytest.approx(sum(r[7] for r in done) / span, rel=1e-6)


def test_sglang_transfer_metrics_become_ms_and_mb_per_request():
    pd = load_pd_results([DATA / "call2"]).replay("pd")
    assert pd is not None
    t = transfer_means(pd.runs[0].transfer)
    rows = _raw(DATA / "call2" / "pd_runs_pd.json")["runs"][0]["requests"]
    # SGLang's "MB" is MiB; per request: its prompt's bf16 KV, 131,072 B a token
    assert t is not None and t["count"] == len(rows)
    assert t["mb"] == pytest.approx(np.mean([r[2] * 131072 for r in rows]) / 1e6, rel=1e-9)
    assert t["latency_ms"] == pytest.approx(
        np.mean([1e3 * (LAT + r[2] * 131072 / BW) for r in rows]), rel=1e-9)
    assert transfer_means(None) is None and transfer_means({}) is None


def test_the_measured_link_is_the_mooncake_fit_else_the_chain_of_copies_and_socket():
    link = dr.choose_link(load_pd_results(CALLS), "measured")
    assert link.bandwidth == pytest.approx(BW, rel=1e-6)
    assert link.latency_s == pytest.approx(LAT, rel=1e-6)
    assert "12 Mooncake TCP transfers of 64 pieces" in link.provenance
    # call 1 alone has no Mooncake probe: D2H, the socket and H2D one after the other
    chain = dr.choose_link(load_pd_results([DATA / "call1"] + [DATA / "call2" /
                                                                "pd_runs_pd.json"]), "measured")
    assert chain.bandwidth == pytest.approx(1 / (2 / 2e10 + 1 / 4294967296.0), rel=1e-9)
    assert chain.latency_s == pytest.approx(3e-5)
    # SGLang's own: bytes / time per request at the lowest rate
    own = dr.choose_link(load_pd_results(CALLS), "sglang")
    t = transfer_means(load_pd_results(CALLS).replay("pd").runs[0].transfer)
    assert own.bandwidth == pytest.approx(t["mb"] * 1e6 / (t["latency_ms"] / 1e3))
    assert dr.choose_link(load_pd_results(CALLS), "tcp-loopback").key == "tcp-loopback"


def test_fit_link_recovers_latency_and_bandwidth_and_clips_a_negative_intercept():
    rows = [[b, 64, 0.003 + b / 2e9] for b in (1e6, 1e7, 1e8)]
    assert fit_link(rows) == pytest.approx((0.003, 2e9), rel=1e-9)
    lat, bw = fit_link([[1e6, 1, 0.0004], [2e6, 1, 0.0011]])   # intercept < 0: through 0
    assert lat == 0.0 and bw == pytest.approx((1e12 + 4e12) / (4e2 + 2.2e3), rel=1e-9)
    with pytest.raises(InputError):
        fit_link([[0, 1, 1.0]])
    # a size's first transfer paying for fresh memory does not move the fit: medians per size
    cold = [[b, 64, t] for b in (1e7, 1e8) for t in (10 * (0.001 + b / 1e9),
                                                       0.001 + b / 1e9, 0.001 + b / 1e9)]
    assert fit_link(cold) == pytest.approx((0.001, 1e9), rel=1e-9)
    # SGLang's 64 pieces when the probe has them, else the most common count
    rows = [[1, 64, 1.0], [1, 1, 1.0], [1, 512, 1.0], [2, 512, 1.0]]
    assert link_rows(rows) == [[1, 64, 1.0]]
    assert link_rows(rows[1:]) == [[1, 512, 1.0], [2, 512, 1.0]]


def test_every_run_is_compared_with_errors_of_simulated_over_measured(result):
    runs = {(r["deployment"], r["rate"]): r for r in result["runs"]}
    assert set(runs) == {("pd", 2.0), ("pd", 4.0), ("colocated", 2.0), ("colocated", 4.0)}
    assert runs[("colocated", 4.0)]["compared"] == 15      # the cut request is left out
    assert runs[("pd", 4.0)]["compared"] == 16
    rows = dr.rows_of(result)
    assert len(rows) == 2 * 8 + 2 * 6
    for row in rows:
        assert row.error == pytest.approx(row.simulated / row.measured - 1)
    for rate in (2.0, 4.0):
        pd, co = runs[("pd", rate)]["simulated"], runs[("colocated", rate)]["simulated"]
        # the same bytes on the wire as SGLang reported: the bf16 pool's 131,072 B a token
        assert pd["kv_mb"] == pytest.approx(runs[("pd", rate)]["measured"]["kv_mb"], rel=1e-6)
        # disaggregation adds the KV's way over a 1.5 GB/s link to every TTFT
        assert pd["ttft_p50_ms"] > co["ttft_p50_ms"] + 30
        # ... and its decode steps no longer share the GPU with prefills
        assert pd["tpot_p90_ms"] <= co["tpot_p90_ms"]
    assert result["settings"]["pd"]["disable_radix_cache"] is True
    assert result["settings"]["pd"]["enable_piecewise_cuda_graph"] is False
    assert result["settings"]["pd"]["mem_fraction_static"] == 0.85


def test_a_slower_link_slows_the_pd_ttft_and_leaves_the_control_alone(tmp_path, result):
    f = tmp_path / "slow.json"
    f.write_text(json.dumps({"name": "slow", "bandwidth": BW / 10, "efficiency": 1.0,
                             "latency_s": LAT, "provenance": "test"}))
    slow = dr.validate(CALLS, link_spec=str(f))
    before = {(r["deployment"], r["rate"]): r["simulated"] for r in result["runs"]}
    for r in slow["runs"]:
        old = before[(r["deployment"], r["rate"])]
        if r["deployment"] == "colocated":
            assert r["simulated"] == old
        else:
            # a ~100 MB prompt's wire time grows from ~70 ms to ~700 ms
            assert r["simulated"]["ttft_p50_ms"] > old["ttft_p50_ms"] + 300
            assert r["simulated"]["kv_ms"] > 5 * old["kv_ms"]


def test_the_exported_disagg_command_gives_the_pd_column(tmp_path, result):
    cmds = dr.export(CALLS, result, tmp_path / "exp")
    assert len(cmds) == 2 and all("--split 1:1" in c and "--trace-arrivals" in c for c in cmds)
    for cmd, rate in zip(cmds, (2.0, 4.0), strict=True):
        out = tmp_path / f"disagg_{rate:g}.json"
        assert cli.main(cmd.split()[1:] + ["--json", str(out), "--no-progress"],
                        io.StringIO()) == 0
        s = _raw(out)["results"][0]["disagg"]["best"]["summary"]
        mine = next(r for r in result["runs"] if r["deployment"] == "pd"
                    and r["rate"] == rate)["simulated"]
        for k, m in (("ttft_ms", "ttft"), ("tpot_ms", "tpot")):
            assert s[k]["p50"] == pytest.approx(mine[f"{m}_p50_ms"], rel=1e-9)
            assert s[k]["p90"] == pytest.approx(mine[f"{m}_p90_ms"], rel=1e-9)


def test_the_command_prints_both_tables_and_writes_json(tmp_path):
    out = io.StringIO()
    js = tmp_path / "v.json"
    assert dr.main([str(DATA), "--json", str(js)], out) == 0
    text = out.getvalue()
    assert "TTFT p90 ms" in text and "KV transfer ms/req" in text
    assert "what disaggregation changed" in text
    assert "compared 15 of 16 requests" in text
    rows = _raw(js)["rows"]
    assert len(rows) == 28 and all(set(r) >= {"measured", "simulated", "error"} for r in rows)
    # the subcommand is wired into diffkv-sim
    assert cli.main(["validate-disagg", str(DATA)]) == 0


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "res"
    shutil.copytree(DATA, dst, ignore=shutil.ignore_patterns("*.py"))
    return dst


@pytest.mark.parametrize("break_it, needle", [
    (lambda d: (d / "call2" / "pd_runs_pd.json").unlink() or shutil.copy(
        d / "call1" / "pd_runs_colocated.json", d / "call2" / "pd_runs_colocated.json"),
     "appears in both"),
    (lambda d: _edit(d / "call2" / "pd_runs_pd.json",
                     lambda j: j["runs"][0]["requests"][3].__setitem__(5, None)),
     "a completed request needs send_s <= first_token_s <= end_s"),
    (lambda d: _edit(d / "call2" / "pd_runs_pd.json", lambda j: j.__setitem__("schema", 2)),
     "schema 2, expected 1"),
    (lambda d: _edit(d / "call1" / "pd_runs_colocated.json",
                     lambda j: j.__setitem__("device", "NVIDIA H200")),
     "give --gpu h100 or h200 (they differ"),
    (lambda d: _edit(d / "call2" / "pd_runs_pd.json",
                     lambda j: j["servers"][0].update(command="", server_args={})),
     "settings are unknown"),
])
def test_bad_results_are_one_clear_error(tmp_path, capsys, break_it, needle):
    d = _copy(tmp_path)
    break_it(d)
    assert dr.main([str(d)]) == 2
    assert needle in capsys.readouterr().err


def _edit(path: Path, change) -> None:
    j = _raw(path)
    change(j)
    path.write_text(json.dumps(j))


def test_without_any_link_probe_measured_asks_for_a_link(tmp_path, capsys):
    d = _copy(tmp_path)
    for f in d.rglob("pd_link.json"):
        f.unlink()
    assert dr.main([str(d)]) == 2
    assert "no usable link probe" in capsys.readouterr().err
    assert dr.main([str(d), "--link", "tcp-loopback"]) == 0
    assert "measured idle" in capsys.readouterr().out


def test_errors_are_none_where_nothing_was_measured():
    assert dr.Row("pd", 2.0, "kv_ms", math.nan, 5.0).error is None
    assert dr.Row("pd", 2.0, "kv_ms", 0.0, 5.0).error is None
    assert dr.Row("pd", 2.0, "kv_ms", 4.0, 5.0).error == pytest.approx(0.25)


# ---- the one-GPU variant (data/pd_run_one_gpu: both P/D servers on GPU 0 of an H200) -------
ONE = DATA.parent / "pd_run_one_gpu"
BW1, LAT1 = 0.8e9, 0.003


def test_a_one_gpu_run_loads_as_shared_and_its_link_is_the_same_gpu_probe():
    res = load_pd_results([ONE])
    pd = res.replay("pd")
    assert pd is not None and pd.shared_gpu
    assert not res.replay("colocated").shared_gpu
    assert res.links[0].same_gpu and res.links[0].probes["mooncake_tcp"]["receiver_gpu"] == 0
    link = dr.choose_link(res, "measured")
    assert link.key == "measured-mooncake-tcp-same-gpu" and "GPU 0->GPU 0" in link.name
    assert link.bandwidth == pytest.approx(BW1, rel=1e-6)
    assert link.latency_s == pytest.approx(LAT1, rel=1e-6)
    # the two-GPU fixture is not shared
    assert not load_pd_results(CALLS).replay("pd").shared_gpu


def test_a_one_gpu_file_without_the_flag_is_shared_by_its_base_gpu_ids(tmp_path):
    d = tmp_path / "one"
    shutil.copytree(ONE, d)
    _edit(d / "pd_runs_pd.json", lambda j: j.pop("shared_gpu"))
    assert load_pd_results([d]).replay("pd").shared_gpu
    _edit(d / "pd_runs_pd.json", lambda j: j["servers"][1].update(
        command=j["servers"][1]["command"].replace("--base-gpu-id 0", "--base-gpu-id 1")))
    assert not load_pd_results([d]).replay("pd").shared_gpu


def test_a_one_gpu_run_compares_kv_bytes_and_time_and_says_the_gpu_was_shared():
    out = io.StringIO()
    assert dr.main([str(ONE)], out) == 0
    text = out.getvalue()
    assert text.splitlines()[1].startswith("ONE GPU: the P/D pair's prefill and decode servers "
                                           "shared one GPU")
    assert "(measured P/D on one shared GPU: indicative)" in text
    result = dr.validate([ONE])
    assert result["shared_gpu"] is True and result["gpu"] == "h200"
    pd = next(r for r in result["runs"] if r["deployment"] == "pd")
    rows = _raw(ONE / "pd_runs_pd.json")["runs"][0]["requests"]
    # SGLang's bytes per request (MiB in its metric) against the model's (transfer.py): equal
    assert pd["measured"]["kv_mb"] == pytest.approx(
        np.mean([r[2] * 131072 for r in rows]) / 1e6, rel=1e-9)
    assert pd["simulated"]["kv_mb"] == pytest.approx(pd["measured"]["kv_mb"], rel=1e-6)
    # the model's transfer: at least the wire time on the measured same-GPU link
    wire = 1e3 * np.mean([LAT1 + r[2] * 131072 / BW1 for r in rows])
    assert pd["measured"]["kv_ms"] == pytest.approx(wire, rel=1e-9)
    assert pd["simulated"]["kv_ms"] >= wire * 0.999
    # the servers' own fractions: the prefill server's 0.30 sizes the model's pd replicas
    assert result["settings"]["pd"]["mem_fraction_static"] == 0.30
    assert result["pool_tokens_measured"] == {"colocated/colocated": 780000,
                                              "pd/prefill": 220000, "pd/decode": 390000}
    # a two-GPU run says nothing of it
    two = io.StringIO()
    assert dr.main([str(DATA)], two) == 0 and "ONE GPU" not in two.getvalue()
