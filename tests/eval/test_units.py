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
from sglang_diffkv.model_record import ModelRecord


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


def test_calibration_picks_fewest_bytes_within_tolerance_and_reports_the_frontier(tmp_path):
    def row(name, b, kl, top1):
        return {"name": name, "bytes_per_token": b, "kl_mean": kl, "top1": top1,
                "ratio_vs_bf16": b / 128}

    rows = [row("a", 110, 0.01, 0.99), row("b", 95, 0.03, 0.95), row("c", 70, 0.04, 0.85),
            row("d", 50, 0.2, 0.7), row("e", 96, 0.05, 0.96)]  # e: dominated by b
    assert cal.choose(rows, max_kl=0.05, min_top1=0.9)["name"] == "b"
    assert cal.choose(rows, max_kl=0.05, min_top1=0.8)["name"] == "c"
    assert cal.choose(rows, max_kl=0.001, min_top1=0.0) is None
    assert [r["name"] for r in cal.frontier(rows)] == ["d", "c", "b", "a"]
    msg = cal.no_point_message(cal.frontier(rows), max_kl=0.005, min_top1=0.9)
    assert "no searched point meets mean KL <= 0.005" in msg and "closest on the frontier: a" in msg
    cfg = preset("default").with_thresholds(4.0, 0.1)
    record = ModelRecord("test-model", "llama", 2, 4, 2, 64, (1.0, 2.0))
    d = cal.preset_dict(cfg, "test-model", record)
    p, prov = cal.write_preset(tmp_path / "test-model.json", d, {"note": "unit test"})
    loaded = DiffKVConfig.from_json(p)
    assert (loaded.alpha_h, loaded.alpha_l, loaded.name) == (4.0, 0.1, "test-model")
    assert loaded.high == preset("default").high and loaded.low == preset("default").low
    assert loaded.calibrated_for == record and not loaded.allow_other_model
    assert json.loads(prov.read_text())["note"] == "unit test"


def test_the_search_covers_tier_pairs_without_4_bit_keys_and_pruning_alone():
    pairs = cal.parse_tier_pairs(",".join(cal.DEFAULT_TIER_PAIRS))
    assert any(p.low.key_bits == 8 for p in pairs)  # a low tier that keeps 8-bit keys
    assert any(p.high.value_groups > 1 for p in pairs)  # grouped metadata
    cands = cal.candidates(preset("llama-3-8b"), pairs, [1.0, 16.0], [0.0, 0.4])
    names = [c.name for c in cands]
    assert "K8V4/K8V2@16/0.4" in names and "K8V4g12/K8V2g12@1/0" in names
    prune = [c for c in cands if c.pruning_only]
    assert [c.name for c in prune] == ["K8V4+prune@0.4", "K8V4g12+prune@0.4"]  # per high tier
    assert all(c.config.alpha_h == c.config.alpha_l == 0.4 for c in prune)
    assert all(c.config.calibrated_for is None and c.config.window == 64 for c in cands)
    with pytest.raises(ConfigError, match="more precise than high tier"):
        cal.parse_tier_pairs("K4V2/K8V2")
    with pytest.raises(ConfigError, match="must be HIGH/LOW"):
        cal.parse_tier_pairs("K8V4")
    with pytest.raises(ConfigError, match=r"--min-top1 1.5 must be a top-1 agreement in \[0, 1\]"):
        cal.check_tolerance(0.03, 1.5)


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
