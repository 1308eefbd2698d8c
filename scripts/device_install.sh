# Sourced (not run) on the GPU machine, from the repo root:
#
#   source scripts/device_install.sh LOGFILE
#
# Puts sglang 0.5.17 and this package on the machine the way a user installs them, in seconds:
# - copies the wheels that travelled with this call (.whl/, filled by scripts/fetch_wheels.sh on
#   a CPU machine) into /tmp/diffkv-wheels, which outlives a call on a warm machine, so later
#   calls on that machine need not carry them again;
# - once every file of .whl/MANIFEST is there, installs them into /tmp/site (--no-deps: torch,
#   triton, numpy, ... are the machine's own) and this package into it (pip install -e . with
#   --no-deps: its `sglang.srt.plugins` entry point is how SGLang finds the backend);
# - exports PYTHONPATH, CUDA_HOME, the offline switches and the Hopper arch lists.
# Returns 3 when wheels are missing (carry .whl), non-zero on any other failure, and prints the
# installed versions.
device_install() {
  local log=$1 wheels=/tmp/diffkv-wheels site=/tmp/site f missing t0
  mkdir -p "$wheels"
  [ -f .whl/MANIFEST ] && cp .whl/MANIFEST .whl/*.whl .whl/*.tar.xz "$wheels"/ 2>/dev/null
  missing=$(comm -23 <(sort "$wheels/MANIFEST" 2>/dev/null) <(ls "$wheels" | sort))
  if [ ! -f "$wheels/MANIFEST" ] || [ -n "$missing" ]; then
    echo "device_install: wheels missing (carry .whl): ${missing:-MANIFEST}"
    return 3
  fi
  if ! cmp -s "$wheels/MANIFEST" "$site/.installed" 2>/dev/null; then
    t0=$(date +%s)
    rm -rf "$site"; mkdir -p "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$site" "$wheels"/*.whl >> "$log" 2>&1 || { tail -20 "$log"; return 1; }
    for f in "$wheels"/*.tar.xz; do xz -dc "$f" | tar xf - -C "$site" || return 1; done
    cp "$wheels/MANIFEST" "$site/.installed"
    echo "device_install: wheels installed into $site in $(( $(date +%s) - t0 )) s"
  fi
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
  case ":$PATH:" in *":$site/bin:"*) ;; *) export PATH="$site/bin:$PATH" ;; esac
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  export SGLANG_DISABLE_REQUEST_LOGGING=${SGLANG_DISABLE_REQUEST_LOGGING:-1}
  if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
  [ -n "${CUDA_HOME:-}" ] && export PATH="$CUDA_HOME/bin:$PATH"
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  # this package, editable, so its entry point is registered (SGLang's load_plugins finds it)
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$log" 2>&1 \
    || { echo "device_install: pip install -e . failed"; tail -20 "$log"; return 1; }
  python3 - <<'PYEOF' || return 1
import importlib.metadata as md

import torch

v = {n: md.version(n) for n in ("sglang", "sglang-kernel", "flashinfer-python", "transformers",
                                "triton", "sglang-diffkv")}
v["torch"] = f"{torch.__version__} (cuda {torch.version.cuda})"
print("device_install:", ", ".join(f"{k} {x}" for k, x in v.items()))
eps = [e.name for e in md.entry_points(group="sglang.srt.plugins")]
print("device_install: sglang.srt.plugins entry points:", eps)
assert "diffkv" in eps, "the diffkv plugin entry point is not installed"
PYEOF
}
device_install "$@"
