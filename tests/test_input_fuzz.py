"""Fuzzed DiffKV configs and per-request parameters: each is either refused with one
ConfigError / RequestParamError line naming the field, or accepted by the whole CPU path
(JSON round trip, capacity planning, the simulator's DiffKV pool and a request served by
the reference cache). Example counts come from the hypothesis profile (tests/conftest.py:
"ci", or HYPOTHESIS_PROFILE=stress for 10x)."""

from __future__ import annotations

import json

from cache_paths import plan_pool, serve_one_request
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sglang_diffkv.config import (
    CONFIG_FIELDS,
    MAX_ALPHA,
    MAX_SCORE_QUERIES,
    MAX_WINDOW,
    PRESETS,
    SUPPORTED_HEAD_DIMS,
    ConfigError,
    DiffKVConfig,
)
from sglang_diffkv.request_params import (
    ALPHA_H_PARAM,
    ALPHA_L_PARAM,
    RequestParamError,
    thresholds_for_request,
)
from simulator.kv.formats import make_format
from simulator.kv.mix import TierMix

# values no field takes, and values just past the bounds
JUNK = st.one_of(
    st.none(), st.booleans(), st.text(max_size=6), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(min_value=-(10**30), max_value=10**30), st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
)
ALPHAS = st.one_of(
    st.floats(0, 64), st.floats(0, MAX_ALPHA), st.integers(0, 10**40),
    st.sampled_from([0, 0.0, MAX_ALPHA, 5e-324, 1e39, -1e-9, 2**128]), JUNK,
)
BITS = st.one_of(st.sampled_from([1, 2, 4, 8, 3, 0, 16]), JUNK)
GROUPS = st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256, 3, 0, 512]), JUNK)
TIER_NAMES = ["K8V4", "K4V2", "K8V8", "K2V2", "K4V4", "K4V2g24", "K8V4g12", "K2V2g11", "k8v4G22",
              "K1V1", "K3V4", "K8V4g99", "K8V4g3", "x"]
TIERS = st.one_of(
    st.sampled_from(TIER_NAMES),
    st.fixed_dictionaries({"key_bits": BITS, "value_bits": BITS},
                          optional={"key_groups": GROUPS, "value_groups": GROUPS}),
    st.dictionaries(st.sampled_from(["key_bits", "value_bits", "groups"]), BITS, max_size=2),
    JUNK,
)


@st.composite
def bench_mixes(draw):
    high = draw(st.floats(0, 1))
    low = draw(st.floats(0, 1 - high))
    return draw(st.sampled_from([[high, low, 1 - high - low], (high, low, 1 - high - low),
                                 [high, low], [high, "x", 0]]))


RECORDS = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["m", "SmolLM2"]), JUNK),
         "architecture": st.one_of(st.sampled_from(["llama", "qwen2"]), JUNK),
         "num_layers": st.one_of(st.integers(1, 80), JUNK),
         "num_q_heads": st.integers(-1, 64), "num_kv_heads": st.integers(1, 8),
         "head_dim": st.sampled_from([64, 128, 0])},
        optional={"embedding_norms": st.one_of(st.lists(st.floats(0, 10), max_size=8), JUNK),
                  "layers": JUNK}),
    JUNK,
)
FIELDS = {
    "preset": st.one_of(st.sampled_from([*PRESETS, "nope"]), JUNK),
    "name": st.one_of(st.text(max_size=8), JUNK),
    "high": TIERS,
    "low": TIERS,
    "alpha_h": ALPHAS,
    "alpha_l": ALPHAS,
    "window": st.one_of(st.integers(1, 96), st.integers(-2, MAX_WINDOW + 2),
                        st.sampled_from([MAX_WINDOW, 10**20]), JUNK),
    "score_queries": st.one_of(st.integers(-1, MAX_SCORE_QUERIES + 2), JUNK),
    "bench_mix": st.one_of(st.none(), bench_mixes(), JUNK),
    "calibrated_for": RECORDS,
    "allow_other_model": st.one_of(st.booleans(), JUNK),
}
assert set(FIELDS) == set(CONFIG_FIELDS)
VALID_FIELDS = {
    "preset": st.sampled_from(list(PRESETS)),
    "high": st.sampled_from(["K8V4", "K8V8", "K4V4", "K8V4g12", "K4V4g22"]),
    "low": st.sampled_from(["K4V2", "K2V2", "K4V2g24", "K2V2g11"]),
    "alpha_h": st.one_of(st.floats(0, 64), st.sampled_from([MAX_ALPHA, 10**20])),
    "alpha_l": st.floats(0, 0.5),
    "window": st.one_of(st.integers(1, 96), st.sampled_from([MAX_WINDOW])),
    "score_queries": st.integers(1, MAX_SCORE_QUERIES),
    "bench_mix": bench_mixes(),
    "calibrated_for": st.sampled_from([None, {"name": "m", "architecture": "llama",
                                              "num_layers": 2, "num_q_heads": 4,
                                              "num_kv_heads": 2, "head_dim": 64,
                                              "embedding_norms": [1.0, 2.5]}]),
    "allow_other_model": st.booleans(),
}
CONFIGS = st.one_of(
    st.fixed_dictionaries({}, optional=VALID_FIELDS),
    st.fixed_dictionaries({}, optional=FIELDS),
    # an unknown key, or one that is not a string, beside known ones
    st.builds(lambda known, key, value: {**known, key: value},
              st.fixed_dictionaries({}, optional=FIELDS), st.sampled_from(["windows", "alpha", 7]),
              JUNK),
)
DIFFKV_MIX = TierMix.parse("0.3,0.5,0.2", 0.0, 0.0)


def assert_names_a_field(msg: str, given: object) -> None:
    assert "\n" not in msg and len(msg) < 400, msg
    names = [str(k) for k in given] if isinstance(given, dict) else []
    assert any(n in msg for n in names), f"{msg!r} names none of {names}"


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=CONFIGS, head_dim=st.sampled_from(SUPPORTED_HEAD_DIMS))
def test_fuzzed_configs_are_refused_by_name_or_work_end_to_end(data, head_dim):
    try:
        cfg = DiffKVConfig.from_dict(data)
    except ConfigError as e:
        assert_names_a_field(str(e), data)
        event("refused")
        return
    # accepted: the same config again from its dict and from JSON (file / env / inline form)
    assert DiffKVConfig.from_dict(cfg.to_dict()) == cfg
    assert DiffKVConfig.from_spec(json.dumps(cfg.to_dict())) == cfg
    try:
        cfg.check_head_dim(head_dim)  # model-dependent: refused at start-up, by tier
    except ConfigError as e:
        assert any(f"{t}." in str(e) for t in ("high", "low")), str(e)
        event("refused for this head_dim")
        return
    try:
        plan_pool(cfg, head_dim)
    except ConfigError as e:  # a mix keeping almost nothing cannot be indexed by SGLang
        assert "bench_mix" in str(e) and cfg.bench_mix is not None and cfg.bench_mix[0] < 1e-3
        event("refused by the pool size")
        return
    make_format("diffkv", head_dim, cfg, DIFFKV_MIX)  # the simulator's pool takes it too
    serve_one_request(cfg, head_dim)
    event("served")


REQUEST_KEYS = st.one_of(
    st.sampled_from([ALPHA_H_PARAM, ALPHA_L_PARAM, "diffkv_alpha_hh", "diffkv_", "DIFFKV_ALPHA_H",
                     "temperature", "x"]),
    st.text(max_size=8), st.integers(),
)
REQUEST_PARAMS = st.one_of(
    st.dictionaries(REQUEST_KEYS, ALPHAS, max_size=3),
    st.fixed_dictionaries({}, optional={ALPHA_H_PARAM: ALPHAS, ALPHA_L_PARAM: ALPHAS}),
    JUNK,
)
REQUEST_CONFIGS = ["default", "llama-3-8b", "qwen2.5-7b", "no-compression", "bench-30-50-20"]


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(params=REQUEST_PARAMS, config=st.sampled_from(REQUEST_CONFIGS))
def test_fuzzed_request_params_are_refused_by_name_or_serve_a_request(params, config):
    cfg = PRESETS[config]
    try:
        alpha = thresholds_for_request(params, cfg)
    except RequestParamError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 400 and msg.startswith("custom_params"), msg
        if isinstance(params, dict):
            diffkv_keys = [k for k in params if isinstance(k, str) and k.startswith("diffkv_")]
            assert any(k in msg for k in diffkv_keys), f"{msg!r} names none of {diffkv_keys}"
        event("refused")
        return
    assert 0.0 <= alpha[1] <= alpha[0] <= MAX_ALPHA
    serve_one_request(cfg, 64, alpha)
    event("served")
