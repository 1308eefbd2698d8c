#!/usr/bin/env bash
# The project's test command (README, .ci/run): lint, then the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
export TRITON_INTERPRET=1
set +e
python -m pytest -q "$@"
rc=$?
set -e
# pytest exits 5 when it collects nothing: that is a broken suite here, not a pass.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
