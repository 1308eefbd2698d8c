#!/usr/bin/env bash
# session 25: does the workload change what a one-token extend costs the host? Session 19's
# ShareGPT fitting command (bf16: burst of 500, ladders at 4 and 12 req/s) and then the Azure
# command's 6 and 10 req/s ladders (bf16), each on its own server, both with the scheduler loop
# traced; compare the extends in each process's decode launches.
set -u
mkdir -p "$OUT"
T0=$(date +%s)
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
run() {  # name est args...
  local NAME=$1 EST=$2; shift 2
  local LEFT=$(( ${TOTAL_S:-580} - ($(date +%s) - T0) ))
  echo "== $NAME, ${LEFT} s left"
  mkdir -p "$OUT/$NAME"
  SGLANG_DIFFKV_LOOP_TRACE="$OUT/$NAME/loop" OUT="$OUT/$NAME" BUDGET_S=$LEFT \
    bash scripts/gpu_e2e_run.sh --configs bf16 --warmup 16 --start-estimate-s "$EST" "$@" 2>&1 | tail -5
}
run sharegpt 120 --workloads sharegpt,ladder --sharegpt-n 500 --sharegpt-skip 1500 --window-s 60 \
  --ladder-abs-rates 4,12 --ladder-window-s 40
run azure 60 --workloads sharegpt,ladder --sharegpt-trace azure-conv --sharegpt-n 300 --window-s 40 \
  --ladder-abs-rates 6,10 --ladder-window-s 40
kill $WATCH
cd "$OUT" && for N in sharegpt azure; do tar czf "$N.tar.gz" "$N" && rm -rf "$N"; done
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
