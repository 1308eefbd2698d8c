"""Numeric settings the DiffKV backend reads from the environment, parsed with a ConfigError
that names the variable, its value and what is allowed (``SGLANG_DIFFKV_CONFIG`` itself is
read by ``DiffKVConfig.from_env``, the planning mix by ``capacity.planning_mix``)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from sglang_diffkv.config import ConfigError
from sglang_diffkv.value_text import short_repr

LOG_INTERVAL_ENV = "SGLANG_DIFFKV_LOG_INTERVAL"
DEFAULT_LOG_INTERVAL = 50  # forward steps between two DiffKV step log lines
MAX_LOG_INTERVAL = 2**31 - 1


def log_interval(environ: Mapping[str, str] | None = None) -> int:
    """Forward steps between DiffKV's step log lines (``SGLANG_DIFFKV_LOG_INTERVAL``; unset
    or empty: DEFAULT_LOG_INTERVAL; 0 turns the lines off)."""
    env = os.environ if environ is None else environ
    text = env.get(LOG_INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_LOG_INTERVAL
    if not re.fullmatch(r"[0-9]{1,10}", text, re.ASCII) or int(text) > MAX_LOG_INTERVAL:
        raise ConfigError(
            f"{LOG_INTERVAL_ENV}={short_repr(text)} is not allowed; expected a whole number "
            f"of forward steps in [0, {MAX_LOG_INTERVAL}] (0 turns the step log lines off; "
            f"default {DEFAULT_LOG_INTERVAL})")
    return int(text)
