"""simulator/validation/prefill_cost.py: a prefill step's cost read from Decode intervals,
on a log written from known step times."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from simulator.validation.prefill_cost import prefill_cost

STEPS = 10


def _log(tmp_path, a_ms: float, b_ms: float, prefill_ms: float, one_token_ms: float,
         seed: int = 0):
    """A server log whose decode steps take a + b * B ms and whose prefill steps take
    prefill_ms (one_token_ms for a one-token extend); every third interval holds one or two
    prefills."""
    rng = np.random.default_rng(seed)
    lines = ["max_total_num_tokens=100000, max_running_requests=64"]
    batch = 8

    def decode_line(b: int, wall_s: float, mean_b: float) -> str:
        # gen throughput: the interval's decode tokens over its wall time
        return (f"[t] Decode batch, #running-req: {b}, #token: {b * 500}, token usage: 0.01, "
                f"cuda graph: True, gen throughput (token/s): {STEPS * mean_b / wall_s:.6f}, "
                "#queue-req: 0")

    lines.append(decode_line(batch, 0.1, batch))
    prev = batch
    for i in range(120):
        batch = int(rng.integers(4, 30))
        # an interval's batch: the mean of its two lines' #running-req, as the parser takes it
        wall = STEPS * (a_ms + b_ms * 0.5 * (prev + batch)) / 1e3
        if i % 3 == 2:
            for _ in range(int(rng.integers(1, 3))):
                one = rng.random() < 0.5
                new = 1 if one else 300
                lines.append(f"[t] Prefill batch, #new-seq: 1, #new-token: {new}, "
                             f"#cached-token: 700, token usage: 0.01, #running-req: {batch}, "
                             "#queue-req: 0")
                wall += (one_token_ms if one else prefill_ms) / 1e3
        lines.append(decode_line(batch, wall, 0.5 * (prev + batch)))
        prev = batch
    p = tmp_path / "server.log"
    p.write_text("\n".join(lines) + "\n")
    return parse_server_log(p)


def test_the_decode_line_and_the_prefill_steps_come_back(tmp_path):
    c = prefill_cost(_log(tmp_path, 5.0, 0.07, 18.0, 11.0), STEPS)
    assert c.decode_a_ms == pytest.approx(5.0, abs=1e-6)
    assert c.decode_b_ms == pytest.approx(0.07, abs=1e-6)
    assert c.one_token_median_ms == pytest.approx(11.0, abs=1e-6)
    assert 11.0 <= c.per_prefill_median_ms <= 18.0
    assert 11.0 < c.per_prefill_mean_ms < 18.0
    assert c.prefill_intervals == 40 and c.one_token_intervals > 0
    assert c.clean_intervals == 80


def test_too_few_clean_intervals_are_named(tmp_path):
    log = _log(tmp_path, 5.0, 0.07, 18.0, 11.0)
    log.decode_line_no = log.decode_line_no[:6]
    log.decode_running = log.decode_running[:6]
    log.decode_gen_throughput = log.decode_gen_throughput[:6]
    with pytest.raises(InputError, match="decode-only intervals"):
        prefill_cost(log, STEPS)
    with pytest.raises(InputError, match="decode_log_interval 0"):
        prefill_cost(log, 0)


def test_no_one_token_extend_gives_nan(tmp_path):
    log = _log(tmp_path, 5.0, 0.07, 18.0, 11.0)
    log.prefill_new_tokens = [300] * len(log.prefill_new_tokens)
    c = prefill_cost(log, STEPS)
    assert math.isnan(c.one_token_median_ms) and c.one_token_intervals == 0
