#!/usr/bin/env bash
# The figures of docs/results.md from the study's runs (tools/plot_routing.py, Debian's
# python3-matplotlib):   scripts/study/plots.sh [OUT=docs/figures]
source "$(dirname "$0")/common.sh"
OUT=${1:-$ROOT/docs/figures}
PLOT=(/usr/bin/python3 "$ROOT/tools/plot_routing.py")
inputs() {  # inputs STUDY FILE CELL...: LABEL=PATH for every finished seed of each cell
  local study=$1 file=$2 cell dir
  shift 2
  for cell in "$@"; do
    for dir in "$RUNS/$study/$cell"/s*; do
      [ -s "$dir/result.txt" ] && [ -f "$dir/$file" ] && echo "$cell=$dir/$file"
    done
  done
  return 0
}
lm=(softmax similarity attention)
mapfile -t a < <(inputs lm report.csv "${lm[@]}"; inputs lm report_load.csv "${lm[@]}"; inputs lm metrics.csv "${lm[@]}")
[ ${#a[@]} -gt 0 ] && "${PLOT[@]}" --out "$OUT/lm" --title "WikiText-2 LM, 4 x 128, E = 16, top-2" "${a[@]}"
mapfile -t a < <(inputs lm report.csv similarity; inputs tau report.csv tau0.1 tau1 tau2 tau11.3; inputs fix report.csv learned-tau exclude-self)
[ ${#a[@]} -gt 0 ] && "${PLOT[@]}" --out "$OUT/tau" --title "Similarity graph: temperature and fixes (similarity = tau 32)" "${a[@]}"
mapfile -t a < <(inputs vision load.csv "${lm[@]}"; inputs vision metrics.csv "${lm[@]}")
[ ${#a[@]} -gt 0 ] && "${PLOT[@]}" --out "$OUT/vision" --title "V-MoE on Fashion-MNIST" "${a[@]}"
exit 0
