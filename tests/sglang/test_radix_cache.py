"""Radix prefix sharing under SGLang's own scheduler classes (the CPU harness with
``radix=True``: the tree comes from SGLang's registry, ``create_tree_cache`` with
``--radix-cache-backend diffkv``; PrefillAdder with the admission hook, prepare_for_extend,
cache_unfinished_req / cache_finished_req / release_kv_cache, retract_decode, SGLang's idle
checks).

The rules (docs/backend.md, "Radix prefix sharing: built"):

- a request whose prompt shares a ``cut``-aligned prefix (SGLANG_DIFFKV_RADIX_CUT, 16 here)
  with a prompt already in the tree hits its longest such prefix, below its last token;
- the first request of a prefix runs exactly as without sharing (its export copies its pages);
- a later request holds, per row and tier, the exporter's tokens before the cut bit for bit,
  then its suffix's. With a config that keeps every token high (alpha 0: nothing pruned,
  demoted or evicted, so the stored bytes do not depend on scores), its decode rows equal
  the run without sharing bit for bit, and its suffix rows are within the K8V4 bound of the
  exact prefill (``prompt_bound``: the prefix is read quantised instead of exact);
- every page is owned exactly once (invariants; every live handle is held by tree nodes or
  a pending export), SGLang's idle check balances with a populated tree, and every page is
  free once the tree is flushed;
- a request whose diffkv thresholds differ from the tree's misses.
"""

from __future__ import annotations

import json
import logging
import random

import harness as H
import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.registry import get_radix_cache_factory
from sglang.srt.server_args import ServerArgs, prepare_server_args
from test_chunked_prefill import outputs_by_position, prompt_bound

from sglang_diffkv.sglang.args import DiffKVUnsupportedError
from sglang_diffkv.sglang.radix import DiffKVRadixCache, create_tree_cache

CUT = 16
COMPRESSING = {"preset": "llama-3-8b", "alpha_h": 1.5, "alpha_l": 0.4, "window": 8,
               "score_queries": 8, "allow_other_model": True}
ALL_HIGH = dict(COMPRESSING, alpha_h=0.0, alpha_l=0.0)


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    H.cpu_sglang_helpers(monkeypatch)
    monkeypatch.setenv("SGLANG_DIFFKV_RADIX_CUT", str(CUT))


def system(n: int, seed: int) -> list[int]:
    return [(7 * i + 31 * seed) % 997 + 1 for i in range(n)]


def sched(config: dict, radix: bool = True, pages: int = 600, chunk: int | None = None,
          monkeypatch=None, **kw) -> H.MiniScheduler:
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(config))
    return H.MiniScheduler(H.ModelShape(), H.budget_for_pages(H.ModelShape(), pages, 8),
                           radix=radix, chunked_prefill_size=chunk, **kw)


def first_extend_prefix(s: H.MiniScheduler) -> dict[str, int]:
    """Each request's prefix at its first extend (its tree hit), by rid."""
    out = {}
    for rec in s.records:
        if rec.mode != "extend":
            continue
        at = 0
        for b, rid in enumerate(rec.rids):
            start = int(rec.positions[at])
            out.setdefault(rid, start)
            at += rec.seq_lens[b] - start
    return out


def check_ownership(s: H.MiniScheduler) -> None:
    """Every page owned exactly once, every live handle held by tree nodes or a pending
    export (never both), every node's handle covering the node."""
    m = s.kv_pool.cache.manager
    m.check_invariants()
    tree = s.tree_cache
    if not isinstance(tree, DiffKVRadixCache):
        assert not m.handles
        return
    held = set(tree.handle_nodes)
    pending = {h.key for h, _ in s.kv_pool.radix.exports.values()}
    assert not held & pending
    assert set(m.handles) == held | pending
    nodes: dict[int, set] = {}
    stack = [(tree.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        for child in node.children.values():
            end = depth + len(child.key)
            h = child.diffkv_handle
            assert h is not None and h.num_tokens >= end
            assert h is m.handles[h.key]  # (the live handle, truncated or not)
            nodes.setdefault(h.key, set()).add(child)
            stack.append((child, end))
    assert nodes == tree.handle_nodes


def assert_idle_and_flush(s: H.MiniScheduler) -> None:
    check_ownership(s)
    leak, msg = s.idle_leak_check()  # SGLang's own strict idle check, with the tree populated
    assert not leak, msg
    assert not s.req_pool_leak()
    alloc = s.token_to_kv_pool_allocator
    assert alloc.available_size() + s.tree_cache.evictable_size() == alloc.size
    s.flush_cache()
    check_ownership(s)
    leak, msg = s.idle_leak_check()
    assert not leak, msg
    m = s.kv_pool.cache.manager
    assert m.num_free_pages_host() == s.kv_pool.num_pages and not m.handles
    assert alloc.available_size() == alloc.size


# ---- arguments and registration --------------------------------------------------------------


def test_server_args_select_the_diffkv_tree(caplog, monkeypatch):
    # (SGLang's logging set-up, once the harness imported it, stops propagation)
    monkeypatch.setattr(logging.getLogger("sglang_diffkv"), "handlers",
                        [*logging.getLogger("sglang_diffkv").handlers, caplog.handler])
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        a = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv"])
    assert a.radix_cache_backend == "diffkv" and not a.disable_radix_cache
    assert any("radix_cache_backend=diffkv" in r.getMessage() for r in caplog.records)
    assert get_radix_cache_factory("diffkv") is create_tree_cache
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        a = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv",
                                 "--disable-radix-cache"])
    assert a.disable_radix_cache and a.radix_cache_backend is None  # SGLang's chunk cache
    assert any("radix cache off" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        a = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv",
                                 "--tp-size", "2"])
    assert a.disable_radix_cache and a.radix_cache_backend is None
    assert any("forcing disable_radix_cache=True" in r.getMessage() for r in caplog.records)
    with pytest.raises(DiffKVUnsupportedError, match="--radix-cache-backend lmc"):
        ServerArgs(model_path="dummy", attention_backend="diffkv", radix_cache_backend="lmc")
    with pytest.raises(DiffKVUnsupportedError, match="--enable-lmcache"):
        ServerArgs(model_path="dummy", attention_backend="diffkv", enable_lmcache=True)
    a = prepare_server_args(["--model-path", "dummy", "--attention-backend", "triton"])
    assert a.radix_cache_backend is None  # other backends: SGLang's own chain


def test_disabled_radix_cache_is_stage_one(monkeypatch):
    """--disable-radix-cache: SGLang's chunk cache, no hits, no exports."""
    s = sched(COMPRESSING, radix=False, monkeypatch=monkeypatch)
    assert isinstance(s.tree_cache, ChunkCache) and s.kv_pool.radix is None
    sys_p = system(40, 1)
    s.add_request("a", sys_p + [3, 4, 5], 3)
    s.run_until_idle()
    s.add_request("b", sys_p + [6, 7], 3)
    s.run_until_idle()
    assert first_extend_prefix(s) == {"a": 0, "b": 0}
    assert not s.kv_pool.cache.manager.handles
    leak, msg = s.idle_leak_check()
    assert not leak, msg


# ---- hits ---------------------------------------------------------------------------------


def test_requests_hit_the_longest_aligned_prefix(monkeypatch):
    s = sched(COMPRESSING, monkeypatch=monkeypatch)
    assert isinstance(s.tree_cache, DiffKVRadixCache)
    sys_p = system(40, 2)  # 2 whole cuts (32 tokens) and a bit
    s.add_request("a", sys_p + [3, 4, 5, 6], 4)
    s.run_until_idle()
    s.add_request("b", sys_p + [9, 9], 4)  # the same 40 tokens: hits 32
    s.add_request("c", sys_p[:20] + [8] * 30, 4)  # 20 shared: hits 16
    s.add_request("d", [5] + sys_p[1:], 4)  # differs at the first token: misses
    s.add_request("e", sys_p[:12], 4)  # shorter than a cut: misses
    s.add_request("f", sys_p[:33], 4)  # 33 tokens: its last token is computed, hits 32
    s.add_request("g", sys_p[:32], 4)  # 32 tokens: at most 31 may hit, so 16
    s.run_until_idle()
    got = first_extend_prefix(s)
    assert got == {"a": 0, "b": 32, "c": 16, "d": 0, "e": 0, "f": 32, "g": 16}
    assert s.kv_pool.radix_counts["attached"] == 4
    # a request that arrives while the first is still decoding hits it too (its prompt
    # entered the tree right after its prefill)
    s.add_request("h", sys_p + [1] * 10, 8)
    s.step()  # h's prefill
    s.add_request("i", sys_p + [1] * 10 + [2] * 5, 2)
    s.run_until_idle()
    assert first_extend_prefix(s)["i"] == 48  # h's prompt: 40 + 10 tokens, 3 cuts
    assert_idle_and_flush(s)


def test_other_thresholds_miss(monkeypatch):
    s = sched(COMPRESSING, monkeypatch=monkeypatch)
    sys_p = system(40, 3)
    own = {"diffkv_alpha_h": 2.5, "diffkv_alpha_l": 0.1}
    s.add_request("a", sys_p + [3], 3)
    s.run_until_idle()
    s.add_request("b", sys_p + [4], 3, custom_params=own)  # other thresholds: a miss
    s.run_until_idle()
    s.add_request("c", sys_p + [5], 3, custom_params=own)  # hits b's
    s.add_request("d", sys_p + [6], 3,  # the config's own values: the default namespace
                  custom_params={"diffkv_alpha_h": COMPRESSING["alpha_h"]})
    s.run_until_idle()
    assert first_extend_prefix(s) == {"a": 0, "b": 0, "c": 32, "d": 32}
    reqs = {r.rid: r for r in s.finished}
    assert reqs["b"].extra_key == reqs["c"].extra_key == "diffkv_alpha=2.5,0.1"
    assert reqs["a"].extra_key is None and reqs["d"].extra_key is None
    assert_idle_and_flush(s)


# ---- outputs --------------------------------------------------------------------------------


def test_the_first_request_runs_as_without_sharing(monkeypatch):
    """Compressing config: the exporter's every output equals the run without sharing,
    however many requests hit it while it decodes: prompt rows bit for bit, decode rows to
    fp32 rounding (a batch's decode reductions are padded to its longest row, and the
    requests batched with it compress their suffixes differently with sharing)."""
    sys_p = system(50, 4)
    reqs = [("a", sys_p + [3, 4, 5], 12), ("b", sys_p + [6] * 9, 6),
            ("c", sys_p[:35] + [7] * 20, 6)]
    runs = {}
    for radix in (False, True):
        s = sched(COMPRESSING, radix=radix, monkeypatch=monkeypatch)
        s.add_request(*reqs[0])
        s.step()  # a's prefill: its prompt is in the tree
        for r in reqs[1:]:
            s.add_request(*r)
        s.run_until_idle()
        runs[radix] = s
    assert first_extend_prefix(runs[True]) == {"a": 0, "b": 48, "c": 32}
    plain, shared = outputs_by_position(runs[False]), outputs_by_position(runs[True])
    mine = [k for k in plain if k[0] == "a"]
    assert len(mine) == 53 + 11
    for k in mine:
        if k[1] < 53:
            assert torch.equal(plain[k], shared[k]), k
        else:
            torch.testing.assert_close(shared[k], plain[k], rtol=1e-5, atol=1e-5)
    assert_idle_and_flush(runs[True])


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole", "chunked"])
def test_later_requests_with_every_token_high(monkeypatch, chunk):
    """Nothing pruned or demoted: a hit's decode rows equal the run without sharing bit for
    bit, its suffix rows are within the K8V4 bound of the exact prefill; chunked prefill
    on (its suffix over the hit in several chunks) or off."""
    sys_p = system(50, 5)
    reqs = [("a", sys_p + [3, 4, 5], 6), ("b", sys_p + [6] * 30, 8),
            ("c", sys_p[:40] + [7] * 45, 8)]
    runs = {}
    for radix in (False, True):
        s = sched(ALL_HIGH, radix=radix, chunk=chunk, monkeypatch=monkeypatch)
        s.add_request(*reqs[0])
        s.run_until_idle()
        for r in reqs[1:]:
            s.add_request(*r)
        s.run_until_idle()
        runs[radix] = s
    assert first_extend_prefix(runs[True]) == {"a": 0, "b": 48, "c": 32}
    plain, shared = outputs_by_position(runs[False]), outputs_by_position(runs[True])
    hits = first_extend_prefix(runs[True])
    assert set(plain) - set(shared) == {(rid, i) for rid, cut in hits.items()
                                        for i in range(cut)}  # (the hits are not computed)
    for rid, ids, _ in reqs[1:]:
        cut = first_extend_prefix(runs[True])[rid]
        n = len(ids)
        for pos in range(n, n + 7):  # decode rows: the same bytes in the same order
            assert torch.equal(plain[rid, pos], shared[rid, pos]), (rid, pos)
        rows = list(range(cut, n))
        for layer in range(H.ModelShape().num_layers):
            w = torch.stack([plain[rid, i][layer] for i in rows])
            c = torch.stack([shared[rid, i][layer] for i in rows])
            bound = prompt_bound(ids, cut, rows, w, ALL_HIGH, layer)
            assert ((c - w).abs() <= bound + 1e-4).all(), (rid, layer)
    assert_idle_and_flush(runs[True])


# ---- eviction, aborts, retractions ------------------------------------------------------------


def test_tree_eviction_returns_pages_to_admission(monkeypatch):
    """A pool too small for the tree and a new prompt: admission evicts least recently used
    nodes (releasing their handles) until the prompt fits."""
    s = sched(COMPRESSING, pages=64, monkeypatch=monkeypatch)
    for i in range(4):
        s.add_request(f"p{i}", system(60, 10 + i), 2)
        s.run_until_idle()
        check_ownership(s)
    m = s.kv_pool.cache.manager
    held = set(m.handles)
    big = system(200, 50)
    need = s.kv_pool.prefill_pages(len(big)) + s.kv_pool.decode_reserve_pages(1)
    assert len(held) == 4 and s.kv_pool.exact_free_pages() < need <= s.kv_pool.num_pages
    s.add_request("big", big, 2)
    s.run_until_idle()
    check_ownership(s)
    assert s.tree_cache.stats["released"] >= 1 and not held <= set(m.handles)
    # SGLang's own logical eviction (evict_from_tree_cache) releases handles too
    s.tree_cache.evict(EvictParams(num_tokens=10**6))
    check_ownership(s)
    assert not m.handles and m.num_free_pages_host() == s.kv_pool.num_pages
    assert_idle_and_flush(s)


def test_evicting_a_prompts_own_tail_truncates_its_handle(monkeypatch):
    """A prompt whose first tokens other prompts share: once its own tail is evicted, the
    node it keeps (the shared part) still holds its handle, truncated to that node's end (the
    next cut), so the tail's pages come back; a later hit attaches the truncated handle."""
    s = sched(COMPRESSING, monkeypatch=monkeypatch)
    sys_p = system(70, 6)
    s.add_request("a", sys_p + [3 + i % 50 for i in range(300)], 2)  # a's own tail: 300
    s.run_until_idle()
    s.add_request("b", sys_p + [4] * 20, 2)  # splits a's node at 70
    s.run_until_idle()
    m = s.kv_pool.cache.manager
    (a_key,) = [k for k, h in m.handles.items() if h.num_tokens == 370]
    tree = s.tree_cache
    ends = sorted(tree._end(n) for n in tree.handle_nodes[a_key])
    assert ends == [64, 70, 368]  # (b's match split a's node at its cut, its insert at 70)
    free = s.kv_pool.exact_free_pages()
    while 368 in [tree._end(n) for n in tree.handle_nodes[a_key]]:
        tree.evict(EvictParams(num_tokens=1))  # least recently used leaves: a's tail first
    assert tree.stats["truncated"] == 1 and tree.stats["released"] == 0
    check_ownership(s)
    short = m.handles[a_key]
    assert short.num_tokens == 80  # the shared node ends at 70: the next cut
    assert s.kv_pool.exact_free_pages() > free
    s.add_request("c", sys_p + [5] * 9, 2)  # hits 64 tokens of the truncated handle
    s.run_until_idle()
    assert first_extend_prefix(s)["c"] == 64
    assert_idle_and_flush(s)


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefix_traffic(monkeypatch, seed):
    """Random requests over a few system prompts with diverging suffixes, some with other
    thresholds, chunked prefill on or off, a small pool (retractions and tree evictions),
    aborts of waiting and running requests: ownership after every step, every request
    finished, SGLang's idle check with the tree populated, every page free after the
    flush."""
    rng = random.Random(seed)
    chunk = 24 if seed % 2 else None
    s = sched(COMPRESSING, pages=rng.choice((64, 80)), chunk=chunk,
              monkeypatch=monkeypatch)
    prompts = [system(rng.randint(20, 70), 100 * seed + i) for i in range(3)]
    sent = 0
    for _ in range(60):
        for _ in range(rng.choice((0, 0, 1, 2))):
            base = rng.choice(prompts)
            ids = base[:rng.randint(1, len(base))] + [rng.randint(1, 999)
                                                        for _ in range(rng.randint(1, 30))]
            params = {"diffkv_alpha_h": 2.0} if rng.random() < 0.15 else None
            if rng.random() < 0.1:
                ids = rng.choice(prompts)[:rng.randint(1, 40)]  # all of it in the tree, maybe
            s.add_request(f"r{sent}", ids, rng.randint(1, 40), custom_params=params)
            sent += 1
        if rng.random() < 0.12 and (s.waiting or (s.running and s.running.reqs)):
            pool = [r.rid for r in s.waiting] + [r.rid for r in
                                                 (s.running.reqs if s.running else [])
                                                 if not r.finished()]
            s.abort(rng.choice(pool))
        if rng.random() < 0.05:
            s.tree_cache.evict(EvictParams(num_tokens=rng.randint(1, 64)))
        if s.chunked_req is not None and rng.random() < 0.2:
            s.abort_chunked()  # (between two chunks, as process_pending_chunked_abort does)
        s.step()
        check_ownership(s)
    s.run_until_idle()
    check_ownership(s)
    assert len(s.finished) == sent
    attached = s.kv_pool.radix_counts["attached"]
    assert attached > 0  # (the traffic shares prefixes)
    assert_idle_and_flush(s)


@pytest.mark.parametrize("seed", range(2))
def test_hit_rate_is_what_the_tree_holds(monkeypatch, seed):
    """With room for everything (no eviction, no retraction): every request's hit is the
    longest prefix it shares with a prompt whose prefill completed before its own began,
    rounded down to the cut, below its last token."""
    rng = random.Random(seed)
    s = sched(COMPRESSING, pages=2000, chunk=rng.choice((None, 40)), monkeypatch=monkeypatch)
    prompts = [system(rng.randint(30, 90), 7 * seed + i) for i in range(3)]
    ids_of: dict[str, list[int]] = {}
    for _ in range(80):
        if len(ids_of) < 30:
            for _ in range(rng.choice((0, 1, 1, 2))):
                base = rng.choice(prompts)
                ids = base[:rng.randint(10, len(base))] + [rng.randint(1, 999) for _ in
                                                           range(rng.randint(0, 20))]
                rid = f"r{len(ids_of)}"
                ids_of[rid] = ids
                s.add_request(rid, ids, rng.randint(1, 6))
        s.step()
    s.run_until_idle()
    assert s.retractions == 0 and s.tree_cache.stats["released"] == 0
    began: dict[str, int] = {}  # rid -> the step of its first extend
    completed: dict[str, int] = {}  # rid -> the step its prompt's prefill completed
    for i, rec in enumerate(s.records):
        if rec.mode != "extend":
            continue
        at = 0
        for b, rid in enumerate(rec.rids):
            start = int(rec.positions[at])
            at += rec.seq_lens[b] - start
            began.setdefault(rid, i)
            if rec.seq_lens[b] == len(ids_of[rid]):
                completed.setdefault(rid, i)

    def lcp(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    got = first_extend_prefix(s)
    hits = 0
    for rid, ids in ids_of.items():
        want = 0
        for other, theirs in ids_of.items():
            if completed.get(other, len(s.records)) < began[rid]:
                held = len(theirs) // CUT * CUT  # what the tree holds of it
                want = max(want, min(lcp(ids, theirs), held, len(ids) - 1) // CUT * CUT)
        assert got[rid] == want, (rid, got[rid], want)
        hits += want > 0
    assert hits >= 5
    assert_idle_and_flush(s)


def test_kernel_path_shares_prefixes_as_copies(monkeypatch):
    """The Triton path (interpreter): an attached prefix is copied into the request's own
    pages (the decode kernels do not skip shared tokens), the cut counts come from the
    compress kernel's tiers and equal the reference path's, hits are the same, and the
    outputs agree within bf16 rounding with the reference path copying too (a copied
    prefix's tokens may be demoted or evicted by the decode policy, a shared one's never);
    ownership and the idle check as always."""
    shape = H.ModelShape(dtype=torch.bfloat16)
    sys_p = system(50, 9)
    runs = []
    for kernels in ("1", "0"):
        monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", kernels)
        monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
        s = H.MiniScheduler(shape, H.budget_for_pages(shape, 400, 8), radix=True)
        assert s.kv_pool.radix.copy_attach == (kernels == "1")
        s.kv_pool.radix.copy_attach = True
        s.add_request("a", sys_p + [3, 4], 4)
        s.run_until_idle()
        cuts = s.tree_cache.root_node.children[sys_p[0]].diffkv_handle.cuts.clone()
        s.add_request("b", sys_p + [5] * 12, 5)
        s.add_request("c", sys_p[:40] + [6] * 7, 5)
        s.run_until_idle()
        if kernels == "1":
            assert not s.kv_pool.cache.manager.shared.any()
        check_ownership(s)
        runs.append((s, cuts, outputs_by_position(s)))
        assert_idle_and_flush(s)
    (sk, ck, ok), (sr, cr, orr) = runs
    assert first_extend_prefix(sk) == first_extend_prefix(sr) == {"a": 0, "b": 48, "c": 32}
    assert torch.equal(ck, cr)
    assert ok.keys() == orr.keys()
    for key in ok:
        w = orr[key].double()
        assert float(torch.linalg.norm(ok[key].double() - w) / torch.linalg.norm(w)) < 2e-2, key


def test_the_step_profile_says_where_prefill_time_goes(monkeypatch, caplog):
    """SGLANG_DIFFKV_PROFILE=1 on a run with chunks and radix hits: the prefill parts line
    times attention, chunk stores, prompt ends and exports, within the step."""
    from sglang_diffkv.serving_io.profile_lines import PART_BUCKETS, parse_parts_line

    monkeypatch.setenv("SGLANG_DIFFKV_PROFILE", "1")
    monkeypatch.setenv("SGLANG_DIFFKV_LOG_INTERVAL", "1")
    sys_p = system(50, 6)
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        s = sched(COMPRESSING, chunk=24, monkeypatch=monkeypatch)
        s.add_request("a", sys_p + [3, 4, 5], 4)
        s.run_until_idle()
        s.add_request("b", sys_p + [6] * 30, 4)  # a hit, its suffix in two chunks
        s.run_until_idle()
    parts = [p for r in caplog.records if (p := parse_parts_line(r.getMessage()))]
    assert parts and all(p["mode"] == "prefill" for p in parts)
    total = {b: sum(p[f"{b}_ms"] * p["steps"] for p in parts) for b in PART_BUCKETS}
    assert all(total[b] > 0 for b in ("attend", "chunk", "end", "export")), total
    for p in parts:
        # (the spans are host-clock on the CPU; each sits inside its step)
        assert sum(p[f"{b}_ms"] for b in PART_BUCKETS) <= p["step_ms"] * 1.001 + 1e-3
    assert_idle_and_flush(s)
