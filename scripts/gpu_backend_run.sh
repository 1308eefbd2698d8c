#!/usr/bin/env bash
# One scripted H100 run of `--attention-backend diffkv` (stage 1), from the repo root, with
# .whl/ (bash scripts/fetch_wheels.sh).
#
#   bash scripts/gpu_backend_run.sh [STEP ...]     # default: triton nocomp default
#
#   triton   stock triton server: greedy top-20 support + logprobs of the first 8 tokens
#   nocomp   diffkv, SGLANG_DIFFKV_CONFIG=no-compression (every token high): same logprobs,
#            KL(triton || diffkv) per position
#   default  diffkv, default preset: logprobs, per-request thresholds, a long-generation batch,
#            then idle (SGLang's strict idle leak check runs), health, log audit
#   small    diffkv, default preset, a SmolLM2-135M-shaped dummy model (head_dim 64, GQA 3)
#   long32k  diffkv, default preset, the dummy Llama-3-8B at a 32,768-token context: one
#            LONG32K_IN-token prompt (default 32,000) through chunked prefill (SGLang's default
#            chunk), 64 tokens out, then the idle leak check
#   flashinfer  stock flashinfer server against triton: the same logprob KL, as a control of
#            how much two correct backends differ on the model
#   rtriton rnocomp rdefault   the same three on a SmolLM2-135M-shaped model with random
#            weights scaled for sharp logits and peaked attention
#            (scripts/sglang_backend_random_model.py): dummy weights give near-uniform
#            logits and flat attention, which neither the KL nor the policy can see
#
# Everything goes to $OUT (or /tmp/diffkv_gpu): summary.txt and logs.tar.gz.
# BUDGET_S (default 540) bounds the run; each step is skipped when too little is left.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu_prologue.sh /tmp/diffkv_gpu 540

source scripts/device_install.sh "$LOGS/install.log" > "$RES/install.txt" 2>&1
rc=$?; cat "$RES/install.txt" >> "$SUMMARY"; cat "$RES/install.txt"; rm -f "$RES/install.txt"
[ "$rc" -eq 0 ] || { say "install failed"; exit 1; }

MODEL=/tmp/dummy-llama3-8b
python3 scripts/dummy_model.py "$MODEL" >/dev/null || exit 1
RMODEL=/tmp/random-smollm2
case " $* " in *" r"*)
  python3 scripts/dummy_model.py "$RMODEL" --layers 30 >/dev/null \
    && python3 scripts/sglang_backend_random_model.py "$RMODEL" | tee -a "$SUMMARY" ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$SUMMARY"
PORT=30000
COMMON=(--load-format dummy --sampling-backend pytorch --grammar-backend none
        --mem-fraction-static 0.85 --skip-tokenizer-init --max-running-requests 64
        --host 127.0.0.1 --port $PORT)
CLIENT="python3 scripts/sglang_backend_client.py"

SERVER_PID=
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM -- -"$SERVER_PID" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SERVER_PID" 2>/dev/null; SERVER_PID=; sleep 3
}
trap stop_server EXIT

# start_server NAME MAXWAIT MODEL ARGS... (env set by the caller)
start_server() {
  local name=$1 maxwait=$2 model=$3; shift 3
  local t=$(date +%s)
  setsid python3 -m sglang.launch_server --model-path "$model" "${COMMON[@]}" "$@" \
    > "$LOGS/$name.log" 2>&1 &
  SERVER_PID=$!
  while :; do
    if grep -q "The server is fired up and ready to roll" "$LOGS/$name.log"; then
      say "$name: ready after $(( $(date +%s) - t )) s"; return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      say "$name: server exited during startup"; tail -30 "$LOGS/$name.log" | tee -a "$SUMMARY"
      SERVER_PID=; return 1; fi
    if [ $(( $(date +%s) - t )) -gt "$maxwait" ]; then
      say "$name: not ready after $maxwait s"; tail -30 "$LOGS/$name.log" | tee -a "$SUMMARY"
      stop_server; return 1; fi
    sleep 2
  done
}

audit() {  # what the diffkv log says: start-up report, forced settings, metrics, errors
  local log=$LOGS/$1.log
  grep -E "DiffKV KV cache|diffkv: |compute path|max_total_num_tokens" "$log" \
    | sed 's/^.*\] //' | sort -u | tee -a "$SUMMARY"
  grep -E "DiffKV (prefill|decode):" "$log" | tail -3 | sed 's/^.*\] //' | tee -a "$SUMMARY"
  say "$1: max pages in use seen: $(grep -oE 'pages in use [0-9]+' "$log" | awk '{print $4}' | sort -n | tail -1)"
  local ignore="Ignore import error|openai_harmony|OpenAIServingResponses|RLIMIT|FA3"
  say "$1: errors/tracebacks/leaks: $(grep -iE 'Traceback|Error|leak' "$log" | grep -cvE "$ignore") lines"
  grep -iE "Traceback|Error|leak" "$log" \
    | grep -vE "$ignore" | head -5 | tee -a "$SUMMARY"
}

run_step() {
  local step=$1 P= M=$MODEL LOAD=(--load-format dummy) X=() S=
  case $step in r*) P=r; M=$RMODEL; LOAD=(--load-format safetensors); step=${step#r} ;; esac
  # nocomp-nooverlap / nocomp-nograph: the same step with the overlap scheduler or the decode
  # CUDA graphs off (to bisect a difference against triton)
  case $step in
    *-nooverlap) X=(--disable-overlap-schedule); S=-nooverlap; step=${step%-nooverlap} ;;
    *-nograph) X=(--disable-cuda-graph); S=-nograph; step=${step%-nograph} ;;
  esac
  say "== $P$step$S ($(left) s left)"
  case $step in
    triton)
      [ "$(left)" -gt 150 ] || { say "skipped: no time"; return; }
      start_server ${P}triton 200 "$M" "${LOAD[@]}" --attention-backend triton --disable-cuda-graph \
        --disable-piecewise-cuda-graph || return
      grep -oE "max_total_num_tokens=[0-9]+" "$LOGS/${P}triton.log" | head -1 | sed "s/^/${P}triton: /" | tee -a "$SUMMARY"
      timeout 120 $CLIENT support $PORT "$RES/${P}support.json" | tee -a "$SUMMARY"
      timeout 120 $CLIENT logits $PORT "$RES/${P}support.json" "$RES/${P}triton.json" | tee -a "$SUMMARY"
      stop_server ;;
    flashinfer)  # control: a second stock backend against triton (the model's sensitivity)
      [ "$(left)" -gt 120 ] || { say "skipped: no time"; return; }
      start_server ${P}flashinfer 200 "$M" "${LOAD[@]}" --attention-backend flashinfer \
        --disable-cuda-graph --disable-piecewise-cuda-graph || return
      timeout 120 $CLIENT logits $PORT "$RES/${P}support.json" "$RES/${P}flashinfer.json" | tee -a "$SUMMARY"
      $CLIENT compare "$RES/${P}triton.json" "$RES/${P}flashinfer.json" | tee -a "$SUMMARY"
      stop_server ;;
    nocomp)
      [ "$(left)" -gt 120 ] || { say "skipped: no time"; return; }
      SGLANG_DIFFKV_CONFIG=no-compression start_server ${P}nocomp$S 200 "$M" "${LOAD[@]}" \
        --attention-backend diffkv "${X[@]}" || return
      timeout 200 $CLIENT logits $PORT "$RES/${P}support.json" "$RES/${P}nocomp$S.json" | tee -a "$SUMMARY"
      $CLIENT compare "$RES/${P}triton.json" "$RES/${P}nocomp$S.json" | tee -a "$SUMMARY"
      # the same prompts again hit the radix cache (all but their last token): every token
      # is high, so the outputs must equal the first pass's
      timeout 200 $CLIENT logits $PORT "$RES/${P}support.json" "$RES/${P}nocomp$S-hit.json" | tee -a "$SUMMARY"
      say "${P}nocomp$S second pass (radix hit) against the first:"
      $CLIENT compare "$RES/${P}nocomp$S.json" "$RES/${P}nocomp$S-hit.json" | tee -a "$SUMMARY"
      grep -oE "#cached-token: [0-9]+" "$LOGS/${P}nocomp$S.log" | sort | uniq -c | tr '\n' ' ' \
        | sed "s/^/${P}nocomp$S prefill lines: /" | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      audit ${P}nocomp$S
      stop_server
      if [ ! -s "$RES/${P}nocomp$S.json" ] && [ -z "${SGLANG_DIFFKV_KERNELS:-}" ]; then
        export SGLANG_DIFFKV_KERNELS=0
        say "nocomp failed with the kernels: the next steps use the torch reference path"
      fi ;;
    default)
      [ "$(left)" -gt 150 ] || { say "skipped: no time"; return; }
      SGLANG_DIFFKV_LOG_INTERVAL=16 start_server ${P}default 200 "$M" "${LOAD[@]}" \
        --attention-backend diffkv || return
      timeout 200 $CLIENT logits $PORT "$RES/${P}support.json" "$RES/${P}default.json" | tee -a "$SUMMARY"
      $CLIENT compare "$RES/${P}triton.json" "$RES/${P}default.json" | tee -a "$SUMMARY"
      timeout 200 $CLIENT logits $PORT "$RES/${P}support.json" "$RES/${P}default-hit.json" | tee -a "$SUMMARY"
      say "${P}default second pass (radix hit over compressed prefixes) against triton:"
      $CLIENT compare "$RES/${P}triton.json" "$RES/${P}default-hit.json" | tee -a "$SUMMARY"
      timeout 60 $CLIENT thresholds $PORT | tee -a "$SUMMARY"
      local budget=$(( $(left) - 60 ))
      timeout "$budget" $CLIENT long $PORT "${LONG_N:-16}" "${LONG_IN:-1024}" "${LONG_OUT:-512}" \
        "$RES/${P}long.json" | tee -a "$SUMMARY"
      sleep 8  # idle: the scheduler's strict memory check runs
      curl -s -o /dev/null -w "${P}default: /health after the run: HTTP %{http_code}\n" \
        "http://127.0.0.1:$PORT/health" | tee -a "$SUMMARY"
      kill -0 "$SERVER_PID" 2>/dev/null && say "${P}default: server alive after idle" \
        || say "${P}default: server DIED"
      audit ${P}default
      stop_server ;;
    small)
      [ "$(left)" -gt 300 ] || { say "skipped: no time"; return; }
      local small=/tmp/dummy-smollm2
      python3 scripts/dummy_model.py "$small" --layers 30 >/dev/null
      python3 - "$small" <<'PYEOF'
import json, sys
p = sys.argv[1] + "/config.json"
c = json.load(open(p))
c.update(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
         head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
json.dump(c, open(p, "w"))
PYEOF
      start_server small 240 "$small" --attention-backend diffkv || return
      timeout 60 $CLIENT thresholds $PORT | tee -a "$SUMMARY"
      timeout 90 $CLIENT long $PORT 8 512 128 "$RES/small_long.json" | tee -a "$SUMMARY"
      audit small
      stop_server ;;
    long32k)
      [ "$(left)" -gt 150 ] || { say "skipped: no time"; return; }
      local m32=/tmp/dummy-llama3-8b-32k
      python3 scripts/dummy_model.py "$m32" >/dev/null
      python3 - "$m32" <<'PYEOF'
import json, sys
p = sys.argv[1] + "/config.json"
c = json.load(open(p))
c.update(max_position_embeddings=32768)
json.dump(c, open(p, "w"))
PYEOF
      SGLANG_DIFFKV_LOG_INTERVAL=16 start_server long32k 240 "$m32" --attention-backend diffkv \
        --context-length 32768 || return
      grep -oE "chunked_prefill_size=[-0-9]+|disable_radix_cache=[A-Za-z]+" "$LOGS/long32k.log" \
        | sort -u | sed 's/^/long32k: /' | tee -a "$SUMMARY"
      timeout 200 $CLIENT long $PORT 1 "${LONG32K_IN:-32000}" 64 "$RES/long32k.json" | tee -a "$SUMMARY"
      say "long32k: prefill chunks logged: $(grep -c 'Prefill batch' "$LOGS/long32k.log")"
      sleep 8
      kill -0 "$SERVER_PID" 2>/dev/null && say "long32k: server alive after idle" \
        || say "long32k: server DIED"
      audit long32k
      stop_server ;;
    *) say "unknown step $step" ;;
  esac
}

STEPS=("$@"); [ ${#STEPS[@]} -eq 0 ] && STEPS=(triton nocomp default)
for s in "${STEPS[@]}"; do run_step "$s"; done
say "== done in $(( $(date +%s) - T0 )) s"
(cd "$RES" && tar czf logs.tar.gz logs ./*.json 2>/dev/null && rm -rf logs ./*.json)
