#!/usr/bin/env bash
# Fills .pdwhl/ (git-ignored) with what a real prefill/decode (P/D) run of SGLang 0.5.17 needs
# beyond scripts/fetch_wheels.sh's .whl/ (scripts/gpu_pd_run.sh installs both on the GPU
# machine: Python 3.12, torch 2.11.0+cu130, no internet, no RDMA NIC). Run on a CPU machine with
# PyPI; idempotent (a second run downloads nothing).
#
#   bash scripts/fetch_pd_wheels.sh            # .pdwhl/mooncake/ + .pdwhl/router/, ~36 MiB
#   PD_FULL=1 bash scripts/fetch_pd_wheels.sh  # the whole Mooncake wheel instead of its engine
#   PD_DEBS=1 bash scripts/fetch_pd_wheels.sh  # also .pdwhl/debs/: the system libraries
#                                              # Mooncake's engine.so links (this machine's
#                                              # distribution's packages: see below)
#
# What is carried, and why:
# - mooncake-transfer-engine-cuda13 0.3.14 (cp312; 49.7 MB): SGLang's
#   --disaggregation-transfer-backend mooncake_tcp imports mooncake.engine only (its
#   TransferEngine). Repacked as a .tar.xz of the package's Python files, engine.so and the
#   shared libraries engine.so needs (its ELF NEEDED closure inside the wheel, found with
#   readelf), without the store, expert-parallel and process-group extensions and the
#   master/client binaries it also ships (none is on the P/D path): ~6.5 MiB. PD_FULL=1 keeps
#   every file (if the slim engine fails to load on the GPU machine, that is the next try).
# - sglang-router 0.3.2 (abi3; 30.7 MB), as downloaded: SGLang 0.5.17 no longer ships the mini
#   load balancer (sglang.srt.disaggregation.mini_lb); `python -m sglang_router.launch_router
#   --pd-disaggregation --mini-lb` is it (its router_args module imports the Rust extension,
#   so the whole wheel travels).
# Their own dependencies (aiohttp, requests, msgpack, fastapi, uvicorn, orjson, setproctitle)
# are the GPU machine's or .whl/'s.
#
# A call carries at most 64 MiB of working tree (docs/data moved aside, the tree is ~7 MiB):
# .whl/ (~57 MiB) fills a call, so .pdwhl/ travels in the next one (carry [".pdwhl"]; or its
# two folders in two calls: carry [".pdwhl/mooncake"], then [".pdwhl/router"]).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.pdwhl
CACHE=${WHL_CACHE:-$HOME/.cache/diffkv-wheels}
PY=${PYTHON:-python3}
MOONCAKE=mooncake-transfer-engine-cuda13==0.3.14
ROUTER=sglang-router==0.3.2
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
      --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
HOW="on a machine with PyPI: pip download --no-deps --only-binary=:all: --python-version 3.12 \
--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 SPEC -d $CACHE, then run this again"

download() {  # download SPEC into DIR unless a wheel of that name and version is there
  local spec=$1 dir=$2 name ver norm
  name=${spec%%==*}; ver=${spec#*==}; norm=$(echo "$name" | tr 'A-Z-' 'a-z_')
  mkdir -p "$dir"
  if ! ls "$dir" 2>/dev/null | grep -qi "^${norm}-${ver}-.*\.whl$"; then
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$dir" "$spec" 2>&1 \
      | grep -v -e "^WARNING: Location" >&2 || true
  fi
  local got
  got=$(ls "$dir" | grep -i "^${norm}-${ver}-.*\.whl$" | head -1 || true)
  if [ -z "$got" ]; then
    echo "fetch_pd_wheels: $spec is not on this machine's package index; ${HOW/SPEC/$spec}" >&2
    exit 1
  fi
  echo "$got"
}

mkdir -p "$DEST/mooncake" "$DEST/router"
w=$(download "$MOONCAKE" "$CACHE")
kind=slim; [ "${PD_FULL:-0}" = 1 ] && kind=full
out="$DEST/mooncake/${w%.whl}-$kind.tar.xz"
if [ ! -s "$out" ]; then
  rm -f "$DEST"/mooncake/*.tar.xz
  command -v readelf > /dev/null || { [ "$kind" = slim ] && \
    { echo "fetch_pd_wheels: readelf (binutils) is needed to slim the engine; or PD_FULL=1" >&2; exit 1; }; }
  echo "fetch_pd_wheels: repacking $w ($kind)"
  "$PY" - "$CACHE/$w" "$out" "$kind" <<'PYEOF'
import io, os, subprocess, sys, tarfile, tempfile, zipfile
whl, out, kind = sys.argv[1:]
z = zipfile.ZipFile(whl)
names = [n for n in z.namelist() if not n.endswith("/")]
if kind == "full":
    keep = set(names)
else:
    # the engine and what it loads: engine.so's NEEDED closure among the wheel's libraries
    libs = {os.path.basename(n): n for n in names if ".so" in os.path.basename(n)}
    keep = {n for n in names if n.endswith((".py", ".pyi", "py.typed"))}
    keep |= {n for n in names if ".dist-info/" in n and "/sboms/" not in n}
    todo = ["mooncake/engine.so", "mooncake/nvlink_allocator.so"]
    with tempfile.TemporaryDirectory() as tmp:
        while todo:
            n = todo.pop()
            if n in keep:
                continue
            keep.add(n)
            p = os.path.join(tmp, os.path.basename(n))
            with open(p, "wb") as f:
                f.write(z.read(n))
            dyn = subprocess.run(["readelf", "-d", p], capture_output=True, text=True,
                                 check=True).stdout
            for line in dyn.splitlines():
                if "(NEEDED)" in line:
                    lib = line.split("[", 1)[1].rstrip("]")
                    if lib in libs:
                        todo.append(libs[lib])
    missing = [n for n in ("mooncake/engine.so", "mooncake/__init__.py") if n not in keep]
    assert not missing, missing
with tarfile.open(out + ".tmp", "w:xz", preset=6) as t:
    for n in sorted(keep):
        data = z.read(n)
        info = tarfile.TarInfo(n)
        info.size = len(data)
        info.mode = 0o755 if ".so" in os.path.basename(n) else 0o644
        t.addfile(info, io.BytesIO(data))
os.replace(out + ".tmp", out)
so = sorted(n for n in keep if ".so" in os.path.basename(n))
print(f"fetch_pd_wheels: kept {len(keep)} of {len(names)} files; shared libraries: "
      + " ".join(os.path.basename(n) for n in so))
PYEOF
fi
rw=$(download "$ROUTER" "$DEST/router")
for f in "$DEST"/router/*.whl; do [ "$(basename "$f")" = "$rw" ] || rm -f "$f"; done

if [ "${PD_DEBS:-0}" = 1 ]; then
  # The libraries engine.so links even for TCP (libibverbs.so.1, libmlx5.so.1, libnuma.so.1;
  # libcurl.so.4 is in most images). These are THIS machine's distribution's packages
  # ($(. /etc/os-release; echo $PRETTY_NAME)): built for its glibc, they may not load on an
  # older one. scripts/gpu_pd_run.sh unpacks them only when the GPU machine lacks the library.
  mkdir -p "$DEST/debs"
  ( cd "$DEST/debs" && apt-get download libibverbs1 ibverbs-providers libnuma1 libnl-3-200 \
      libnl-route-3-200 )
fi

size() { du -sb "$1" | awk '{printf "%.1f MiB", $1/1048576}'; }
echo "fetch_pd_wheels: $DEST/mooncake $(size "$DEST/mooncake"), $DEST/router $(size "$DEST/router")\
$( [ -d "$DEST/debs" ] && echo ", $DEST/debs $(size "$DEST/debs")"), $(size "$DEST") in all"
echo "fetch_pd_wheels: carry [\".pdwhl\"] in the call after the one that carried [\".whl\"] \
(docs/data moved aside); or [\".pdwhl/mooncake\"] and [\".pdwhl/router\"] in two calls"
