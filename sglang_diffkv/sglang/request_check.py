"""Per-request DiffKV parameters, checked where SGLang checks a request's sampling parameters.

``verify_hook`` is an AFTER hook on ``SamplingParams.verify`` (``plugin.HOOKS``), which SGLang's
tokenizer manager calls for every request before it is sent to a scheduler: a bad
``diffkv_*`` value raises ``ValueError`` there, so that request alone fails with HTTP 400 and
one line naming the key, the value and what is allowed (``sglang_diffkv.request_params``). No
scheduler sees it, no slot or page is taken.

``thresholds_or_abort`` is the scheduler side's second line (a request that reached a scheduler
without the tokenizer manager's check): it aborts that request with the same message, never
raises, and gives it the config's thresholds for the one token an aborted request still runs.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.request_params import RequestParamError, thresholds_for_request
from sglang_diffkv.sglang.args import uses_diffkv

logger = logging.getLogger("sglang_diffkv")


@functools.lru_cache(maxsize=1)
def _config() -> DiffKVConfig:
    # the launching process validated SGLANG_DIFFKV_CONFIG at start-up (args.py); every
    # process reads the same environment
    return DiffKVConfig.from_env()


def _serving_diffkv() -> bool:
    from sglang.srt.server_args import get_global_server_args

    try:
        args = get_global_server_args()
    except Exception:  # noqa: BLE001 - no server in this process (a client, a test)
        return False
    return args is not None and uses_diffkv(args)


def verify_hook(result: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``SamplingParams.verify``: the request's DiffKV parameters, on a diffkv server."""
    if _serving_diffkv():
        thresholds_for_request(getattr(sampling_params, "custom_params", None), _config())


def thresholds_or_abort(req: Any, config: DiffKVConfig) -> tuple[float, float]:
    """(alpha_h, alpha_l) for ``req``; a request whose parameters are invalid is aborted
    (SGLang's ``Req.set_finish_with_abort``: it ends with a 400 and its message) and gets the
    config's thresholds."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        return thresholds_for_request(params, config)
    except RequestParamError as e:
        abort = getattr(req, "set_finish_with_abort", None)
        if abort is not None:
            abort(f"diffkv: {e}")
        else:
            logger.error("diffkv: request %s: %s", getattr(req, "rid", "?"), e)
        return config.alpha_h, config.alpha_l
