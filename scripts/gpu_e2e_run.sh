#!/usr/bin/env bash
# End-to-end serving benchmark on the GPU machine, from the repo root, with the wheel parts
# of scripts/fetch_wheels.sh (carried in this call or an earlier one on the same machine):
#
#   bash scripts/gpu_e2e_run.sh [bench_e2e.py options ...]
#   e.g. bash scripts/gpu_e2e_run.sh --configs bf16 --workloads longgen,sharegpt,ladder
#   DUMMY_SHAPE=qwen2.5-32b bash scripts/gpu_e2e_run.sh --server-args "--tp-size 2" ...
#   (DUMMY_SHAPE: a scripts/dummy_model.py --shape; default llama-3-8b)
#
# Installs SGLang and this package (scripts/device_install.sh: editable, so SGLang's
# load_plugins finds the diffkv entry point), writes the dummy Llama-3-8B model, then runs
# scripts/bench_e2e.py with the time that is left. Everything lands in $OUT (or
# /tmp/diffkv_e2e): results.json, bench_serving.jsonl, summary.txt, logs.tar.gz -- four files,
# inside the GPU tool's limit of eight. BUDGET_S (default 560) bounds the whole script,
# install included; keep it below the call's timeout_s (at most 600).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${OUT:-/tmp/diffkv_e2e}; LOGS=$RES/logs; mkdir -p "$LOGS"
T0=$(date +%s); BUDGET_S=${BUDGET_S:-560}
export PYTHONUNBUFFERED=1
# one descriptor per streamed request on both sides; children inherit the raised limit
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

finish() {  # keep only the four result files: the tool brings back at most eight
  if [ ! -f "$RES/logs.tar.gz" ]; then (cd "$RES" && tar czf logs.tar.gz logs); fi
  rm -rf "$LOGS"
}
trap finish EXIT

source scripts/device_install.sh "$LOGS/install.log" || { echo "install failed"; exit 1; }
python3 -c "import aiohttp, numpy" || { echo "aiohttp/numpy missing"; exit 1; }
SHAPE=${DUMMY_SHAPE:-llama-3-8b}
MODEL=/tmp/dummy-llama3-8b; [ "$SHAPE" = llama-3-8b ] || MODEL=/tmp/dummy-$SHAPE
python3 scripts/dummy_model.py "$MODEL" --shape "$SHAPE" > /dev/null || exit 1
LEFT=$(( BUDGET_S - ($(date +%s) - T0) ))
echo "install done in $(( $(date +%s) - T0 )) s; bench budget ${LEFT} s"
python3 scripts/bench_e2e.py --model "$MODEL" --out "$RES" --budget-s "$LEFT" "$@"
