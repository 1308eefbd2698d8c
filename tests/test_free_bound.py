"""FreePagesBound: a sync-free lower bound on free pages (copies landed by hand here:
ManualFreePagesBound)."""

from __future__ import annotations

import torch

from sglang_diffkv.memory.free_bound import FreePagesBound, ManualFreePagesBound


def hand_landed(count: list[int], exact_below: int) -> ManualFreePagesBound:
    return ManualFreePagesBound(lambda: torch.tensor(count[0]), exact_below)


def test_bound_never_exceeds_the_true_count_and_needs_no_sync():
    true = [1000]
    b = hand_landed(true, exact_below=100)
    assert b.read() == 1000 and b.exact_reads == 1  # nothing landed yet: one exact read
    # the device takes 300 (worst case 300) and returns 50: the bound does not see the 50
    true[0] -= 300
    b.taken(300)
    true[0] += 50
    assert b.read() == 700 <= true[0]
    b.land()  # the copy enqueued by the second read landed: 750, the count after the take
    assert b.read() == 750 == true[0]
    # an allocation issued while a copy is in flight stays subtracted after it lands
    b.taken(200)  # (the copy enqueued by the last read captured 750, before this take)
    true[0] -= 120
    b.land()
    assert b.read() == 550 <= true[0]
    b.land()
    assert b.read() == 630 == true[0]  # the copy enqueued after the take
    assert b.exact_reads == 1


def test_bound_near_a_full_pool_reads_exactly():
    true = [1000]
    b = hand_landed(true, exact_below=400)
    b.read()
    b.land()
    b.taken(700)  # worst case: the bound (300) is below 400 ...
    true[0] -= 100  # ... but only 100 were really taken
    assert b.read() == 900 and b.exact_reads == 2


def test_cpu_device_is_exact():
    b = FreePagesBound(lambda: torch.tensor(42), torch.device("cpu"), exact_below=10)
    b.taken(40)
    assert b.read() == 42


def test_callers_threshold_forces_an_exact_read():
    true = [1000]
    b = hand_landed(true, exact_below=0)
    b.read()
    b.land()
    b.taken(300)
    true[0] -= 10
    assert b.read() == 700  # stale but above every threshold
    assert b.read(exact_below=800) == 990 and b.exact_reads == 2
