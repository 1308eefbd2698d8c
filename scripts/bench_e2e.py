#!/usr/bin/env python3
"""End-to-end serving benchmark: bf16 / fp8 / diffkv SGLang servers x longgen / sharegpt / ladder
workloads, inside one time budget. See docs/e2e.md; on the GPU machine run
scripts/gpu_e2e_run.sh, which installs SGLang and then calls this.

  python3 scripts/bench_e2e.py --configs bf16,diffkv-mix --workloads longgen,sharegpt,ladder \
      --budget-s 500 --out "$OUT" --model /tmp/dummy-llama3-8b
  python3 scripts/bench_e2e.py --dry-run ...     # the command lines and traces, no server
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_diffkv.bench.e2e import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
