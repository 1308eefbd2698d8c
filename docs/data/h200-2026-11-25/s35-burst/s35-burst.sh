#!/usr/bin/env bash
# session 35: a ShareGPT burst of SHAREGPT_N (default 2000, the bundled trace's all) on one
# DiffKV server, then a ladder at 23.03 req/s: eager decode batches beyond the 1,500 that the
# fitting start (#m1) reached, with the scheduler's loop traced and the host sampled.
set -u
mkdir -p "$OUT/diffkv-mix"
T0=$(date +%s)
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
SGLANG_DIFFKV_LOOP_TRACE="$OUT/diffkv-mix/loop" OUT="$OUT/diffkv-mix" BUDGET_S=${TOTAL_S:-500} \
  bash scripts/gpu_e2e_run.sh --configs diffkv-mix --workloads ${WORKLOADS:-sharegpt,ladder} \
  --sharegpt-n ${SHAREGPT_N:-2000} --ladder-abs-rates ${RATES:-23.03} --ladder-window-s 45 \
  --warmup 16 --start-estimate-s 170 2>&1 | tail -8
kill $WATCH 2>/dev/null
python3 scripts/loop_trace_report.py --graph-max-bs 512 --json "$OUT/report.json" \
  diffkv="$OUT/diffkv-mix" > "$OUT/report.txt" 2>&1 || true
gzip -f "$OUT"/diffkv-mix/loop/*.jsonl 2>/dev/null
cd "$OUT" && tar czf diffkv-mix.tar.gz diffkv-mix && rm -rf diffkv-mix
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
