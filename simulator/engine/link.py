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

from collections.abc import Callable
from dataclasses import dataclass

import simpy

from simulator.errors import SimulatorInputError
from simulator.specs.link import LinkSpec

LINK_SCOPES = ("pair", "gpu")


@dataclass
class Port:
    """One FIFO queue of transfers and what it carried."""

    name: str
    queue: simpy.Resource
    busy_s: float = 0.0
    bytes: float = 0.0
    transfers: int = 0


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

        def port(name: str) -> Port:
            return Port(name, simpy.Resource(env, capacity=1))

        if scope == "pair":
            self._pair = {(p, d): port(f"P{p}->D{d}") for p in range(prefill)
                          for d in range(decode)}
        else:
            self._send = [port(f"P{p} send") for p in range(prefill)]
            self._recv = [port(f"D{d} receive") for d in range(decode)]

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
        self.env.process(self._transfer(self.route(p, d), nbytes, done))

    def _transfer(self, route: tuple[Port, ...], nbytes: float,
                  done: Callable[[float, float], None]):  # simpy process generator
        held = []
        for port in route:
            req = port.queue.request()
            yield req
            held.append((port, req))
        start = self.env.now
        wire = self.spec.transfer_s(nbytes)
        yield self.env.timeout(wire)
        for port, req in held:
            port.queue.release(req)
            port.busy_s += wire
            port.bytes += nbytes
            port.transfers += 1
        done(start, wire)
