"""SGLang's ScheduleBatch-driven extend and decode through the DiffKV pool and backend.

Every step the harness runs is replayed request by request on an independent reference
``CompressedKVCache`` fed the same q/k/v: outputs and compressed state must agree. Prefill
outputs are also checked against exact causal attention computed here.
"""

from __future__ import annotations

import json
import logging
import os
import types

import harness as H
import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.memory.free_bound import ManualFreePagesBound

# llama-3-8b's tiers with thresholds that prune on the harness's stand-in model, which is not
# the Llama-3-8B the preset records: the start-up guard needs the explicit opt-in
COMPRESSING = {"preset": "llama-3-8b", "alpha_h": 1.5, "alpha_l": 0.4, "window": 8,
               "score_queries": 8, "allow_other_model": True}


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    H.cpu_sglang_helpers(monkeypatch)




def exact_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: H.ModelShape
                 ) -> torch.Tensor:
    """[n, Hq*D] from [n, H*D] inputs, in float64."""
    n, d, g = q.shape[0], shape.head_dim, shape.num_q_heads // shape.num_kv_heads
    qh = q.double().view(n, shape.num_q_heads, d).transpose(0, 1)
    kh = k.double().view(n, shape.num_kv_heads, d).transpose(0, 1).repeat_interleave(g, 0)
    vh = v.double().view(n, shape.num_kv_heads, d).transpose(0, 1).repeat_interleave(g, 0)
    logits = qh @ kh.transpose(1, 2) * shape.scaling
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(logits, -1) @ vh).transpose(0, 1).reshape(n, -1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


def replay_on_reference(s: H.MiniScheduler, alphas: dict[str, tuple[float, float]] | None = None,
                        tol: float = 1e-5) -> dict[str, int]:
    """Re-run every recorded step per request on a fresh reference cache; return how many
    extend / decode rows were compared."""
    shape, cfg = s.shape, s.kv_pool.cache.config
    ref = CompressedKVCache(
        cfg, head_dim=shape.head_dim, num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads, num_pages=20_000, max_reqs=64,
        max_context=shape.context_len + 4,
    )
    slot: dict[str, int] = {}
    compared = {"extend": 0, "decode": 0}
    d = shape.head_dim
    for rec in s.records:
        if rec.mode == "extend":
            start = 0
            for b, rid in enumerate(rec.rids):
                n = rec.seq_lens[b]
                slot[rid] = len(slot) + compared["extend"]  # a fresh slot per (re)prefill
                ah, al = (alphas or {}).get(rid, (cfg.alpha_h, cfg.alpha_l))
                assert bool(ref.begin_prefill([slot[rid]], [n], [ah], [al]).ok)
                for layer, (q, k, v, o) in enumerate(rec.layers):
                    qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
                    assert rel_err(o[start:start + n], exact_causal(qs, ks, vs, shape)) < tol
                    ref.prefill_layer(
                        layer, [slot[rid]], torch.tensor([n]),
                        qs.view(1, n, -1, d).transpose(1, 2),
                        ks.view(1, n, -1, d).transpose(1, 2),
                        vs.view(1, n, -1, d).transpose(1, 2), shape.scaling,
                    )
                ref.end_prefill([slot[rid]])
                assert torch.equal(rec.counts_after[b], ref.counts[slot[rid]]), (rid, "prefill")
                start += n
                compared["extend"] += 1
        else:
            for b, rid in enumerate(rec.rids):
                assert bool(ref.begin_decode([slot[rid]]).ok)
                for layer, (q, k, v, o) in enumerate(rec.layers):
                    ref.decode_layer_store(layer, [slot[rid]], rec.positions[b:b + 1],
                                           k[b].view(1, -1, d), v[b].view(1, -1, d))
                    res = ref.decode_layer_attend(layer, [slot[rid]], q[b].view(1, -1, d),
                                                  shape.scaling)
                    assert rel_err(o[b], res.out.reshape(-1)) < tol, (rid, layer)
                assert torch.equal(rec.counts_after[b], ref.counts[slot[rid]]), (rid, "decode")
                compared["decode"] += 1
    return compared


def assert_back_to_initial_state(s: H.MiniScheduler) -> None:
    kv, cache = s.kv_pool, s.kv_pool.cache
    assert not kv.active
    # SGLang's own accounting first: available_size() flushes the batched frees, as the
    # scheduler's calls do between steps
    alloc = s.token_to_kv_pool_allocator
    assert alloc.logical_available_size() == alloc.available_size() == alloc.size
    leak, msg = s.idle_leak_check()  # SGLang's own strict idle check
    assert not leak, msg
    assert not kv._pending_free
    cache.manager.check_invariants()
    assert cache.manager.num_free_pages_host() == kv.num_pages
    assert bool((cache.manager.table == -1).all()) and not bool(cache.manager.counts.any())
    assert not s.req_pool_leak()


def test_extend_and_decode_match_the_reference_through_compression(monkeypatch):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 600, 8))
    s.add_request("a", [(7 * i) % 997 + 1 for i in range(70)], 40)
    s.add_request("b", [(3 * i) % 991 + 2 for i in range(33)], 25)
    s.run_until_idle()
    s.add_request("c", [(11 * i) % 983 + 3 for i in range(50)], 30)  # joins an idle server
    s.add_request("d", list(range(1, 20)), 12)
    s.run_until_idle()
    assert [r.rid for r in s.finished] == ["b", "a", "d", "c"]
    assert all(len(r.output_ids) == r.sampling_params.max_new_tokens for r in s.finished)
    compared = replay_on_reference(s)
    assert compared["extend"] == 4 and compared["decode"] == 39 + 24 + 29 + 11
    # compression really happened: some tokens went low and some were pruned
    assert s.kv_pool.stats.finished_reqs == 4
    hi, lo, pr = (float(x) for x in s.kv_pool.stats.finished_tokens / 4)
    assert lo > 0.02 and pr > 0.02 and hi < 0.96
    assert_back_to_initial_state(s)


def test_the_forward_context_hands_model_code_the_diffkv_pools(monkeypatch):
    """Model code reaches the pools through the backend (SGLang's get_token_to_kv_pool /
    get_req_to_token_pool); the fused RoPE + set-KV check reads the pool's dtype there and
    must never pick the dense-buffer path."""
    from sglang.srt.model_executor.forward_context import (
        ForwardContext,
        forward_context,
        get_req_to_token_pool,
        get_token_to_kv_pool,
    )

    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", "default")
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8))
    with forward_context(ForwardContext(attn_backend=s.runner.attn_backend)):
        assert get_token_to_kv_pool() is s.kv_pool
        assert get_req_to_token_pool() is s.req_to_token_pool
        assert get_token_to_kv_pool().dtype == torch.uint8  # never the bf16 fused path


def test_padded_decode_rows_are_skipped(monkeypatch):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 400, 8))
    # padded rows: out_cache_loc 0 and a stale req_pool_idx naming a live request
    s.pad_decode_rows = 2
    s.add_request("a", list(range(1, 41)), 20)
    s.add_request("b", list(range(5, 30)), 20)
    s.run_until_idle()
    assert s.padded_rows_seen > 0
    assert all(bool((o == 0).all()) for o in s.padded_outputs)
    replay_on_reference(s)  # a padded row that wrote into the live request would diverge here
    assert_back_to_initial_state(s)


def test_page_exhaustion_retracts_instead_of_failing(monkeypatch):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", "no-compression")
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 40, 8))
    s.new_token_ratio = 0.05  # a decayed ratio: SGLang admits optimistically
    for i in range(3):
        s.add_request(f"r{i}", [(i * 13 + j) % 900 + 1 for j in range(40)], 80)
    s.run_until_idle()
    assert s.retractions >= 1
    assert sorted(r.rid for r in s.finished) == ["r0", "r1", "r2"]
    assert all(len(r.output_ids) == 80 for r in s.finished)
    # the physical term, not the logical slots, is what ran out
    assert s.max_peak_logical_used < s.token_to_kv_pool_allocator.size
    replay_on_reference(s)  # retracted requests recompute to the same state and outputs
    assert_back_to_initial_state(s)


def test_per_request_thresholds_from_custom_params(monkeypatch):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 400, 8))
    s.add_request("keep", list(range(1, 61)), 2,
                  custom_params={"diffkv_alpha_h": 0.0, "diffkv_alpha_l": 0.0})
    s.add_request("squeeze", list(range(1, 61)), 2)
    s.step()  # prefill both
    kept = s.records[-1].counts_after
    assert bool((kept[0, ..., 0] == 60).all()), "alpha 0/0 keeps every prompt token high"
    assert bool((kept[1, ..., 0] < 60).any())
    s.run_until_idle()
    replay_on_reference(s, {"keep": (0.0, 0.0)})
    assert_back_to_initial_state(s)


def test_flush_cache_resets_the_pool(monkeypatch):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", "default")
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8))
    s.add_request("a", list(range(1, 50)), 30)
    s.step()
    s.step()
    assert s.kv_pool.active and s.kv_pool.free_pages() < s.kv_pool.num_pages
    # what Scheduler.flush_cache and bench_one_batch do between runs
    s.req_to_token_pool.clear()
    s.token_to_kv_pool_allocator.clear()
    s.running = None
    assert_back_to_initial_state(s)


def test_startup_report_and_step_metrics_are_logged(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    monkeypatch.setenv("SGLANG_DIFFKV_LOG_INTERVAL", "1")
    shape = H.ModelShape()
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8))
        s.add_request("a", list(range(1, 50)), 5)
        s.run_until_idle()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"page {s.kv_pool.cache.geometry.page_bytes} B; tokens per page: high 32" in text
    assert f"{s.kv_pool.num_pages} pages" in text and "fp16/bf16 tokens" in text
    assert "logical token slots" in text and "expected max concurrency" in text
    assert "diffkv: cuda_graph_backend_prefill=disabled (forced): " in text  # repeated in log
    assert "DiffKV prefill: batch 1, tokens high" in text
    assert "DiffKV decode: batch 1" in text and "pruned" in text and "pages in use" in text
    assert "a bf16 cache would need" in text


def count_record_use(monkeypatch) -> list[int]:
    """[rows whose fused-argmin record the policy step took, rows], counted around every
    ``DiffKVOps.decode_store`` (``decode_hint.valid``: the kernel's own test)."""
    from sglang_diffkv import decode_hint
    from sglang_diffkv.sglang.ops import DiffKVOps

    used = [0, 0]
    store = DiffKVOps.decode_store

    def counted(self, layer, req, positions, k, v, step=None):
        if self.hints is not None:
            m, c = self.cache.manager, self.cache
            per = torch.tensor(c.spec.tokens_per_page, device=c.device)
            ok = decode_hint.valid(self.hints[req, layer], m.counts[req, layer],
                                   m.shared[req, layer].long() * per, positions,
                                   c.config.window)
            used[0] += int(ok.sum())
            used[1] += ok.numel()
        return store(self, layer, req, positions, k, v, step=step)

    monkeypatch.setattr(DiffKVOps, "decode_store", counted)
    return used


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("fused", ["0", "1"])
def test_kernel_path_matches_the_reference(monkeypatch, fused):
    """The same SGLang-driven run with the Triton kernels behind the ops seam, with the
    policy step's argmin scanned and fused into the merge pass (SGLANG_DIFFKV_FUSED_ARGMIN)."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", "1")
    monkeypatch.setenv("SGLANG_DIFFKV_FUSED_ARGMIN", fused)
    used = count_record_use(monkeypatch)
    shape = H.ModelShape(dtype=torch.bfloat16)
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8))
    assert s.runner.attn_backend.ops.use_kernels
    s.add_request("a", [(7 * i) % 997 + 1 for i in range(45)], 14)
    s.add_request("b", [(3 * i) % 991 + 2 for i in range(30)], 10)
    s.run_until_idle()
    compared = replay_on_reference(s, tol=2e-2)  # bf16 activations
    assert compared == {"extend": 2, "decode": 13 + 9}
    assert_back_to_initial_state(s)
    # fused: every decode step after a request's first takes its records
    assert (used[0] > used[1] // 2) if fused == "1" else used == [0, 0], used


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("fused", ["0", "1"])
def test_cuda_graph_decode_matches_the_reference(monkeypatch, caplog, fused):
    """Decode driven as DecodeCudaGraphRunner does it: captured per batch size with every
    row padding, replayed from its static buffers through build_replay_fb_view (rows past
    the batch: req_pool_indices 0, SGLang's padding row, seq_lens the fill value, input ids
    stale). Padding must neither store nor score anything: outputs and counters match the
    reference per request, and the pad request stays empty; with the fused argmin too."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", "1")
    monkeypatch.setenv("SGLANG_DIFFKV_LOG_INTERVAL", "1")
    monkeypatch.setenv("SGLANG_DIFFKV_FUSED_ARGMIN", fused)
    used = count_record_use(monkeypatch)
    shape = H.ModelShape(dtype=torch.bfloat16)
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8), graph_bs=(1, 2, 4))
    backend = s.runner.attn_backend
    assert backend.graphs is not None and sorted(backend.graphs.steps) == [1, 2, 4]
    # one scratch arena serves every batch size's plan
    arena = backend.graphs.arena.buf
    plans = [st.plans[shape.num_q_heads] for st in backend.graphs.steps.values()]
    assert all(p.acc.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
               for p in plans)
    s.add_request("a", [(7 * i) % 997 + 1 for i in range(45)], 14)
    s.add_request("b", [(3 * i) % 991 + 2 for i in range(30)], 10)
    s.add_request("c", [(5 * i) % 983 + 3 for i in range(38)], 6)
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        s.run_until_idle()
    # batches of 3 (padded to 4), then 2 and 1
    assert s.graph_replays == 13 and s.padded_rows_seen == 5
    compared = replay_on_reference(s, tol=2e-2)
    assert compared == {"extend": 3, "decode": 13 + 9 + 5}
    pad = s.kv_pool.pad_req
    assert pad == 0  # SGLang's own padding row: its ReqToTokenPool never allocates it
    cache = s.kv_pool.cache
    assert not bool(cache.counts[pad].any()) and bool((cache.manager.table[pad] == -1).all())
    # the replayed steps still log, each at the next step's metadata (so the last one, with
    # no step after it, not yet)
    assert sum("DiffKV decode: batch" in r.getMessage() for r in caplog.records) == 12
    assert_back_to_initial_state(s)
    assert (used[0] > used[1] // 3) if fused == "1" else used == [0, 0], used


def test_finished_requests_are_freed_in_one_batched_call(monkeypatch):
    """SGLang releases finished requests one at a time; the pool returns their pages in one
    free_requests call, before anything reads the free count or takes pages."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 600, 8))
    for i, n in enumerate((30, 31, 32)):
        s.add_request(f"r{i}", [(5 * j + i) % 900 + 1 for j in range(n)], 6)
    kv, manager = s.kv_pool, s.kv_pool.cache.manager
    calls: list[list[int]] = []
    free_requests = manager.free_requests

    def spy(req_idx):
        calls.append(torch.as_tensor(req_idx).tolist())
        return free_requests(req_idx)

    monkeypatch.setattr(manager, "free_requests", spy)
    s.run_until_idle()
    assert len(s.finished) == 3
    # all three (one prefill batch, 6 tokens each) finished in the same step: released one
    # by one by SGLang, pending together, nothing freed yet
    assert calls == [] and len(kv._pending_free) == 3 and not kv.active
    held = manager.num_free_pages_host()
    kv.free_pages()  # what available_size() does on every scheduler iteration
    assert len(calls) == 1 and len(calls[0]) == 3
    assert manager.num_free_pages_host() == kv.num_pages > held
    assert_back_to_initial_state(s)


def test_a_stale_free_page_bound_never_overstates_the_free_pages(monkeypatch):
    # The scheduler reads free pages as a lower bound built from asynchronous copies of the
    # device count (FreePagesBound). Here the copies land only every other step, through
    # prefill, decode, page exhaustion (retraction) and frees: the bound must never exceed
    # the true count (else a decode allocation could fail), and the run must end as usual.
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", "no-compression")
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 40, 8))
    s.new_token_ratio = 0.05
    pool = s.kv_pool
    pool.free_bound = ManualFreePagesBound(pool.cache.manager.num_free_pages)
    for i in range(3):
        s.add_request(f"r{i}", [(i * 11 + j) % 900 + 1 for j in range(40)], 80)
    stale_reads = 0
    for step in range(10_000):
        ran = s.step()
        bound = pool.free_pages()  # (returns released requests' pages first)
        true_free = int(pool.cache.manager.num_free_pages())
        assert bound <= true_free, f"step {step} ({ran}): bound {bound} > free {true_free}"
        stale_reads += bound < true_free
        if step % 2:
            pool.free_bound.land()
        if ran == "idle" and not s.waiting:
            break
    assert stale_reads > 0  # the bound really lagged
    assert s.retractions >= 1
    assert sorted(r.rid for r in s.finished) == ["r0", "r1", "r2"]
    assert all(len(r.output_ids) == 80 for r in s.finished)
    assert_back_to_initial_state(s)


@pytest.mark.parametrize("bad", [
    {"diffkv_alpha_h": "abc"}, {"diffkv_alpha_h": None}, {"diffkv_alpha_h": [1.0]},
    {"diffkv_alpha_h": 10**400}, {"diffkv_alpha_h": 0.1, "diffkv_alpha_l": 0.5},
    {"diffkv_alpha_hh": 2.0},
])
def test_a_bad_request_that_reaches_the_scheduler_fails_alone(monkeypatch, bad):
    """The tokenizer manager's check (request_check.verify_hook) stops these first; a request
    that reaches a scheduler anyway is aborted alone: the valid request beside it in the same
    prefill batch is served, and no slot or page leaks."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    # Req.set_finish_with_abort logs on TP rank 0: one rank, no process group on the CPU
    import sglang.srt.managers.schedule_batch as sb
    monkeypatch.setattr(sb, "get_parallel", lambda: types.SimpleNamespace(tp_rank=0))
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 400, 8))
    s.add_request("good", list(range(1, 41)), 3)
    bad_req = s.add_request("bad", list(range(1, 41)), 3)
    bad_req.sampling_params.custom_params = dict(bad)  # past the tokenizer manager's check
    s.run_until_idle()
    done = {r.rid: r for r in s.finished}
    assert set(done) == {"good", "bad"}
    assert len(done["good"].output_ids) == 3 and done["good"].finished_reason.__class__.__name__ \
        == "FINISH_LENGTH"
    reason = done["bad"].finished_reason
    assert type(reason).__name__ == "FINISH_ABORT"
    key = next(iter(bad)) if len(bad) == 1 else "diffkv_alpha_l"
    assert key in reason.message, reason.message
    assert_back_to_initial_state(s)
