#!/usr/bin/env python3
"""What a prefill step costs each open-loop run of scripts/bench_e2e.py result folders, from
the server's log alone (simulator/validation/prefill_cost.py): the decode step as a line in
the batch, each prefill step's time beyond the decode steps around it, and a one-token
extend's. CPU only.

    python scripts/log_prefill_cost.py docs/data/h200-2026-11-24/e2e-s23-azure-conv-fp8-r4#v4 \\
        docs/data/h200-2026-11-24/e2e-s23-azure-conv-bf16-r4#v4

A folder is given as validate_simulator.py takes it (DIR#TAG); its packed logs are unpacked
under --scratch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from validate_simulator import results_arg, scratch_name, slice_log  # noqa: E402

from simulator.errors import SimulatorInputError  # noqa: E402
from simulator.validation.harness import load_harness  # noqa: E402
from simulator.validation.prefill_cost import prefill_cost  # noqa: E402
from simulator.validation.step_fit import decode_log_interval  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_e2e.py --out folders, DIR[#TAG]")
    ap.add_argument("--scratch", default="/tmp/log-prefill-cost",
                    help="where packed logs are unpacked (default: %(default)s)")
    a = ap.parse_args(argv)
    head = (f"{'run':34} {'decode ms':>16} {'clean':>5} {'prefill ms med/mean':>20} "
            f"{'n':>4} {'1-token ms':>10} {'n':>4}")
    print(head)
    print("-" * len(head))
    try:
        for arg in a.results:
            d, tag, rename = results_arg(arg)
            h = load_harness(d, Path(a.scratch) / scratch_name(d), tag=tag, rename=rename)
            for run in h.runs:
                if run.rate_req_s is None:     # a burst: its prefills come back to back
                    continue
                log = slice_log(run, run.server_log or h.server_logs[run.config])
                c = prefill_cost(log, decode_log_interval(log))
                print(f"{run.key:34} {c.decode_a_ms:6.2f} + {c.decode_b_ms:.3f}*B "
                      f"{c.clean_intervals:5d} {c.per_prefill_median_ms:9.1f} / "
                      f"{c.per_prefill_mean_ms:8.1f} {c.prefill_intervals:4d} "
                      f"{c.one_token_median_ms:10.1f} {c.one_token_intervals:4d}")
    except SimulatorInputError as e:
        print(f"log_prefill_cost: error: {e}", file=sys.stderr)
        return 2
    print("decode ms: a decode step, from the intervals without a Prefill line; prefill ms: "
          "what an interval takes beyond its decode steps, per Prefill line in it; 1-token: "
          "intervals with one Prefill line of <= 2 new tokens (a prompt the radix cache held)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
