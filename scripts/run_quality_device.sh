#!/usr/bin/env bash
# Run the full quality run (python -m sglang_diffkv.eval.full_run) on a lent GPU machine (the reference cache is plain torch, so
# --device cuda runs the very same code as the CPU, only faster). The GGUF (98 MB) is over
# the 64 MiB a call may carry, so it travels in two parts under the git-ignored .dk/:
#   head -c 50000000 $GGUF > .dk/p1; tail -c +50000001 $GGUF > .dk/p2; gguf wheel in .dk/whl
# Calls (each within the machine's warm window of the previous one):
#   part1  (carry .dk/p1 .dk/whl)  stash part 1 and the wheel in /tmp/dk
#   start  (carry .dk/p2)          assemble, verify sha256, start the pipeline detached, wait
#   wait                           wait more; every call ends by packing /tmp/dk/out to $OUT
set -u
D=/tmp/dk
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF=$D/SmolLM2-135M-Instruct.Q4_1.gguf
mode=${1:?part1|start|wait}
shift
wait_and_pack() {
  local budget=${WAIT_S:-540} t=0
  while [ -f $D/pid ] && kill -0 "$(cat $D/pid)" 2>/dev/null && [ $t -lt "$budget" ]; do
    sleep 10; t=$((t + 10))
  done
  kill -0 "$(cat $D/pid)" 2>/dev/null && echo "STILL RUNNING after ${t}s" || echo "FINISHED"
  grep -v "Warning\|Loading weights\|de-quantizing" $D/log | tail -60
  tar czf "$OUT/quality_out.tgz" -C $D out log 2>/dev/null
}
assemble() {  # the GGUF from its two parts, the gguf wheel, the data (carry .dk/p2 .dk/data)
  echo "$SHA  $GGUF" | sha256sum -c - 2>/dev/null || cat $D/p1 .dk/p2 > $GGUF
  echo "$SHA  $GGUF" | sha256sum -c - || return 1
  [ -d $D/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target $D/site \
    $D/*.whl || return 1
  # the evaluation data (../shared/data/eval here) travels in .dk/data
  mkdir -p $D/data $D/out && cp .dk/data/* $D/data/ || { echo "carry .dk/data"; return 1; }
}
case $mode in
  part1)
    mkdir -p $D && cp .dk/p1 $D/p1 && cp .dk/whl/*.whl $D/
    nvidia-smi -L
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
    ;;
  start)
    assemble || exit 1
    mkdir -p $D/out
    SGLANG_DIFFKV_DATA=$D/data PYTHONPATH=$D/site:$PWD HF_HUB_OFFLINE=1 SGLANG_DIFFKV_CACHE=$D/cache PYTHONUNBUFFERED=1 \
      setsid nohup python3 -m sglang_diffkv.eval.full_run --model $GGUF --device cuda \
      --out-dir $D/out --preset $D/out/smollm2-135m.json "$@" > $D/log 2>&1 &
    echo $! > $D/pid
    wait_and_pack
    ;;
  wait)
    wait_and_pack
    ;;
  cli)  # any diffkv-eval command, detached, e.g. a needles-only run
    assemble || exit 1
    SGLANG_DIFFKV_DATA=$D/data PYTHONPATH=$D/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
      setsid nohup python3 -m sglang_diffkv.eval.cli "$@" > $D/log 2>&1 &
    echo $! > $D/pid
    wait_and_pack
    ;;
esac
