# Sourced (not run) by the scripts that run on the GPU machine, from the repo root, with .whl/
# (bash ../shared/device/fetch_wheels.sh) and .device/ (a copy of ../shared/device/):
#
#   source scripts/device_install.sh LOGFILE
#
# Puts SGLang on the machine (.device/install_on_device.sh, its environment stays exported)
# and installs this package the way a user does (editable, so its sglang_diffkv.pth import
# hook lands in site-packages; written by hand if pip fails). Prints the installed versions;
# returns non-zero when SGLang cannot be installed or the import hook is not active.
device_install() {
  local log=$1 root
  root=$(pwd)
  source .device/install_on_device.sh >> "$log" 2>&1 || { tail -20 "$log"; return 1; }
  tail -2 "$log"
  if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$log" 2>&1; then
    local site
    site=$(python3 -c "import site; print(site.getsitepackages()[0])")
    printf '%s\nimport sglang_diffkv.sglang._bootstrap\n' "$root" > "$site/sglang_diffkv.pth"
    echo "pip install -e . failed (see $log); wrote $site/sglang_diffkv.pth by hand"
  fi
  python3 -c "import sys; assert any(type(f).__name__ == 'PostImportFinder' for f in sys.meta_path)" \
    && echo "import hook active at interpreter start" \
    || { echo "import hook NOT active"; return 1; }
}
device_install "$@"
