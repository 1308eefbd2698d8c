"""Full quality run behind docs/quality.md: calibrate -> evaluate -> report.

Stages (``--stages``, comma list, default all):
  calibrate  diffkv-eval calibrate's search (--tiers pairs x (alpha_h, alpha_l), pruning
             alone) on the calibration split; the most compressive point within tolerance
             becomes the preset (none: the frontier is printed and the run stops)
  run        teacher forcing on the eval split for the calibrated preset, the default preset,
             the DiffKV grid points (to draw DiffKV's own curve), the baselines and pruning at
             each DiffKV config's bytes; greedy agreement on GSM8K; needles
  report     markdown table + Pareto PNG

Everything lands in --out-dir; the chosen preset is also written to --preset.
Example (what docs/quality.md ran):
  python -m sglang_diffkv.eval.full_run --device cuda --out-dir results/quality
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from sglang_diffkv.eval import cli

log = logging.getLogger("full_run")

BASELINES = "uniform:K8V8,uniform:K8V4,uniform:K4V4,uniform:K4V2,kivi:2,kivi:2:residual=32"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out-dir", default="results/quality")
    p.add_argument("--preset", default="sglang_diffkv/presets/smollm2-135m.json")
    p.add_argument("--stages", default="calibrate,run,report")
    p.add_argument("--base", default="default",
                   help="preset whose window / score_queries are kept")
    p.add_argument("--tiers", default=None,
                   help="tier pairs searched (default: diffkv-eval calibrate's)")
    p.add_argument("--alpha-h", default="0.5,1,2,4,8,16")
    p.add_argument("--alpha-l", default="0,0.05,0.1,0.2,0.4,0.8")
    p.add_argument("--max-kl", default="0.035")
    p.add_argument("--min-top1", default="0.9")
    p.add_argument("--cal-windows", default="4")
    p.add_argument("--windows", default="8")
    p.add_argument("--prompt-len", default="1024")
    p.add_argument("--score-tokens", default="128")
    p.add_argument("--greedy-prompts", default="16")
    p.add_argument("--greedy-tokens", default="64")
    p.add_argument("--needle-lengths", default="1024,2048,4096,8192")
    p.add_argument("--needle-depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--threads", default="1")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(","))
    common = ["--model", args.model, "--device", args.device, "--threads", args.threads,
              "--prompt-len", args.prompt_len, "--score-tokens", args.score_tokens]
    t0 = time.perf_counter()

    if "calibrate" in stages:
        pre = out / "preset.json"
        rc = cli.main(["calibrate", *common, "--windows", args.cal_windows, "--base", args.base,
                       *(["--tiers", args.tiers] if args.tiers else []),
                       "--alpha-h", args.alpha_h, "--alpha-l", args.alpha_l,
                       "--max-kl", args.max_kl, "--min-top1", args.min_top1,
                       "--out", str(pre), "--name", Path(args.preset).stem,
                       "--results", str(out / "calibration.json")])
        if rc != 0:
            log.error("calibration exited %d; no preset written", rc)
            return rc
        dst = Path(args.preset)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pre, dst)
        shutil.copy(pre.with_name(pre.stem + ".provenance.json"),
                    dst.with_name(dst.stem + ".provenance.json"))
        log.info("calibrated preset %s", dst)

    if "run" in stages:
        grid_specs = []
        f = out / "calibration.json"
        if f.is_file():  # the search's points, one preset file per tier pair
            for g in json.loads(f.read_text())["grid"]:
                tiers = out / f"tiers-{g['high']}-{g['low']}.json"
                if not tiers.is_file():
                    tiers.write_text(json.dumps({"preset": args.base, "high": g["high"],
                                                 "low": g["low"]}) + "\n")
                grid_specs.append(f"diffkv:{tiers}@{g['alpha_h']:g}/{g['alpha_l']:g}")
        main_cfgs = f"diffkv:default,diffkv:{args.preset}"
        configs = ",".join([BASELINES, main_cfgs, *grid_specs, "prune:match"])
        rc = cli.main(["run", *common, "--windows", args.windows, "--configs", configs,
                       "--greedy-prompts", args.greedy_prompts,
                       "--greedy-tokens", args.greedy_tokens,
                       "--needle-lengths", args.needle_lengths,
                       "--needle-depths", args.needle_depths,
                       "--needle-configs", _needle_configs(args.preset),
                       "--out", str(out / "quality.json")])
        if rc != 0:
            return rc

    if "report" in stages:
        name = f"diffkv-{Path(args.preset).stem}"
        cal = out / "calibration.json"
        rp = ["report", str(out / "quality.json"), "--png", str(out / "pareto.png"),
              "--mark", f"diffkv-default,{name}"]
        if cal.is_file():
            rp += ["--calibration", str(cal)]
        table = out / "table.md"
        stdout = sys.stdout
        with table.open("w") as fh:
            sys.stdout = fh
            try:
                cli.main(rp)
            finally:
                sys.stdout = stdout
        print(table.read_text())
    log.info("done in %.0fs", time.perf_counter() - t0)
    return 0


def _needle_configs(preset: str) -> str:
    name = f"diffkv-{Path(preset).stem}"
    return ",".join(["uniform-K8V4", "uniform-K4V4", "kivi-2bit", "kivi-2bit-r32g32",
                     "diffkv-default", name, f"prune-as-{name}"])


if __name__ == "__main__":
    sys.exit(main())
