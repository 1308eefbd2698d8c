#!/usr/bin/env bash
# Served-path quality of SmolLM2-135M-Instruct served for real (issue 57 item 1), on the GPU
# machine from the repo root, SGLang 0.5.17 installed (scripts/device_install.sh):
#
#   GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/gpu_served_quality.sh [served options]
#
# The GGUF (98 MB) crosses to the machine in parts (more than one transfer carries): join them
# into $GGUF first. This script writes the bf16 copy SGLang serves (safetensors of the
# dequantised state dict, lm_head dropped when the embeddings are tied, no
# quantization_config, architectures LlamaForCausalLM: save_pretrained refuses a GGUF model),
# starts the reference (bf16, triton) once and each candidate in turn on a second port, and
# runs `diffkv-eval served` for each: needles, multi-key needles, variable tracking,
# common-word extraction and greedy continuations at 1k-7k tokens. Candidates (CANDIDATES, a
# space list): fp8 (--kv-cache-dtype fp8_e4m3) and DiffKV presets by name or file; the
# llama-3-8b preset must now be refused at start-up (its log line is kept).
# $OUT (or /tmp/diffkv_served) gets one <candidate>.json and .md per candidate, and logs.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${OUT:-/tmp/diffkv_served}; mkdir -p "$RES/logs"
GGUF=${GGUF:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
MODEL=/tmp/smollm2-bf16
CANDIDATES=${CANDIDATES:-"fp8 no-compression default sglang_diffkv/presets/smollm2-135m.json llama-3-8b"}
python3 - "$GGUF" "$MODEL" <<'PY' || { echo "conversion failed"; exit 1; }
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
start() {  # port, log, extra args...: starts a server in its own process group, waits ready
  local port=$1 log=$2; shift 2
  setsid python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$port" \
    --mem-fraction-static 0.35 --context-length 8192 "$@" > "$log" 2>&1 &
  PID=$!
  for _ in $(seq 300); do
    grep -q "fired up and ready" "$log" && return 0
    kill -0 $PID 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
stop() { kill -TERM -- -"$1" 2>/dev/null; sleep 3; kill -KILL -- -"$1" 2>/dev/null; }
start 30000 "$RES/logs/reference.log" --attention-backend triton || { echo "reference failed"; exit 1; }
REF=$PID
trap 'stop $REF' EXIT
for c in $CANDIDATES; do
  name=$(basename "$c" .json)
  if [ "$c" = fp8 ]; then args=(--attention-backend triton --kv-cache-dtype fp8_e4m3); cfg=
  else args=(--attention-backend diffkv); cfg=$c; fi
  if ! SGLANG_DIFFKV_CONFIG=$cfg start 30001 "$RES/logs/$name.log" "${args[@]}"; then
    echo "$name: did not start: $(grep -m1 -o 'diffkv: preset.*' "$RES/logs/$name.log" || tail -n 1 "$RES/logs/$name.log")"
    stop $PID; continue
  fi
  python3 -m sglang_diffkv.eval.cli served --reference http://127.0.0.1:30000 \
    --candidate http://127.0.0.1:30001 --label "$name" --out "$RES/$name.json" "$@" \
    > "$RES/$name.md" 2> "$RES/logs/$name.client.log"
  echo "$name: diffkv-eval served exit $?"; cat "$RES/$name.md"
  stop $PID
done
