"""End-to-end serving benchmark on the GPU machine: scripts/gpu_e2e_run.sh installs SGLang
and this package, then calls this wrapper. Anywhere else run the package entry directly,
``python -m sglang_diffkv.bench.e2e`` (docs/e2e.md).

  python3 scripts/bench_e2e.py --configs bf16,diffkv-mix --workloads longgen,sharegpt,ladder \
      --budget-s 500 --out "$OUT" --model /tmp/dummy-llama3-8b
  python3 scripts/bench_e2e.py --dry-run ...     # the command lines and traces, no server
"""

import sys

from sglang_diffkv.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
