#!/usr/bin/env bash
# Served fuzz run on the GPU machine (issue 50 item 4), from the repo root, with .whl/ from
# scripts/fetch_wheels.sh carried in this call or an earlier one on the same machine:
#
#   bash scripts/gpu_fuzz_run.sh [fuzz_serve options ...]      e.g. --n 1000 --seed 1
#
# Installs SGLang 0.5.17 and this package (scripts/device_install.sh), writes the dummy
# Llama-3-8B model, starts `--attention-backend diffkv` with a small KV pool so that the load
# forces retractions (and the e2e harness's streaming settings: incremental chunks every 4
# tokens, so that neither SGLang's output path nor the client is the bottleneck), and runs `python -m sglang_diffkv.bench.fuzz_serve` against it: 1,000
# streaming requests of random lengths with random valid / invalid custom_params, client
# disconnects and /abort_request aborts mid-stream, 384 in flight. The client then waits for
# the server to drain, idles 10 s (SGLang's strict idle memory check runs; a leak is fatal:
# SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1) and checks /health and the server pid. This
# script then audits the server log after its ready line (leak / Traceback lines,
# retractions, tokenizer-manager errors) and stops the server.
#
# Environment knobs (defaults in brackets):
#   BUDGET_S [560]        the whole script, install included; keep below the call's timeout_s
#   DIFFKV_CONFIG         SGLANG_DIFFKV_CONFIG [{"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]}]
#   MAX_TOTAL_TOKENS [100000]  --max-total-tokens (the pool, GPU-independent; empty: unset)
#   MEM_FRACTION [0.6]    --mem-fraction-static
#   MAX_RUNNING [256]     --max-running-requests
#   FUZZ_TEST_RETRACT [1] 1: also SGLANG_TEST_RETRACT=1 (a retraction every
#                         SGLANG_TEST_RETRACT_INTERVAL [50] steps): the load alone fills the pool
#                         (85% of pages, 340 queued on an H100) but forced no retraction there:
#                         admission holds requests back before decode runs out; 0: natural only
#
# $OUT (or /tmp/diffkv_fuzz) gets three files: summary.txt (the verdict, the fuzz summary, the
# log audit), results.json (fuzz_serve's: arguments, checks, one record per request) and
# logs.tar.gz (server.log, fuzz.log, install.log). Exit 0 only when everything passed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu_prologue.sh /tmp/diffkv_fuzz 560
# one descriptor per open stream on both sides; the server inherits the raised limit
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

SERVER_PID=
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM -- -"$SERVER_PID" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SERVER_PID" 2>/dev/null; SERVER_PID=
}
finish() {  # at most eight files come back: keep three
  stop_server
  [ -f "$RES/fuzz/results.json" ] && mv "$RES/fuzz/results.json" "$RES/results.json"
  rm -rf "$RES/fuzz"
  (cd "$RES" && tar czf logs.tar.gz logs && rm -rf logs)
}
trap finish EXIT

source scripts/device_install.sh "$LOGS/install.log" > "$LOGS/install.txt" 2>&1
rc=$?; tee -a "$SUMMARY" < "$LOGS/install.txt"
[ "$rc" -eq 0 ] || { say "install failed (rc $rc)"; exit 1; }
python3 -c "import aiohttp" || { say "aiohttp missing"; exit 1; }
MODEL=/tmp/dummy-llama3-8b
python3 scripts/dummy_model.py "$MODEL" > /dev/null || { say "dummy model failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | sed 's/^/gpu: /' | tee -a "$SUMMARY"

export SGLANG_DIFFKV_CONFIG=${DIFFKV_CONFIG:-'{"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]}'}
export SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1
if [ "${FUZZ_TEST_RETRACT:-1}" = 1 ]; then
  export SGLANG_TEST_RETRACT=1 SGLANG_TEST_RETRACT_INTERVAL=${SGLANG_TEST_RETRACT_INTERVAL:-50}
fi
PORT=30000
ARGS=(--model-path "$MODEL" --load-format dummy --sampling-backend pytorch
      --grammar-backend none --skip-tokenizer-init --attention-backend diffkv
      --incremental-streaming-output --stream-interval 4 --decode-log-interval 10
      --mem-fraction-static "${MEM_FRACTION:-0.6}" --max-running-requests "${MAX_RUNNING:-256}"
      --host 127.0.0.1 --port $PORT)
MTT=${MAX_TOTAL_TOKENS-100000}
[ -n "$MTT" ] && ARGS+=(--max-total-tokens "$MTT")
say "server: SGLANG_DIFFKV_CONFIG=$SGLANG_DIFFKV_CONFIG ${SGLANG_TEST_RETRACT:+SGLANG_TEST_RETRACT=1 }${ARGS[*]}"
LOG=$LOGS/server.log
t=$(date +%s)
setsid python3 -m sglang.launch_server "${ARGS[@]}" > "$LOG" 2>&1 &
SERVER_PID=$!
MAXWAIT=$(( $(left) - 200 ))
while ! grep -q "The server is fired up and ready to roll" "$LOG"; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    say "server exited during start-up"; tail -30 "$LOG" | tee -a "$SUMMARY"; SERVER_PID=; exit 1
  fi
  if [ $(( $(date +%s) - t )) -gt "$MAXWAIT" ]; then
    say "server not ready after $MAXWAIT s"; tail -30 "$LOG" | tee -a "$SUMMARY"; exit 1
  fi
  sleep 2
done
READY_LINE=$(grep -n "The server is fired up and ready to roll" "$LOG" | head -1 | cut -d: -f1)
say "server: ready after $(( $(date +%s) - t )) s (pid $SERVER_PID)"
grep -E "max_total_num_tokens|DiffKV KV cache:|diffkv: " "$LOG" | sed 's/^.*\] //' | sort -u \
  | head -12 | tee -a "$SUMMARY"

# the client's deadline leaves time for its drain (<= 30 s), idle (10 s), /health (SGLang's
# generates one token, <= 20 s + margin), this audit and the stop (<= 30 s)
DEADLINE=$(( $(left) - 130 ))
say "fuzz: deadline ${DEADLINE} s"
python3 -m sglang_diffkv.bench.fuzz_serve --url "http://127.0.0.1:$PORT" --out "$RES/fuzz" \
  --server-pid "$SERVER_PID" --deadline-s "$DEADLINE" --drain-timeout-s 30 --idle-s 10 \
  --diffkv-config "$SGLANG_DIFFKV_CONFIG" "$@" 2>&1 | tee "$LOGS/fuzz.log" | grep -v '^{'
FUZZ_RC=${PIPESTATUS[0]}
[ -f "$RES/fuzz/summary.txt" ] && cat "$RES/fuzz/summary.txt" >> "$SUMMARY"

# log audit: only what the server wrote after it was ready
RUN_LOG=$LOGS/run_part.log
tail -n +"$((READY_LINE + 1))" "$LOG" > "$RUN_LOG"
LEAKS=$(grep -ciE "memory leak|mem leak|double free|use-after-free" "$RUN_LOG")
TRACEBACKS=$(grep -c "Traceback" "$RUN_LOG")
RETRACT_LINES=$(grep -c "Retract requests" "$RUN_LOG")
RETRACTED=$(grep -oE "#retracted_reqs: [0-9]+" "$RUN_LOG" | awk '{s += $2} END {print s + 0}')
TEST_RETRACTS=$(grep -c "Testing retraction" "$RUN_LOG")
TM_ERRORS=$(grep -c "\[http_server\] Error" "$RUN_LOG")
DISCONNECTS=$(grep -c "Client disconnected" "$RUN_LOG")
say "log: leak lines $LEAKS, Traceback lines $TRACEBACKS"
say "log: retractions: $RETRACT_LINES 'KV cache pool is full' events retracting $RETRACTED requests; $TEST_RETRACTS forced (SGLANG_TEST_RETRACT)"
say "log: [http_server] Error lines $TM_ERRORS (one per refused request), 'Client disconnected' $DISCONNECTS"
grep -E "DiffKV decode:" "$RUN_LOG" | tail -2 | sed 's/^.*\] //' | tee -a "$SUMMARY"
grep -iE "memory leak|mem leak|double free|use-after-free|Traceback" -A3 "$RUN_LOG" | head -20 \
  | tee -a "$SUMMARY"
ALIVE=no; kill -0 "$SERVER_PID" 2>/dev/null && ALIVE=yes
say "server alive at the end: $ALIVE"
rm -f "$RUN_LOG"

VERDICT=PASS
[ "$FUZZ_RC" -eq 0 ] || VERDICT=FAIL
[ "$LEAKS" -eq 0 ] && [ "$TRACEBACKS" -eq 0 ] && [ "$ALIVE" = yes ] || VERDICT=FAIL
NOTE=
[ $(( RETRACT_LINES + TEST_RETRACTS )) -gt 0 ] \
  || NOTE=" (but no retraction happened: lower MAX_TOTAL_TOKENS or set FUZZ_TEST_RETRACT=1)"
say "== served fuzz run: $VERDICT$NOTE (fuzz_serve exit $FUZZ_RC) in $(( $(date +%s) - T0 )) s"
[ "$VERDICT" = PASS ]
