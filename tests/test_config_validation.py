"""Every bad DiffKV config the issue lists (dict, inline JSON, file, environment) is one
ConfigError line naming the field and what is allowed; values at the bounds are accepted and
normalised; the numeric environment settings name their variable."""

from __future__ import annotations

import pytest
import torch
from cache_paths import serve_one_request

from sglang_diffkv.capacity import PLANNING_MIX_ENV, CapacityPlan, planning_mix
from sglang_diffkv.config import (
    ENV_VAR,
    MAX_ALPHA,
    MAX_GROUPS,
    MAX_SCORE_QUERIES,
    MAX_WINDOW,
    ConfigError,
    DiffKVConfig,
    TierConfig,
    preset,
)
from sglang_diffkv.env_settings import DEFAULT_LOG_INTERVAL, LOG_INTERVAL_ENV, log_interval
from sglang_diffkv.value_text import short_repr


def one_line_error(call, *args) -> str:
    with pytest.raises(ConfigError) as e:
        call(*args)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


@pytest.mark.parametrize("data, field, allowed", [
    ({"preset": None}, "preset=None", "available"),
    ({"preset": ["default"]}, "preset=['default']", "available"),
    ({"high": {"key_bits": 8}}, "high: missing field(s) value_bits", "required"),
    ({"high": "K²V4"}, "high: 'K²V4' is not a tier name", "K8V4"),
    ({"high": "K" + "9" * 5000 + "V4"}, "high:", "K8V4"),
    ({1: 2, "x": 3}, "unknown config field(s) [1, 'x']", "allowed: preset"),
    ({"window": 10**20}, "window=100000000000000000000", f"[1, {MAX_WINDOW}]"),
    ({"window": 10**5000}, "window=<integer of about 5001 digits>", f"[1, {MAX_WINDOW}]"),
    ({"window": 64.0}, "window=64.0 is not an integer", "integer"),
    ({"window": True}, "window=True is not an integer", "integer"),
    ({"score_queries": MAX_SCORE_QUERIES + 1}, "score_queries=257",
     f"[1, {MAX_SCORE_QUERIES}]"),
    ({"alpha_h": 10**20 * 10**20}, "alpha_h=", "[0, 3.40282e+38]"),
    ({"alpha_h": 1e300}, "alpha_h=1e+300", "[0, 3.40282e+38]"),
    ({"alpha_h": 10**400}, "alpha_h=<integer of about 401 digits>", "[0, 3.40282e+38]"),
    ({"alpha_h": float("inf")}, "alpha_h=inf", "[0, 3.40282e+38]"),
    ({"alpha_h": "2"}, "alpha_h='2' is not a number", "number"),
    ({"alpha_h": None}, "alpha_h=None is not a number", "number"),
    ({"alpha_h": 0.5, "alpha_l": 0.7}, "alpha_l=0.7 > alpha_h=0.5", "alpha_l <= alpha_h"),
    ({"high": {"key_bits": True, "value_bits": True}}, "high: key_bits=True", "(1, 2, 4, 8)"),
    ({"high": {"key_bits": 8, "value_bits": 4, "key_groups": 3}}, "high: key_groups=3",
     "power of two"),
    ({"high": {"key_bits": 8, "value_bits": 4, "value_groups": 2 * MAX_GROUPS}},
     f"high: value_groups={2 * MAX_GROUPS}", f"[1, {MAX_GROUPS}]"),
    ({"high": {"key_bits": 8, "value_bits": 4, "key_groups": 2.0}}, "high: key_groups=2.0",
     "integer"),
    ({"low": "K4V1"}, "low.value_bits=1", "(2, 4, 8)"),
    ({"high": "K8V8", "low": {"key_bits": 1, "value_bits": 2}}, "low.key_bits=1", "(2, 4, 8)"),
    ({"high": 8}, "high=8", "K8V4"),
    ({"name": None}, "name=None", "string"),
    ({"name": ["a"]}, "name=['a']", "string"),
    ({"name": {"a": 1}}, "name={'a': 1}", "string"),
    ({"name": ""}, "name=''", "string"),
    ({"name": "two\nlines"}, r"name='two\nlines'", "one-line"),
    ({"bench_mix": [10**400, 0, 0]}, "bench_mix high=<integer of about 401 digits>", "[0, 1]"),
    ({"bench_mix": [0.5, float("nan"), 0.5]}, "bench_mix low=nan", "[0, 1]"),
    ({"bench_mix": [0.5, "0.5", 0]}, "bench_mix low='0.5' is not a number", "[0, 1]"),
    ({"bench_mix": "0.3,0.5,0.2"}, "bench_mix='0.3,0.5,0.2'", "three fractions"),
])
def test_bad_dict_fields_are_named_with_what_is_allowed(data, field, allowed):
    msg = one_line_error(DiffKVConfig.from_dict, data)
    assert field in msg and allowed in msg, msg


def test_values_at_the_bounds_are_accepted_and_normalised():
    cfg = DiffKVConfig.from_dict({"alpha_h": MAX_ALPHA, "alpha_l": 10**20, "window": MAX_WINDOW,
                                  "score_queries": MAX_SCORE_QUERIES, "bench_mix": [1, 0, 0],
                                  "high": {"key_bits": 8, "value_bits": 8,
                                           "key_groups": MAX_GROUPS}})
    assert cfg.alpha_h == MAX_ALPHA and isinstance(cfg.alpha_l, float) and cfg.alpha_l == 1e20
    assert cfg.bench_mix == (1.0, 0.0, 0.0)
    assert DiffKVConfig.from_dict(cfg.to_dict()) == cfg
    # the bound is float32's largest value, what the thresholds' tensors hold
    assert MAX_ALPHA == torch.finfo(torch.float32).max
    assert torch.tensor([MAX_ALPHA], dtype=torch.float32).isfinite().all()
    # a threshold given as a huge int reaches the cache as a float (torch.full overflowed
    # at the first prefill), and serves
    big = DiffKVConfig.from_dict({"alpha_h": 10**20})
    assert isinstance(big.alpha_h, float)
    serve_one_request(big, 64)
    serve_one_request(cfg.with_thresholds(MAX_ALPHA, 0.0), MAX_GROUPS)  # head_dim 256


def test_json_text_file_and_env_errors_are_config_errors(tmp_path, monkeypatch):
    deep = '{"bench_mix": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert "nested too deeply" in one_line_error(DiffKVConfig.from_spec, deep)
    big = '{"window": ' + "9" * 5000 + "}"
    assert "invalid JSON" in one_line_error(DiffKVConfig.from_spec, big)
    assert "line 1: invalid JSON" in one_line_error(DiffKVConfig.from_spec, "{oops")
    assert "must be a string" in one_line_error(DiffKVConfig.from_spec, None)
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{\n"name": "caf\xe9"}')
    msg = one_line_error(DiffKVConfig.from_json, bad)
    assert f"{bad}: line 2: not UTF-8" in msg and "0xe9" in msg
    nul = one_line_error(DiffKVConfig.from_json, str(tmp_path / "a\0.json"))
    assert "cannot read DiffKV config file" in nul
    deep_file = tmp_path / "deep.json"
    deep_file.write_text(deep)
    assert f"{deep_file}: JSON nested too deeply" in one_line_error(
        DiffKVConfig.from_json, deep_file)
    env = {ENV_VAR: '{"window": 100000000000000000000}'}
    msg = one_line_error(DiffKVConfig.from_env, env)
    assert msg.startswith(f"{ENV_VAR}=") and "window=100000000000000000000" in msg
    monkeypatch.setenv(ENV_VAR, '{"preset": null}')
    assert "preset=None" in one_line_error(DiffKVConfig.from_env)


def test_tier_parse_accepts_the_documented_forms():
    assert TierConfig.parse(" k4v2G24 ", "low") == TierConfig(4, 2, 2, 4)
    assert TierConfig.parse({"key_bits": 8, "value_bits": 4}, "high") == TierConfig(8, 4)
    for text in ("K8V4g2", "K8V4g123", "K-8V4", "K8V4V4", "K８V4"):  # (a full-width 8)
        assert "is not a tier name" in one_line_error(TierConfig.parse, text, "high")


def test_planning_mix_environment_is_checked():
    cfg = preset("llama-3-8b")
    for text in ("nan,0.5", "0.5,nan", "inf,0", "0,0.5", "0.7,0.7", "0.5", "a,b"):
        msg = one_line_error(planning_mix, cfg, {PLANNING_MIX_ENV: text})
        assert msg.startswith(f"{PLANNING_MIX_ENV}='{text}'"), msg
    assert planning_mix(cfg, {PLANNING_MIX_ENV: "0.25,0.5"}) == (0.25, 0.5)


def test_a_mix_that_keeps_almost_nothing_cannot_size_a_pool():
    """A high fraction near 0 would give more logical slots than SGLang's int32 indices."""
    cfg = DiffKVConfig.from_dict({"preset": "llama-3-8b", "bench_mix": [5e-324, 0, 1]})
    plan = CapacityPlan.build(cfg, 128, 32, 8)
    msg = one_line_error(plan.size_pool, 10**6, 64, 8192)
    assert "bench_mix" in msg and "2147483647" in msg
    ok = CapacityPlan.build(preset("bench-30-50-20"), 128, 32, 8).size_pool(10**6, 64, 8192)
    assert 0 < ok.logical_slots < 2**31


def test_log_interval_names_the_variable():
    assert log_interval({}) == DEFAULT_LOG_INTERVAL
    assert log_interval({LOG_INTERVAL_ENV: " 0 "}) == 0
    assert log_interval({LOG_INTERVAL_ENV: "200"}) == 200
    for text in ("abc", "-1", "1.5", "1e3", "99999999999", "٣"):
        msg = one_line_error(log_interval, {LOG_INTERVAL_ENV: text})
        assert msg.startswith(f"{LOG_INTERVAL_ENV}={text!r}") and "[0, " in msg, msg


def test_short_repr_never_raises_and_stays_short():
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    for value in (nested, 10**5000, -(10**5000), "x" * 10**6, b"\xff" * 1000, {"a": "b\n"}):
        text = short_repr(value)
        assert len(text) <= 80 and "\n" not in text
    assert short_repr(12) == "12" and short_repr("K8V4") == "'K8V4'"
