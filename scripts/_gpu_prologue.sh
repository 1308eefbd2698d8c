# The common start of the scripts/gpu_*.sh wrappers that keep a summary and logs in $OUT.
# Sourced from the repo root, after `set -uo pipefail` and `cd "$(dirname "$0")/.."`:
#
#   source scripts/_gpu_prologue.sh DEFAULT_OUT DEFAULT_BUDGET_S
#
# sets RES ($OUT, else DEFAULT_OUT) and LOGS ($RES/logs), both created; SUMMARY
# ($RES/summary.txt, emptied) and say (echo a line and append it to the summary); T0 (the
# start) and BUDGET_S ($BUDGET_S, else DEFAULT_BUDGET_S) and left (seconds of the budget
# left); and unbuffered Python output for the children.
RES=${OUT:-$1}; LOGS=$RES/logs; mkdir -p "$LOGS"
SUMMARY=$RES/summary.txt; : > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
T0=$(date +%s); BUDGET_S=${BUDGET_S:-$2}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
