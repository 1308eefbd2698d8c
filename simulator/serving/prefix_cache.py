"""A block-level model of SGLang's radix (prefix) cache, keyed by a trace's prefix hash ids.

A hash id names a prompt block of the trace's ``prefix_block_tokens`` (Mooncake's 512), and an
id depends on every block before it, so a request's reusable prefix is the longest run of its
leading ids already cached. SGLang matches single tokens (page size 1): the model rounds a
match down to whole blocks. Invariants:

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

from sglang_diffkv.serving_io.trace import MOONCAKE_BLOCK_TOKENS


class PrefixCache:
    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS):
        self.block = block_tokens
        self.refs: dict[int, int] = {}                     # id -> refcount
        # the unlocked (refcount 0) blocks, least recently used first: eviction takes from
        # the front without walking past the locked ones
        self.unlocked: OrderedDict[int, None] = OrderedDict()
        self.hits = 0          # prompt tokens served from the cache
        self.lookups = 0       # prompt tokens looked up

    @property
    def units(self) -> int:
        return len(self.refs) * self.block

    @property
    def evictable_blocks(self) -> int:
        return len(self.unlocked)

    @property
    def evictable_units(self) -> int:
        return len(self.unlocked) * self.block

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
                del self.unlocked[h]
                newly += 1
            self.refs[h] = rc + 1
        return newly * self.block

    def unlock(self, ids: Sequence[int]) -> None:
        """Drop a reference; a block nobody holds becomes the most recently used evictable."""
        for h in ids:
            rc = self.refs[h] - 1
            self.refs[h] = rc
            if rc == 0:
                self.unlocked[h] = None

    def insert_locked(self, ids: Sequence[int], max_new: int) -> list[int]:
        """Cache the missing ones of ``ids`` locked by their owner (a request whose prefill just
        finished keeps using them), adding at most ``max_new`` blocks; returns those added."""
        added: list[int] = []
        for h in ids:
            if h in self.refs:
                if h in self.unlocked:
                    self.unlocked.move_to_end(h)
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
                if h in self.unlocked:
                    self.unlocked.move_to_end(h)
            elif new < max_new:
                self.refs[h] = 0
                self.unlocked[h] = None
                new += 1
        return new

    def evict(self, units: int) -> int:
        """Free at least ``units`` (if possible) from unlocked blocks, least recently used
        first; returns the units freed."""
        need = min(-(-units // self.block), len(self.unlocked))
        for _ in range(need):
            h, _ = self.unlocked.popitem(last=False)
            del self.refs[h]
        return need * self.block
