"""A disaggregated deployment: P prefill replicas and D decode replicas joined by KV links,
as SGLang's ``--disaggregation-mode prefill`` / ``decode`` servers run a request:

1. The router picks a prefill and a decode replica for each arriving request (SGLang's
   router sends it to both).
2. The decode replica queues it until its KV can be preallocated
   (``simulator.serving.prealloc``); only then is the prefill replica told where to write,
   and the request joins the prefill replica's waiting queue (its bootstrap).
3. The prefill replica is the colocated replica model with every request ending at its
   first token (SGLang sets ``max_new_tokens = 1`` there), except that a finished prompt's
   KV stays allocated until its transfer has left (``Scheduler.hold_finished``).
4. The KV goes over the pair's link (``simulator.engine.link``), in the pieces its format
   sends (``simulator.kv.transfer``): bf16 / fp8 each chunk when its forward ends, DiffKV
   the compressed pages once the prompt is complete. A transfer starts when the step that
   computed its KV ends; there is no layer-by-layer overlap with that step.
5. When the last piece has arrived the request joins the decode replica's running batch at
   its next batch formation, without a forward (the prefill sampled the first token, which
   streams then: TTFT ends there), if the batch has room (``max_running_requests``), and
   decodes as in a colocated replica.

Invariants: a request joins a decode batch only after its reservation (so its pages fit)
and after the last byte of its KV has arrived; every request finishes once or is rejected;
a prefill replica frees a prompt's KV exactly once, after its transfer. Decode-side
retraction (rare: the reservation keeps room for 512 tokens per request) is modelled as the
colocated server does it, by recomputing on the decode replica; SGLang's decode server may
offload the KV to host memory instead. The step costs are the colocated cost model's; the
decode side pays nothing to dequantise or re-encode what arrives (every format is sent as
its pool stores it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from sglang_diffkv.serving_io.trace import Trace
from simulator.engine.cluster import Router, RunResult, _Progress, _sim_request
from simulator.engine.link import KVLinks
from simulator.engine.replica import Replica
from simulator.errors import SimulatorInputError
from simulator.kv.transfer import KVTransfer
from simulator.serving.prealloc import PreallocQueue
from simulator.serving.request import SimRequest
from simulator.serving.scheduler import Batch
from simulator.serving.server import ResolvedServer
from simulator.specs.link import LinkSpec


@dataclass
class KVRecord:
    """One request's way from its prefill to its decode replica (seconds, bytes)."""

    prefill: int = -1
    decode: int = -1
    reserved: float = math.nan      # its KV was preallocated on the decode replica
    prefill_start: float = math.nan  # the step that began its prompt started
    prefill_end: float = math.nan   # the step that completed its prompt ended
    bytes: float = 0.0              # on the wire, all pieces
    wire_s: float = 0.0             # on the wire, all pieces (excluding queueing)
    last_wire_s: float = 0.0        # the last piece's time on the wire
    arrived: float = math.nan       # its last piece arrived


class PrefillReplica(Replica):
    """A replica that only prefills; ``on_chunk(replica, request)`` runs after every step
    for each request the step prefilled a chunk of."""

    def __init__(self, *args, on_chunk: Callable[[PrefillReplica, SimRequest], None],
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler.hold_finished = True
        self.on_chunk = on_chunk
        self.step_start = 0.0

    def _before_batch(self) -> None:
        # nothing yields between forming a batch and starting its step
        self.step_start = self.env.now

    def _after_step(self, batch: Batch) -> None:
        for r, _ in batch.chunks:
            self.on_chunk(self, r)


class DecodeReplica(Replica):
    """A replica whose requests arrive prefilled: ``offer`` queues one for preallocation,
    ``on_reserved(replica, request)`` runs when its KV is reserved, ``kv_arrived`` when the
    KV is in."""

    def __init__(self, *args, on_reserved: Callable[[DecodeReplica, SimRequest], None],
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.prealloc = PreallocQueue(self.scheduler)
        self._run_hook = self._between_run_steps
        self.on_reserved = on_reserved
        self.in_flight = 0               # reserved, not yet in the running batch
        self.arrived: list[SimRequest] = []

    def offer(self, r: SimRequest) -> bool:
        """Queue ``r`` for preallocation; False: rejected at once (``r.rejected``)."""
        r.replica = self.index
        if not self.prealloc.admissible(r):
            return False
        r.queued_at = self.env.now
        self.prealloc.add(r)
        self.outstanding += 1
        # a run of decode steps reserves it between two of its steps (_between_run_steps)
        self.poke(cut=False)
        return True

    def kv_arrived(self, r: SimRequest) -> None:
        self.arrived.append(r)
        self.poke()

    def cancel(self, r: SimRequest) -> None:
        """A reserved request whose KV will never come: give back its pages."""
        self.scheduler.cancel_reservation(r)
        self.in_flight -= 1
        self.outstanding -= 1

    def _may_fast_forward(self) -> bool:
        # a run of decode steps is fast-forwarded only while no formation would join
        # anything: nothing arrived that has room (what waits for preallocation is reserved
        # between its steps; a radix cache, which reserving may evict from, is off here)
        room = self.scheduler.lim.max_running_requests - self.scheduler.running
        return (self.scheduler.cache is None
                and (not self.arrived or room <= 0))

    def _between_run_steps(self, held: int, free: int) -> int:
        # _before_batch's reservations, which the formation of the run's next step would
        # make first: on the run's planned state, the batch unchanged
        if not self.prealloc.queue:
            return 0
        before = self.scheduler.used
        for r in self.prealloc.pop_preallocated(self.in_flight, held, free):
            self.in_flight += 1
            self.on_reserved(self, r)
        return self.scheduler.used - before

    def _before_batch(self) -> None:
        sched = self.scheduler
        room = sched.lim.max_running_requests - sched.running
        if self.arrived and room > 0:
            joining, self.arrived = self.arrived[:room], self.arrived[room:]
            self.in_flight -= len(joining)
            for r in sched.join_prebuilt(joining, self.env.now):
                self.outstanding -= 1
                self.on_finish(r)
        for r in self.prealloc.pop_preallocated(self.in_flight):
            self.in_flight += 1
            self.on_reserved(self, r)


def simulate_disagg(workload: Trace, server: ResolvedServer, prefill: int, decode: int,
                    link: LinkSpec, scope: str = "pair", router: str = "round_robin",
                    seed: int = 0, progress: bool | None = False) -> RunResult:
    """Run ``workload`` (an open-loop trace) on ``prefill`` + ``decode`` replicas of
    ``server``, each replica ``server.deployment.settings.tp`` GPUs. The result's requests
    are the trace's, with their decode-side times; its replicas are the prefill replicas,
    then the decode ones; ``meta["kv"]`` holds each request's ``KVRecord`` by id,
    ``meta["ports"]`` what each link carried."""
    for name, n in (("prefill", prefill), ("decode", decode)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SimulatorInputError(f"{name} replicas={n!r} must be an integer >= 1")
    if not isinstance(workload, Trace):
        raise SimulatorInputError("a disaggregated deployment replays an open-loop trace, "
                                  "not a closed loop")
    env = simpy.Environment()
    d_model = server.deployment
    xfer = KVTransfer.for_format(d_model.kv_format, server.pool, d_model.model,
                                 d_model.settings.tp)
    links = KVLinks(env, link, prefill, decode, scope)
    requests: list[SimRequest] = []
    records: dict[int, KVRecord] = {}
    prefill_of: dict[int, PrefillReplica] = {}   # a request's prefill replica, chosen at arrival
    # request id -> (the request, its prefill half); the half is the prefill replica's copy,
    # with one output token (SGLang's prefill server sets max_new_tokens = 1)
    halves: dict[int, tuple[SimRequest, SimRequest]] = {}
    sent: dict[int, float] = {}                   # bytes queued so far, per request
    bar = _Progress(len(workload), progress, f"{d_model.kv_format.name} {prefill}P{decode}D")

    def finish(r: SimRequest) -> None:
        bar.tick()

    def on_reserved(d: DecodeReplica, r: SimRequest) -> None:
        rec = records[r.rid]
        rec.reserved = env.now
        p = prefill_of.pop(r.rid)
        rec.prefill = p.index
        half = SimRequest(r.rid, r.arrival, r.input_len, 1, 1, r.user, r.hash_ids)
        half.prof = r.prof                        # the tier mix its decode replica drew
        halves[r.rid] = (r, half)
        sent[r.rid] = 0.0
        if not p.submit(half):                    # the prefill pool cannot hold the prompt
            r.rejected = f"prefill replica: {half.rejected}"
            del halves[r.rid]
            d.cancel(r)
            finish(r)

    def on_chunk(p: PrefillReplica, half: SimRequest) -> None:
        r, _ = halves[half.rid]
        rec = records[half.rid]
        if math.isnan(rec.prefill_start):
            rec.prefill_start = p.step_start
        complete = half.prefilled >= half.fill_len
        if xfer.streams_chunks:
            nbytes = xfer.prefix_bytes(half.prefilled) - sent[half.rid]
        elif complete:
            nbytes = xfer.prompt_bytes(half.input_len, half.prof)
        else:
            return                                # DiffKV: nothing to send before scoring
        sent[half.rid] += nbytes
        if complete:
            rec.prefill_end = env.now
        d = decode_reps[rec.decode]

        def done(start: float, wire: float) -> None:
            rec.bytes += nbytes
            rec.wire_s += wire
            if complete:                          # FIFO: the last piece arrives last
                rec.last_wire_s = wire
                rec.arrived = env.now
                del halves[half.rid], sent[half.rid]
                p.scheduler.release(half)
                p.poke()
                d.kv_arrived(r)
        links.send(p.index, d.index, nbytes, done)

    prefill_reps = [PrefillReplica(env, k, server, seed * 1000 + k, lambda _r: None,
                                   workload.prefix_block_tokens, on_chunk=on_chunk)
                    for k in range(prefill)]
    decode_reps = [DecodeReplica(env, k, server, seed * 1000 + 500 + k, finish,
                                 workload.prefix_block_tokens, on_reserved=on_reserved)
                   for k in range(decode)]
    for rep in decode_reps:
        # SGLang's decode server runs without a radix cache by default
        rep.scheduler.cache = None
    p_router = Router(router, list(prefill_reps), seed)
    d_router = Router(router, list(decode_reps), seed + 1)

    def arrivals():  # simpy process generator
        for i, t in enumerate(workload.requests):
            gap = t.arrival_s - env.now
            if gap > 0:
                yield env.timeout(gap)
            r = _sim_request(i, t, t.arrival_s)
            requests.append(r)
            p, d = p_router.pick(), d_router.pick()
            records[i] = KVRecord(decode=d.index)
            prefill_of[i] = p
            if not d.offer(r):
                del prefill_of[i]
                finish(r)

    env.process(arrivals())
    try:
        env.run()
    finally:
        bar.close()
    return RunResult(requests, [*prefill_reps, *decode_reps], server, workload.name, env.now,
                     {"prefill": prefill, "decode": decode, "link": link, "scope": scope,
                      "kv": records, "ports": links.ports})
