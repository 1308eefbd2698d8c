"""Per-request thresholds (``custom_params``): every bad value the issue lists fails that
request alone with one line naming the key, the value and what is allowed; good ones reach
the cache and serve a request end to end."""

from __future__ import annotations

import pytest
from cache_paths import serve_one_request

from sglang_diffkv.config import MAX_ALPHA, preset
from sglang_diffkv.request_params import (
    ALPHA_H_PARAM,
    ALPHA_L_PARAM,
    RequestParamError,
    thresholds_for_request,
)

CONFIG = preset("llama-3-8b")  # alpha_h 1.0, alpha_l 0.02


@pytest.mark.parametrize("params, named, allowed", [
    ({ALPHA_H_PARAM: "abc"}, "diffkv_alpha_h='abc'", "a number in [0, 3.40282e+38]"),
    ({ALPHA_H_PARAM: None}, "diffkv_alpha_h=None", "a number in"),
    ({ALPHA_H_PARAM: [1.0]}, "diffkv_alpha_h=[1.0]", "a number in"),
    ({ALPHA_H_PARAM: {"x": 1}}, "diffkv_alpha_h={'x': 1}", "a number in"),
    ({ALPHA_H_PARAM: True}, "diffkv_alpha_h=True", "a number in"),
    ({ALPHA_H_PARAM: "2.0"}, "diffkv_alpha_h='2.0'", "a number in"),
    ({ALPHA_H_PARAM: 10**400}, "diffkv_alpha_h=<integer of about 401 digits>", "a number in"),
    ({ALPHA_H_PARAM: 1e39}, "diffkv_alpha_h=1e+39", "a number in [0, 3.40282e+38]"),
    ({ALPHA_H_PARAM: float("nan")}, "diffkv_alpha_h=nan", "a number in"),
    ({ALPHA_H_PARAM: float("inf")}, "diffkv_alpha_h=inf", "a number in"),
    ({ALPHA_L_PARAM: -0.5}, "diffkv_alpha_l=-0.5", "a number in"),
    ({ALPHA_H_PARAM: 0.5, ALPHA_L_PARAM: 0.7}, "diffkv_alpha_h=0.5 and diffkv_alpha_l=0.7",
     "must not exceed"),
    # the other threshold comes from the config: alpha_l 0.02 > the request's alpha_h 0.01
    ({ALPHA_H_PARAM: 0.01}, "diffkv_alpha_l=0.02 (diffkv_alpha_l from config 'llama-3-8b')",
     "must not exceed"),
    ({"diffkv_alpha_hh": 2.0}, "key 'diffkv_alpha_hh'", "allowed: diffkv_alpha_h, "
     "diffkv_alpha_l"),
    ({"diffkv_": 1}, "key 'diffkv_'", "allowed: diffkv_alpha_h"),
    ("abc", "custom_params='abc'", "must be a JSON object"),
    ([ALPHA_H_PARAM, 2.0], "custom_params=['diffkv_alpha_h', 2.0]", "must be a JSON object"),
    (3, "custom_params=3", "must be a JSON object"),
])
def test_bad_request_params_name_key_value_and_what_is_allowed(params, named, allowed):
    with pytest.raises(RequestParamError) as e:
        thresholds_for_request(params, CONFIG)
    msg = str(e.value)
    assert named in msg and allowed in msg and "\n" not in msg, msg
    assert isinstance(e.value, ValueError)  # (what SGLang turns into a failed request)


def test_good_request_params():
    assert thresholds_for_request(None, CONFIG) == (1.0, 0.02)
    assert thresholds_for_request({}, CONFIG) == (1.0, 0.02)
    # keys that do not start with diffkv_ belong to other code
    assert thresholds_for_request({"temperature_hint": "x", 5: None}, CONFIG) == (1.0, 0.02)
    assert thresholds_for_request({ALPHA_H_PARAM: 4}, CONFIG) == (4.0, 0.02)
    assert thresholds_for_request({ALPHA_L_PARAM: 1.0}, CONFIG) == (1.0, 1.0)
    got = thresholds_for_request({ALPHA_H_PARAM: MAX_ALPHA, ALPHA_L_PARAM: 10**20}, CONFIG)
    assert got == (MAX_ALPHA, 1e20) and all(type(x) is float for x in got)


@pytest.mark.parametrize("params", [
    {ALPHA_H_PARAM: MAX_ALPHA, ALPHA_L_PARAM: MAX_ALPHA},  # everything outside the window
    {ALPHA_H_PARAM: 10**20, ALPHA_L_PARAM: 0},            # ... demoted / nothing pruned
    {ALPHA_H_PARAM: 0.0, ALPHA_L_PARAM: 0.0},             # everything kept high
    {ALPHA_L_PARAM: 5e-324},                              # (a denormal: float32 0)
])
def test_accepted_params_serve_a_request_on_the_reference_cache(params):
    cfg = preset("qwq-32b").with_thresholds(2.0, 0.0)
    serve_one_request(cfg, 64, thresholds_for_request(params, cfg))
    serve_one_request(preset("bench-30-50-20"), 64, thresholds_for_request(params, cfg))
