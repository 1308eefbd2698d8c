"""A block-level model of SGLang's radix (prefix) cache, keyed by Mooncake prefix hash ids.

Mooncake hash ids name 512-token prompt blocks, and an id depends on every block before it, so
a request's reusable prefix is the longest run of its leading ids already cached. Invariants:

  * a cached block holds ``block_tokens`` pool units (token pools only: the DiffKV backend runs
    with the radix cache disabled);
  * a block used by running requests is locked (refcount > 0) and cannot be evicted; unlocked
    blocks are "evictable" and count as available memory, as in SGLang's PrefillAdder;
  * a request inserts its full prompt blocks when its prefill completes (SGLang's
    cache_unfinished_req) and keeps them locked until it finishes or is retracted; eviction
    takes the least recently used unlocked blocks first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MOONCAKE_BLOCK_TOKENS = 512


class PrefixCache:
    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS):
        self.block = block_tokens
        self.refs: OrderedDict[int, int] = OrderedDict()   # id -> refcount, oldest first
        self.evictable_blocks = 0
        self.hits = 0          # prompt tokens served from the cache
        self.lookups = 0       # prompt tokens looked up

    @property
    def units(self) -> int:
        return len(self.refs) * self.block

    @property
    def evictable_units(self) -> int:
        return self.evictable_blocks * self.block

    def match(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """Leading cached ids, at most ``max_tokens`` worth (SGLang leaves >= 1 token to
        compute, so callers pass prompt length - 1)."""
        out: list[int] = []
        for h in ids[: max(0, max_tokens) // self.block]:
            if h not in self.refs:
                break
            out.append(h)
        return out

    def lock(self, ids: Sequence[int]) -> int:
        """Reference ``ids``; returns the units that stop being evictable."""
        newly = 0
        for h in ids:
            rc = self.refs[h]
            if rc == 0:
                self.evictable_blocks -= 1
                newly += 1
            self.refs[h] = rc + 1
            self.refs.move_to_end(h)
        return newly * self.block

    def unlock(self, ids: Sequence[int]) -> None:
        for h in ids:
            rc = self.refs[h] - 1
            self.refs[h] = rc
            if rc == 0:
                self.evictable_blocks += 1

    def insert_locked(self, ids: Sequence[int], max_new: int) -> list[int]:
        """Cache the missing ones of ``ids`` locked by their owner (a request whose prefill just
        finished keeps using them), adding at most ``max_new`` blocks; returns those added."""
        added: list[int] = []
        for h in ids:
            if h in self.refs:
                self.refs.move_to_end(h)
            elif len(added) < max_new:
                self.refs[h] = 1
                added.append(h)
        return added

    def insert(self, ids: Sequence[int], max_new: int) -> int:
        """Cache ``ids`` (unlocked), adding at most ``max_new`` blocks (the finished request's
        own units back them); returns how many were added."""
        new = 0
        for h in ids:
            if h in self.refs:
                self.refs.move_to_end(h)
            elif new < max_new:
                self.refs[h] = 0
                self.evictable_blocks += 1
                new += 1
        return new

    def evict(self, units: int) -> int:
        """Free at least ``units`` (if possible) from unlocked blocks, oldest first; returns
        the units freed."""
        need = -(-units // self.block)
        victims = []
        for h, rc in self.refs.items():
            if len(victims) >= need:
                break
            if rc == 0:
                victims.append(h)
        for h in victims:
            del self.refs[h]
        self.evictable_blocks -= len(victims)
        return len(victims) * self.block
