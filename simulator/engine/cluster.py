"""Run a workload through one or more replicas behind a router; return the raw results.

Open-loop traces: a single arrival process submits each request at its arrival time.
Closed loop: each user submits its next request ``think_s`` after its previous one finishes,
as the client sees it (the calibration's ``first_token_latency_s`` later: the last token's way
out and the next request's way in).
Seeds make everything deterministic: the same inputs give identical results.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from simulator.engine.replica import Replica
from simulator.errors import SimulatorInputError
from simulator.serving.request import SimRequest
from simulator.serving.server import ResolvedServer
from simulator.workload.generate import ClosedLoop

ROUTERS = ("round_robin", "least_outstanding", "random")


@dataclass
class RunResult:
    requests: list[SimRequest]
    replicas: list[Replica]
    server: ResolvedServer
    workload: str
    end_time: float
    meta: dict[str, Any] = field(default_factory=dict)


class Router:
    def __init__(self, policy: str, replicas: list[Replica], seed: int):
        if policy not in ROUTERS:
            raise SimulatorInputError(f"router {policy!r} is unknown; choose one of {ROUTERS}")
        self.policy = policy
        self.replicas = replicas
        self.rng = np.random.default_rng(seed)
        self.next = 0

    def pick(self) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round_robin":
            r = reps[self.next % len(reps)]
            self.next += 1
            return r
        if self.policy == "least_outstanding":
            return min(reps, key=lambda x: (x.outstanding, x.index))
        return reps[int(self.rng.integers(len(reps)))]


class _Progress:
    """tqdm over finished requests, updated in 1% steps so it stays off the hot path."""

    def __init__(self, total: int, enabled: bool | None, desc: str):
        if enabled is None:
            enabled = total >= 2000 and sys.stderr.isatty()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", leave=False)
        self.every = max(1, total // 100)
        self.pending = 0

    def tick(self) -> None:
        if self.bar is None:
            return
        self.pending += 1
        if self.pending >= self.every:
            self.bar.update(self.pending)
            self.pending = 0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.pending)
            self.bar.close()


def _sim_request(i: int, t: TraceRequest, arrival: float, user: int = -1) -> SimRequest:
    return SimRequest(i, arrival, t.input_tokens, t.output_tokens, t.requested_new_tokens, user,
                      t.prefix_hash_ids)


def simulate(workload: Trace | ClosedLoop, server: ResolvedServer, replicas: int = 1,
             router: str = "round_robin", seed: int = 0, progress: bool | None = False,
             max_sim_time: float = math.inf, warm_cache: Sequence[Sequence[int]] = ()
             ) -> RunResult:
    """``warm_cache``: what every replica's radix cache holds at the start, as the prefix ids
    (in the workload's block size) that each earlier request left there, oldest first
    (``Scheduler.warm_cache``); empty: a fresh server."""
    if replicas < 1:
        raise SimulatorInputError(f"replicas={replicas} must be >= 1")
    env = simpy.Environment()
    requests: list[SimRequest] = []
    bar = _Progress(len(workload), progress, f"{server.deployment.kv_format.name}")
    closed = workload if isinstance(workload, ClosedLoop) else None
    client_latency = server.deployment.calibration.first_token_latency_s
    cursor = [0]

    def submit(r: SimRequest) -> None:
        rep = rt.pick()
        if not rep.submit(r):
            on_finish(r)            # rejected: done at once

    def next_closed(user: int) -> None:
        i = cursor[0]
        if closed is None or i >= len(closed.requests):
            return
        cursor[0] += 1
        r = _sim_request(i, closed.requests[i], env.now, user)
        requests.append(r)
        submit(r)

    def on_finish(r: SimRequest) -> None:
        bar.tick()
        if closed is not None:
            # from the last token's streaming, which may come after now (Replica)
            gap = closed.think_s + client_latency + max(0.0, r.finish - env.now)
            if gap > 0:
                ev = env.timeout(gap)
                ev.callbacks.append(lambda _e, u=r.user: next_closed(u))
            else:
                next_closed(r.user)

    reps = [Replica(env, k, server, seed * 1000 + k, on_finish, workload.prefix_block_tokens,
                    warm_cache) for k in range(replicas)]
    rt = Router(router, reps, seed)

    if closed is not None:
        for u in range(min(closed.users, len(closed.requests))):
            next_closed(u)
    else:
        assert isinstance(workload, Trace)

        def arrivals():  # simpy process generator
            for i, t in enumerate(workload.requests):
                gap = t.arrival_s - env.now
                if gap > 0:
                    yield env.timeout(gap)
                r = _sim_request(i, t, t.arrival_s)
                requests.append(r)
                submit(r)

        env.process(arrivals())
    try:
        env.run(until=None if math.isinf(max_sim_time) else max_sim_time)
    finally:
        bar.close()
    name = closed.name if closed is not None else workload.name
    return RunResult(requests, reps, server, name, env.now)
