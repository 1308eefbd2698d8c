"""KV transfer links between prefill and decode replicas, as FIFO queues in simpy.

A transfer of B bytes holds its link for ``LinkSpec.transfer_s(B)`` = latency + B / (nominal
bandwidth x efficiency); transfers on one link run one after another, in the order they were
sent (a link moves one transfer at its full rate rather than sharing it among several, which
finishes the first earlier and the last at the same time). Two scopes:

- ``pair``: every (prefill replica, decode replica) pair has a link of its own, so
  transfers between different pairs never wait for each other;
- ``gpu``: every replica has one port per direction (a NIC, or its NVLink or PCIe lanes),
  shared by all its transfers: a transfer holds its prefill replica's send port and its
  decode replica's receive port. It takes the send port first, then waits for the receive
  port while holding it (head-of-line blocking, as one send queue per NIC would); ports
  are always taken in that order, so no two transfers wait for each other in a cycle.

With tensor parallelism every rank has such a link and sends its own heads at the same
time, so a replica's transfer moves its per-rank bytes at one link's rate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from simulator.errors import SimulatorInputError
from simulator.specs.link import LinkSpec

LINK_SCOPES = ("pair", "gpu")


@dataclass
class Port:
    """One FIFO queue of transfers and what it carried."""

    name: str
    busy_s: float = 0.0
    bytes: float = 0.0
    transfers: int = 0
    # the transfer holding it, and those waiting for it in order (``KVLinks``)
    holder: _Transfer | None = field(default=None, repr=False)
    waiting: deque[_Transfer] = field(default_factory=deque, repr=False)


@dataclass
class _Transfer:
    """One transfer: its ports in the order it takes them, how many it holds."""

    route: tuple[Port, ...]
    nbytes: float
    done: Callable[[float, float], None]
    taken: int = 0


class KVLinks:
    """The links of a deployment with ``prefill`` and ``decode`` replicas."""

    def __init__(self, env: simpy.Environment, spec: LinkSpec, prefill: int, decode: int,
                 scope: str = "pair"):
        if scope not in LINK_SCOPES:
            raise SimulatorInputError(f"link scope {scope!r} is unknown; choose one of "
                                      f"{', '.join(LINK_SCOPES)}")
        self.env = env
        self.spec = spec
        self.scope = scope
        if scope == "pair":
            self._pair = {(p, d): Port(f"P{p}->D{d}") for p in range(prefill)
                          for d in range(decode)}
        else:
            self._send = [Port(f"P{p} send") for p in range(prefill)]
            self._recv = [Port(f"D{d} receive") for d in range(decode)]

    @property
    def ports(self) -> list[Port]:
        return (list(self._pair.values()) if self.scope == "pair"
                else self._send + self._recv)

    def route(self, p: int, d: int) -> tuple[Port, ...]:
        """The ports a transfer from prefill replica ``p`` to decode replica ``d`` holds, in
        the order it takes them."""
        if self.scope == "pair":
            return (self._pair[(p, d)],)
        return (self._send[p], self._recv[d])

    def send(self, p: int, d: int, nbytes: float,
             done: Callable[[float, float], None]) -> None:
        """Queue ``nbytes`` from prefill replica ``p`` to decode replica ``d``; when they have
        arrived, ``done(start, seconds on the wire)`` is called (``start``: when the transfer
        got its link)."""
        self._advance(_Transfer(self.route(p, d), nbytes, done))

    # A port is a FIFO lock held for a transfer's wire time. It is kept here rather than as
    # a simpy Resource with a process per transfer (request, grant and release events for
    # each): the ports are taken and handed on at the same times, and a transfer's wire
    # time is one timeout, as before.
    def _advance(self, t: _Transfer) -> None:
        """Take ``t``'s ports in order while they are free; queue it on the first that is
        not; with all of them, put it on the wire."""
        while t.taken < len(t.route):
            port = t.route[t.taken]
            if port.holder is not None:
                port.waiting.append(t)
                return
            port.holder = t
            t.taken += 1
        start = self.env.now
        wire = self.spec.transfer_s(t.nbytes)
        self.env.timeout(wire).callbacks.append(
            lambda _ev: self._arrived(t, start, wire))

    def _arrived(self, t: _Transfer, start: float, wire: float) -> None:
        """``t``'s last byte is in: free its ports, each handed to the next transfer waiting
        for it, report the transfer, then let those transfers go on (as a released
        Resource grants the next request at once and its process resumes after)."""
        handed: list[_Transfer] = []
        for port in t.route:
            port.holder = None
            port.busy_s += wire
            port.bytes += t.nbytes
            port.transfers += 1
            if port.waiting:
                nxt = port.waiting.popleft()
                port.holder = nxt
                nxt.taken += 1
                handed.append(nxt)
        t.done(start, wire)
        for nxt in handed:
            self._advance(nxt)
