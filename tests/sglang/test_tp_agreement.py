"""The TP agreement rule (``sglang_diffkv.sglang.tp_agreement``): TP ranks whose DiffKV
pools hold different numbers of pages take the same admission and retraction decisions.

The two-rank tests spawn two processes joined by gloo on the CPU (``tp_ranks.py``), each
driving SGLang's own scheduler objects on its own pool; the rest check the rule's
bookkeeping in process (how often it all-reduces, and that TP 1 never does).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import multiprocessing as mp
import socket
from typing import Any

import harness as H
import pytest
import tp_ranks

from sglang_diffkv.sglang.tp_agreement import (
    FreePagesAgreement,
    scheduler_step_hook,
    tp_cpu_group,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=tp_ranks.run_rank, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        assert "error" not in got[rank], f"rank {rank}:\n{got[rank]['error']}"
    return [got[0], got[1]]


def test_ranks_hold_their_own_heads_and_use_different_page_counts(two_ranks):
    a, b = (r["agreed"] for r in two_ranks)
    assert a["kv_heads"] == b["kv_heads"] == 2  # 4 KV heads over TP 2
    assert a["num_pages"] == b["num_pages"] == tp_ranks.PAGES
    # the scenario the rule exists for: the same requests take different pages per rank
    assert a["local_free"] != b["local_free"]
    assert sum(x != y for x, y in zip(a["local_free"], b["local_free"], strict=False)) >= 5


def test_ranks_with_different_page_use_take_the_same_decisions(two_ranks):
    a, b = (r["agreed"] for r in two_ranks)
    assert a["decisions"] == b["decisions"]
    assert a["retractions"] == b["retractions"] >= 1  # retraction was decided, identically
    # admission waited on pages: the first prefill left requests waiting
    n = len(tp_ranks.requests())
    prefills = [d for d in a["decisions"] if d[0] == "prefill"]
    assert len(prefills[0][1]) < n and len(prefills) >= 2
    assert a["finished"] == b["finished"]
    assert len(a["finished"]) == n
    assert all(k == dict((r, m) for r, _, m in tp_ranks.requests())[rid]
               for rid, k in a["finished"])
    # one all-reduce per step that read memory, plus one per retraction read: the same on
    # both ranks (a mismatch would have hung the gloo collective instead)
    assert a["reductions"] == b["reductions"] > 0
    assert a["reductions"] <= len(a["decisions"]) + a["retractions"]
    for r in (a, b):  # back to idle: every page on every rank, SGLang's idle check quiet
        assert r["idle_free"] == r["num_pages"] and r["leak"] == ""


def test_without_the_agreement_the_same_ranks_disagree(two_ranks):
    """The control: each rank deciding on its own pages takes different decisions on the
    same requests (at TP > 1 that desynchronises the ranks' batches and collectives)."""
    a, b = (r["local"] for r in two_ranks)
    assert a["reductions"] == b["reductions"] == 0
    assert a["decisions"] != b["decisions"]


def test_ranks_with_different_pool_sizes_are_refused(two_ranks):
    for rank, r in enumerate(two_ranks):
        msg = r["mismatch_refused"]
        assert "TP ranks built different DiffKV pools" in msg, (rank, msg)
        assert f"pages {tp_ranks.PAGES}..{tp_ranks.PAGES + 1}" in msg


# ---- in process: when the rule all-reduces ------------------------------------------------


class _Counted:
    def __init__(self, local: int, others_min: int) -> None:
        self.local, self.others_min, self.calls = local, others_min, 0

    def reduce(self, value: int) -> int:
        self.calls += 1
        return min(value, self.others_min)


def test_one_all_reduce_per_step_and_one_per_release_inside_it():
    c = _Counted(local=50, others_min=40)
    ag = FreePagesAgreement(None, lambda: c.local, reduce_min=c.reduce)
    assert ag.read() == 50 and c.calls == 0  # before any step: local, no collective
    with ag.scheduler_step():
        assert [ag.read() for _ in range(5)] == [40] * 5  # reused within the step
        assert c.calls == 1
        c.local, c.others_min = 30, 45
        ag.released()  # a retraction returned pages: the next read agrees anew
        assert ag.read() == 30 and c.calls == 2
    c.local = 10
    ag.released()  # (a finished request between steps)
    assert ag.read() == 30 and c.calls == 2  # outside a step: never a collective
    with ag.scheduler_step():
        assert ag.read() == 10 and c.calls == 3
    assert ag.reductions == 3


def test_tp1_has_no_agreement_and_the_hook_passes_through(monkeypatch):
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    H.cpu_sglang_helpers(monkeypatch)
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", "default")
    assert tp_cpu_group(ParallelState.trivial()) is None
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8))
    assert s.kv_pool.agreement is None
    s.add_request("a", list(range(1, 30)), 4)
    calls = []

    def original(sched: Any) -> str:
        calls.append(sched)
        return H.MiniScheduler.step(sched)

    assert scheduler_step_hook(original, s) == "prefill" and calls == [s]
    assert s.kv_pool.free_pages() == s.kv_pool.local_free_pages()


def test_a_tp2_rank_plans_graph_decode_for_its_own_query_heads(monkeypatch):
    """A rank holds its share of the query heads as of the KV heads: the CUDA-graph decode
    plans (kernel path, emulated replays) are built for it, and replays never build another."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_diffkv.sglang import runner

    # what the backend reads on SGLang's own ModelRunner / ModelConfig
    assert "self.ps = ps" in inspect.getsource(ModelRunner.__init__)
    assert callable(ModelConfig.get_num_attention_heads)
    H.cpu_sglang_helpers(monkeypatch)
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(tp_ranks.CONFIG))
    monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", "1")
    monkeypatch.setattr(runner, "tp_cpu_group", lambda ps: None)  # (one rank, no group)
    monkeypatch.setattr(H, "fake_qkv", tp_ranks.rank_heads(H.fake_qkv, 1, 2))
    shape = H.ModelShape(num_layers=1, num_q_heads=8, num_kv_heads=4, dtype=torch.bfloat16)
    rank_shape = dataclasses.replace(shape, num_q_heads=4, num_kv_heads=2)
    ps = ParallelState.trivial(tp_rank=1, tp_size=2, attn_tp_rank=1, attn_tp_size=2)
    s = H.MiniScheduler(shape, H.budget_for_pages(rank_shape, 200, 8), graph_bs=(1, 2), ps=ps)
    backend = s.runner.attn_backend
    assert backend.num_q_heads == 4 and s.kv_pool.cache.spec.num_kv_heads == 2
    s.add_request("a", list(range(1, 30)), 4)
    s.add_request("b", list(range(3, 20)), 3)
    s.run_until_idle()
    assert sorted((r.rid, len(r.output_ids)) for r in s.finished) == [("a", 4), ("b", 3)]
    assert s.graph_replays == 3  # two steps of both, one of "a" alone
    assert {bs: sorted(st.plans) for bs, st in backend.graphs.steps.items()} == {
        1: [4], 2: [4]}
