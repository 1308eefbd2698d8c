#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what scripts/device_install.sh needs to run sglang 0.5.17 with
# this package on the GPU machine (Python 3.12, torch 2.11.0+cu130, triton 3.6, no internet).
# Run on a CPU machine with PyPI; idempotent (a second run downloads nothing).
#
#   bash scripts/fetch_wheels.sh
#
# One call to the GPU machine carries at most 64 MiB of working tree (the repo itself is about
# 7 MiB without docs/data), so the large wheels are repacked as .tar.xz of their files (a
# wheel is a zip; unpacked into the target it is installed): about 52 MiB in all. Carry `.whl`
# in the first call on a machine; device_install.sh keeps the install in /tmp/site, so later
# calls on the same warm machine need not carry it again.
#
# What is carried, and why:
# - sglang 0.5.17 (cp312), repacked without its three Rust extension cores (grpc, multimodal
#   and the Rust HTTP server: none is on the HTTP /generate path).
# - sglang-kernel 0.4.5: its Python files and sm90/common_ops.abi3.so only (the wheel is 383 MB).
# - xgrammar 0.2.1 without its static library: sglang's server_args imports it at module level.
# - transformers 5.12.1 (sglang's pin): the GPU machine's 5.17 already registers qwen3_asr,
#   which sglang registers again at import (ValueError); with tokenizers 0.22.2, as its
#   import-time check requires (<=0.23.0; the GPU machine's image now has 0.23.2).
# - flashinfer-python + apache-tvm-ffi (sampler), soundfile + cffi (http_server imports it),
#   zstandard, and the pure-python / small binary modules the server imports that the GPU
#   machine lacks.
# Everything else (torch, triton, numpy, aiohttp, uvloop, ...) is the GPU machine's own.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
# the downloaded wheels before repacking (sglang-kernel alone is 383 MB): kept outside .whl
CACHE=${WHL_CACHE:-$HOME/.cache/diffkv-wheels}
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
      --abi none --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

WHEELS=(
  apache-tvm-ffi==0.1.11 soundfile==0.13.1 cffi==2.0.0 pycparser==2.23 zstandard==0.25.0
  pybase64==1.5.1 orjson==3.13.0 pyzmq==27.3.0 msgspec==0.22.0
  setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 python-multipart==0.0.34
  fastapi==0.128.0 starlette==0.50.0 uvicorn==0.40.0
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5
  openai==2.6.1 distro==1.9.0 sniffio==1.3.1
  compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0 dill==0.4.1 tokenizers==0.22.2
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  ipython==9.8.0 traitlets==5.16.1 decorator==5.3.1 prompt-toolkit==3.0.53 wcwidth==0.9.4
  stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
)

download() {  # download SPEC into DIR unless a wheel of that name and version is there
  local spec=$1 dir=$2 name ver norm
  name=${spec%%==*}; ver=${spec#*==}; norm=$(echo "$name" | tr 'A-Z-' 'a-z_')
  if ! ls "$dir" 2>/dev/null | grep -qi "^${norm}-${ver}-.*\.whl$"; then
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$dir" "$spec" 2>&1 \
      | grep -v -e "^WARNING: Location" >&2 || true
  fi
  ls "$dir" | grep -i "^${norm}-${ver}-.*\.whl$" | head -1
}

# repack WHEEL -> NAME.tar.xz keeping the members KEEP (a Python expression on n) selects
repack() {
  local whl=$1 out=$2 keep=$3
  [ -s "$out" ] && return 0
  "$PY" - "$whl" "$out" "$keep" <<'PYEOF'
import io, sys, tarfile, zipfile
whl, out, keep = sys.argv[1:]
z = zipfile.ZipFile(whl)
with tarfile.open(out + ".tmp", "w:xz", preset=6) as t:
    for n in z.namelist():
        if n.endswith("/") or not eval(keep, {"n": n}):
            continue
        data = z.read(n)
        info = tarfile.TarInfo(n)
        info.size = len(data)
        info.mode = 0o644
        t.addfile(info, io.BytesIO(data))
import os; os.replace(out + ".tmp", out)
PYEOF
}

mkdir -p "$DEST" "$CACHE"
rm -rf "$DEST/part1" "$DEST/part2" "$DEST/cache"  # (older layouts)
echo "fetch_wheels: repacking the large wheels"
w=$(download sglang==0.5.17 "$CACHE")
repack "$CACHE/$w" "$DEST/sglang-0.5.17.tar.xz" 'not n.endswith(".so")'
w=$(download sglang-kernel==0.4.5 "$CACHE")
repack "$CACHE/$w" "$DEST/sglang_kernel-0.4.5.tar.xz" \
  '(n.startswith("sgl_kernel/") and n.endswith(".py")) or n == "sgl_kernel/sm90/common_ops.abi3.so" or (".dist-info/" in n and n.rsplit("/", 1)[1] in ("METADATA", "WHEEL", "top_level.txt"))'
w=$(download xgrammar==0.2.1 "$CACHE")
repack "$CACHE/$w" "$DEST/xgrammar-0.2.1.tar.xz" 'not n.endswith(".a") and "/include/" not in n'
w=$(download flashinfer-python==0.6.15.post1 "$CACHE")
repack "$CACHE/$w" "$DEST/flashinfer_python-0.6.15.post1.tar.xz" 'True'
w=$(download transformers==5.12.1 "$CACHE")
repack "$CACHE/$w" "$DEST/transformers-5.12.1.tar.xz" 'True'
echo "fetch_wheels: wheels"
want=()
for spec in "${WHEELS[@]}"; do want+=("$(download "$spec" "$DEST")"); done
for f in "$DEST"/*.whl; do  # drop wheels no longer listed
  b=$(basename "$f"); keep=0
  for x in "${want[@]}"; do [ "$b" = "$x" ] && keep=1; done
  [ $keep = 1 ] || { echo "removing $b"; rm -f "$f"; }
done
( cd "$DEST" && ls ./*.whl ./*.tar.xz | sed 's#^\./##' | sort > MANIFEST )
echo "fetch_wheels: .whl holds $(wc -l < "$DEST/MANIFEST") files, $(du -sb "$DEST" \
  | awk '{printf "%.1f MiB", $1/1048576}'): carry [\".whl\"] in a call's first run on a machine"
