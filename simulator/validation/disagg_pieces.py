"""The pieces of a disaggregated deployment beside measured runs that exercise them, on the
CPU: no SGLang P/D run exists (SGLang's P/D mode cannot serve the diffkv backend, and the GPU
machine has no transfer engine), so each piece is checked where a colocated run measures it.

- Prefill side: the runs on Azure-code lengths (long prompts, about 27 output tokens: the
  server spends its time prefilling; bf16 without a radix cache, H200, held out of every
  fit). Measured TTFT beside the colocated replay and beside the prefill replica of a 1:1
  deployment on an instant link (its TTFT up to the prompt's last prefill step, plus the
  client latency the calibration adds to every TTFT).
- Decode side, the same runs: measured TPOT beside the colocated replay and the decode
  replica (which never shares a step with a prefill: the gap is the interference the
  measurement contains and a P/D deployment removes).

    python -m simulator.validation.disagg_pieces [--data DIR] [--gpu h200]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.sglang_log import parse_server_log
from simulator.engine.disagg import simulate_disagg
from simulator.metrics.summary import per_request_arrays
from simulator.report.table import render
from simulator.specs.calibration_set import load_calibration_set
from simulator.specs.gpu import load_gpu
from simulator.specs.link import LinkSpec
from simulator.specs.model import load_model
from simulator.studies.scenario import Scenario
from simulator.validation.harness import load_harness, server_settings

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data" / "h200-2026-11-24" / "e2e-s20-azure-code"
# a link that takes no time: the prefill side's own TTFT, nothing of the wire
INSTANT = LinkSpec("instant", "instant (validation)", 1e30, 1.0, 0.0,
                   "no time on the wire: isolates the prefill side")


def compare(data: Path, gpu: str = "h200") -> list[dict[str, Any]]:
    """One row per open-loop run of the harness folder ``data``."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        res = load_harness(data, extract_to=tmp)
        calib = load_calibration_set(gpu)
        g = load_gpu(gpu)
        for run in res.runs:
            if not run.workload.startswith("ladder"):
                continue
            settings, fmt = server_settings(res.configs[run.config.split("#")[0]],
                                            parse_server_log(run.server_log))
            sc = Scenario(load_model("llama-3-8b"), g, calib, settings)
            trace, warm = run.replay_inputs(radix_cache=not settings.disable_radix_cache)
            srv = sc.server(fmt)
            colo = per_request_arrays(sc.run(trace, fmt, srv, warm))
            dis = simulate_disagg(trace, srv, 1, 1, INSTANT)
            arrs = per_request_arrays(dis)
            lat = srv.deployment.calibration.first_token_latency_s
            kv = dis.meta["kv"]
            prefill_ttft = np.array([kv[r.rid].prefill_end - r.arrival + lat
                                     for r in dis.requests if r.rejected is None])
            c = run.client
            rows.append({
                "run": run.key, "rate": run.rate_req_s,
                "ttft_measured": c["mean_ttft_ms"], "ttft_colocated": 1e3 * colo["ttft"].mean(),
                "ttft_prefill_replica": 1e3 * prefill_ttft.mean(),
                "ttft_median_measured": c["median_ttft_ms"],
                "ttft_median_colocated": 1e3 * float(np.median(colo["ttft"])),
                "ttft_median_prefill_replica": 1e3 * float(np.median(prefill_ttft)),
                "tpot_measured": c["mean_tpot_ms"],
                "tpot_colocated": 1e3 * float(np.nanmean(colo["tpot"])),
                "tpot_decode_replica": 1e3 * float(np.nanmean(arrs["tpot"])),
            })
    return rows


def _err(model: float, measured: float) -> str:
    return "-" if not measured or math.isnan(model) else f"{model / measured - 1:+.1%}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        out.append([r["run"], r["rate"], r["ttft_measured"], r["ttft_colocated"],
                    _err(r["ttft_colocated"], r["ttft_measured"]), r["ttft_prefill_replica"],
                    _err(r["ttft_prefill_replica"], r["ttft_measured"]),
                    r["ttft_median_measured"], r["ttft_median_prefill_replica"],
                    _err(r["ttft_median_prefill_replica"], r["ttft_median_measured"]),
                    r["tpot_measured"], r["tpot_colocated"],
                    _err(r["tpot_colocated"], r["tpot_measured"]), r["tpot_decode_replica"]])
    return render(["run", "req/s", "TTFT meas", "coloc", "err", "prefill repl", "err",
                   "TTFT p50 meas", "prefill repl", "err", "TPOT meas", "coloc", "err",
                   "decode repl"], out,
                  "mean (and median) TTFT and mean TPOT in ms: measured (SGLang, colocated), "
                  "the colocated replay, and the P/D replicas of a 1:1 deployment on an "
                  "instant link")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.validation.disagg_pieces",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA), help="a harness result folder (default: the "
                   "H200 Azure-code runs, %(default)s)")
    p.add_argument("--gpu", default="h200", help="the GPU the runs ran on (default: "
                   "%(default)s)")
    a = p.parse_args(argv)
    try:
        print(table(compare(Path(a.data), a.gpu)))
    except InputError as e:
        print(f"disagg_pieces: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
