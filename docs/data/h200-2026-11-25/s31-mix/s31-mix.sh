#!/usr/bin/env bash
# session 31: one DiffKV server start serving Azure-conversation and ShareGPT lengths in
# alternate blocks of 200 requests, open loop at 10 req/s for 200 s, the scheduler loop
# traced (thread CPU time, garbage collection and the DiffKV backend's spans inside each
# launch), the threads of every SGLang process and the cores' steal sampled each second.
set -u
P=${P:-docs/data/h200-2026-11-25/s31-mix}  # the GPU run: P=.device/probe, a copy
mkdir -p "$OUT/diffkv-mix"
T0=$(date +%s)
python3 $P/make_trace.py /tmp/s31-blocks.jsonl 200 10
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
python3 $P/threads.py /tmp/threads.jsonl 1.0 &
THREADS=$!
SGLANG_DIFFKV_LOOP_TRACE="$OUT/diffkv-mix/loop" OUT="$OUT/diffkv-mix" BUDGET_S=${TOTAL_S:-560} \
  bash scripts/gpu_e2e_run.sh --configs diffkv-mix --workloads ladder \
  --sharegpt-trace /tmp/s31-blocks.jsonl --sharegpt-n 2000 --ladder-abs-rates ${RATE:-10} \
  --ladder-window-s ${WINDOW:-200} --warmup 16 --start-estimate-s 120 2>&1 | tail -8
kill $WATCH $THREADS 2>/dev/null
gzip -c /tmp/threads.jsonl > "$OUT/threads.jsonl.gz"
gzip -f "$OUT"/diffkv-mix/loop/*.jsonl 2>/dev/null
cd "$OUT" && tar czf diffkv-mix.tar.gz diffkv-mix && rm -rf diffkv-mix
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
