"""A decode step above the largest CUDA graph whose host iteration the calibration times
(``eager_decode_host_s``) lasts the longer of that iteration and its kernels with the fixed
costs: the calibration field, the cost model, the interval fit that leaves such steps out,
and validate_simulator's option."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace

import pytest
from sim_helpers import scenario

from simulator.errors import SimulatorInputError
from simulator.serving.cost import StepShape
from simulator.specs.calibration import load_calibration


def _decode(reqs: int, context: int = 600) -> StepShape:
    return StepShape(decode_reqs=reqs, decode_kv_tokens=reqs * context,
                     decode_read_bytes=reqs * context * 4096.0)


@pytest.mark.parametrize("field, getter, value, fp8_value, bad_values", [
    ("eager_decode_host_s", "decode_host_s", 0.033, 0.021,
     (-0.001, {"fp8": "fast"}, [0.01])),
    ("eager_decode_host_per_req_s", "decode_host_per_req_s", 5e-5, 2e-5,
     (-1e-6, {"fp8": None})),
])
def test_the_fields_load_round_trip_and_name_a_bad_value(tmp_path, field, getter, value,
                                                          fp8_value, bad_values):
    """The host iteration's base and its per-request term, each with its per-format form;
    a bad value (a negative number, a format's non-number, a non-mapping) is named."""
    by_format = f"{field}_by_format"
    base = load_calibration("h100").to_dict()
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | {
        field: value, by_format: {"fp8": fp8_value}}}}))
    cal = load_calibration("h100", str(f))
    assert (getattr(cal, getter)("diffkv"), getattr(cal, getter)("fp8")) == (value, fp8_value)
    d = cal.to_dict()
    assert d[field] == value
    assert d[by_format] == {"fp8": fp8_value}
    default = load_calibration("h100")
    assert getattr(default, getter)("bf16") == 0.0
    assert field not in default.to_dict()
    for bad in bad_values:
        entry = {field: bad} if not isinstance(bad, (dict, list)) else {by_format: bad}
        f.write_text(json.dumps({"version": 1, "gpus": {"h100": base | entry}}))
        with pytest.raises(SimulatorInputError, match=field):
            load_calibration("h100", str(f))


def test_an_eager_decode_step_lasts_the_host_iteration_or_its_kernels():
    sc = scenario()
    summed = sc.server("bf16").cost
    top = summed.graph_max
    small, big = _decode(top + 1), _decode(8 * top, 4000)
    c = summed.calib

    def fixed(s: StepShape) -> float:
        return c.step_overhead_s + c.seq_overhead_s * s.decode_reqs

    def kernels(s: StepShape) -> float:
        return summed.step_time(s) - fixed(s) - summed.layers * summed.layer_overhead(s)

    assert summed.eager_decode(small) and summed.eager_decode(big)
    host = 0.5 * (kernels(small) + fixed(small) + kernels(big) + fixed(big))
    assert kernels(small) + fixed(small) < host < kernels(big) + fixed(big)
    cost = replace(sc, calibration=replace(c, eager_decode_host_s=host)).server("bf16").cost
    # host-bound: the iteration, whatever the kernels
    assert cost.step_time(small) == pytest.approx(host)
    # kernel-bound: the kernels and fixed costs, and no per-layer eager cost on top
    assert cost.step_time(big) == pytest.approx(kernels(big) + fixed(big))
    assert cost.step_time(big) < summed.step_time(big)
    # graphed decode steps and prefill steps are unchanged
    prefill = StepShape(prefill_tokens=512, prefill_pairs=512 * 512 / 2, prefill_seqs=1)
    for s in (_decode(top), _decode(8), prefill):
        assert cost.step_time(s) == summed.step_time(s)
        assert cost.host_bound_floor(s) == 0.0
    # a KV format's own value wins over the default; a format without one keeps the sum
    own = replace(c, eager_decode_host_s_by_format={"fp8": 2 * host})
    assert replace(sc, calibration=own).server("fp8").cost.step_time(small) == pytest.approx(
        2 * host)
    assert replace(sc, calibration=own).server("bf16").cost.step_time(small) == (
        summed.step_time(small))


def test_without_cuda_graphs_every_decode_step_is_eager_and_floored():
    sc = scenario()
    host = 0.05
    cal = replace(sc.calibration, eager_decode_host_s=host)
    eager = replace(sc, calibration=cal,
                    settings=replace(sc.settings, disable_cuda_graph=True)).server("bf16").cost
    assert not eager.graphed(_decode(4))
    assert eager.step_time(_decode(4)) == pytest.approx(host)


def test_the_interval_fit_leaves_host_bound_eager_intervals_out(tmp_path):
    from test_step_fit import TRUE, _intervals, _log, _server

    from simulator.validation.step_fit import fit_step_costs, step_rows
    top = _server().cost.graph_max
    ivs = _intervals(4)
    ivs += [(b, b * 600, []) for b in (top + 40, top + 90, top + 150) for _ in range(3)]
    ivs += [(top - 20, (top - 20) * 600, [])]
    host = 0.2     # longer than any of these eager steps' kernels
    log = _log(tmp_path, ivs, eager_decode_host_s=host)
    start = {**{k: 0.0 for k in TRUE}, "decode_attention_scale": 1.0,
             "eager_decode_host_s": host}
    rows = step_rows(_server(**start), log, "fit", None)
    graphed = step_rows(_server(**start), log, "fit", True)
    # no eager interval made a row: 8 of the 9 left out, the one into them (mixed flags) too
    assert len(rows) == len(graphed) and rows.host_bound == 8
    fit = fit_step_costs(_server(**start), rows)
    assert fit["eager_decode_rows"] == 0
    assert "eager_decode_layer_overhead_s" in fit["kept"]
    for k in ("step_overhead_s", "seq_overhead_s", "decode_attention_scale"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.05), k
    # without the host time the same log's eager intervals are rows, fitted per layer
    per_layer = step_rows(_server(**{**start, "eager_decode_host_s": 0.0}), log, "fit", None)
    assert len(per_layer) > len(rows)


def test_validate_simulator_reads_the_option_per_backend_or_format(tmp_path, capsys):
    vs = importlib.import_module("simulator.validation.runs")
    rc = vs.main([str(tmp_path), "--eager-decode-host-s", "diffkv=slow",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--eager-decode-host-s 'diffkv=slow'" in err and "KEY one of" in err
    assert vs.key_seconds_arg("eager_decode_host_s", ["diffkv=0.0381", "fp8=0.02"]) == {
        "diffkv": 0.0381, "fp8": 0.02}
    # the option named in milliseconds is gone: one name per knob, in the field's unit
    rc = vs.main([str(tmp_path), "--eager-decode-host-ms", "diffkv=38.1"])
    assert rc == 2
    assert "--eager-decode-host-ms is now --eager-decode-host-s" in capsys.readouterr().err


def test_the_option_sets_the_backends_value_and_a_formats_own():
    vs = importlib.import_module("simulator.validation.runs")
    cal = load_calibration("h100")
    given = {"diffkv": 0.0381, "fp8": 0.02}
    dk = vs.with_given_seconds(cal, "diffkv", given, "eager_decode_host_s")
    assert dk.eager_decode_host_s == pytest.approx(0.0381)
    assert dk.eager_decode_host_s_by_format == {"fp8": pytest.approx(0.02)}
    tr = vs.with_given_seconds(cal, "triton", given, "eager_decode_host_s")
    assert tr.eager_decode_host_s == 0.0
    assert (tr.decode_host_s("fp8"), tr.decode_host_s("bf16")) == (pytest.approx(0.02), 0.0)


def test_the_host_iteration_grows_with_the_eager_batch():
    sc = scenario()
    summed = sc.server("bf16").cost
    top = summed.graph_max
    base_s, per_req_s = 0.010, 0.001      # far above any of these steps' kernels
    cal = replace(sc.calibration, eager_decode_host_s=base_s,
                  eager_decode_host_per_req_s=per_req_s)
    cost = replace(sc, calibration=cal).server("bf16").cost
    for b in (top + 1, 2 * top, 3 * top):
        assert cost.host_bound_floor(_decode(b)) == pytest.approx(base_s + per_req_s * b)
        assert cost.step_time(_decode(b)) == pytest.approx(base_s + per_req_s * b)
    # graphed steps keep no floor; the per-request term alone times the host, and the
    # per-layer eager cost goes
    assert cost.host_bound_floor(_decode(top)) == 0.0
    alone = replace(sc, calibration=replace(
        sc.calibration, eager_decode_host_per_req_s=per_req_s)).server("bf16").cost
    assert alone.layer_overhead(_decode(top + 1)) == 0.0
    assert alone.step_time(_decode(top + 1)) == pytest.approx(per_req_s * (top + 1))
    own = replace(cal, eager_decode_host_per_req_s_by_format={"fp8": 2 * per_req_s})
    fp8 = replace(sc, calibration=own).server("fp8").cost
    assert fp8.host_bound_floor(_decode(top + 1)) == pytest.approx(
        base_s + 2 * per_req_s * (top + 1))


def test_validate_simulator_reads_the_per_request_option_in_seconds(tmp_path, capsys):
    vs = importlib.import_module("simulator.validation.runs")
    rc = vs.main([str(tmp_path), "--eager-decode-host-per-req-s", "diffkv=-3",
                  "--doc", str(tmp_path / "d.md")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--eager-decode-host-per-req-s 'diffkv=-3'" in err and "seconds" in err
    given = vs.key_seconds_arg("eager_decode_host_per_req_s", ["diffkv=52.4e-6", "fp8=2e-5"])
    cal = load_calibration("h100")
    dk = vs.with_given_seconds(cal, "diffkv", given, "eager_decode_host_per_req_s")
    assert dk.eager_decode_host_per_req_s == pytest.approx(52.4e-6)
    assert dk.decode_host_per_req_s("fp8") == pytest.approx(20e-6)
