#!/usr/bin/env python3
"""HTTP client for the diffkv backend's GPU run (scripts/gpu_backend_run.sh).

    support PORT OUT.json          greedy top-20 ids of the first tokens (defines the support)
    logits  PORT SUPPORT.json OUT  logprobs of that support at every generated position
    compare A.json B.json          KL(A || B) per position over the support, token agreement
    long    PORT N IN_LEN OUT_LEN OUT.json   N concurrent ignore_eos requests
    thresholds PORT                a request with per-request thresholds (custom_params)

Prompts are fixed token-id lists (the server runs with --skip-tokenizer-init).
"""

from __future__ import annotations

import json
import math
import sys
import time

import requests

NEW_TOKENS = 8
PROMPTS = [[(i * (17 + 4 * p) + 11 * p) % 128000 for i in range(200 + 300 * p)] for p in range(4)]


def _post(port: str, body: dict, timeout: float = 600) -> list | dict:
    r = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def _greedy(extra: dict) -> dict:
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True, **extra}


def support(port: str, out: str) -> None:
    rs = _post(port, _greedy({"top_logprobs_num": 20}))
    ids = sorted({int(t[1]) for r in rs for pos in r["meta_info"]["output_top_logprobs"]
                  for t in pos})
    json.dump({"ids": ids}, open(out, "w"))
    print(f"support: {len(ids)} token ids from the top-20 of {len(rs)} x {NEW_TOKENS} positions")


def logits(port: str, support_file: str, out: str) -> None:
    ids = json.load(open(support_file))["ids"]
    rs = _post(port, _greedy({"token_ids_logprob": ids}))
    res = [{"output_ids": r["output_ids"],
            "logprobs": [{int(t[1]): float(t[0]) for t in pos}
                         for pos in r["meta_info"]["output_token_ids_logprobs"]]}
           for r in rs]
    json.dump(res, open(out, "w"))
    print(f"logits: {len(res)} prompts, first output ids {[r['output_ids'][:4] for r in res]}")


def compare(a_file: str, b_file: str) -> None:
    a, b = json.load(open(a_file)), json.load(open(b_file))
    kls, agree, total, mass, first = [], 0, 0, [], []
    for pa, pb in zip(a, b, strict=True):
        for t in range(NEW_TOKENS):
            if pa["output_ids"][:t] != pb["output_ids"][:t]:
                break  # later positions condition on different tokens
            la, lb = pa["logprobs"][t], pb["logprobs"][t]
            keys = la.keys() & lb.keys()
            za = math.log(sum(math.exp(la[k]) for k in keys))
            zb = math.log(sum(math.exp(lb[k]) for k in keys))
            mass.append(math.exp(za))
            kls.append(sum(math.exp(la[k] - za) * ((la[k] - za) - (lb[k] - zb)) for k in keys))
            if t == 0:
                first.append(kls[-1])
            total += 1
            agree += pa["output_ids"][t] == pb["output_ids"][t]
    print(f"compare: {total} positions compared; greedy token agreement {agree}/{total}; "
          f"KL(A||B) over the support: mean {sum(kls) / len(kls):.3e}, max {max(kls):.3e}; "
          f"first token KL {[f'{k:.2e}' for k in first]}; "
          f"support covers {min(mass):.1%}-{max(mass):.1%} of A's mass")


def long_run(port: str, n: str, in_len: str, out_len: str, out: str) -> None:
    n_, li, lo = int(n), int(in_len), int(out_len)
    batch = [[(i * 31 + j * 7 + 3) % 128000 for i in range(li)] for j in range(n_)]
    sp = {"max_new_tokens": lo, "temperature": 0, "ignore_eos": True}
    t = time.time()
    rs = _post(port, {"input_ids": batch, "sampling_params": sp}, timeout=900)
    dt = time.time() - t
    done = sum(r["meta_info"]["completion_tokens"] for r in rs)
    json.dump({"requests": n_, "input_len": li, "output_len": lo, "seconds": dt,
               "completion_tokens": done, "finish": [r["meta_info"]["finish_reason"] for r in rs]},
              open(out, "w"))
    reasons = {str(r["meta_info"]["finish_reason"]) for r in rs}
    print(f"long: {n_} x ({li} in, {lo} out): {done} tokens in {dt:.1f} s "
          f"({done / dt:.0f} tok/s); finish reasons {reasons}")


def thresholds(port: str) -> None:
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
          "custom_params": {"diffkv_alpha_h": 0.0, "diffkv_alpha_l": 0.0}}
    r = _post(port, {"input_ids": PROMPTS[0], "sampling_params": sp})
    n = r["meta_info"]["completion_tokens"]
    print(f"thresholds: per-request custom_params accepted, {n} tokens")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"support": support, "logits": logits, "compare": compare, "long": long_run,
     "thresholds": thresholds}[cmd](*args)
