"""A request's life inside the simulated server; one object per trace request."""

from __future__ import annotations

import numpy as np


class SimRequest:
    """Mutable state of one request. Invariants: 0 <= gen <= output_len <= max_new;
    while waiting or prefilling, 0 <= prefilled <= fill_len where fill_len = input_len + gen
    at admission (a retracted request recomputes its prompt and its outputs so far)."""

    __slots__ = ("rid", "arrival", "input_len", "output_len", "max_new", "gen", "fill_len",
                 "prefilled", "held", "prof", "first_token", "finish", "last_token",
                 "retractions", "rejected", "replica", "itl", "queued_at", "user", "hash_ids",
                 "prefix_blocks", "cached")

    def __init__(self, rid: int, arrival: float, input_len: int, output_len: int,
                 max_new: int, user: int = -1, hash_ids: tuple[int, ...] = ()):
        self.rid = rid
        self.arrival = arrival
        self.input_len = input_len
        self.output_len = output_len
        self.max_new = max_new
        self.gen = 0
        self.fill_len = input_len
        self.prefilled = 0
        self.held = 0                      # pool units held now
        self.prof: np.ndarray | None = None  # DiffKV tier fractions (2, K) or None
        self.first_token = -1.0
        self.finish = -1.0
        self.last_token = -1.0
        self.retractions = 0
        self.rejected: str | None = None
        self.replica = -1
        self.itl: list[float] | None = None  # gaps not produced by plain decode steps
        self.queued_at = arrival           # reached the scheduler (later in a front-end pause)
        self.user = user
        self.hash_ids = hash_ids             # Mooncake prompt-block ids (prefix cache keys)
        self.prefix_blocks: list[int] = []   # cached blocks this request holds locked
        self.cached = 0                      # prompt tokens the radix cache served it

    @property
    def done(self) -> bool:
        return self.finish >= 0 or self.rejected is not None
