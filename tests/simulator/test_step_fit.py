"""The joint step-cost fit (simulator/validation/step_fit.py) recovers known per-step,
per-request, prefill-step and per-prompt-token costs and the decode attention scale from
Decode intervals with prefill steps inside, drops an interval that spans idle time, keeps what
the rows cannot determine, and refuses too few rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from simulator.specs.calibration import load_calibration
from simulator.validation.fit import _shape, prefill_shape
from simulator.validation.step_fit import LaunchFloors, _kernels, fit_step_costs, step_rows

TRUE = {"step_overhead_s": 5e-4, "seq_overhead_s": 1e-5, "prefill_step_overhead_s": 8e-3,
        "prefill_seq_overhead_s": 0.0, "prefill_token_overhead_s": 2e-6,
        "decode_attention_scale": 0.85}
N = 10  # decode_log_interval


def _server(fmt="bf16", **costs):
    cal = replace(load_calibration("h100"), **costs)
    return replace(scenario(), calibration=cal).server(fmt)


def _log(tmp_path, intervals, idle_at=None, fmt="bf16", release_s=0.0, head_start=False,
         **truth_costs):
    """Decode lines every N decode steps, with Prefill lines between them; each interval's
    gen throughput is its decode tokens over the wall time that the true costs give, plus
    ``release_s`` per request a decode-only interval's batch lost. ``head_start``: a
    prefill's launches began a decode step's kernel time before it (the overlap scheduler)."""
    truth = _server(fmt, **{**TRUE, **truth_costs})
    lines = ["max_total_num_tokens=400000, chunked_prefill_size=8192",
             f"server_args=ServerArgs(decode_log_interval={N}, chunked_prefill_size=8192)"]

    def decode_line(b: int, kv: int, g: float) -> str:
        graph = b <= truth.cost.graph_max
        return (f"[2026-11-22 12:00:00] Decode batch, #running-req: {b}, #token: {kv}, token "
                f"usage: 0.05, cuda graph: {graph}, gen throughput (token/s): {g:.4f}, "
                f"#queue-req: 0")

    pb, pkv = intervals[0][0], intervals[0][1]
    lines.append(decode_line(pb, pkv, 1.0))
    for i, (b, kv, prefills) in enumerate(intervals):
        # the interval's decode steps at the mean of its two lines, as the fit reads them
        mb, mkv = 0.5 * (pb + b), 0.5 * (pkv + kv)
        wall = N * truth.cost.step_time(_shape(truth, mb, mkv))
        if not prefills:
            wall += release_s * max(0, pb - b)
        pb, pkv = b, kv
        for tok in prefills:
            lines.append(f"[2026-11-22 12:00:00] Prefill batch, #new-seq: 1, #new-token: {tok}, "
                         f"#cached-token: 0, token usage: 0.05, #running-req: {b}, "
                         f"#queue-req: 0, cuda graph: False, input throughput (token/s): 0.00")
            shape = prefill_shape(truth, 1, tok, 0)
            if head_start:
                rest, attn, _, _ = _kernels(truth, _shape(truth, mb, mkv))
                shape = replace(shape, launch_head_start_s=rest + attn
                                * truth.cost.attention_scale)
            wall += truth.cost.step_time(shape)
        if i == idle_at:
            wall *= 3.0      # the server idled inside this interval
        lines.append(decode_line(b, kv, N * mb / wall))
    p = tmp_path / f"server-{fmt}.log"
    p.write_text("\n".join(lines) + "\n")
    return parse_server_log(p)


def _intervals(seed: int = 0, prefill: bool = True, prompts: tuple[int, int] = (20, 4000)):
    rng = np.random.default_rng(seed)
    out = []
    b = 8
    for _ in range(60):
        kv = int(b * rng.integers(200, 3000))
        k = int(rng.integers(0, 3)) if prefill else 0
        out.append((b, kv, [int(t) for t in rng.integers(*prompts, size=k)]))
        b = int(np.clip(b + rng.integers(-3, 4), 2, 120))
    out += [(int(b), int(b) * 2000, []) for b in (100, 110, 120) for _ in range(5)]
    return out


def test_fit_recovers_known_costs_and_drops_idle(tmp_path):
    log = _log(tmp_path, _intervals(), idle_at=7)
    srv = _server(**{**{k: 0.0 for k in TRUE}, "decode_attention_scale": 1.0})
    rows = step_rows(srv, log, "fit", graphed=True)
    assert {"decode", "prefill-interval"} <= set(rows.kind)
    fit = fit_step_costs(srv, rows)
    assert len(fit["dropped"]) == 1 and "lines" in fit["dropped"][0]
    # one prompt per prefill step: the per-request prefill cost cannot be separated
    assert "prefill_seq_overhead_s" in fit["kept"]
    for k in ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
              "prefill_token_overhead_s", "decode_attention_scale"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.05, abs=2e-7), k
    assert fit["mape"] < 1e-3 < fit["mape_before"]


def test_launch_bound_prefills_count_their_launches_from_the_decode_step_before(tmp_path):
    launch = 0.012   # above every decode step's kernels here, and most prefills'
    log = _log(tmp_path, _intervals(5), head_start=True, eager_prefill_launch_s=launch)
    start = {**{k: 0.0 for k in TRUE}, "decode_attention_scale": TRUE["decode_attention_scale"],
             "eager_prefill_launch_s": launch}
    rows = step_rows(_server(**start), log, "fit", graphed=True)
    fit = fit_step_costs(_server(**start), rows)
    for k in ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
              "prefill_token_overhead_s", "decode_attention_scale"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.05, abs=2e-7), k
    assert fit["mape"] < 1e-3
    # read as if the launches began with the prefill step (no overlap), the log fits worse
    cal = replace(load_calibration("h100"), **start)
    flat_srv = replace(scenario(disable_overlap_schedule=True), calibration=cal).server("bf16")
    flat = fit_step_costs(flat_srv, step_rows(flat_srv, log, "fit", graphed=True))
    assert flat["mape"] > 10 * fit["mape"]


def test_the_per_token_cost_is_fitted_on_the_steps_the_launches_do_not_hide(tmp_path):
    # short prompts whose kernels all sit under the launches: with the per-token cost the
    # larger of them outlast the launches, without it none does, so the fit must settle
    # which side bounds each step as its per-token cost moves (LaunchFloors)
    launch, p_tok = 0.02, 8e-6
    log = _log(tmp_path, _intervals(3, prompts=(20, 600)), head_start=True,
               eager_prefill_launch_s=launch, prefill_token_overhead_s=p_tok)
    start = {**{k: 0.0 for k in TRUE}, "decode_attention_scale": TRUE["decode_attention_scale"],
             "eager_prefill_launch_s": launch}
    srv = _server(**start)
    rows = step_rows(srv, log, "fit", graphed=True)
    fit = fit_step_costs(srv, rows)
    for k in ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
              "decode_attention_scale"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.05, abs=2e-7), k
    assert fit["prefill_token_overhead_s"] == pytest.approx(p_tok, rel=0.05)
    assert fit["mape"] < 1e-3
    floors = LaunchFloors.of(rows)
    at_start, settled = floors.bound(0.0), floors.bound(p_tok)
    # the calibration's per-token cost (0) puts every step on the launch side, where the
    # rows hold no per-token column at all; the truth puts some on the kernel side
    assert at_start.all() and (at_start & ~settled).sum() >= 5 and settled.sum() >= 10
    assert fit["floor_settled"] and fit["floor_passes"] >= 2
    assert fit["launch_bound_steps"] == int(settled.sum())


def test_a_diffkv_prefill_counts_its_launches_from_its_own_start(tmp_path):
    # DiffKV's prefill allocation waits for the decode step in flight: no head start
    launch = 0.012
    log = _log(tmp_path, _intervals(5), fmt="diffkv", head_start=False,
               eager_prefill_launch_s=launch)
    start = {**{k: 0.0 for k in TRUE}, "decode_attention_scale": TRUE["decode_attention_scale"],
             "eager_prefill_launch_s": launch}
    srv = _server("diffkv", **start)
    fit = fit_step_costs(srv, step_rows(srv, log, "fit", graphed=True))
    for k in ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
              "prefill_token_overhead_s", "decode_attention_scale"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.05, abs=2e-7), k
    assert fit["mape"] < 1e-3


def test_decode_only_rows_keep_the_prefill_costs(tmp_path):
    log = _log(tmp_path, _intervals(1, prefill=False))
    given = {**{k: 0.0 for k in TRUE}, "prefill_step_overhead_s": 0.019,
             "decode_attention_scale": 1.0}
    fit = fit_step_costs(_server(**given), step_rows(_server(**given), log, "fit", True))
    assert fit["prefill_step_overhead_s"] == 0.019
    # (releases cost nothing in this log: their term is kept too)
    assert set(fit["kept"]) == {"prefill_step_overhead_s", "prefill_seq_overhead_s",
                                "prefill_token_overhead_s", "release_overhead_s",
                                "eager_decode_layer_overhead_s"}
    for k in ("step_overhead_s", "seq_overhead_s", "decode_attention_scale"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.05), k


def test_eager_decode_steps_give_the_eager_launch_cost(tmp_path):
    """Batches above the largest CUDA graph run eagerly: with enough such intervals their
    per-layer cost is fitted, apart from the prefill steps' (which keep the calibration's
    eager_layer_overhead_s, here a wrong one that the prefill-step cost absorbs); the
    intervals whose two lines disagree on the graph are left out (their steps ran both ways)."""
    eager = 1.5e-4
    srv0 = _server()
    top = srv0.cost.graph_max
    ivs = _intervals(4)
    ivs += [(b, b * 600, []) for b in (top + 40, top + 90, top + 150, top + 220) for _ in range(3)]
    ivs += [(top - 20, (top - 20) * 600, [])]            # back under the limit
    log = _log(tmp_path, ivs, eager_decode_layer_overhead_s=eager)
    start = {**{k: 0.0 for k in TRUE}, "decode_attention_scale": 1.0,
             "eager_decode_layer_overhead_s": 0.0, "eager_layer_overhead_s": 0.0}
    prefill_eager = srv0.deployment.calibration.eager_layer_overhead_s * srv0.cost.layers
    rows = step_rows(_server(**start), log, "fit", None)
    fit = fit_step_costs(_server(**start), rows)
    assert fit["eager_decode_rows"] >= 10
    assert "eager_decode_layer_overhead_s" in fit["fitted"]
    for k, v in {**TRUE, "eager_decode_layer_overhead_s": eager}.items():
        if k in fit["fitted"] and k != "prefill_step_overhead_s":
            assert fit[k] == pytest.approx(v, rel=0.05, abs=2e-7), k
    # the prefill steps' true eager launches (the start calibration has none) land in p_step
    assert prefill_eager > 0
    assert fit["prefill_step_overhead_s"] == pytest.approx(
        TRUE["prefill_step_overhead_s"] + prefill_eager, rel=0.05)
    assert len(rows) == len(ivs) - 2      # the intervals into and out of the eager batches
    # graphed-only rows (as before) hold no eager decode step: the cost is kept
    kept = fit_step_costs(_server(**start), step_rows(_server(**start), log, "fit", True))
    assert "eager_decode_layer_overhead_s" in kept["kept"]


def test_too_few_rows_is_a_clear_error(tmp_path):
    log = _log(tmp_path, _intervals()[:3])
    with pytest.raises(InputError, match="at least 8"):
        fit_step_costs(_server(), step_rows(_server(), log, "fit", True))


def test_formats_share_fixed_costs_and_get_their_own_attention_scale(tmp_path):
    """bf16 and fp8 runs of one backend: one step/request cost, one attention factor each;
    the calibration written from the fit gives each format's cost model its own factor."""
    from simulator.validation.fit import calibration_file, write_calibration

    start = {**{k: 0.0 for k in TRUE}, "decode_attention_scale": 1.0}
    rows = step_rows(_server("bf16", **start), _log(tmp_path, _intervals(2, prefill=False)),
                     "bf16", True)
    fp8_log = _log(tmp_path, _intervals(3, prefill=False), fmt="fp8",
                   decode_attention_scale=1.3)
    step_rows(_server("fp8", **start), fp8_log, "fp8", True, rows)
    fit = fit_step_costs(_server("bf16", **start), rows)
    assert fit["decode_attention_scale_by_format"] == {
        "bf16": pytest.approx(0.85, rel=0.03), "fp8": pytest.approx(1.3, rel=0.03)}
    assert fit["decode_attention_scale"] == fit["decode_attention_scale_by_format"]["bf16"]
    assert fit["step_overhead_s"] == pytest.approx(TRUE["step_overhead_s"], rel=0.05)
    assert fit["seq_overhead_s"] == pytest.approx(TRUE["seq_overhead_s"], rel=0.05)
    data = calibration_file(_server("bf16", **start), {**fit, "fixed_only": True}, "logs")
    path = write_calibration(tmp_path / "cal.json", data)
    cal = load_calibration("h100", path)
    assert set(cal.decode_attention_scale_by_format) == {"fp8"}
    fp8 = replace(scenario(), calibration=cal).server("fp8")
    bf16 = replace(scenario(), calibration=cal).server("bf16")
    assert fp8.cost.attention_scale == pytest.approx(1.3, rel=0.03)
    assert bf16.cost.attention_scale == pytest.approx(0.85, rel=0.03)


def test_a_bad_per_format_scale_is_refused(tmp_path):
    import json

    data = json.loads((Path(__file__).parents[2] / "simulator" / "calibration"
                       / "default.json").read_text())
    data["gpus"]["h100"]["decode_attention_scale_by_format"] = {"fp8": 0}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError,
                       match=r"decode_attention_scale_by_format.fp8=0 must be in \(0, 4\]"):
        load_calibration("h100", path)


def test_a_constant_batch_charges_the_hidden_cost_per_step(tmp_path):
    """One batch size throughout (a single long-generation run) cannot tell a per-step cost
    from a per-request one: the per-request cost is kept and the rest charged per step."""
    hidden = 0.01
    intervals = [(200, int(kv), []) for kv in np.linspace(2e5, 4e5, 20)]
    log = _log(tmp_path, intervals, step_overhead_s=TRUE["step_overhead_s"] + hidden)
    srv = _server(**TRUE)
    fit = fit_step_costs(srv, step_rows(srv, log, "fit", True))
    assert "seq_overhead_s" in fit["kept"] and fit["seq_overhead_s"] == TRUE["seq_overhead_s"]
    assert fit["step_overhead_s"] == pytest.approx(TRUE["step_overhead_s"] + hidden, rel=0.02)
