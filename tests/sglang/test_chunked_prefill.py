"""Chunked prefill with compressed KV under SGLang's own scheduler classes (the CPU harness:
PrefillAdder.add_chunked_req, ChunkCache.cache_unfinished_req, ScheduleBatch with a
chunked_req, release_kv_cache / retract_all, SGLang's idle checks).

A prompt longer than ``--chunked-prefill-size`` is prefilled over several extend steps. The
rule (docs/backend.md, "Stage 2"): chunks before the last are stored at the high tier (K8V4),
unscored; the last chunk scores the whole prompt with its last ``score_queries`` queries
(those of earlier chunks kept per request when the last chunk is shorter) over the stored
chunks and its own tokens, and classifies every token with the prefill policy.

Compared with the same requests prefilled whole (``chunked_prefill_size`` None), per request
and position (batching differs between the runs, a request's outputs do not depend on it):

- scores: each token's significance within the factor exp(+-2 eps) of the whole prompt's,
  eps = scale * max_j sum_d |q_d| e_k(j, d) over the scoring queries and the stored keys
  (e_k: half a K8 step); tier decisions equal wherever no threshold lies in that band (on
  these prompts: everywhere);
- prompt rows of a chunk after the first: within max e_v + (exp(2 eps) - 1) * max |v - o|
  elementwise (eps of that row's query over the stored chunks; e_v: half a V4 step);
- decode rows: relative error below DECODE_TOL (stated; measured 5e-3: the earlier
  chunks' low-tier tokens are re-quantised from their K8V4 copy, as a decode demotion does);
  with no low tier (alpha_h = alpha_l), and so K8V4 bytes kept bit for bit, to fp32 rounding.
"""

from __future__ import annotations

import json
import os

import harness as H
import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.policy import contributing_queries, thresholds
from sglang_diffkv.quant import error_bound, quantize

COMPRESSING = {"preset": "llama-3-8b", "alpha_h": 1.5, "alpha_l": 0.4, "window": 8,
               "score_queries": 8, "allow_other_model": True}
NO_LOW_TIER = dict(COMPRESSING, alpha_h=0.4)
DECODE_TOL = 2e-2


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    H.cpu_sglang_helpers(monkeypatch)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 13 * seed) % 997 + 1 for i in range(n)]


@pytest.fixture
def classified(monkeypatch):
    """Every prefill classification: (request slot, significance sum [Hkv, L], tiers
    [Hkv, L]) per call and request, in call order (layers in order)."""
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    orig = CompressedKVCache.classify

    def spy(self, req_idx, lengths, sig):
        cls = orig(self, req_idx, lengths, sig)
        for b, (r, n) in enumerate(zip(self._index(req_idx).tolist(), lengths.tolist(),
                                       strict=True)):
            calls.append((r, sig[b, :, :n].clone(), cls.tier[b, :, :n].clone()))
        return cls

    monkeypatch.setattr(CompressedKVCache, "classify", spy)
    return calls


def run(config: dict, requests: list[tuple[str, list[int], int]], chunk: int | None,
        pages: int = 600, **kw) -> H.MiniScheduler:
    s = H.MiniScheduler(H.ModelShape(), H.budget_for_pages(H.ModelShape(), pages, 8),
                        chunked_prefill_size=chunk, **kw)
    for rid, ids, new in requests:
        s.add_request(rid, ids, new)
    s.run_until_idle()
    return s


def outputs_by_position(s: H.MiniScheduler) -> dict[tuple[str, int], torch.Tensor]:
    """(rid, position) -> attention outputs [layers, Hq * D] (the last computation of that
    position: a retracted request recomputes its positions)."""
    out = {}
    for rec in s.records:
        if rec.mode == "extend":
            at = 0
            for b, rid in enumerate(rec.rids):
                # fresh rows: tokens after the step less the chunk's first position (its prefix)
                end = at + (rec.seq_lens[b] - int(rec.positions[at]))
                for i in range(at, end):
                    out[rid, int(rec.positions[i])] = torch.stack([o[i] for *_, o in rec.layers])
                at = end
        else:
            for b, rid in enumerate(rec.rids):
                out[rid, int(rec.positions[b])] = torch.stack([o[b] for *_, o in rec.layers])
    return out


def assert_idle(s: H.MiniScheduler) -> None:
    kv, cache = s.kv_pool, s.kv_pool.cache
    alloc = s.token_to_kv_pool_allocator
    assert alloc.logical_available_size() == alloc.available_size() == alloc.size
    leak, msg = s.idle_leak_check()  # SGLang's own strict idle check
    assert not leak, msg
    assert not s.req_pool_leak()
    assert not kv.active and not kv._pending_free and not kv.chunked and not kv.prompt_len
    cache.manager.check_invariants()
    assert cache.manager.num_free_pages_host() == kv.num_pages
    assert bool((cache.manager.table == -1).all()) and not bool(cache.manager.counts.any())
    assert not cache._score_queries


def significance_band(ids: list[int], stored: int, config: dict, layer: int
                      ) -> torch.Tensor:
    """exp(2 eps) - 1 per KV head [Hkv]: the factor within which the last chunk's scores
    (keys 0..stored-1 quantised to K8) may differ from the whole prompt's."""
    shape = H.ModelShape()
    cfg = DiffKVConfig.from_dict(config)
    n, d, hkv = len(ids), shape.head_dim, shape.num_kv_heads
    pos = torch.arange(n)
    q, k, _ = H.fake_qkv(torch.tensor(ids), pos, layer, shape)
    q = q.float().view(n, shape.num_q_heads, d)
    k = k.float().view(n, hkv, d)[:stored]
    ek = error_bound(quantize(k, cfg.high.key_bits, cfg.high.key_groups).scale, d)
    nq = min(cfg.score_queries, n)
    qs = q[n - nq:].abs().view(nq, hkv, -1, d)  # the scoring queries, by KV head
    eps = shape.scaling * torch.einsum("qhgd,jhd->hqgj", qs, ek).amax((1, 2, 3))
    return torch.expm1(2 * eps)


def assert_same_decisions(whole, chunked, ids, stored, config, slot_w, slot_c):
    """Per layer: scores within the band, tiers equal wherever no threshold is in it."""
    cfg = DiffKVConfig.from_dict(config)
    w = [(sig, tier) for r, sig, tier in whole if r == slot_w]
    c = [(sig, tier) for r, sig, tier in chunked if r == slot_c]
    assert len(w) == len(c) == H.ModelShape().num_layers
    n = len(ids)
    count = contributing_queries(torch.tensor([n]), n, cfg.score_queries)[0].float()
    t = [float(thresholds(torch.tensor(a), torch.tensor(n))) for a in (cfg.alpha_h,
                                                                        cfg.alpha_l)]
    flips = 0
    for layer, ((sw, tw), (sc, tc)) in enumerate(zip(w, c, strict=True)):
        band = significance_band(ids, stored, config, layer)[:, None]  # [Hkv, 1]
        assert ((sc - sw).abs() <= sw * band + 1e-5).all(), layer
        mean = sw / count
        near = torch.zeros_like(mean, dtype=torch.bool)
        for thr in t:
            near |= (mean / (1 + band) <= thr) & (thr <= mean * (1 + band))
        assert bool((tw == tc)[~near].all()), layer
        flips += int((tw != tc).sum())
    return flips


def prompt_bound(ids, stored, positions, o_whole, config, layer):
    """Elementwise bound [len(positions), Hq * D] on |chunked - whole| for the rows of a
    chunk whose first ``stored`` tokens were stored at K8V4 (docs/backend.md)."""
    shape = H.ModelShape()
    cfg = DiffKVConfig.from_dict(config)
    n, d, hq, hkv = len(ids), shape.head_dim, shape.num_q_heads, shape.num_kv_heads
    g = hq // hkv
    q, k, v = (x.float() for x in H.fake_qkv(torch.tensor(ids), torch.arange(n), layer, shape))
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    ek = error_bound(quantize(k[:stored], cfg.high.key_bits, cfg.high.key_groups).scale, d)
    ev = error_bound(quantize(v[:stored], cfg.high.value_bits, cfg.high.value_groups).scale, d)
    ek, ev = ek.repeat_interleave(g, 1), ev.repeat_interleave(g, 1)  # [stored, Hq, D]
    vg = v.repeat_interleave(g, 1)
    rows = []
    for r, i in enumerate(positions):
        o = o_whole[r].view(hq, d)
        eps = shape.scaling * (q[i].abs()[None] * ek).sum(-1).amax(0)  # [Hq]
        spread = (vg[:i + 1] - o).abs().amax(0)
        rows.append((ev.amax(0) + torch.expm1(2 * eps)[:, None] * spread).reshape(-1))
    return torch.stack(rows)


def compare_outputs(sw, sc, config, prompts: dict[str, list[int]], chunk: int,
                    decode_tol: float = DECODE_TOL) -> dict[str, float]:
    """Every (request, position) of the chunked run against the whole run: prompt rows of
    chunks after the first within ``prompt_bound``, first chunks and unchunked prompts to
    fp32 rounding, decode rows within ``decode_tol`` (relative, per request)."""
    ow, oc = outputs_by_position(sw), outputs_by_position(sc)
    assert ow.keys() == oc.keys()
    starts = {}
    for rid, p, _ in sc.chunks:
        starts.setdefault(rid, []).append(p)
    worst = {"prompt": 0.0, "decode": 0.0}
    for rid, ids in prompts.items():
        n = len(ids)
        chunk_starts = sorted(set(starts[rid]))
        for layer in range(H.ModelShape().num_layers):
            for a, b in zip(chunk_starts, [*chunk_starts[1:], n], strict=True):
                pos = list(range(a, b))
                w = torch.stack([ow[rid, i][layer] for i in pos])
                c = torch.stack([oc[rid, i][layer] for i in pos])
                if a == 0:
                    torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-5)
                    continue
                bound = prompt_bound(ids, a, pos, w, config, layer)
                err = (c - w).abs()
                assert (err <= bound + 1e-4).all(), (rid, layer, a, float((err - bound).max()))
                worst["prompt"] = max(worst["prompt"], float((err / (bound + 1e-4)).max()))
        dec = sorted(p for r, p in ow if r == rid and p >= n)
        if dec:
            w = torch.stack([ow[rid, p] for p in dec]).double()
            c = torch.stack([oc[rid, p] for p in dec]).double()
            rel = float(torch.linalg.norm(c - w) / torch.linalg.norm(w))
            assert rel < decode_tol, (rid, rel)
            worst["decode"] = max(worst["decode"], rel)
    return worst


def slot_of(s: H.MiniScheduler, rid: str) -> int:
    for rec in s.records:
        if rid in rec.rids and rec.mode == "extend":
            return rec.req_pool_indices[rec.rids.index(rid)]
    raise KeyError(rid)


# ---- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [COMPRESSING, NO_LOW_TIER], ids=["low-tier", "no-low-tier"])
def test_a_chunked_prompt_equals_the_whole_prompt(monkeypatch, classified, config):
    """A 100-token prompt in chunks of 32 (its last chunk of 4 tokens takes 4 of its 8
    scoring queries from the chunk before) and a 70-token one (28 + 32 + 10: its first
    chunk shares a step with the other's last, and its last holds all scoring queries),
    against the same prompts whole: decisions, stored counts and outputs by the module's
    rule."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(config))
    prompts = {"a": prompt(100), "b": prompt(70, 1)}
    reqs = [(rid, ids, 12) for rid, ids in prompts.items()]
    sw = run(config, reqs, None)
    whole = list(classified)
    classified.clear()
    sc = run(config, reqs, 32)
    for rid, ids in prompts.items():
        chunks = [(p, n) for r, p, n in sc.chunks if r == rid]
        stored, last = chunks[-1]
        assert chunks == {"a": [(0, 32), (32, 32), (64, 32), (96, 4)],
                          "b": [(0, 28), (28, 32), (60, 10)]}[rid]
        flips = assert_same_decisions(whole, classified, ids, stored, config,
                                      slot_of(sw, rid), slot_of(sc, rid))
        assert flips == 0, rid
    # same tier counts once the prompts are whole, row by row
    for rid in prompts:
        last = [r for r in sc.records if r.mode == "extend" and rid in r.rids][-1]
        first = next(r for r in sw.records if r.mode == "extend" and rid in r.rids)
        assert torch.equal(last.counts_after[last.rids.index(rid)],
                           first.counts_after[first.rids.index(rid)]), rid
    worst = compare_outputs(sw, sc, config, prompts, 32,
                            decode_tol=DECODE_TOL if config is COMPRESSING else 1e-5)
    assert worst["prompt"] > 0  # the stored chunks really went through the quantiser
    assert_idle(sc)


def run_script(config: dict, chunk: int | None, script: dict[int, list], pages: int = 600,
               on_step=None) -> H.MiniScheduler:
    """Requests arriving at given scheduler iterations ({iteration: [(rid, ids, new)]});
    ``on_step(s, iteration)`` runs after each iteration."""
    s = H.MiniScheduler(H.ModelShape(), H.budget_for_pages(H.ModelShape(), pages, 8),
                        chunked_prefill_size=chunk)
    for it in range(10_000):
        for rid, ids, new in script.get(it, []):
            s.add_request(rid, ids, new)
        ran = s.step()
        if on_step is not None:
            on_step(s, it)
        if ran == "idle" and not s.waiting and s.chunked_req is None and it > max(script):
            return s
    raise AssertionError("requests did not finish")


def test_chunks_run_between_decode_steps_of_other_requests(monkeypatch):
    """Two requests decode; a 150-token prompt arrives and is prefilled in chunks of 32
    (SGLang runs each chunk as a prefill step while the others wait); a short prompt
    arriving with it starts in its last chunk's step and ends in a step of its own; then
    all four decode together. With chunks of 32, SGLang also splits the second request
    (2 + 18 tokens: the first's 30 left 2 of the step's budget) and the short one (10 + 2:
    its last chunk shorter than score_queries). Outputs per request and position equal the
    whole-prompt run by the module's rule."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    prompts = {"d1": prompt(30, 2), "d2": prompt(20, 3), "long": prompt(150, 4),
               "short": prompt(12, 5)}
    script = {0: [("d1", prompts["d1"], 40), ("d2", prompts["d2"], 30)],
              5: [("long", prompts["long"], 10), ("short", prompts["short"], 8)]}
    sw = run_script(COMPRESSING, None, script)
    held = []
    sc = run_script(COMPRESSING, 32, script,
                    on_step=lambda s, it: held.append(dict(s.kv_pool.chunked)))
    assert sc.chunks == [("d1", 0, 30), ("d2", 0, 2), ("d2", 2, 18), ("long", 0, 32),
                         ("long", 32, 32), ("long", 64, 32), ("long", 96, 32),
                         ("long", 128, 22), ("short", 0, 10), ("short", 10, 2)]
    steps = [(rec.mode, rec.rids) for rec in sc.records]
    first = steps.index(("extend", ["long"]))
    assert steps[first - 3:first] == [("decode", ["d1", "d2"])] * 3  # decoding before
    assert steps[first + 4:first + 6] == [("extend", ["long", "short"]), ("extend", ["short"])]
    assert steps[first + 6][0] == "decode" and set(steps[first + 6][1]) == set(prompts)
    # the pool knows a prompt in chunks between its steps, and forgets it after the last
    assert any(held) and not held[-1]
    compare_outputs(sw, sc, COMPRESSING, prompts, 32)
    assert_idle(sc)


def test_a_prompt_of_many_chunks(monkeypatch, classified):
    """300 tokens in chunks of 8 (38 extend steps, the last of 4 tokens): every step keeps
    the page invariants, the pages reserved at the first chunk are all the prompt takes
    until its last chunk, which returns what compression freed; decisions as whole."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    ids = prompt(300, 6)
    sw = run(COMPRESSING, [("a", ids, 4)], None)
    whole = list(classified)
    classified.clear()
    free: list[int] = []

    def check(s, it):
        s.kv_pool.cache.manager.check_invariants()
        free.append(s.kv_pool.cache.manager.num_free_pages_host())

    sc = run_script(COMPRESSING, 8, {0: [("a", ids, 4)]}, on_step=check)
    chunks = [(p, n) for _, p, n in sc.chunks]
    assert len(chunks) == 38 and chunks[-1] == (296, 4)
    kv = sc.kv_pool
    rows = kv.cache.spec.heads_per_request
    reserved = kv.prefill_pages(300)
    assert reserved == (-(-300 // 32) + 1) * rows
    assert free[:37] == [kv.num_pages - reserved] * 37  # no page taken after the first
    assert free[37] > free[36]  # the last chunk compressed the prompt and reclaimed pages
    assert assert_same_decisions(whole, classified, ids, 296, COMPRESSING,
                                 slot_of(sw, "a"), slot_of(sc, "a")) == 0
    compare_outputs(sw, sc, COMPRESSING, {"a": ids}, 8)
    assert_idle(sc)


def test_an_abort_between_chunks_frees_every_page(monkeypatch):
    """The request in chunks is aborted between two chunks (Scheduler.
    process_pending_chunked_abort -> release_kv_cache): its reservation and slot come back
    at once, the request decoding beside it finishes, and the server ends idle with every
    page free (SGLang's strict idle check)."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    s = H.MiniScheduler(H.ModelShape(), H.budget_for_pages(H.ModelShape(), 600, 8),
                        chunked_prefill_size=32)
    s.add_request("d", prompt(30, 1), 20)
    s.step()
    s.step()
    kv = s.kv_pool
    before = kv.free_pages()
    s.add_request("long", prompt(200, 2), 10)
    s.step()
    s.step()
    slot = s.chunked_req.req_pool_idx
    assert kv.chunked == {slot: 64} and slot in kv.cache._score_queries
    assert kv.free_pages() == before - kv.prefill_pages(200)
    aborted = s.abort_chunked()
    assert type(aborted.finished_reason).__name__ == "FINISH_ABORT"
    assert kv.free_pages() == before and not kv.chunked and not kv.cache._score_queries
    s.run_until_idle()
    assert [r.rid for r in s.finished] == ["long", "d"]
    assert len(s.finished[1].output_ids) == 20
    assert_idle(s)


def test_a_retraction_between_chunks_recomputes_the_prompt(monkeypatch):
    """Scheduler.pause_generation(mode="retract") between two chunks retracts the running
    request and the one in chunks (retract_all): every page comes back at once, both
    requests return from the waiting queue, the long prompt is chunked again from its
    start with outputs equal to the whole-prompt run, and the server ends idle with every
    page free."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    prompts = {"d": prompt(30, 1), "long": prompt(130, 2)}
    script = {0: [("d", prompts["d"], 12)], 2: [("long", prompts["long"], 6)]}
    sw = run_script(COMPRESSING, None, script)
    retracted = []

    def pause(s, it):
        if it == 4:  # after the long prompt's third chunk
            assert s.chunked_req is not None and s.kv_pool.chunked
            retracted.extend(r.rid for r in s.retract_all())
            assert not s.kv_pool.active and not s.kv_pool.chunked
            assert s.kv_pool.free_pages() == s.kv_pool.num_pages

    sc = run_script(COMPRESSING, 32, script, on_step=pause)
    assert sorted(retracted) == ["d", "long"]
    starts = [p for r, p, _ in sc.chunks if r == "long"]
    assert starts == [0, 32, 64, 0, 32, 64, 96, 128]  # chunked again from its start
    assert sorted(len(r.output_ids) for r in sc.finished) == [6, 12]
    # (the retracted decoding request re-prefills its prompt and outputs as one prompt, so
    # it is compressed otherwise than when it was never retracted: only the long one compares)
    compare_outputs(sw, sc, COMPRESSING, {"long": prompts["long"]}, 32)
    assert_idle(sc)


def test_admission_counts_the_whole_prompt_at_its_first_chunk(monkeypatch):
    """A prompt in chunks holds the all-high pages of the whole prompt from its first chunk
    (what the admission hook reserved); a second prompt that would not fit beside that
    reservation waits until the first is compressed, and no prefill ever runs out of
    pages."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    refused = []
    hooked = PrefillAdder.add_one_req  # (SGLang's, wrapped by the admission hook)

    def spy(adder, req, *a, **k):
        res = hooked(adder, req, *a, **k)
        if res == AddReqResult.NO_TOKEN:
            refused.append(req.rid)
        return res

    monkeypatch.setattr(PrefillAdder, "add_one_req", spy)
    rows = 4  # 2 layers x 2 KV heads
    long_pages = (-(-200 // 32) + 1) * rows  # 32
    second_pages = (-(-100 // 32) + 1) * rows  # 20
    reserve = 2 * rows  # one decode step's worst case per request
    pages = long_pages + second_pages + 2 * reserve - 1  # one page short of both at once
    s = H.MiniScheduler(H.ModelShape(), H.budget_for_pages(H.ModelShape(), pages, 8),
                        chunked_prefill_size=32)
    kv = s.kv_pool
    assert kv.num_pages == pages and kv.prefill_pages(200) == long_pages
    s.add_request("long", prompt(200, 1), 4)
    s.step()
    long = s.chunked_req
    s.add_request("second", prompt(100, 2), 4)
    while s.chunked_req is long:
        assert kv.free_pages() == pages - long_pages  # the reservation, no more, no less
        assert not kv.admits(second_pages, 1)  # the physical rule that holds "second" back
        s.step()
    assert "second" in refused  # the admission hook held it back
    s.run_until_idle()
    order = [r for r, _, _ in s.chunks]
    assert order.index("second") > len(order) - 1 - order[::-1].index("long")
    assert sorted(r.rid for r in s.finished) == ["long", "second"]
    assert_idle(s)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
def test_kernel_path_chunks_match_the_reference_path(monkeypatch):
    """The same chunked run with the Triton kernels behind the ops seam (extend attention
    over the stored chunks, whole prompts' scoring and compression) and with the torch
    reference: the same stored counts after every step, outputs within bf16 rounding."""
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", json.dumps(COMPRESSING))
    shape = H.ModelShape(dtype=torch.bfloat16)
    runs = []
    for kernels in ("1", "0"):
        monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", kernels)
        s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8), chunked_prefill_size=32)
        assert s.runner.attn_backend.ops.use_kernels == (kernels == "1")
        s.add_request("a", prompt(70), 4)
        s.add_request("b", prompt(20, 1), 3)
        s.run_until_idle()
        assert_idle(s)
        runs.append(s)
    sk, sr = runs
    assert sk.chunks == [("a", 0, 32), ("a", 32, 32), ("a", 64, 6), ("b", 0, 20)]
    assert_kernel_run_matches_reference(sk, sr)


def assert_kernel_run_matches_reference(sk: H.MiniScheduler, sr: H.MiniScheduler) -> None:
    """The kernel-path run ``sk`` against the reference run ``sr`` of the same requests: the
    same chunks, the same stored counts after every step, every output within bf16
    rounding (relative norm < 2e-2)."""
    assert sk.chunks == sr.chunks
    for rk, rr in zip(sk.records, sr.records, strict=True):
        assert torch.equal(rk.counts_after, rr.counts_after)
    ok, orr = outputs_by_position(sk), outputs_by_position(sr)
    assert ok.keys() == orr.keys()
    for key in ok:
        w = orr[key].double()
        assert float(torch.linalg.norm(ok[key].double() - w) / torch.linalg.norm(w)) < 2e-2, key
