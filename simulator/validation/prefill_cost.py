"""What prefill steps cost a running server, read from its log alone (no model).

Between two Decode lines SGLang runs ``decode_log_interval`` decode steps plus the prefill
steps whose Prefill lines fall in between; the later line's ``gen throughput`` makes the
interval's wall time (``fit.py``'s module docstring). The intervals without a Prefill line give
the decode step's time as a line in the batch, a + b * B; an interval with k Prefill lines
takes k prefill steps beyond its decode steps, (wall - steps * (a + b * B)) / k each. One
number per run that needs no calibration, so runs on different servers, caches or hosts
compare directly; a one-token extend (a prompt the radix cache holds but its last token) is
mostly its eager launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_diffkv.serving_io.sglang_log import ServerLog, decode_intervals
from simulator.errors import SimulatorInputError

MIN_CLEAN = 8   # decode-only intervals needed to fit the decode step's line


@dataclass(frozen=True)
class PrefillCost:
    decode_a_ms: float          # decode step = a + b * batch
    decode_b_ms: float
    clean_intervals: int
    prefill_intervals: int
    per_prefill_median_ms: float
    per_prefill_mean_ms: float
    one_token_intervals: int    # intervals with one Prefill line of <= 2 new tokens
    one_token_median_ms: float  # nan when there are none


def prefill_cost(log: ServerLog, steps: int) -> PrefillCost:
    """The log's decode step line and what each prefill step adds (see the module docstring);
    ``steps``: the server's decode_log_interval."""
    if steps < 1:
        raise SimulatorInputError(f"decode_log_interval {steps} must be >= 1")
    rows = [(iv.batch, iv.wall_s, len(iv.prefills),
             sum(log.prefill_new_tokens[j] for j in iv.prefills))
            for iv in decode_intervals(log, steps)]
    a = np.array(rows, dtype=float).reshape(-1, 4)
    clean = a[a[:, 2] == 0]
    if len(clean) < MIN_CLEAN:
        raise SimulatorInputError(f"{log.path}: {len(clean)} decode-only intervals; the decode "
                                  f"step's line needs >= {MIN_CLEAN}")
    x = np.c_[np.ones(len(clean)), clean[:, 0]]
    (c0, c1), *_ = np.linalg.lstsq(x, clean[:, 1] / steps, rcond=None)
    pf = a[a[:, 2] > 0]
    extra = (pf[:, 1] - steps * (c0 + c1 * pf[:, 0])) / pf[:, 2]
    one = (pf[:, 2] == 1) & (pf[:, 3] <= 2)
    nan = float("nan")
    return PrefillCost(
        decode_a_ms=float(c0) * 1e3, decode_b_ms=float(c1) * 1e3, clean_intervals=len(clean),
        prefill_intervals=len(pf),
        per_prefill_median_ms=float(np.median(extra)) * 1e3 if len(pf) else nan,
        per_prefill_mean_ms=float(extra.mean()) * 1e3 if len(pf) else nan,
        one_token_intervals=int(one.sum()),
        one_token_median_ms=float(np.median(extra[one])) * 1e3 if one.any() else nan)
