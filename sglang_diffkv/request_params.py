"""Per-request DiffKV thresholds from a request's ``sampling_params.custom_params``.

A request may override the config's thresholds with ``diffkv_alpha_h`` / ``diffkv_alpha_l``.
The SGLang layer validates them when the request arrives (``thresholds_for_request``), so a
bad value fails that request alone, before any request slot or page is taken, with one line
naming the key, the value and what is allowed. Keys starting with ``diffkv_`` belong to
DiffKV: an unknown one (a typo such as ``diffkv_alpha_hh``) is an error, not silently
ignored. Other keys belong to other code and are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from sglang_diffkv.config import MAX_ALPHA, ConfigError, DiffKVConfig, checked_number
from sglang_diffkv.value_text import short_repr

ALPHA_H_PARAM = "diffkv_alpha_h"
ALPHA_L_PARAM = "diffkv_alpha_l"
PARAM_PREFIX = "diffkv_"
KNOWN_PARAMS = (ALPHA_H_PARAM, ALPHA_L_PARAM)


class RequestParamError(ValueError):
    """A request's DiffKV parameters cannot be accepted (the request fails, nothing else)."""


def thresholds_for_request(custom_params: object, config: DiffKVConfig) -> tuple[float, float]:
    """(alpha_h, alpha_l) for a request: the config's, overridden by the request's
    ``diffkv_alpha_h`` / ``diffkv_alpha_l``. ``custom_params`` is None or a dict (as
    SGLang's SamplingParams holds it); each value must be a real number (not a bool or a
    string) in [0, MAX_ALPHA] (the largest float32, what the kernels store), and
    alpha_l <= alpha_h after the overrides. Raises RequestParamError otherwise."""
    if custom_params is None:
        return config.alpha_h, config.alpha_l
    if not isinstance(custom_params, Mapping):
        raise RequestParamError(
            f"custom_params={short_repr(custom_params)} must be a JSON object (e.g. "
            f'{{"{ALPHA_H_PARAM}": 2.0}}), got {type(custom_params).__name__}')
    unknown = sorted(k for k in custom_params
                     if isinstance(k, str) and k.startswith(PARAM_PREFIX)
                     and k not in KNOWN_PARAMS)
    if unknown:
        raise RequestParamError(
            f"custom_params key {short_repr(unknown[0])} is not a DiffKV parameter; "
            f"allowed: {', '.join(KNOWN_PARAMS)}")
    alpha = {ALPHA_H_PARAM: config.alpha_h, ALPHA_L_PARAM: config.alpha_l}
    for key in KNOWN_PARAMS:
        if key in custom_params:
            try:
                alpha[key] = checked_number(f"custom_params {key}", custom_params[key], 0.0,
                                            MAX_ALPHA)
            except ConfigError as e:
                raise RequestParamError(str(e)) from None
    alpha_h, alpha_l = alpha[ALPHA_H_PARAM], alpha[ALPHA_L_PARAM]
    if alpha_l > alpha_h:
        source = " and ".join(f"{k}={alpha[k]!r}" for k in KNOWN_PARAMS)
        defaulted = [k for k in KNOWN_PARAMS if k not in custom_params]
        note = f" ({defaulted[0]} from config {config.name!r})" if defaulted else ""
        raise RequestParamError(
            f"custom_params {source}{note}: {ALPHA_L_PARAM} must not exceed {ALPHA_H_PARAM} "
            "(the pruning threshold is at most the demotion threshold)")
    return alpha_h, alpha_l
