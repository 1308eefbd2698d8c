"""One tensor-parallel rank's scheduler on the CPU, for test_tp_agreement.py.

``run_rank`` runs in a spawned process per rank, joined by SGLang's own TP process groups
(``init_distributed_environment`` / ``initialize_model_parallel`` on gloo); the pool takes
the TP CPU group its schedulers share, as in a server (``tp_agreement.tp_cpu_group``). Each
rank drives the harness's ``MiniScheduler`` (SGLang's own PrefillAdder,
ScheduleBatch.check_decode_mem / retract_decode, ChunkCache, our pools and backend) through
our ``Scheduler.get_next_batch_to_run`` hook, on the same requests. Each rank holds its own
half of the KV heads and sees its own heads' K/V, so compression keeps different tokens and
the ranks' pools consume different numbers of pages.

Two runs per process, on fresh pools: ``agreed`` (the TP > 1 wiring: ``runner.init_pools``
joins the pool to the TP CPU group) and ``local`` (the same ranks, each deciding on its own
pages: the control that shows the scenario would make ranks disagree).
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

# a pool tight enough that admission waits on pages and decode retracts (the 8B preset's
# page layout, thresholds that compress hard; the test model is not the preset's, hence the
# opt-in)
CONFIG = {"preset": "llama-3-8b", "alpha_h": 1.5, "alpha_l": 0.4, "window": 8,
          "score_queries": 8, "allow_other_model": True}
PAGES = 30
MAX_STEPS = 2000
# per rank: how sharply its heads attend. Rank 0's heads attend sharply (compression prunes
# most tokens), rank 1's broadly (it keeps most): the head-to-head spread that per-head
# budgets exist for
K_SCALE = (3.0, 0.3)


def requests() -> list[tuple[str, list[int], int]]:
    return [(f"r{i}", [(i * 13 + j * 7) % 900 + 1 for j in range(40 + 25 * i)], 50 + 5 * i)
            for i in range(4)]


def rank_heads(full_qkv: Callable[..., tuple], rank: int, world: int, k_scale: float = 1.0
               ) -> Callable[..., tuple]:
    """The stand-in transformer as rank ``rank`` of ``world`` sees it: its share of the
    query and KV heads (column-parallel projections), its keys scaled by ``k_scale`` (how
    sharply its heads attend)."""

    def qkv(ids: Any, pos: Any, layer: int, shape: Any) -> tuple:
        q, k, v = full_qkv(ids, pos, layer, shape)
        cq, ck = q.shape[1] // world, k.shape[1] // world
        return (q[:, rank * cq:(rank + 1) * cq], k_scale * k[:, rank * ck:(rank + 1) * ck],
                v[:, rank * ck:(rank + 1) * ck])

    return qkv


def run_rank(rank: int, world: int, port: int, out: Any) -> None:
    try:
        out.put((rank, _run(rank, world, port)))
    except BaseException:  # (reported to the parent, which fails the test with it)
        out.put((rank, {"error": traceback.format_exc()}))


def _run(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ["SGLANG_DIFFKV_CONFIG"] = json.dumps(CONFIG)
    import torch

    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    import harness as H
    import pytest
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    # SGLang's own process groups, as a TP-2 scheduler process builds them (gloo: CPU only)
    parallel_state.init_distributed_environment(
        world_size=world, rank=rank, local_rank=rank, backend="gloo", timeout=60,
        distributed_init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")

    from sglang_diffkv.sglang import runner
    from sglang_diffkv.sglang.tp_agreement import RanksDisagreeError, scheduler_step_hook

    mp = pytest.MonkeyPatch()
    H.cpu_sglang_helpers(mp)
    shape = H.ModelShape(num_layers=1, num_q_heads=8, num_kv_heads=4)
    rank_shape = dataclasses.replace(shape, num_q_heads=4, num_kv_heads=2)
    mp.setattr(H, "fake_qkv", rank_heads(H.fake_qkv, rank, world, K_SCALE[rank]))
    ps = ParallelState.trivial(tp_rank=rank, tp_size=world, attn_tp_rank=rank,
                               attn_tp_size=world)
    result: dict[str, Any] = {}
    for mode in ("agreed", "local"):
        if mode == "local":  # (the agreed run takes the TP CPU group as a server does)
            mp.setattr(runner, "tp_cpu_group", lambda ps: None)
        s = H.MiniScheduler(shape, H.budget_for_pages(rank_shape, PAGES, 8), ps=ps)
        s.new_token_ratio = 0.05  # a decayed ratio: SGLang admits optimistically
        for rid, prompt, n in requests():
            s.add_request(rid, prompt, n)
        kv = s.kv_pool
        decisions, local_free = [], []
        for _ in range(MAX_STEPS):
            ran = scheduler_step_hook(H.MiniScheduler.step, s)
            rids = s.records[-1].rids if ran in ("prefill", "decode") and s.records else []
            decisions.append([ran, rids, s.retractions])
            local_free.append(kv.local_free_pages())
            if ran == "idle" and not s.waiting:
                break
        leak, msg = s.idle_leak_check()
        result[mode] = {
            "decisions": decisions,
            "local_free": local_free,
            "retractions": s.retractions,
            "finished": sorted((r.rid, len(r.output_ids)) for r in s.finished),
            "reductions": kv.agreement.reductions if kv.agreement is not None else 0,
            "idle_free": kv.local_free_pages(),
            "num_pages": kv.num_pages,
            "kv_heads": kv.cache.spec.num_kv_heads,
            "leak": msg if leak else "",
        }
        if mode == "agreed":
            try:  # pools of different sizes can never agree: refused at start-up
                kv.agreement.check_same_pool(kv.num_pages + rank, kv.size)
                result["mismatch_refused"] = ""
            except RanksDisagreeError as e:
                result["mismatch_refused"] = str(e)
    mp.undo()
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    return result
