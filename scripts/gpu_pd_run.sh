#!/usr/bin/env bash
# A real bf16 prefill/decode (P/D) deployment of SGLang 0.5.17 on the 2-GPU machine (or, on a
# one-GPU machine, both servers on that GPU: below), and its colocated control, for
# `diffkv-sim validate-disagg` (docs/disaggregation.md, "Validating against a real P/D run").
# From the repo root:
#
#   bash scripts/gpu_pd_run.sh [STEP ...]     # default: link coloc pd
#
# Every call first installs what it can (fast when already there):
#   SGLang       scripts/device_install.sh: .whl/ (scripts/fetch_wheels.sh) carried in this
#                call or an earlier one on this machine
#   P/D extras   .pdwhl/ (scripts/fetch_pd_wheels.sh: Mooncake's transfer engine, slimmed, and
#                the sglang-router wheel) carried now or earlier, kept in /tmp/diffkv-pdwheels
#                and installed into /tmp/site-pd; the system libraries Mooncake's engine.so
#                links are checked (one line names what is missing) and `import mooncake.engine`
#                is tried
# Steps:
#   install  only that
#   link     link probes -> $OUT/pd_link.json (sglang_diffkv.bench.link_probe): the loopback
#            socket, GPU<->host copies and, with Mooncake installed, its TCP transport moving
#            GPU 0 memory into GPU 1 memory as SGLang's mooncake_tcp backend does (one GPU:
#            into another buffer on GPU 0, owned by another process; labelled same_gpu)
#   coloc    the control: one ordinary bf16 server on GPU 0, the trace at each rate
#            -> $OUT/pd_runs_colocated.json (sglang_diffkv.bench.pd_replay)
#   pd       a prefill server on GPU 0 and a decode server on GPU 1
#            (--disaggregation-transfer-backend mooncake_tcp: KV goes GPU -> host -> TCP ->
#            host -> GPU), SGLang's router in front (sglang_router --mini-lb), the trace at
#            each rate through the router -> $OUT/pd_runs_pd.json; the prefill server's
#            sglang:kv_transfer_* metrics are kept per rate.
#            One GPU (NGPU == 1): both servers on GPU 0, started one after the other (below),
#            recorded as shared_gpu in pd_runs_pd.json: TTFT/TPOT then include the two
#            servers' contention for one GPU (indicative only); the KV transfer bytes and
#            times are the measurement
# A step whose needs are missing (SGLang, the extras) says so in one line and is skipped; the
# others still run.
#
# The one-GPU memory split. SGLang 0.5.17 sizes a server's KV pool at start-up as
#   pool = free_now - pre * (1 - mem_fraction_static)
# (mem_cache/kv_cache_configurator.py _profile_available_bytes), where pre is the GPU's free
# memory when that server started (before its weights) and free_now the free memory after
# them: pool = pre * frac - weights - context. So the servers start one after the other, each
# sized on what the other left. H200 (140.4 GiB, ~139.5 free) and the dummy Llama-3-8B (15.0
# GiB of bf16 weights):
#   prefill, PD1_PREFILL_FRAC 0.30: 139.5 * 0.30 - 15 = ~26.8 GiB pool (~220k tokens of 128 KiB);
#            with CUDA graphs, activations and context it holds ~45-47 GiB
#   decode,  PD1_DECODE_FRAC 0.68, started after the prefill server is ready: pre ~92 GiB,
#            92 * 0.68 - 15 = ~47.6 GiB pool (~390k tokens); ~29 GiB stay free for both
#            servers' graphs, activations and Mooncake
# (were the rule total * (1 - frac), as in older SGLang: 124.5 - 98.3 = 26 GiB and 77 - 45 =
# 32 GiB: positive too). An H100 (79.1 GiB): 0.30 gives ~8.5 GiB, 0.68 ~22 GiB. The colocated
# control keeps 0.85 of the whole GPU (~104 GiB on an H200): far more pool than either P/D
# server, which at these rates (tens of requests of ~1.4k tokens in flight) none of them fills.
#
# Both deployments run the e2e bench's bf16 flags (sglang_diffkv/bench/server.py
# launch_command: dummy Llama-3-8B weights, triton attention, no tokenizer, mem fraction 0.85,
# no piecewise CUDA graphs, incremental streaming every 4 tokens) plus --disable-radix-cache
# (the prompts share nothing; SGLang's decode server has no radix cache either) and
# --enable-metrics.
#
# Env: BUDGET_S (default 560) bounds the whole script, install included: keep it below the
# call's timeout_s (at most 600). PD_TRACE (azure-conv), PD_RATES (2,4,8 req/s), PD_WINDOW_S
# (45: arrivals per rate), PD_DRAIN_S (60: the most a rate waits for its last requests),
# DUMMY_SHAPE (llama-3-8b), PD1_PREFILL_FRAC / PD1_DECODE_FRAC (0.30 / 0.68: the one-GPU
# split above), PD_ONE_GPU=1 (the one-GPU layout on a machine with more GPUs).
# $OUT (or /tmp/diffkv_pd) gets summary.txt, logs.tar.gz and the pd_*.json files: at most five
# files, inside the tool's eight.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu_prologue.sh /tmp/diffkv_pd 560
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
TRACE=${PD_TRACE:-azure-conv}; RATES=${PD_RATES:-2,4,8}
WINDOW_S=${PD_WINDOW_S:-45}; DRAIN_S=${PD_DRAIN_S:-60}
READY="The server is fired up and ready to roll"

PIDS=()
stop_all() {  # only the process groups this script started (setsid), by their ids
  local p
  for p in "${PIDS[@]}"; do kill -TERM -- -"$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 30); do kill -0 "$p" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -"$p" 2>/dev/null
  done
  PIDS=(); sleep 2
}
finish() {
  stop_all
  say "== done in $(( $(date +%s) - T0 )) s"
  (cd "$RES" && tar czf logs.tar.gz logs && rm -rf logs)
}
trap finish EXIT

# start NAME COMMAND...: in its own session, the command line as the log's first line (the
# replay driver records it); its pid in PID_NAME
start() {
  local name=$1; shift
  echo "# command: $*" > "$LOGS/$name.log"
  setsid "$@" >> "$LOGS/$name.log" 2>&1 &
  PIDS+=($!); printf -v "PID_$name" '%s' "$!"; printf -v "T_$name" '%s' "$(date +%s)"
}
# wait_ready NAME PORT MAXWAIT [MARKER]: until the log has MARKER (if given) and /health
# answers; a server that died stops the wait at once
wait_ready() {
  local name=$1 port=$2 maxwait=$3 marker=${4:-} pidv=PID_$1 tv=T_$1
  local pid=${!pidv} t=${!tv}
  while :; do
    if { [ -z "$marker" ] || grep -q "$marker" "$LOGS/$name.log"; } \
        && curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$port/health"; then
      say "$name: ready after $(( $(date +%s) - t )) s"; return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      say "$name: exited during startup"; tail -25 "$LOGS/$name.log" | tee -a "$SUMMARY"
      return 1; fi
    if [ $(( $(date +%s) - t )) -gt "$maxwait" ]; then
      say "$name: not ready after $maxwait s"; tail -25 "$LOGS/$name.log" | tee -a "$SUMMARY"
      return 1; fi
    sleep 2
  done
}
audit() {  # what a server log says: pool, transfer-engine lines, errors
  local log=$LOGS/$1.log
  grep -oE "max_total_num_tokens=[0-9]+" "$log" | head -1 | sed "s/^/$1: /" | tee -a "$SUMMARY"
  grep -iE "mooncake_tcp|MC_FORCE_TCP|TcpTransport|Transfer Engine|bootstrap" "$log" \
    | sed 's/^.*\] //' | sort -u | head -6 | sed "s/^/$1: /" | tee -a "$SUMMARY"
  local ignore="Ignore import error|openai_harmony|OpenAIServingResponses|RLIMIT|FA3"
  say "$1: errors/tracebacks: $(grep -iE 'Traceback|Error' "$log" | grep -cvE "$ignore") lines"
  grep -iE "Traceback|Error" "$log" | grep -vE "$ignore" | head -5 | tee -a "$SUMMARY"
}

# ---- install -------------------------------------------------------------------------------------
SGLANG_OK=; PD_OK=
source scripts/device_install.sh "$LOGS/install.log" > "$RES/install.txt" 2>&1
rc=$?; cat "$RES/install.txt" >> "$SUMMARY"; cat "$RES/install.txt"; rm -f "$RES/install.txt"
case $rc in
  0) SGLANG_OK=1 ;;
  3) say "install: SGLang is not on this machine (a fresh one): carry .whl in this call" ;;
  *) say "install: SGLang install failed (rc $rc)" ;;
esac

pd_install() {
  local cache=/tmp/diffkv-pdwheels site=/tmp/site-pd f m missing="" lib d
  mkdir -p "$cache" "$site"
  [ -d .pdwhl ] && cp -r .pdwhl/. "$cache"/   # carried now: kept for later calls on this machine
  for f in "$cache"/mooncake/*.tar.xz; do
    [ -f "$f" ] || continue
    m="$site/.installed-$(basename "$f")"
    if [ ! -f "$m" ]; then
      rm -rf "$site"/mooncake "$site"/mooncake_transfer_engine_cuda13* "$site"/.installed-mooncake*
      xz -dc "$f" | tar xf - -C "$site" && touch "$m" && say "pd-install: unpacked $(basename "$f")"
    fi
  done
  for f in "$cache"/router/*.whl; do
    [ -f "$f" ] || continue
    m="$site/.installed-$(basename "$f")"
    if [ ! -f "$m" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$site" "$f" >> "$LOGS/install.log" 2>&1 && touch "$m" \
        && say "pd-install: installed $(basename "$f")"
    fi
  done
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
  if [ ! -d "$site/mooncake" ] || [ ! -d "$site/sglang_router" ]; then
    say "pd-install: the P/D extras are not on this machine: carry .pdwhl (bash scripts/fetch_pd_wheels.sh)"
    return 1
  fi
  # engine.so links these even for TCP; libcudart.so.13 comes with torch or the CUDA toolkit
  for lib in libibverbs.so.1 libmlx5.so.1 libnuma.so.1 libcurl.so.4; do
    ldconfig -p 2>/dev/null | grep -q "$lib " || missing="$missing $lib"
  done
  if [ -n "$missing" ] && ls "$cache"/debs/*.deb > /dev/null 2>&1; then
    mkdir -p /tmp/pdlibs
    for f in "$cache"/debs/*.deb; do dpkg-deb -x "$f" /tmp/pdlibs 2>/dev/null \
      || (cd /tmp/pdlibs && ar p "$f" data.tar.xz | tar xJf -); done
    for d in $(find /tmp/pdlibs -name "*.so*" -printf '%h\n' | sort -u); do
      LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; done
    export LD_LIBRARY_PATH
    local still=""
    for lib in $missing; do find /tmp/pdlibs -name "$lib" | grep -q . || still="$still $lib"; done
    say "pd-install: system libraries missing:$missing; from the carried .deb files:$( [ -n "$still" ] && echo " still missing$still" || echo " all there")"
    missing=$still
  elif [ -n "$missing" ]; then
    say "pd-install: Mooncake's engine.so needs system libraries this machine lacks:$missing (Debian/Ubuntu packages libibverbs1, ibverbs-providers, libnuma1, libcurl4): carry them as .deb files (PD_DEBS=1 bash scripts/fetch_pd_wheels.sh puts them in .pdwhl/debs)"
  fi
  # libcudart.so.13 for engine.so: torch loads it before mooncake (in SGLang too), and a
  # library loaded by soname is found; the toolkit's is linked in only if that fails, and
  # alone (a whole toolkit dir on LD_LIBRARY_PATH would come before torch's own libraries)
  if ! pd_import > "$LOGS/pd_import.txt" 2>&1 && grep -q "libcudart" "$LOGS/pd_import.txt"; then
    for d in ${CUDA_HOME:-/usr/local/cuda}/lib64 ${CUDA_HOME:-/usr/local/cuda}/lib; do
      if [ -e "$d/libcudart.so.13" ]; then
        mkdir -p /tmp/pdlibs-cudart && ln -sf "$d/libcudart.so.13" /tmp/pdlibs-cudart/
        export LD_LIBRARY_PATH="/tmp/pdlibs-cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        say "pd-install: libcudart.so.13 from $d"; break; fi
    done
  fi
  if pd_import 2>&1 | tee -a "$SUMMARY"; [ "${PIPESTATUS[0]}" -eq 0 ]; then
    PD_OK=1
  else
    local nf; nf=$(ldd "$site/mooncake/engine.so" 2>&1 | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
    say "pd-install: the import failed (above)${nf:+; libraries engine.so cannot find: $nf}"
  fi
}
pd_import() {
  python3 - <<'PYEOF'
import importlib.metadata as md

import torch  # noqa: F401  (loads libcudart first, as SGLang does)

import mooncake.engine as me
import sglang_router.launch_router  # noqa: F401

print(f"pd-install: import mooncake.engine OK ({me.__file__}, SUPPORT_CUDA "
      f"{getattr(me, 'SUPPORT_CUDA', '?')}); sglang-router {md.version('sglang-router')}")
PYEOF
}
pd_install
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
  | sed 's/^/gpu: /' | tee -a "$SUMMARY"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")

MODEL=/tmp/dummy-llama3-8b; SHAPE=${DUMMY_SHAPE:-llama-3-8b}
[ "$SHAPE" = llama-3-8b ] || MODEL=/tmp/dummy-$SHAPE
if [ -n "$SGLANG_OK" ]; then python3 scripts/dummy_model.py "$MODEL" --shape "$SHAPE" > /dev/null || SGLANG_OK=; fi
# --mem-fraction-static per server: 0.85 (the e2e bench's) unless one GPU holds both P/D servers
COMMON=(--model-path "$MODEL" --load-format dummy --attention-backend triton
        --sampling-backend pytorch --grammar-backend none --skip-tokenizer-init
        --disable-piecewise-cuda-graph
        --incremental-streaming-output --stream-interval 4 --decode-log-interval 10
        --disable-radix-cache --enable-metrics --host 127.0.0.1)
REPLAY=(python3 -m sglang_diffkv.bench.pd_replay --out "$RES" --trace "$TRACE" --rates "$RATES"
        --window-s "$WINDOW_S" --drain-s "$DRAIN_S")
# the replay's budget: what is left less the time to stop the servers and pack the logs
replay_budget() { local b=$(( $(left) - 40 )); [ "$b" -ge 60 ] && echo "$b"; }
# a server's start-up wait: 300 s, less when less is left (100 s kept for the replay and exit)
start_wait() { local w=$(( $(left) - 100 )); [ "$w" -gt 300 ] && w=300; [ "$w" -lt 30 ] && w=30; echo "$w"; }
ONE_GPU=; { [ "$NGPU" -eq 1 ] || [ "${PD_ONE_GPU:-0}" = 1 ]; } && ONE_GPU=1
PFRAC=${PD1_PREFILL_FRAC:-0.30}; DFRAC=${PD1_DECODE_FRAC:-0.68}
gpu0_used() { nvidia-smi -i 0 --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null; }

# ---- steps ---------------------------------------------------------------------------------------
step_link() {
  [ "$(left)" -gt 60 ] || { say "link: skipped: no time"; return; }
  # one GPU: Mooncake writes GPU 0 memory into another process's buffer on GPU 0 (--same-gpu)
  local mc=() same=() rc
  [ -n "$PD_OK" ] && [ "$NGPU" -ge 1 ] && mc=(--mooncake)
  [ -n "$ONE_GPU" ] && same=(--same-gpu)
  timeout 150 python3 -m sglang_diffkv.bench.link_probe --out "$RES" "${mc[@]}" "${same[@]}" \
    > "$LOGS/link_probe.log" 2>&1
  rc=$?
  say "link: rc $rc ($([ ${#mc[@]} -gt 0 ] && echo "with" || echo "without") Mooncake$([ ${#same[@]} -gt 0 ] && echo "; one GPU: GPU 0 -> GPU 0 loopback"))"
  grep "^link_probe" "$LOGS/link_probe.log" | tee -a "$SUMMARY"
}

step_coloc() {
  [ -n "$SGLANG_OK" ] || { say "coloc: skipped: SGLang is not installed"; return; }
  [ "$(left)" -gt 240 ] || { say "coloc: skipped: $(left) s left"; return; }
  [ -n "$ONE_GPU" ] && say "coloc: --mem-fraction-static 0.85 of GPU 0 (the P/D pair on this one GPU splits it ${PFRAC} / ${DFRAC}: their pools are smaller; none fills at these rates)"
  start colocated python3 -m sglang.launch_server "${COMMON[@]}" --mem-fraction-static 0.85 \
    --base-gpu-id 0 --port 30000
  local b
  if wait_ready colocated 30000 "$(start_wait)" "$READY"; then
    if b=$(replay_budget); then
      "${REPLAY[@]}" --deployment colocated --url http://127.0.0.1:30000 \
        --metrics-url http://127.0.0.1:30000 --idle-url http://127.0.0.1:30000 \
        --server colocated="$LOGS/colocated.log" --budget-s "$b" 2>&1 | tee -a "$SUMMARY"
    else say "coloc: no time left for the replay"; fi
  fi
  audit colocated
  stop_all
}

step_pd() {
  [ -n "$SGLANG_OK" ] || { say "pd: skipped: SGLang is not installed"; return; }
  [ -n "$PD_OK" ] || { say "pd: skipped: the P/D extras (Mooncake, sglang-router) are not usable"; return; }
  [ "$NGPU" -ge 1 ] || { say "pd: skipped: no GPU"; return; }
  [ "$(left)" -gt 270 ] || { say "pd: skipped: $(left) s left"; return; }
  # Mooncake's engine advertises SGLang's local IP: on this machine, loopback
  local env=(env SGLANG_HOST_IP=127.0.0.1 MC_FORCE_TCP=1) b ok=
  local pd=(--disaggregation-transfer-backend mooncake_tcp) one=()
  local pre=(--disaggregation-mode prefill --disaggregation-bootstrap-port 8998 --port 30000)
  local dec=(--disaggregation-mode decode --port 30001)
  if [ -n "$ONE_GPU" ]; then
    # both on GPU 0, one after the other: each sizes its pool on what the other left (above)
    one=(--shared-gpu)
    say "pd: ONE GPU: prefill and decode servers share GPU 0 (--mem-fraction-static $PFRAC, then $DFRAC); TTFT/TPOT include their contention (indicative), the KV transfer bytes/times are the measurement"
    say "pd: GPU 0 before the prefill server: $(gpu0_used)"
    start prefill "${env[@]}" python3 -m sglang.launch_server "${COMMON[@]}" "${pd[@]}" \
      --mem-fraction-static "$PFRAC" "${pre[@]}" --base-gpu-id 0
    if wait_ready prefill 30000 "$(start_wait)" "$READY"; then
      say "pd: GPU 0 before the decode server: $(gpu0_used)"
      start decode "${env[@]}" python3 -m sglang.launch_server "${COMMON[@]}" "${pd[@]}" \
        --mem-fraction-static "$DFRAC" "${dec[@]}" --base-gpu-id 0
      wait_ready decode 30001 "$(start_wait)" "$READY" && ok=1
      say "pd: GPU 0 with both servers: $(gpu0_used)"
    fi
  else
    start prefill "${env[@]}" python3 -m sglang.launch_server "${COMMON[@]}" "${pd[@]}" \
      --mem-fraction-static 0.85 "${pre[@]}" --base-gpu-id 0
    start decode "${env[@]}" python3 -m sglang.launch_server "${COMMON[@]}" "${pd[@]}" \
      --mem-fraction-static 0.85 "${dec[@]}" --base-gpu-id 1
    wait_ready prefill 30000 300 "$READY" && wait_ready decode 30001 300 "$READY" && ok=1
  fi
  if [ -n "$ok" ]; then
    start router python3 -m sglang_router.launch_router --pd-disaggregation --mini-lb \
      --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 \
      --host 127.0.0.1 --port 8000
    if wait_ready router 8000 60 && b=$(replay_budget); then
      "${REPLAY[@]}" --deployment pd "${one[@]}" --url http://127.0.0.1:8000 \
        --metrics-url http://127.0.0.1:30000 \
        --idle-url http://127.0.0.1:30000 --idle-url http://127.0.0.1:30001 \
        --server prefill="$LOGS/prefill.log" --server decode="$LOGS/decode.log" \
        --router-log "$LOGS/router.log" --budget-s "$b" 2>&1 | tee -a "$SUMMARY"
    else say "pd: the router did not start or no time is left for the replay"; fi
  fi
  audit prefill; audit decode
  say "router: errors: $(grep -ciE 'Traceback|Error' "$LOGS/router.log" 2>/dev/null || echo 0) lines"
  stop_all
}

STEPS=("$@"); [ ${#STEPS[@]} -eq 0 ] && STEPS=(link coloc pd)
for s in "${STEPS[@]}"; do
  say "== $s ($(left) s left)"
  case $s in
    install) ;;
    link) step_link ;;
    coloc) step_coloc ;;
    pd) step_pd ;;
    *) say "unknown step $s (install, link, coloc, pd)" ;;
  esac
done
