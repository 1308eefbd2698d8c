#!/usr/bin/env bash
# session 38, second call: how often does the tokenizer manager's full collection come back?
# One bf16 start of the probe command's burst (Azure-conversation, 300) and then ladders at
# 12/15/18 req/s of 60 s (about 3,000 requests since the start), loop traced, SGLang's GC
# warning on (> 20 ms): every long collection is logged with its generation and duration.
set -u
mkdir -p "$OUT/l"
T0=$(date +%s)
SGLANG_DIFFKV_LOOP_TRACE="$OUT/l/loop" OUT="$OUT/l" BUDGET_S=${TOTAL_S:-560} \
  bash scripts/gpu_e2e_run.sh --configs bf16 --workloads sharegpt,ladder \
  --sharegpt-trace azure-conv --sharegpt-n 300 --window-s 40 --ladder-abs-rates ${RATES:-12,15,18} \
  --ladder-window-s ${WIN:-60} --warmup 16 --start-estimate-s 120 \
  --server-args "--gc-warning-threshold-secs 0.02" 2>&1 | tail -6
gzip -f "$OUT"/l/loop/*.jsonl 2>/dev/null
cd "$OUT" && tar czf l.tar.gz l && rm -rf l
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
