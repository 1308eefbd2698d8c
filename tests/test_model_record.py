"""The preset's recorded model against the served one: records, their comparison and the
start-up verdict (sglang_diffkv.model_record), and how configs carry the record."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_diffkv.config import PRESET_DIR, PRESETS, ConfigError, DiffKVConfig, preset
from sglang_diffkv.model_record import (
    ALLOW_OTHER_MODEL,
    FINGERPRINT_ROWS,
    ModelRecord,
    differences,
    embedding_norms,
    guard,
)

SMOL = ModelRecord("SmolLM2-135M-Instruct", "llama", 30, 9, 3, 64)
LLAMA8B = preset("llama-3-8b").calibrated_for


def _verdict(cfg: DiffKVConfig, served: ModelRecord, dummy: bool = False):
    return guard(cfg.name, cfg.calibrated_for, served, alpha_l=cfg.alpha_l,
                 allow_other_model=cfg.allow_other_model, bench_mode=cfg.bench_mix is not None,
                 dummy_weights=dummy)


def test_the_llama_preset_on_smollm2_is_refused_naming_preset_model_and_opt_in():
    v = _verdict(preset("llama-3-8b"), SMOL)
    assert v.refusal is not None and v.warning is None
    assert "\n" not in v.refusal
    for part in ("'llama-3-8b'", "Llama-3-8B (llama, 32 layers, 32 query / 8 KV heads, "
                 "head_dim 128)", "SmolLM2-135M-Instruct (llama, 30 layers, 9 query / 3 KV",
                 "alpha_l=0.02", f'"{ALLOW_OTHER_MODEL}": true', "SGLANG_DIFFKV_CONFIG",
                 "num_layers 32 vs 30"):
        assert part in v.refusal, part


def test_opt_in_turns_the_refusal_into_a_warning():
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", ALLOW_OTHER_MODEL: True})
    assert cfg.name == "llama-3-8b"  # the opt-in does not make it a custom config
    v = _verdict(cfg, SMOL)
    assert v.refusal is None and ALLOW_OTHER_MODEL in v.warning and "SmolLM2" in v.warning


def test_a_customised_preset_keeps_its_record_and_the_opt_in_names_its_base():
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5})
    assert cfg.name == "llama-3-8b+custom" and cfg.calibrated_for == LLAMA8B
    assert '{"preset": "llama-3-8b", "allow_other_model": true}' in _verdict(cfg, SMOL).refusal


@pytest.mark.parametrize("name", ["qwen2.5-32b", "llama-3-70b", "qwq-32b"])
def test_a_mismatched_preset_that_does_not_prune_is_a_warning_only(name):
    v = _verdict(preset(name), SMOL)
    assert v.refusal is None and "nothing is pruned" in v.warning and name in v.warning


@pytest.mark.parametrize("name", ["default", "no-compression"])
def test_model_agnostic_presets_record_nothing_and_pass_on_any_model(name):
    assert preset(name).calibrated_for is None
    assert _verdict(preset(name), SMOL) == _verdict(preset(name), LLAMA8B)
    assert _verdict(preset(name), SMOL).refusal is _verdict(preset(name), SMOL).warning is None


def test_matching_model_is_silent_and_dummy_weights_or_bench_mode_never_refuse():
    assert _verdict(preset("llama-3-8b"), LLAMA8B) == _verdict(preset("qwen2.5-7b"),
                                                                PRESETS["qwen2.5-7b"]
                                                                .calibrated_for)
    v = _verdict(preset("llama-3-8b"), LLAMA8B)
    assert v.refusal is None and v.warning is None
    dummy = _verdict(preset("llama-3-8b"), SMOL, dummy=True)
    assert dummy.refusal is None and "dummy weights" in dummy.warning
    bench = PRESETS["bench-measured"]  # records SmolLM2, runs on dummy Llama-3-8B shapes
    assert bench.calibrated_for.num_layers == 30
    assert _verdict(bench, LLAMA8B).refusal is _verdict(bench, LLAMA8B).warning is None


def test_the_weights_fingerprint_is_compared_with_a_tolerance_for_bf16():
    torch.manual_seed(0)
    w = torch.randn(100, 64)
    norms = embedding_norms(w)
    assert len(norms) == FINGERPRINT_ROWS
    mine = ModelRecord("m", "llama", 2, 4, 2, 16, norms)
    served_bf16 = ModelRecord("copy", "llama", 2, 4, 2, 16, embedding_norms(w.bfloat16()))
    other = ModelRecord("other", "llama", 2, 4, 2, 16, embedding_norms(torch.randn(100, 64)))
    no_weights = ModelRecord("shape only", "llama", 2, 4, 2, 16)
    assert differences(mine, served_bf16) == [] and differences(mine, no_weights) == []
    (diff,) = differences(mine, other)
    assert "weights fingerprint" in diff
    assert differences(mine, other, compare_weights=False) == []
    cfg = DiffKVConfig(alpha_l=0.1, calibrated_for=mine, name="mine")
    assert _verdict(cfg, other).refusal is not None
    assert _verdict(cfg, other, dummy=True).refusal is None  # random weights are not compared


def test_the_shipped_smollm2_presets_record_smollm2_with_a_fingerprint():
    for stem in ("smollm2-135m", "smollm2-135m-strict"):
        rec = DiffKVConfig.from_json(PRESET_DIR / f"{stem}.json").calibrated_for
        assert differences(rec, SMOL, compare_weights=False) == []
        assert len(rec.embedding_norms) == FINGERPRINT_ROWS


def test_the_record_round_trips_through_a_preset_file(tmp_path):
    cfg = DiffKVConfig(alpha_l=0.1, calibrated_for=SMOL, name="x")
    path = tmp_path / "x.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert DiffKVConfig.from_json(path) == cfg


@pytest.mark.parametrize("bad, expect", [
    ({"calibrated_for": {"name": "m"}}, "calibrated_for: missing field(s) architecture"),
    ({"calibrated_for": {**SMOL.to_dict(), "layers": 3}}, "unknown field(s) ['layers']"),
    ({"calibrated_for": {**SMOL.to_dict(), "num_layers": 0}}, "num_layers=0 must be a "
     "positive integer"),
    ({"calibrated_for": {**SMOL.to_dict(), "embedding_norms": ["a"]}}, "embedding_norms="),
    ({"calibrated_for": [1]}, "calibrated_for: [1] must be an object"),
    ({ALLOW_OTHER_MODEL: "yes"}, "allow_other_model='yes' must be true or false"),
])
def test_bad_records_and_opt_ins_are_one_line_config_errors(bad, expect):
    with pytest.raises(ConfigError) as e:
        DiffKVConfig.from_dict(bad)
    assert expect in str(e.value) and "\n" not in str(e.value)
