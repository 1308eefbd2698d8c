#!/usr/bin/env bash
# session 38: is the tokenizer manager's one ~0.4 s stall per server start (at the ~820-1030th
# request of the traced Azure command) a full garbage collection, and does /freeze_gc after the
# warm-up remove it? Two bf16 starts of session 32's probe command (Azure-conversation burst of
# 300, ladders 6/10/14(/18) req/s of 36 s), loop traced, SGLang's GC warning on (> 20 ms):
#   a: as before;  b: the same with bench_e2e.py --freeze-gc.
set -u
mkdir -p "$OUT"
T0=$(date +%s)
{ nvidia-smi -q | head -40; nproc; lscpu | head -20; } > "$OUT/machine.txt" 2>&1
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
FIRST=1
for V in ${ORDER:-a b}; do
  LEFT=$(( ${TOTAL_S:-575} - ($(date +%s) - T0) ))
  echo "== $V, ${LEFT} s left"
  mkdir -p "$OUT/$V"
  EST=60; [ $FIRST = 1 ] && EST=120
  FIRST=0
  FREEZE=""; R=6,10,14,18; [ "$V" = b ] && { FREEZE="--freeze-gc"; R=6,10,14; }
  SGLANG_DIFFKV_LOOP_TRACE="$OUT/$V/loop" OUT="$OUT/$V" BUDGET_S=$LEFT \
    bash scripts/gpu_e2e_run.sh --configs bf16 --workloads sharegpt,ladder \
    --sharegpt-trace azure-conv --sharegpt-n 300 --window-s 40 --ladder-abs-rates "$R" \
    --ladder-window-s 36 --warmup 16 --start-estimate-s $EST $FREEZE \
    --server-args "--gc-warning-threshold-secs 0.02" 2>&1 | tail -6
  gzip -f "$OUT/$V"/loop/*.jsonl 2>/dev/null
done
kill $WATCH 2>/dev/null
cd "$OUT" && for V in ${ORDER:-a b}; do tar czf "$V.tar.gz" "$V" && rm -rf "$V"; done
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
