"""Which admission rule SGLang 0.5.17 applied to a run's requests.

``PrefillAdder.add_one_req`` (sglang/srt/managers/schedule_policy.py) takes one of two paths:

- ``ignore_eos_strict``: the request sends ``ignore_eos`` and the tree cache is disabled
  (``getattr(tree_cache, "disable", True)``: SGLang's ChunkCache, i.e. the server resolved
  ``disable_radix_cache=True``). ``add_one_req_ignore_eos`` admits a request only if every
  admitted request can still reach its ``max_new_tokens``: no retraction, a batch of
  pool / (prompt + output) requests.
- ``new_token_ratio``: otherwise. Admission reserves ``new_token_ratio`` (0.7 at start,
  decaying) of each request's remaining output, so the batch is larger at first and may
  retract when the pool fills.

Two configurations of one workload that ran under different rules are not comparable as a
throughput ratio: the ratio mixes the backends' capacity with the two admission rules. Pass the
same radix flag (``--server-args --disable-radix-cache`` or none) to every configuration.

The server's resolved ``disable_radix_cache`` is read from its log (SGLang logs
``server_args=ServerArgs(...)`` after ``__post_init__``, so DiffKV's own forcing, e.g. with
``--tp-size > 1``, and SGLang's, e.g. for some models, are in it; ``parse_server_log``
keeps that line as ``ServerLog.server_args``, which ``logstats.startup_info`` reads). Where
the log has no such line (a fake server, a start that failed early) the launch command
decides: the flag itself, or for ``--attention-backend diffkv`` a tensor-parallel size above 1
(``sglang_diffkv.sglang.args.apply_radix_setting`` then forces the radix cache off).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sglang_diffkv.serving_io.launch_args import launch_args

STRICT = "ignore_eos_strict"
RATIO = "new_token_ratio"
SHORT = {STRICT: "strict", RATIO: "ratio"}


def logged_disable_radix(server_args: Mapping[str, str]) -> bool | None:
    """The resolved ``disable_radix_cache`` of a server's logged arguments
    (``ServerLog.server_args``), or None where the log holds none."""
    v = server_args.get("disable_radix_cache")
    return None if v not in ("True", "False") else v == "True"


def _tp_size(args: Mapping[str, str]) -> int:
    """The tensor-parallel size ``launch_args`` found (SGLang's aliases of ``--tp-size``)."""
    v = next((args[k] for k in ("tp_size", "tensor_parallel_size", "tp") if k in args), "1")
    try:
        return int(v)
    except ValueError:  # a bare flag ("True"): argparse would have refused it
        return 1


def argv_disable_radix(argv: Sequence[str], attention_backend: str | None) -> bool:
    """``disable_radix_cache`` as the launch command implies it: the flag, or diffkv's forcing
    with a tensor-parallel size above 1."""
    args = launch_args(argv)
    if "disable_radix_cache" in args:  # a store_true flag: present is on
        return True
    return attention_backend == "diffkv" and _tp_size(args) > 1


def radix_disabled(argv: Sequence[str], attention_backend: str | None,
                   logged: bool | None = None) -> tuple[bool, str]:
    """(the server's ``disable_radix_cache``, where it was read: ``server log`` when the log
    gave it, ``logged`` from ``logged_disable_radix``, else ``launch command``)."""
    if logged is not None:
        return logged, "server log"
    return argv_disable_radix(argv, attention_backend), "launch command"


def admission_rule(ignore_eos: bool, radix_cache_disabled: bool) -> str:
    """SGLang 0.5.17's admission path for a request (see the module docstring)."""
    return STRICT if ignore_eos and radix_cache_disabled else RATIO


def mixed_rule_warnings(runs: Iterable[dict[str, Any]]) -> list[str]:
    """One warning line per workload whose configurations ran under different admission
    rules (runs without an ``admission_rule`` are left out)."""
    by_wl: dict[str, dict[str, str]] = {}
    for r in runs:
        rule = r.get("admission_rule")
        if rule is None:
            continue
        by_wl.setdefault(r.get("workload") or r.get("label", "?"), {}).setdefault(
            r["config"], rule)
    out = []
    for wl, rules in by_wl.items():
        if len(set(rules.values())) < 2:
            continue
        named = ", ".join(f"{c} {rule}" for c, rule in rules.items())
        out.append(
            f"WARNING {wl}: configurations ran under different SGLang admission rules ({named}): "
            "a throughput ratio between them mixes two admission rules (ignore_eos_strict: "
            "ignore_eos with the radix cache off, no retraction; new_token_ratio: optimistic, "
            "may retract); align them by passing the same radix flag to every configuration "
            "(--server-args --disable-radix-cache, or none)")
    return out
