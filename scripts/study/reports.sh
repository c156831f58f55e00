#!/usr/bin/env bash
# Reruns the routing report of every finished LM cell (seconds each), e.g. once the softmax
# baselines exist for cells that finished before them:   scripts/study/reports.sh [STUDY...]
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/cells.sh"
studies=("$@")
[ $# -gt 0 ] || studies=(lm tau fix sigma plugin)
for study in "${studies[@]}"; do
  for dir in "$RUNS/$study"/*/s*; do
    [ -s "$dir/result.txt" ] || continue
    cell=$(basename "$(dirname "$dir")")
    if lm_report "$dir" "$(lm_baseline "$study" "$cell" "$(basename "$dir")")"; then
      echo "report $dir"
    else
      echo "report FAILED for $dir" >&2
    fi
  done
done
