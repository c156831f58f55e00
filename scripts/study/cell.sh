#!/usr/bin/env bash
# Runs one cell of the routing study alone:   scripts/study/cell.sh lm similarity 2
# (FORCE=1 reruns a finished cell.) See scripts/study/all.sh for whole studies.
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/cells.sh"
[ $# -eq 3 ] || { echo "usage: $0 STUDY CELL SEED" >&2; exit 2; }
run_cell "$1" "$2" "$3"
