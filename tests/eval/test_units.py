"""Config specs, calibration choice and preset files, metrics, needles, data splits."""

import json

import pytest
import torch

from sglang_diffkv.config import ConfigError, DiffKVConfig, preset
from sglang_diffkv.eval import calibrate as cal
from sglang_diffkv.eval import configs as cfgs
from sglang_diffkv.eval import data
from sglang_diffkv.eval.metrics import greedy_agreement
from sglang_diffkv.eval.report import pareto_front


def test_config_specs_parse_and_reject_clearly():
    assert cfgs.parse("uniform:K4V4").tier.name == "K4V4"
    assert cfgs.parse("kivi:2:residual=32").name == "kivi-2bit-r32g32"
    assert cfgs.parse("prune:bytes=80").budget_bytes == 80
    c = cfgs.parse("diffkv:default@2/0.1")
    assert (c.diffkv.alpha_h, c.diffkv.alpha_l) == (2.0, 0.1)
    with pytest.raises(ConfigError, match="unknown config spec"):
        cfgs.parse("fp8")
    with pytest.raises(ConfigError, match="alpha_l"):
        cfgs.parse("diffkv:default@0.1/2")


@pytest.mark.parametrize("spec, what", [
    ("kivi:x", "'kivi:x': bits='x' must be an integer >= 1"),
    ("kivi:3", "KIVI bits=3 is not one of (1, 2, 4, 8)"),
    ("kivi:2:group=0", "group='0' must be an integer >= 1"),
    ("kivi:2:residual=-1", "residual='-1' must be an integer >= 0"),
    ("kivi:2:size=4", "unknown KIVI option"),
    ("kivi:2:group", "option 'group' must be key=value"),
    ("prune:nan", "kept fraction 'nan' must be a finite number in (0, 1]"),
    ("prune:1.5", "kept fraction '1.5'"),
    ("prune:bytes=inf", "byte budget 'inf' must be a finite number > 0"),
    ("prune:bytes=-3", "byte budget '-3'"),
    ("uniform:K3V3", "'uniform:K3V3': uniform: key_bits=3"),
    ("diffkv:nope", "'diffkv:nope': unknown preset 'nope'"),
    ("diffkv:default@1/x", "thresholds must be '@alpha_h/alpha_l'"),
    ("diffkv:default@1e300/0", "alpha_h=1e+300 is out of range"),
    ("bf16,,", None),
])
def test_bad_eval_configs_are_one_line_before_the_model_loads(spec, what, capsys):
    """diffkv-eval run parses --configs first: a bad spec costs no model load and prints
    one line (exit 2); the model argument here could not even be loaded."""
    from sglang_diffkv.eval.cli import main

    if what is None:  # a good list: parse_list accepts it
        assert [c.name for c in cfgs.parse_list(spec)] == ["bf16"]
        return
    with pytest.raises(ConfigError) as e:
        cfgs.parse_list(spec)
    assert what in str(e.value), str(e.value)
    assert main(["run", "--model", "/nonexistent", "--configs", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"diffkv-eval: error: {e.value}"
    assert main(["memory", "--configs", spec]) == 2


def test_diffkv_configs_differing_in_thresholds_share_one_backend():
    from tiny import tiny

    shape = tiny().shape
    plan = cfgs.build(
        [cfgs.parse("diffkv:default"), cfgs.parse("diffkv:default@4/0.2"),
         cfgs.parse("uniform:K8V4")], shape, prompts=2)
    assert len(plan.backends) == 2
    assert plan.rows["diffkv-default"][1] == [0, 1]
    assert plan.rows["diffkv-default@4/0.2"][1] == [2, 3]
    d = plan.backends[plan.rows["diffkv-default"][0]]
    assert d.alphas == [(1.0, 0.0)] * 2 + [(4.0, 0.2)] * 2


def test_calibration_picks_fewest_bytes_within_tolerance(tmp_path):
    def s(b, kl, top1):
        return {"summary": {"bytes_per_token": b, "kl_mean": kl, "top1": top1}}

    pts = [(1.0, 0.0), (2.0, 0.0), (4.0, 0.1), (8.0, 0.3)]
    res = {cal.point_name(*pts[0]): s(110, 0.01, 0.99), cal.point_name(*pts[1]): s(95, 0.03, 0.95),
           cal.point_name(*pts[2]): s(70, 0.04, 0.85), cal.point_name(*pts[3]): s(50, 0.2, 0.7)}
    assert cal.choose(res, pts, max_kl=0.05, min_top1=0.9) == (2.0, 0.0)
    assert cal.choose(res, pts, max_kl=0.05, min_top1=0.8) == (4.0, 0.1)
    assert cal.choose(res, pts, max_kl=0.001, min_top1=0.0) is None
    d = cal.preset_dict(preset("default"), 4.0, 0.1, "test-model")
    p, prov = cal.write_preset(tmp_path / "test-model.json", d, {"note": "unit test"})
    loaded = DiffKVConfig.from_json(p)
    assert (loaded.alpha_h, loaded.alpha_l, loaded.name) == (4.0, 0.1, "test-model")
    assert loaded.high == preset("default").high and loaded.low == preset("default").low
    assert json.loads(prov.read_text())["note"] == "unit test"


def test_grid_skips_points_with_alpha_l_above_alpha_h():
    assert cal.grid_points([0.5, 2.0], [0.0, 1.0]) == [(0.5, 0.0), (2.0, 0.0), (2.0, 1.0)]


def test_greedy_agreement_and_pareto():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    got = torch.tensor([[1, 2, 3, 4], [5, 9, 7, 8]])
    g = greedy_agreement("x", got, ref)
    assert (g.exact_match, g.first_divergence_mean, g.first_divergence_min) == (0.5, 2.5, 1)
    pts = [(100, 0.01, "a"), (80, 0.05, "b"), (90, 0.06, "c"), (60, 0.5, "d")]
    assert pareto_front(pts) == ["a", "b", "d"]


def test_token_windows_respect_the_calibration_split():
    ids = torch.arange(1000)
    cal_w = data.token_windows(ids, 3, 50, "calibration")
    ev = data.token_windows(ids, 3, 50, "eval")
    assert cal_w.max() < 300 <= ev.min()
    assert cal_w.shape == ev.shape == (3, 50)
    with pytest.raises(data.DataError, match="cannot take"):
        data.token_windows(ids, 20, 50, "calibration")


def test_bundled_excerpts_are_found_and_joined():
    text = data.wikitext(data.PACKAGE_DATA / data.EXCERPT[data.WIKITEXT])
    assert "\r" not in text and "\n\n" not in text and text.startswith(" = Robert Boulter")
    assert len(data.gsm8k_questions(data.PACKAGE_DATA / data.EXCERPT[data.GSM8K], 3)) == 3
