#!/usr/bin/env bash
# Reruns the routing report of every finished LM cell (seconds each), e.g. once the softmax
# baselines exist for cells that finished before them:   scripts/study/reports.sh [STUDY...]
source "$(dirname "$0")/common.sh"
for study in "${@:-lm tau sigma plugin}"; do
  for dir in "$RUNS"/$study/*/s*; do
    [ -s "$dir/result.txt" ] || continue
    lm_report "$dir" && echo "report $dir"
  done
done
