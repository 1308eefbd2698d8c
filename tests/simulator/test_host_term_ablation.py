"""simulator/validation/ablation.py: each host-side term removed from a shipped calibration
leaves the others as they are; terms at zero are not scored; the table's counts and largest
error change come from the rows."""

from __future__ import annotations

from simulator.specs.calibration_set import load_calibration_set
from simulator.validation.ablation import (
    HOST_TERMS,
    _largest_change,
    _passes,
    ablation_table,
    is_used,
)
from simulator.validation.harness import row


def test_each_term_removed_alone_and_zero_terms_are_not_scored():
    h200 = load_calibration_set("h200").by_backend
    diffkv = h200["diffkv"]
    no_turnaround = HOST_TERMS["eager_prefill_turnaround_s"](diffkv)
    assert no_turnaround.prefill_turnaround_s("diffkv") == 0.0
    assert no_turnaround.prefill_launch_s("diffkv") == diffkv.prefill_launch_s("diffkv") > 0
    no_launch = HOST_TERMS["eager_prefill_launch_s"](diffkv)
    assert no_launch.prefill_launch_s("fp8") == 0.0 and not no_launch.eager_launch_holds_loop
    no_per_req = HOST_TERMS["eager_decode_host_per_req_s"](diffkv)
    assert no_per_req.decode_host_per_req_s("diffkv") == 0.0
    assert no_per_req.decode_host_s("diffkv") == diffkv.decode_host_s("diffkv") > 0
    # the H200 files hold no released-request cost; the H100 files no eager host times
    assert not is_used("release_overhead_s", h200)
    assert is_used("first_token_latency_s", h200)
    h100 = load_calibration_set("h100").by_backend
    assert not is_used("eager_prefill_turnaround_s", h100)
    assert is_used("first_token_latency_s", h100)


def test_counts_and_the_largest_change_come_from_the_rows():
    base = [row("TPOT mean (ms)", "a", 10.0, 10.2, 0.05), row("TTFT mean (ms)", "b", 20, 21, 0.1),
            row("peak running batch", "a", 100, 150, None)]
    other = [row("TPOT mean (ms)", "a", 10.0, 11.0, 0.05), row("TTFT mean (ms)", "b", 20, 21, 0.1),
             row("peak running batch", "a", 100, 300, None)]
    assert _passes(base) == (2, 2) and _passes(other) == (1, 2)
    c = _largest_change(base, other)
    # rows without a target do not count, however far they move
    assert (c["metric"], c["run"]) == ("TPOT mean (ms)", "a")
    assert abs(c["with"] - 0.02) < 1e-9 and abs(c["without"] - 0.10) < 1e-9
    text = ablation_table([{"term": "x", "rows": (1, 2), "repeats": (0, 0),
                            "held_out_rows": (1, 1), "largest_change": c}])
    assert "| x | 1 / 2 | 0 / 0 | 1 / 1 | TPOT mean (ms), a: +2.0% -> +10.0% |" in text
