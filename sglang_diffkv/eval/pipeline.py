"""The evaluations of ``diffkv-eval run``: teacher forcing, greedy agreement, needles.

Each takes a loaded model and parsed configs and returns plain dicts (JSON-ready). Pruning
baselines given as ``prune:match`` get the byte budget each DiffKV config actually used in
the same evaluation (a second pass after the DiffKV configs ran).
"""

from __future__ import annotations

import logging
import time

import torch

from sglang_diffkv.eval import configs as cfgs
from sglang_diffkv.eval.configs import EvalConfig
from sglang_diffkv.eval.metrics import greedy_agreement, per_layer_head, summarise
from sglang_diffkv.eval.model import LoadedModel
from sglang_diffkv.eval.needle import build_cases, passed
from sglang_diffkv.eval.runner import greedy, teacher_force

log = logging.getLogger(__name__)


def matched_pruning(configs: list[EvalConfig], quality: dict[str, dict]) -> list[EvalConfig]:
    """One pruning-only config per DiffKV config (grid points, named with '@', excluded),
    at the bytes/token DiffKV used."""
    out = []
    for c in configs:
        if c.kind == "diffkv" and c.name in quality and "@" not in c.name:
            b = quality[c.name]["summary"]["bytes_per_token"]
            out.append(
                EvalConfig(f"prune-as-{c.name}", "prune", budget_bytes=b, params={"match": c.name})
            )
    return out


def teacher_forcing(
    lm: LoadedModel, configs: list[EvalConfig], windows: torch.Tensor, prompt_len: int
) -> dict[str, dict]:
    """windows [W, P + T + 1]; returns {config name: {summary, layer_head_fractions}}."""
    plan = cfgs.build(configs, lm.shape, windows.shape[0])
    t0 = time.perf_counter()
    scores = teacher_force(lm.model, plan.backends, windows, prompt_len)
    out = {}
    for name, (bi, rows) in plan.rows.items():
        s = summarise(scores[bi], torch.tensor(rows), name)
        out[name] = {"summary": s.to_dict(), "layer_head_fractions": per_layer_head(
            scores[bi], torch.tensor(rows))}
        log.info(
            "%-28s KL mean %.4f p99 %.3f top1 %.3f ppl %.3f (ref %.3f) %.1f B/token (%.1f%% "
            "of bf16) high/low/pruned %.2f/%.2f/%.2f",
            name, s.kl_mean, s.kl_p99, s.top1, s.ppl, s.ref_ppl, s.bytes_per_token,
            100 * s.ratio_vs_bf16, s.high, s.low, s.pruned,
        )
    log.info("teacher forcing of %d configs took %.0fs", len(configs), time.perf_counter() - t0)
    return out


def greedy_agreement_eval(
    lm: LoadedModel, configs: list[EvalConfig], prompts: list[torch.Tensor], new_tokens: int
) -> dict[str, dict]:
    """Greedy continuations vs the bf16 cache's, one prompt at a time (no padding)."""
    ref_cfg = cfgs.parse("bf16")
    all_cfgs = [ref_cfg] + [c for c in configs if c.name != "bf16"]
    got: dict[str, list[torch.Tensor]] = {c.name: [] for c in all_cfgs}
    mem: dict[str, list[float]] = {c.name: [] for c in all_cfgs}
    for i, p in enumerate(prompts):
        plan = cfgs.build(all_cfgs, lm.shape, 1)
        toks, mems = greedy(lm.model, plan.backends, p[None], new_tokens)
        for name, (bi, rows) in plan.rows.items():
            got[name].append(toks[bi][rows])
            mem[name].append(float(mems[bi].bytes_per_token[rows].mean()))
        log.info("greedy prompt %d/%d (%d tokens) done", i + 1, len(prompts), p.shape[0])
    ref = torch.cat(got[ref_cfg.name])
    out = {}
    for c in all_cfgs:
        g = greedy_agreement(c.name, torch.cat(got[c.name]), ref)
        out[c.name] = {**g.__dict__, "bytes_per_token": sum(mem[c.name]) / len(mem[c.name])}
        log.info(
            "%-28s greedy exact-match %.2f, first divergence mean %.1f (min %d) of %d",
            c.name, g.exact_match, g.first_divergence_mean, g.first_divergence_min, new_tokens,
        )
    return out


def needles(
    lm: LoadedModel,
    configs: list[EvalConfig],
    filler: torch.Tensor,
    lengths: list[int],
    depths: list[float],
    answer_tokens: int = 8,
) -> dict[str, dict]:
    """Pass rate per config over lengths x depths; bf16 (uncompressed) always included."""
    all_cfgs = [cfgs.parse("bf16")] + [c for c in configs if c.name != "bf16"]
    cases = build_cases(lm.tokenizer, filler, lengths, depths)
    res: dict[str, list[dict]] = {c.name: [] for c in all_cfgs}
    mem: dict[str, list[float]] = {c.name: [] for c in all_cfgs}
    for length in lengths:
        batch = [c for c in cases if c.length == length]
        ids = torch.stack([c.ids for c in batch])
        t0 = time.perf_counter()
        plan = cfgs.build(all_cfgs, lm.shape, len(batch))
        toks, mems = greedy(lm.model, plan.backends, ids, answer_tokens)
        for name, (bi, rows) in plan.rows.items():
            for case, r in zip(batch, rows, strict=True):
                ans = toks[bi][r]
                res[name].append({
                    "length": length, "depth": case.depth, "key": case.key,
                    "answer": lm.tokenizer.decode(ans.tolist()),
                    "passed": passed(lm.tokenizer, case, ans),
                })
            mem[name].append(float(mems[bi].bytes_per_token[rows].mean()))
        log.info(
            "needles at %d tokens: %s (%.0fs)", length,
            ", ".join(f"{n} {sum(x['passed'] for x in v if x['length'] == length)}/{len(batch)}"
                      for n, v in res.items()),
            time.perf_counter() - t0,
        )
    return {
        n: {
            "pass_rate": sum(x["passed"] for x in v) / len(v),
            "bytes_per_token": sum(mem[n]) / len(mem[n]),
            "cases": v,
        }
        for n, v in res.items()
    }
