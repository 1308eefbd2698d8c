#!/usr/bin/env bash
# session 27: session 19's DiffKV ShareGPT command again (burst of 1500, ladders 7.68/15.35/23.03
# req/s, 45 s windows; the #d order), with the scheduler's loop traced and the host sampled:
# more starts of the one DiffKV ladder that still misses at 23 req/s, and where its steps go.
# WORKLOADS and RATES override the command (fitting runs at other rates).
set -u
mkdir -p "$OUT/diffkv-mix"
T0=$(date +%s)
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
SGLANG_DIFFKV_LOOP_TRACE="$OUT/diffkv-mix/loop" OUT="$OUT/diffkv-mix" BUDGET_S=${TOTAL_S:-585} \
  bash scripts/gpu_e2e_run.sh --configs diffkv-mix --workloads ${WORKLOADS:-sharegpt,ladder} \
  --ladder-abs-rates ${RATES:-7.68,15.35,23.03} --ladder-window-s 45 --warmup 16 --start-estimate-s 170 2>&1 | tail -8
kill $WATCH 2>/dev/null
python3 scripts/loop_trace_report.py --json "$OUT/report.json" diffkv="$OUT/diffkv-mix" > "$OUT/report.txt" 2>&1 || true
gzip -f "$OUT"/diffkv-mix/loop/*.jsonl 2>/dev/null
cd "$OUT" && tar czf diffkv-mix.tar.gz diffkv-mix && rm -rf diffkv-mix
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
