#!/usr/bin/env bash
# session 37: the DiffKV ladder at 23.03 req/s (45 s window, as #n1-#n6) with the scheduler's
# loop traced, the host and the GPU's clocks sampled, and the torch profiler (GPU kernels)
# attached for PROF_STEPS forward steps at AT seconds after the server first answers:
# what a decode step at batch ~110 and ~560 tokens spends on the GPU, and whether a decode
# step after an extend runs slower than one after a decode step.
set -u
mkdir -p "$OUT/diffkv-mix" "$OUT/prof"
T0=$(date +%s)
{ nvidia-smi -q | head -60; nproc; lscpu | head -20; } > "$OUT/machine.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -lms 100 > "$OUT/smi.csv" 2>&1 &
SMI=$!
python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
SGLANG_DIFFKV_LOOP_TRACE="$OUT/diffkv-mix/loop" OUT="$OUT/diffkv-mix" BUDGET_S=${TOTAL_S:-480} \
  bash scripts/gpu_e2e_run.sh --configs diffkv-mix --workloads ladder \
  --ladder-abs-rates ${RATES:-23.03} --ladder-window-s 45 --warmup 16 --start-estimate-s 170 \
  > "$OUT/e2e.txt" 2>&1 &
E2E=$!
sleep 5
python3 scripts/profile_server_step.py --attach --at-seconds ${AT:-22,38} --steps ${PROF_STEPS:-100} \
  --server-log "$OUT/diffkv-mix/logs/server__diffkv-mix.log" --out "$OUT/prof" > "$OUT/prof.txt" 2>&1
wait $E2E
kill $WATCH $SMI 2>/dev/null
tail -8 "$OUT/e2e.txt"
python3 scripts/loop_trace_report.py --json "$OUT/report.json" diffkv="$OUT/diffkv-mix" > "$OUT/report.txt" 2>&1 || true
gzip -f "$OUT"/diffkv-mix/loop/*.jsonl 2>/dev/null
cd "$OUT" && tar czf diffkv-mix.tar.gz diffkv-mix && rm -rf diffkv-mix
tar czf prof.tar.gz prof prof.txt smi.csv host.jsonl && rm -rf prof smi.csv host.jsonl
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
