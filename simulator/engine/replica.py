"""One server replica as a simpy process: form a batch, let its step time pass, apply it.

Under SGLang's overlap scheduler (the default) the batch for step n+1 is formed while step n
runs, so it sees only the requests that arrived before step n started; one that arrives
during step n joins at step n+2 at the earliest. An idle server forms its batch at once.
Where the calibration says an eager prefill's launches hold the loop
(``eager_launch_holds_loop``), the batch is formed once the host has launched step n (the
end of a prefill's timed launches, ``CostModel.launch_s``) and step n's tokens stream only
after the host has launched step n+1, so a prefill launched next holds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import simpy

from sglang_diffkv.serving_io.trace import MOONCAKE_BLOCK_TOKENS
from simulator.serving.request import SimRequest
from simulator.serving.scheduler import Batch
from simulator.serving.server import ResolvedServer

KIND_CODE = {"prefill": 0, "decode": 1, "mixed": 2}


class StepLog:
    """Per-step time series of one replica (appended as plain lists: cheap in the hot loop)."""

    def __init__(self) -> None:
        self.t_end: list[float] = []
        self.dt: list[float] = []
        self.kind: list[int] = []
        self.running: list[int] = []      # decoding requests in the step (0: prefill only)
        self.batch: list[int] = []        # running batch size after the step
        self.tokens: list[int] = []       # tokens through the model in the step
        self.seqs: list[int] = []         # prompt chunks prefilled in the step
        self.waiting: list[int] = []
        self.usage: list[float] = []      # pool fraction allocated after the step

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in vars(self).items()}


class Replica:
    def __init__(self, env: simpy.Environment, index: int, server: ResolvedServer, seed: int,
                 on_finish: Callable[[SimRequest], None],
                 prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                 warm_cache: Sequence[Sequence[int]] = ()):
        self.env = env
        self.index = index
        self.scheduler = server.new_scheduler(seed, prefix_block_tokens)
        self.scheduler.warm_cache(warm_cache)
        self.cost = server.cost
        self.on_finish = on_finish
        self.log = StepLog()
        self.itl: list[np.ndarray] = []
        self.outstanding = 0
        self.overlap = not server.deployment.settings.disable_overlap_schedule
        # whether an eager prefill's launches hold the overlap loop (batch formation and
        # streaming); otherwise the next batch is formed at a step's start, tokens stream at
        # its end
        self.launch_holds_loop = (self.overlap
                                  and server.deployment.calibration.eager_launch_holds_loop)
        self._wake: simpy.Event | None = None
        env.process(self._loop())

    def submit(self, r: SimRequest) -> bool:
        """Hand ``r`` to the scheduler; False: rejected at once."""
        r.replica = self.index
        return self._enter(r)
    def _enter(self, r: SimRequest) -> bool:
        r.queued_at = self.env.now
        if not self.scheduler.submit(r):
            return False
        self.outstanding += 1
        self.poke()
        return True

    def poke(self) -> None:
        """Wake the loop if it idles: there may be work it can start now."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # hooks for the disaggregated roles (``simulator.engine.disagg``): a colocated replica
    # does nothing in them
    def _before_batch(self) -> None:
        """Runs each time the loop is about to form a batch (between steps)."""

    def _after_step(self, batch: Batch) -> None:
        """Runs when a step's results are applied (``Scheduler.complete``), at its end."""

    def _loop(self):  # simpy process generator
        env, sched, log = self.env, self.scheduler, self.log
        step_time = self.cost.step_time
        last_start = math.inf      # start of the step just run (inf: none, the server idled)
        last_launch = 0.0          # how long the host launched that step's kernels
        last_decode = False        # whether that step was decode-only
        prefill_end = -math.inf    # end of the last prefill step: the GPU's clocks recover
        streamed: list[SimRequest] = []  # given a first or last token by the step just run
        finished: list[SimRequest] = []  # finished by it: delivered once their tokens stream
        while True:
            self._before_batch()
            batch = sched.next_batch(last_start + last_launch if self.overlap else math.inf)
            formed_now = False   # formed by a loop that had nothing to launch
            if batch is None:
                # nothing to launch: the loop streams the last step's tokens (its finished
                # closed-loop users may send again), then sees every arrival
                self._deliver(streamed, finished, 0.0)
                if sched.waiting:
                    batch = sched.next_batch()
                    formed_now = batch is not None
            if batch is None:
                last_start = math.inf
                sched.on_idle()
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            if batch.chunks:
                # under overlap the host formed this batch, and began its eager launches,
                # when the step just run started; a decode step's graph launch leaves the
                # host free for that, a prefill's own launches do not, nor does a KV format
                # whose prefill allocation waits for the step in flight
                head = (env.now - last_start if self.overlap and last_decode and not formed_now
                        and last_start != math.inf and self.cost.prefill_launch_overlaps
                        else 0.0)
                batch.shape = replace(batch.shape, prefill_gap_s=env.now - prefill_end,
                                      launch_head_start_s=head)
            launch = self.cost.launch_s(batch.shape) if self.launch_holds_loop else 0.0
            self._deliver(streamed, finished, launch)
            last_start = env.now
            last_launch = launch
            last_decode = not batch.chunks
            dt = step_time(batch.shape)
            yield env.timeout(dt)
            now = env.now
            if batch.chunks:
                prefill_end = now
            finished = sched.complete(batch, now, self.itl)
            self._after_step(batch)
            streamed = [r for r, _ in batch.chunks if r.first_token == now]
            streamed += [r for r in finished if r.first_token != now]
            shape = batch.shape
            log.t_end.append(now)
            log.dt.append(dt)
            log.kind.append(KIND_CODE[batch.kind])
            log.running.append(shape.decode_reqs)
            log.batch.append(sched.running)
            log.tokens.append(shape.decode_reqs + shape.prefill_tokens)
            log.seqs.append(shape.prefill_seqs)
            log.waiting.append(len(sched.waiting))
            log.usage.append(sched.usage)
            for r in sched.aborted:
                self.outstanding -= 1
                self.on_finish(r)
            sched.aborted.clear()

    def _deliver(self, streamed: list[SimRequest], finished: list[SimRequest],
                 delay: float) -> None:
        """Stream the tokens of the step just run ``delay`` after its end (now), then hand
        its finished requests to ``on_finish``; both lists are emptied."""
        _stream_after(streamed, self.env.now, delay)
        for r in finished:
            self.outstanding -= 1
            self.on_finish(r)
        streamed.clear()
        finished.clear()


def _stream_after(reqs: list[SimRequest], at: float, delay: float) -> None:
    """Move the first and last tokens that ``reqs`` were given at ``at`` by ``delay``: SGLang's
    overlap loop streams a step's tokens only after it has launched the next step, so an
    eager prefill launched next holds them for its launch (the loop traces: a one-prompt
    extend's first token reached the client 24-46 ms after its own launch when another
    extend was launched next, 5-12 ms when a decode step was). The scheduler's state is
    not delayed: the next step runs on the tokens the GPU already has."""
    if delay <= 0.0:
        return
    for r in reqs:
        if r.first_token == at:
            r.first_token += delay
        if r.finish == at:
            r.finish += delay
        if r.last_token == at:
            r.last_token += delay
