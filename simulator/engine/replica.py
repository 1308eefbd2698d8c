"""One server replica as a simpy process: form a batch, let its step time pass, apply it.

Under SGLang's overlap scheduler (the default) the batch for step n+1 is formed while step n
runs, so it sees only the requests that arrived before step n started; one that arrives
during step n joins at step n+2 at the earliest. An idle server forms its batch at once.
Where the calibration says an eager prefill's launches hold the loop
(``eager_launch_holds_loop``), the batch is formed once the host has launched step n (the
end of a prefill's timed launches, ``CostModel.launch_s``) and step n's tokens stream only
after the host has launched step n+1, so a prefill launched next holds them.

Runs of decode steps are fast-forwarded: once a decode-only step is formed and nothing but
a request finishing could change the batch (``Scheduler.decode_run_steps``), the steps up to
the first that finishes a request are planned as their predecessors end
(``Scheduler.plan_decode``, ``next_decode``) and timed with the same cost model, and the
loop only lets their step times pass, without forming, completing or logging each step.
Anything that reaches the replica meanwhile (an arrival, a prompt's KV, freed memory:
``poke``) cuts the run at the end of the step it fell in, where the step-by-step loop would
first have seen it. The run's steps but the last are then committed as the loop would have
left them (``Scheduler.apply_decode_steps``), and the last completes as any step does. Each
step still ends with a timeout of its own, so the results are the same to the last bit,
event order included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from sglang_diffkv.serving_io.trace import MOONCAKE_BLOCK_TOKENS
from simulator.serving.request import SimRequest
from simulator.serving.scheduler import Batch, DecodePlan
from simulator.serving.server import ResolvedServer

KIND_CODE = {"prefill": 0, "decode": 1, "mixed": 2}
# the most decode steps one fast-forwarded run plans: a run cut early wastes the rest of its
# plan, and a long generation is planned again from where the last run ended
MAX_RUN_STEPS = 256


@dataclass
class _DecodeRun:
    """A run of decode steps the loop sleeps through, from ``start``: step i lasts
    ``dts[i]`` and ended at ``ends[i]``; ``cut``: something reached the replica during the
    step in flight, the run's last (``Replica.poke``)."""

    start: float
    ends: list[float]
    dts: list[float]
    plan: DecodePlan
    cached: int            # evictable cached units when it began (they stay put through it)
    waiting: int           # requests waiting then
    timer: Callable[[int, float, int], float]     # a step's time (CostModel.decode_step_timer)
    cut: bool = False
    # (steps ended, units): allocated beside the steps after that many had ended
    shifts: list[tuple[int, int]] = field(default_factory=list)


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

    def arrays(self, *names: str) -> dict[str, np.ndarray]:
        """The series as arrays: those named, or all of them."""
        series = vars(self)
        return {k: np.asarray(series[k]) for k in (names or series)}


class Replica:
    # fast-forward runs of decode steps (module docstring); False: form, complete and log
    # every step in turn (the reference the fast path is tested against)
    fast_forward = True

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
        self._run: _DecodeRun | None = None
        # what a role does between a run's steps (_between_run_steps), None: nothing
        self._run_hook: Callable[[int, int], int] | None = None
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

    def poke(self, cut: bool = True) -> None:
        """Wake the loop if it idles: there may be work it can start now. A fast-forwarded
        run of decode steps ends with the step in flight, where the step-by-step loop would
        first see what changed; ``cut=False``: the run takes it in between two steps
        (``_between_run_steps``)."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        if cut and self._run is not None:
            self._run.cut = True

    def _may_fast_forward(self) -> bool:
        """Whether the replica's own state lets a run of decode steps be fast-forwarded
        (the scheduler decides the rest); a role with queues of its own says no while they
        hold anything the next formation would take."""
        return True

    def _between_run_steps(self, held: int, free: int) -> int:
        """In a run of decode steps, between a step's end and the next one's formation (the
        place of ``_before_batch``): what the replica's own queues do there without changing
        the batch, given the running requests' units (``held``) and the free units as
        planned. Returns the units it allocated (negative: freed) beside the steps. A role
        that has such queues sets ``_run_hook`` to it."""
        return 0

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
                batch.shape = batch.shape.started(env.now - prefill_end, head)
            launch = self.cost.launch_s(batch.shape) if self.launch_holds_loop else 0.0
            self._deliver(streamed, finished, launch)
            last_start = env.now
            last_launch = launch
            last_decode = not batch.chunks
            dt = step_time(batch.shape)
            run = self._plan_run(batch, dt) if self.fast_forward and not batch.chunks else None
            beside = 0
            if run is None:
                yield env.timeout(dt)
            else:
                yield from self._sleep_through(run)
                # all but the run's last step are done; that one completes as any other
                last_start, dt, beside = self._commit_run(run, batch)
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
            # what a run allocated beside its steps as its last one ended comes after that
            # step's row, as it would after the step's completion
            log.usage.append(sched.usage_of(sched.used - beside))
            for r in sched.aborted:
                self.outstanding -= 1
                self.on_finish(r)
            sched.aborted.clear()

    def _plan_run(self, batch: Batch, dt: float) -> _DecodeRun | None:
        """The run of decode steps starting with ``batch`` (just formed, lasting ``dt``) up
        to the first that finishes a request, or None when that is this one."""
        sched = self.scheduler
        steps = min(sched.decode_run_steps(), MAX_RUN_STEPS)
        if steps < 2 or not self._may_fast_forward():
            return None
        cached = sched.cache.evictable_units if sched.cache is not None else 0
        return _DecodeRun(self.env.now, [], [dt], sched.plan_decode(steps - 1), cached,
                          len(sched.waiting),
                          self.cost.decode_step_timer(batch.shape.decode_reqs))

    def _sleep_through(self, run: _DecodeRun):  # simpy process generator
        """Let the run's steps pass, one timeout each as the step-by-step loop waits (so
        every step ends at the same time, in the same order among other events), each
        planned and timed when the one before ends, until the last planned, until the end
        of a step during which ``poke`` cut the run, or until a formation that is not a
        plain decode step."""
        env, plan_next, between = self.env, self.scheduler.next_decode, self._run_hook
        plan, dts, ends, timer = run.plan, run.dts, run.ends, run.timer
        end = run.start
        self._run = run
        try:
            while True:
                dt = dts[-1]
                yield env.timeout(dt)
                end += dt                    # env.now, as the timeout added it
                ends.append(end)
                if run.cut or len(plan.used) > plan.limit:
                    break                    # the step ending now completes as any other
                if between is not None:
                    shift = between(plan.held, plan.free)
                    if shift:
                        plan.shift(shift)
                        run.shifts.append((len(ends), shift))
                step = plan_next(plan)
                if step is None:
                    break
                dts.append(timer(step[0], step[1], 0))
        finally:
            self._run = None

    def _commit_run(self, run: _DecodeRun, batch: Batch) -> tuple[float, float, int]:
        """The run's steps but the last applied and logged as the step-by-step loop would
        have left them, and the last one formed: (its start, its length, the units
        allocated beside the steps as it ended, ``_between_run_steps``). Its completion,
        log row and whatever reached the replica during it are the loop's as after any step
        (``batch`` stands for it: a decode step of the same requests)."""
        sched, log = self.scheduler, self.log
        done = len(run.ends) - 1
        if done:
            n = batch.shape.decode_reqs
            cap = sched.pool.capacity
            sched.apply_decode_steps(run.plan, done, run.ends, self.itl)
            ends = run.ends[:done]
            log.t_end.extend(ends)
            log.dt.extend(run.dts[:done])
            log.kind.extend([KIND_CODE["decode"]] * done)
            log.running.extend([n] * done)
            log.batch.extend([n] * done)
            log.tokens.extend([n] * done)
            log.seqs.extend([0] * done)
            log.waiting.extend([run.waiting] * done)
            used = run.plan.used[:done]
            for after, units in run.shifts:  # allocated at a step's end: in the rows after
                used[after:] = [u + units for u in used[after:]]
            log.usage.extend([(u - run.cached) / cap for u in used])
        beside = sum(units for after, units in run.shifts if after == done + 1)
        return (run.ends[done - 1] if done else run.start), run.dts[done], beside

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
