"""Session 31's interleaved trace: blocks of BLOCK requests, Azure conversation then ShareGPT
lengths in turn, so that one DiffKV server start serves both workloads alternately at one
rate (does a workload change how fast the host launches a prefill?).

  python docs/data/h200-2026-11-25/s31-mix/make_trace.py OUT.jsonl [BLOCK] [BLOCKS]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # run from the repository root

from simulator.workload.bundled import load_named_trace  # noqa: E402
from simulator.workload.schema import Trace  # noqa: E402
from simulator.workload.writer import write_mooncake_jsonl  # noqa: E402

out = Path(sys.argv[1])
block = int(sys.argv[2]) if len(sys.argv) > 2 else 200
blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 10
azure, sharegpt = load_named_trace("azure-conv"), load_named_trace("sharegpt")
reqs = []
for b in range(blocks):
    src = azure if b % 2 == 0 else sharegpt
    i = (b // 2) * block
    reqs += src.requests[i:i + block]
trace = Trace(tuple(reqs), name="azure-sharegpt-blocks")
write_mooncake_jsonl(trace.with_arrivals([0.1 * k for k in range(len(reqs))]), out)
print(f"{out}: {len(reqs)} requests, blocks of {block} (azure-conv first)")
