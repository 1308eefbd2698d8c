import json

import pytest

from sglang_diffkv.config import (
    ENV_VAR,
    PRESETS,
    ConfigError,
    DiffKVConfig,
    TierConfig,
    preset,
)


def test_presets_carry_diffkv_thresholds():
    assert (preset("llama-3-8b").alpha_l, preset("llama-3-8b").alpha_h) == (0.02, 1.0)
    assert (preset("qwen2.5-7b").alpha_l, preset("qwen2.5-7b").alpha_h) == (0.04, 0.04)
    assert not preset("qwen2.5-7b").has_low_tier
    assert (preset("llama-3-70b").alpha_l, preset("llama-3-70b").alpha_h) == (0.0, 1.0)
    assert preset("qwen2.5-32b").alpha_h == 3.0 and preset("qwq-32b").alpha_h == 3.0
    assert preset("qwq-32b").high == TierConfig(8, 4, 1, 2)
    assert preset("qwq-32b").low == TierConfig(4, 2, 2, 4)
    assert {"default", "llama-3-8b", "qwen2.5-7b", "llama-3-70b", "qwen2.5-32b", "qwq-32b"} <= set(
        PRESETS
    )
    for name, cfg in PRESETS.items():
        assert cfg.name == name and cfg.window == 64 and cfg.score_queries == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"high": {"key_bits": 3, "value_bits": 4}}, "key_bits=3"),
        ({"low": {"key_bits": 4, "value_bits": 16}}, "value_bits=16"),
        ({"alpha_h": 0.1, "alpha_l": 0.2}, "alpha_l=0.2 > alpha_h=0.1"),
        ({"alpha_h": -1.0}, "alpha_h=-1.0"),
        ({"alpha_l": float("nan")}, "alpha_l=nan"),
        ({"window": -4}, "window=-4"),
        ({"score_queries": 0}, "score_queries=0"),
        ({"high": "K8V4", "low": "K8V8"}, "more precise"),
        ({"high": {"key_bits": 8, "value_bits": 4, "key_groups": 0}}, "key_groups=0"),
        ({"bogus": 1}, "unknown config field"),
        ({"preset": "llama-4"}, "unknown preset 'llama-4'"),
    ],
)
def test_validation_names_the_bad_field(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        DiffKVConfig.from_dict(kwargs)


def test_groups_must_divide_head_dim():
    cfg = DiffKVConfig.from_dict({"low": {"key_bits": 4, "value_bits": 2, "key_groups": 256}})
    with pytest.raises(ConfigError, match="low.key_groups=256 does not divide head_dim=128"):
        cfg.check_head_dim(128)
    cfg = DiffKVConfig.from_dict({"low": {"key_bits": 4, "value_bits": 2, "value_groups": 64}})
    with pytest.raises(ConfigError, match="low.value_groups=64 gives groups of 2 2-bit"):
        cfg.check_head_dim(128)
    preset("qwq-32b").check_head_dim(128)
    preset("qwq-32b").check_head_dim(64)


def test_tier_names_round_trip():
    assert TierConfig.parse("K4V2g24", "low") == TierConfig(4, 2, 2, 4)
    assert TierConfig.parse("k8v4", "high") == TierConfig(8, 4)
    assert TierConfig(4, 2, 2, 4).name == "K4V2g24"
    with pytest.raises(ConfigError, match="'Q8V4' is not a tier name"):
        TierConfig.parse("Q8V4", "high")


def test_from_dict_overrides_a_preset():
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_l": 0.05, "window": 32})
    assert cfg.alpha_l == 0.05 and cfg.alpha_h == 1.0 and cfg.window == 32
    assert cfg.high == preset("llama-3-8b").high
    assert DiffKVConfig.from_dict({"preset": "qwq-32b"}).name == "qwq-32b"
    assert DiffKVConfig.from_dict(preset("qwq-32b").to_dict()) == preset("qwq-32b")


def test_from_json_file_and_env(tmp_path):
    path = tmp_path / "diffkv.json"
    path.write_text(json.dumps({"preset": "qwen2.5-32b", "alpha_h": 2.0}))
    assert DiffKVConfig.from_json(path).alpha_h == 2.0
    assert DiffKVConfig.from_env({ENV_VAR: str(path)}).alpha_h == 2.0
    assert DiffKVConfig.from_env({ENV_VAR: "qwq-32b"}) == preset("qwq-32b")
    assert DiffKVConfig.from_env({ENV_VAR: '{"alpha_h": 0.5}'}).alpha_h == 0.5
    assert DiffKVConfig.from_env({}) == preset("default")
    with pytest.raises(ConfigError, match=f"{ENV_VAR}='nope'.*unknown preset"):
        DiffKVConfig.from_env({ENV_VAR: "nope"})
    bad = tmp_path / "bad.json"
    bad.write_text('{"alpha_h": 1.0,\n "alpha_l": }')
    with pytest.raises(ConfigError, match="line 2: invalid JSON"):
        DiffKVConfig.from_json(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        DiffKVConfig.from_json(tmp_path / "missing.json")
