"""A fixed single-thread Python workload: a reading of host speed that travels with a run.

SGLang's scheduler, its eager prefill launches and the HTTP front end are single-threaded
Python, so a server start on a slower (or busier) host pays more per step. The workload mixes
what that code does: attribute and dict access, small-list building, integer arithmetic.
"""

import time


def _workload(n: int) -> int:
    table: dict[int, int] = {}
    acc = 0
    for i in range(n):
        row = [i, i + 1, i + 2]
        table[i & 1023] = row[1] * 3 + acc % 7
        acc += table.get((i * 7) & 1023, 0) + len(row)
    return acc


def python_loop_ms(repeat: int = 3, n: int = 200_000) -> float:
    """Best wall time, in ms, of ``repeat`` runs of the workload at size ``n``."""
    if repeat < 1 or n < 1:
        raise ValueError(f"repeat={repeat}, n={n}: both must be >= 1")
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        _workload(n)
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best
