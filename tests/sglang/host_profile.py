"""The host-side profile of chunked + radix prefill steps (``sglang_diffkv.host_audit``) under
the CPU harness: per prefill step, the torch ops, Triton launches, syncs and uploads of each
DiffKV component, per layer where the component runs per layer.

The scenario (``SCENARIO``): a 62-token prompt prefilled in chunks of 48 (first chunk, then
a 14-token last chunk) and exported to the radix tree; then, in three steps of at most 48
tokens, a radix hit with its suffix in one chunk, a whole prompt, a radix hit whose suffix
takes two chunks, and a prompt in three chunks whose last one (3 tokens) is shorter than
score_queries (8). Every prefill step therefore mixes kinds the way served traffic does.

Run as a script for the table (``docs/backend.md``, stage 2):

    PYTHONPATH=$PWD:tests/sglang TRITON_INTERPRET=1 SGLANG_DIFFKV_KERNELS=1 \\
        python tests/sglang/host_profile.py [layers]
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from dataclasses import dataclass

import harness as H
import pytest
import torch

from sglang_diffkv.host_audit import CATEGORIES, HostAudit

CONFIG = {"preset": "llama-3-8b", "alpha_h": 1.5, "alpha_l": 0.4, "window": 8,
          "score_queries": 8, "allow_other_model": True}
CUT = 16
CHUNK = 48

# sections that run once per layer (the rest run once per step)
PER_LAYER = ("attend", "compress whole prompts", "chunk stores", "radix suffix",
             "last chunks + suffixes", "layer (rest)")


def system(n: int, seed: int) -> list[int]:
    return [(7 * i + 31 * seed) % 997 + 1 for i in range(n)]


SYS = system(60, 9)
# (rid, prompt, new tokens): the warm-up prompt that fills the tree, then the mixed steps
WARMUP = [("a", SYS + [3, 4], 1)]
SCENARIO = [
    ("b", SYS[:48] + [5] * 10, 1),  # radix hit at 48, its 10-token suffix in one chunk
    ("c", system(20, 3), 1),  # a whole prompt
    ("d", SYS[:32] + [6] * 60, 1),  # radix hit at 32, its 60-token suffix in two chunks
    ("e", system(57, 4), 1),  # chunks 6, 48 and a last chunk of 3 (< score_queries)
]


@dataclass
class StepProfile:
    chunks: list[tuple[str, int, int]]  # (rid, prefix, fresh) of each request of the step
    audit: HostAudit

    def count(self, category: str, per_layer: bool | None = None) -> int:
        """``category``'s count over the step's sections (only the per-layer ones, or only
        the per-step ones, when ``per_layer`` says so)."""
        names = [n for n in self.audit.sections
                 if per_layer is None or (n in PER_LAYER) == per_layer]
        return self.audit.total(category, names)


def _watch(audit: HostAudit, backend) -> None:
    """The components' sections: every DiffKV function a prefill step runs."""
    from sglang_diffkv import cache, kernels, prompt_sharing
    from sglang_diffkv.sglang import backend as backend_mod
    from sglang_diffkv.sglang import ops

    targets = [
        (backend_mod.DiffKVAttnBackend, "init_forward_metadata", "metadata"),
        (backend_mod.DiffKVAttnBackend, "forward_extend", "layer (rest)"),
        (ops.DiffKVOps, "end_prefill_step", "end of step"),
        (ops, "causal_sdpa", "attend"),
        (kernels, "extend_attention", "attend"),
        (cache.CompressedKVCache, "extend_layer_attend", "attend"),
        (ops.DiffKVOps, "_score_and_compress", "compress whole prompts"),
        (cache.CompressedKVCache, "prefill_layer", "compress whole prompts"),
        (cache.CompressedKVCache, "store_chunk", "chunk stores"),
        (cache.CompressedKVCache, "store_last_chunk", "chunk stores"),
        (prompt_sharing.PromptSharing, "store_chunk", "radix suffix"),
        (prompt_sharing.PromptSharing, "store_last", "radix suffix"),
        (prompt_sharing.PromptSharing, "export", "export"),
    ]
    # the kernel path's group stores (sglang_diffkv.sglang.extend_ops), where present
    extend_ops = sys.modules.get("sglang_diffkv.sglang.extend_ops")
    if extend_ops is not None:
        targets += [
            (extend_ops.ExtendStores, "store_chunks", "chunk stores"),
            (extend_ops.ExtendStores, "store_prompt_ends", "last chunks + suffixes"),
        ]
    for owner, attribute, name in targets:
        if hasattr(owner, attribute):
            audit.watch(owner, attribute, name)
    pa = backend.ops.__dict__.get("prompt_attention")
    if pa is not None:  # (a frozen dataclass: its run is wrapped, the holder replaced)
        backend.ops.prompt_attention = dataclasses.replace(pa, run=audit.wrap(pa.run, "attend"))


def run_scenario(monkeypatch, kernels: bool, num_layers: int = 2,
                 scenario: list | None = None) -> tuple[H.MiniScheduler, list[StepProfile]]:
    """The scenario's prefill steps, each audited (the warm-up's and decode steps are not).
    ``monkeypatch``: pytest's (the harness's CPU helpers and the environment)."""
    H.cpu_sglang_helpers(monkeypatch)
    monkeypatch.setenv("SGLANG_DIFFKV_RADIX_CUT", str(CUT))
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(CONFIG))
    monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", "1" if kernels else "0")
    shape = H.ModelShape(dtype=torch.bfloat16, num_layers=num_layers)
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 600, 8), radix=True,
                        chunked_prefill_size=CHUNK)
    backend = s.runner.attn_backend
    for rid, ids, new in WARMUP:
        s.add_request(rid, ids, new)
    s.run_until_idle()
    for rid, ids, new in SCENARIO if scenario is None else scenario:
        s.add_request(rid, ids, new)
    steps = []
    for _ in range(100):
        before = len(s.chunks)
        pa = backend.ops.__dict__.get("prompt_attention")
        with HostAudit() as audit:
            _watch(audit, backend)
            what = s.step()
        if pa is not None:
            backend.ops.prompt_attention = pa
        if what == "prefill":
            steps.append(StepProfile(s.chunks[before:], audit))
        if what == "idle" and not s.waiting and s.chunked_req is None:
            return s, steps
    raise AssertionError("the scenario did not finish")


def report(steps: list[StepProfile], num_layers: int) -> str:
    per = {name: num_layers for name in PER_LAYER}
    out = []
    for i, st in enumerate(steps):
        out.append(f"step {i + 1}: {st.chunks}")
        out.append(st.audit.table(per))
        syncs = sum((sec.detail for sec in st.audit.sections.values()), Counter())
        syncs = {k: v for k, v in sorted(syncs.items()) if not k.startswith("triton")}
        out.append(f"  syncs / uploads by op (whole step): {syncs}")
        out.append("  step totals: " + ", ".join(f"{c} {st.count(c)}" for c in CATEGORIES))
        out.append("  per layer: " + ", ".join(
            f"{c} {st.count(c, per_layer=True) / num_layers:g}" for c in CATEGORIES)
            + "; per step outside the layers: " + ", ".join(
            f"{c} {st.count(c, per_layer=False)}" for c in CATEGORIES))
    return "\n".join(out)


if __name__ == "__main__":
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    import os

    with pytest.MonkeyPatch.context() as mp:
        _, profiled = run_scenario(mp, os.environ.get("SGLANG_DIFFKV_KERNELS", "0") == "1",
                                   layers)
    print(report(profiled, layers))
