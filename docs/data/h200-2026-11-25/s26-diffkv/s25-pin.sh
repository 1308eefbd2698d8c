#!/usr/bin/env bash
# session 25: session 24's traced Azure-conversation command (fp8 and bf16 one after the other)
# with SGLang's processes pinned to their own physical cores: scheduler, tokenizer manager (the
# launch_server process), detokenizer and the benchmark client each get one core that nothing
# else may use; everything else runs on the remaining cores. Does pinning remove the spread of
# host speed between server starts?
set -u
mkdir -p "$OUT"
T0=$(date +%s)
TOPO="$OUT/topo.txt"
{ lscpu; echo; nvidia-smi topo -m; echo; for n in /sys/devices/system/node/node*; do echo "$n $(cat $n/cpulist)"; done; } > "$TOPO" 2>&1
# physical cores as sibling lists, in order of their first cpu
mapfile -t CORES < <(cat /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list | sort -u -t, -k1,1n | sort -n -t- -k1,1)
echo "cores: ${CORES[*]}" | tee -a "$TOPO"
N=${#CORES[@]}; PIN=${PIN:-1}; SCHED=-; TOK=-; DETOK=-; CLIENT=-
if [ "${PIN:-1}" = 1 ] && [ "$N" -ge 6 ]; then
  SCHED=${CORES[1]}; TOK=${CORES[2]}; DETOK=${CORES[3]}; CLIENT=${CORES[4]}
  REST=$(IFS=,; echo "${CORES[0]},${CORES[*]:5}")
else
  PIN=0; REST=$(IFS=,; echo "${CORES[*]}")
fi
echo "PIN=${PIN:-1} sched=$SCHED tok=$TOK detok=$DETOK client=$CLIENT rest=$REST" | tee -a "$TOPO"
pin_loop() {
  while true; do
    for p in $(pgrep -f '^sglang::detokenizer'); do taskset -acp "$DETOK" "$p" > /dev/null 2>&1; done
    for p in $(pgrep -f 'python[0-9.]* -m sglang.launch_server'); do taskset -acp "$TOK" "$p" > /dev/null 2>&1; done
    for p in $(pgrep -f 'scripts/bench_e2e.py'); do taskset -acp "$CLIENT" "$p" > /dev/null 2>&1; done
    for p in $(pgrep -f '^sglang::scheduler'); do taskset -acp "$SCHED" "$p" > /dev/null 2>&1; done
    sleep 1
  done
}
snap() {  # where each SGLang thread ran, once the ladders are under way
  sleep "$1"
  { date; ps -eLo pid,tid,psr,pcpu,comm,args --sort=-pcpu | grep -E 'sglang|bench_e2e' | grep -v grep | head -60
    for p in $(pgrep -f '^sglang::|sglang.launch_server|bench_e2e'); do echo "$p $(grep Cpus_allowed_list /proc/$p/status)"; done
  } >> "$OUT/threads.txt" 2>&1
}
[ "$PIN" = 1 ] && { pin_loop & PINNER=$!; }
taskset -c "$REST" python3 scripts/probe_host.py --watch 1.0 --out "$OUT/host.jsonl" > /dev/null 2>&1 &
WATCH=$!
FIRST=1
for CFG in ${ORDER:-fp8 bf16}; do
  LEFT=$(( ${TOTAL_S:-585} - ($(date +%s) - T0) ))
  echo "== $CFG, ${LEFT} s left"
  mkdir -p "$OUT/$CFG"
  EST=60; [ $FIRST = 1 ] && EST=120
  ( snap $(( EST + 70 )) ) &
  FIRST=0
  SGLANG_DIFFKV_LOOP_TRACE="$OUT/$CFG/loop" OUT="$OUT/$CFG" BUDGET_S=$LEFT \
    taskset -c "$REST" bash scripts/gpu_e2e_run.sh --configs "$CFG" --workloads sharegpt,ladder \
    --sharegpt-trace azure-conv --sharegpt-n 300 --window-s 40 --ladder-abs-rates ${RATES:-6,10,14} \
    --ladder-window-s 40 --warmup 16 --start-estimate-s $EST 2>&1 | tail -6
done
kill $WATCH ${PINNER:-} 2>/dev/null
cd "$OUT" && for CFG in ${ORDER:-fp8 bf16}; do tar czf "$CFG.tar.gz" "$CFG" && rm -rf "$CFG"; done
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
