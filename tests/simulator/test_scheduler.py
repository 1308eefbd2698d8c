"""The SGLang scheduler model against hand-computed admission, chunking and retraction cases.

A token pool of ``capacity`` slots (page size 1) keeps the arithmetic readable; every expected
number below is derived in the comment next to it from SGLang's rules."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import req, token_scheduler

from simulator.serving.settings import MIN_NEW_TOKEN_RATIO_FACTOR, NEW_TOKEN_RATIO_DECAY_STEPS

SINK: list[np.ndarray] = []


def test_admission_stops_at_no_token_and_marks_batch_full():
    s = token_scheduler(1000)
    r0, r1 = req(0, 300, 200), req(1, 300, 200)
    assert s.submit(r0) and s.submit(r1)
    b = s.next_batch()
    # r0: 300 + min(200, 4096) = 500 < 1000 -> admitted; rem_total = 1000 - 500 = 500
    # r1: 500 >= 500 -> NO_TOKEN, batch marked full
    assert [(r.rid, n) for r, n in b.chunks] == [(0, 300)]
    assert s.batch_is_full and list(s.waiting) == [r1] and s.used == 300
    s.complete(b, 1.0, SINK)
    assert r0.gen == 1 and r0.first_token == 1.0 and s.running == 1
    # batch still full: no admission attempt, a decode step instead
    b = s.next_batch()
    assert b.kind == "decode" and s.used == 301


def test_new_token_ratio_reservation_and_decay():
    # 2202 slots: max request length 2201 leaves r0's max_new (2000) unclamped
    s = token_scheduler(2202)
    r0, r1 = req(0, 200, 2000), req(1, 300, 500)
    s.submit(r0)
    s.complete(s.next_batch(), 0.0, SINK)            # r0 prefilled: 200 slots, 1 output
    s.submit(r1)
    decay = 0.7 * (1 - MIN_NEW_TOKEN_RATIO_FACTOR) / NEW_TOKEN_RATIO_DECAY_STEPS
    flips = []
    for k in range(0, 300):                          # k decode steps done so far
        s.batch_is_full = False                      # as if a request had just finished
        ratio = 0.7 - k * decay
        assert s.new_token_ratio == pytest.approx(ratio)
        # running reservation min(2000 - gen, 4096) * ratio with gen = 1 + k;
        # available = 2202 - (200 + k); r1 needs 300 + min(500, 4096) = 800
        rem_total = 2202 - (200 + k) - (2000 - 1 - k) * ratio
        b = s.next_batch()
        admitted = b.kind == "prefill"
        assert admitted == (800 < rem_total), k
        if admitted:
            flips.append(k)
            break
        s.complete(b, float(k + 1), SINK)
    # k=0: 2002 - 1999 * 0.7 = 602.7 < 800 refused; admitted once the ratio has decayed
    assert flips and flips[0] > 0 and b.chunks[0][0] is r1
    s.on_idle()
    assert s.new_token_ratio == 0.7


def test_max_prefill_tokens_and_max_running_requests():
    s = token_scheduler(100_000, chunk=None, max_prefill=16384)
    a, b = req(0, 10000, 5), req(1, 10000, 5)
    s.submit(a)
    s.submit(b)
    # a: 10000 < 16384 admitted; b: 10000 >= 16384 - 10000 with a request already in -> OTHER
    batch = s.next_batch()
    assert [r.rid for r, _ in batch.chunks] == [0] and not s.batch_is_full
    s2 = token_scheduler(100_000, max_running=2)
    for i in range(3):
        s2.submit(req(i, 10, 5))
    batch = s2.next_batch()
    assert [r.rid for r, _ in batch.chunks] == [0, 1] and s2.batch_is_full


def test_chunked_prefill_splits_long_prompts():
    s = token_scheduler(100_000, chunk=8192)
    big, small = req(0, 20000, 3), req(1, 1000, 3)
    s.submit(big)
    s.submit(small)
    sizes = []
    t = 0.0
    while big.first_token < 0:
        b = s.next_batch()
        sizes.append([(r.rid, n) for r, n in b.chunks])
        t += 1
        s.complete(b, t, SINK)
    # 8192 + 8192 + 3616; the last chunk leaves 8192 - 3616 = 4576 for the small request
    assert sizes == [[(0, 8192)], [(0, 8192)], [(0, 3616), (1, 1000)]]
    assert big.first_token == 3.0 and small.first_token == 3.0 and s.chunked is None
    assert s.used == 21000


def test_retraction_pops_fewest_outputs_then_longest_prompt():
    s = token_scheduler(82)
    reqs = []
    for rid, inp, gen in ((0, 30, 5), (1, 20, 2), (2, 25, 2)):
        r = req(rid, inp, 50, 100)
        r.gen, r.fill_len, r.prefilled = gen, inp + gen - 1, inp + gen - 1
        r.held, r.last_token = inp + gen - 1, 0.0
        reqs.append(r)
    s._join(reqs)
    s.used = int(s.held.sum())                     # 34 + 21 + 26 = 81, one slot free
    b = s.next_batch()
    # need 3 slots > 1 free -> retract; order by (gen, -input) descending, pop the last:
    # (5,-30), (2,-20), (2,-25) -> request 2 goes (2 outputs, longest prompt of the two)
    assert b.retracted == 1 and s.retractions == 1
    assert [r.rid for r in s.run_reqs] == [0, 1] and list(s.waiting) == [reqs[2]]
    assert reqs[2].fill_len == 25 + 2 and reqs[2].prefilled == 0 and reqs[2].retractions == 1
    # ratio re-estimated over the kept requests: (5 + 2 + 20 * 2) / (100 + 100 + 1)
    assert s.new_token_ratio == pytest.approx(47 / 201)
    assert s.used == 34 + 21 + 2                   # freed 26, then one slot each to decode
    assert b.shape.decode_reqs == 2


def test_retracted_request_recomputes_and_keeps_its_outputs():
    s = token_scheduler(100)           # one request peaks at 59 tokens, two cannot fit
    r = req(0, 20, 40, 40)
    s.submit(r)
    s.complete(s.next_batch(), 1.0, SINK)
    s.new_token_ratio = 0.0   # as after a long decay: r2 (60 <= 80 free) is admitted at once
    s.min_ratio = 0.0
    s.ratio_decay = 0.0
    r2 = req(1, 20, 40, 40)
    s.submit(r2)
    t = 1.0
    while not (r.done and r2.done):
        b = s.next_batch()
        assert b is not None
        t += 1
        s.complete(b, t, SINK)
        assert 0 <= s.used <= s.pool.capacity
    assert r.gen == 40 and r2.gen == 40 and s.retractions >= 1 and s.used == 0
    retracted = r if r.retractions else r2
    assert retracted.itl  # the recompute produced a token after a gap


def test_mixed_chunk_decodes_with_the_prefill():
    s = token_scheduler(10_000, chunk=512, mixed=True)
    s.submit(req(0, 100, 10))
    s.complete(s.next_batch(), 1.0, SINK)
    s.submit(req(1, 1000, 10))
    b = s.next_batch()
    # chunk budget 512 minus one decode token: 511 prompt tokens this step
    assert b.kind == "mixed" and b.chunks[0][1] == 511 and b.shape.decode_reqs == 1


def test_submit_rejects_and_clamps_like_sglang():
    s = token_scheduler(1000, context_len=500)
    r = req(0, 400, 100)
    assert not s.submit(r) and "context length 500" in r.rejected
    s = token_scheduler(300, context_len=10_000)
    r = req(1, 299, 1)
    assert not s.submit(r) and "max request length 299" in r.rejected
    r = req(2, 200, 150, 200)
    assert s.submit(r)
    # max_req_len = min(10000, 300) - 1 = 299: max_new clamped to 299 - 200 - 1 = 98
    assert r.max_new == 98 and r.output_len == 98


@pytest.mark.parametrize("max_new,admitted", [(300, True), (400, False)])
def test_ignore_eos_admission_replays_requests_to_max_new(max_new, admitted):
    s = token_scheduler(1000, ignore_eos_admission=True)
    r0 = req(0, 100, 500)
    s.submit(r0)
    s.complete(s.next_batch(), 1.0, SINK)           # r0 holds 100 slots, 1 of 500 outputs
    s.batch_is_full = False
    r1 = req(1, 200, max_new)
    s.submit(r1)
    b = s.next_batch()
    # free after r1's prompt: 1000 - 100 - 200 = 700. Replay shortest-first:
    #   max_new 300: 700 - 300*2 = 100 > 2, then 700 + 200 - 499 = 401 > 1 -> admitted
    #   max_new 400: 700 - 400*2 = -100 <= 2 -> NO_TOKEN
    assert (b.kind == "prefill") == admitted
    assert s.batch_is_full != admitted


def test_an_emptied_batch_admits_waiting_requests_at_once():
    s = token_scheduler(100)
    r0 = req(0, 60, 50, 30)
    r0.gen, r0.fill_len, r0.prefilled, r0.held, r0.last_token = 1, 60, 60, 100, 0.0
    s._join([r0])
    s.used = 100                                   # r0 fills the pool: its next step cannot fit
    waiting = req(1, 10, 5)
    s.waiting.append(waiting)
    b = s.next_batch()
    # the lone request is aborted (out of memory even after retracting), which frees the pool:
    # the same call admits the waiting request instead of idling until another arrival
    assert r0.rejected and s.aborted == [r0]
    assert b is not None and b.chunks == [(waiting, 10)]


def test_submit_rejects_what_ignore_eos_admission_could_never_admit():
    from simulator.kv.pool import TokenPool
    from simulator.serving.scheduler import Scheduler, SchedulerLimits

    def sched(ignore_eos: bool) -> Scheduler:
        limits = SchedulerLimits(None, 16384, 4096, 100_000, 1023, 1.0, False, ignore_eos)
        return Scheduler(TokenPool(1024, 32, 512.0), limits, np.random.default_rng(0))

    # prompt 500 -> 512 paged slots; 512 + 480 = 992 < 1024 fits the regular rule, but the
    # ignore_eos rule also keeps one page (32 slots) per request: 992 + 32 >= 1024
    assert sched(False).submit(req(0, 500, 480))
    r = req(1, 500, 480)
    assert not sched(True).submit(r) and "even in an empty pool" in r.rejected
