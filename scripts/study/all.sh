#!/usr/bin/env bash
# Runs whole studies, JOBS cells side by side (default 2: one per core, 1 thread each):
#   scripts/study/all.sh lm tau sigma plugin
# Finished cells are skipped; each cell's wall time is in its result.txt. Then:
#   scripts/study/tables.py        the tables of docs/results.md (mean +- std over seeds)
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/cells.sh"
JOBS=${JOBS:-2}
[ $# -ge 1 ] || { echo "usage: $0 STUDY..." >&2; exit 2; }
for study in "$@"; do study_cells "$study" > /dev/null; done  # unknown names fail before any run
for study in "$@"; do study_cells "$study" | sed "s/^/$study /"; done \
  | xargs -P "$JOBS" -L 1 bash "$(dirname "$0")/cell.sh"
