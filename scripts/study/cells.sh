# scripts/study/cells.sh: which cells each study has, and what each cell runs (sourced).
#   study_cells STUDY          prints "CELL SEED" lines in the order they should run
#   run_cell STUDY CELL SEED   runs one cell (skipped when done)

SEEDS=${SEEDS:-"1 2 3"}

study_cells() {
  local s c
  case "$1" in
    lm)  # the three routers of the paper on the softmax (Switch) scorer
      for s in $SEEDS; do for c in softmax similarity attention; do echo "$c $s"; done; done ;;
    tau)  # the Similarity graph's temperature (paper Tables 9-10); tau32 is lm/similarity
      for s in ${TAU_SEEDS:-1}; do for c in tau0.1 tau1 tau2 tau11.3; do echo "$c $s"; done; done ;;
    sigma)  # the Attention graph's sigma; sigma1 is lm/attention
      for s in ${SIGMA_SEEDS:-1}; do for c in sigma0.1 sigma11.3; do echo "$c $s"; done; done ;;
    plugin)  # Table 1's plug-in claim: X-MoE, SMoE-Dropout and GLaM with and without each graph
      # (host by host, all seeds of a host before the next, so that a partial run completes rows)
      for c in smoe-dropout smoe-dropout-similarity smoe-dropout-attention xmoe xmoe-similarity \
               xmoe-attention glam glam-similarity glam-attention; do
        for s in ${PLUGIN_SEEDS:-1}; do echo "$c $s"; done
      done ;;
    fix)  # the fixes of docs/results.md: a learned tau (from D / 4), exclude self (tau sqrt(D)),
          # a learned W_s in U W_s U^T (tau D / 4)
      for s in ${FIX_SEEDS:-1}; do for c in learned-tau exclude-self projection; do echo "$c $s"; done; done ;;
    vision)  # V-MoE on Fashion-MNIST, clean and corrupted (Table 2, Figure 4); attention-prefix:
             # the Attention graph with h* chosen per prefix instead of per image
      for s in ${VISION_SEEDS:-$SEEDS}; do
        for c in softmax similarity attention attention-prefix; do echo "$c $s"; done
      done ;;
    finetune)  # Table 3: each lm/<router>/s<seed> LM fine-tuned on SST-2, SST-5 and Banking-77
      for s in ${FINETUNE_SEEDS:-1}; do
        for t in ${FINETUNE_TASKS:-sst2 sst5 banking77}; do
          for c in softmax similarity attention; do echo "$c-$t $s"; done
        done
      done ;;
    *) echo "unknown study '$1' (lm, tau, sigma, fix, plugin, vision, finetune)" >&2; return 2 ;;
  esac
}

run_cell() {
  local study=$1 cell=$2 seed=$3
  case "$study/$cell" in
    lm/softmax) lm_cell lm softmax "$seed" softmax ;;
    lm/similarity) lm_cell lm similarity "$seed" similarity --tau "$LM_TAU" ;;
    lm/attention) lm_cell lm attention "$seed" attention ;;
    tau/tau*) lm_cell tau "$cell" "$seed" similarity --tau "${cell#tau}" ;;
    fix/learned-tau) lm_cell fix learned-tau "$seed" similarity --tau "$LM_TAU" --tau-mode learned ;;
    fix/exclude-self) lm_cell fix exclude-self "$seed" similarity --tau 11.3 --graph-exclude-self ;;
    fix/projection) lm_cell fix projection "$seed" similarity --tau "$LM_TAU" --graph-projection ;;
    vision/attention-prefix) vision_cell "$cell" "$seed" attention --head-choice per-prefix ;;
    vision/*) vision_cell "$cell" "$seed" ;;
    finetune/*) finetune_cell "${cell%-*}" "${cell##*-}" "$seed" ;;
    sigma/sigma*) lm_cell sigma "$cell" "$seed" attention --sigma "${cell#sigma}" ;;
    plugin/glam) lm_cell plugin glam "$seed" softmax --layout glam ;;
    plugin/glam-similarity) lm_cell plugin glam-similarity "$seed" similarity --tau "$LM_TAU" --layout glam ;;
    plugin/glam-attention) lm_cell plugin glam-attention "$seed" attention --layout glam ;;
    plugin/*-similarity) lm_cell plugin "$cell" "$seed" "$cell" --tau "$LM_TAU" ;;
    plugin/*) lm_cell plugin "$cell" "$seed" "$cell" ;;
    *) echo "unknown cell $study/$cell" >&2; return 2 ;;
  esac
}
