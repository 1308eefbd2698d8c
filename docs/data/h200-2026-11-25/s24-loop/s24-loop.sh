#!/usr/bin/env bash
# session 24: session 21's Azure-conversation command (burst of 300, ladders 6/10/14 req/s) on
# two configurations one after the other (ORDER, default "fp8 bf16"), with the scheduler's loop
# traced (SGLANG_DIFFKV_LOOP_TRACE) and the host's Python speed sampled every second: where
# does fp8's extra TTFT go inside the server?
set -u
mkdir -p "$OUT"
T0=$(date +%s)
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
FIRST=1
for CFG in ${ORDER:-fp8 bf16}; do
  LEFT=$(( ${TOTAL_S:-585} - ($(date +%s) - T0) ))
  echo "== $CFG, ${LEFT} s left"
  mkdir -p "$OUT/$CFG"
  EST=60; [ $FIRST = 1 ] && EST=120; FIRST=0
  SGLANG_DIFFKV_LOOP_TRACE="$OUT/$CFG/loop" OUT="$OUT/$CFG" BUDGET_S=$LEFT \
    bash scripts/gpu_e2e_run.sh --configs "$CFG" --workloads sharegpt,ladder \
    --sharegpt-trace azure-conv --sharegpt-n 300 --window-s 40 --ladder-abs-rates ${RATES:-6,10,14} \
    --ladder-window-s 40 --warmup 16 --start-estimate-s $EST 2>&1 | tail -6
done
kill $WATCH
cd "$OUT" && for CFG in ${ORDER:-fp8 bf16}; do tar czf "$CFG.tar.gz" "$CFG" && rm -rf "$CFG"; done
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
