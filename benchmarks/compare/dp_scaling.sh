#!/usr/bin/env bash
# Data-parallel scaling of the LM on this machine: bench_dp at 1, 2 and 4 ranks of one OpenMP
# thread each (ranks beyond the cores oversubscribe them: the table says so), and one rank with a
# thread per core (the single-process baseline that uses the whole machine), then a table of
# tokens/s, speed-up over one single-thread rank, and the bytes each rank handed MPI per step
# against the analytic count.
#
#   bash benchmarks/compare/dp_scaling.sh [BUILD_DIR] [-- bench_dp options]
#   e.g. bash benchmarks/compare/dp_scaling.sh build -- --router similarity --steps 10
#        bash benchmarks/compare/dp_scaling.sh build -- --ep 1     (experts split over the ranks)
set -euo pipefail
build=${1:-build}
shift || true
[[ "${1:-}" == "--" ]] && shift
bench="$build/benchmarks/bench_dp"
[[ -x "$bench" ]] || { echo "dp_scaling.sh: $bench not found (configure with MPI: GRAPHMOE_ENABLE_MPI)" >&2; exit 1; }
cores=$(nproc)  # before OMP_NUM_THREADS, which GNU nproc obeys
export OMP_NUM_THREADS=1
# OpenBLAS's own kernel choice, unless it falls back to SSE3 on a CPU it does not know
unset OPENBLAS_CORETYPE
coretype=$(bash "$(dirname "$0")/../../scripts/openblas-coretype.sh")
[[ -n "$coretype" ]] && export OPENBLAS_CORETYPE=$coretype && echo "OPENBLAS_CORETYPE=$coretype" >&2
[[ "$(id -u)" == 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for np in 1 2 4; do
  extra=()
  (( np > cores )) && extra=(--oversubscribe)
  mpiexec -n "$np" "${extra[@]}" "$bench" --threads 1 "$@" | tee -a "$out"
done
# --bind-to none: Open MPI binds a job of <= 2 ranks to one core each, which would put every thread
# of this rank on one core
OMP_NUM_THREADS=$cores mpiexec -n 1 --bind-to none "$bench" --threads "$cores" "$@" | tee -a "$out"
python3 - "$out" "$cores" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    if line.startswith("dp_lm "):
        rows.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
cores = int(sys.argv[2])
base = float(rows[0]["tokens_per_s"])
print(f"\n| ranks x threads | tokens/s | speed-up | step ms | all-reduce bytes/step | analytic | ratio | agreement bytes/step | all-to-all bytes/step sent (mean over ranks) | analytic |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    n, t = int(r["ranks"]), int(r["threads"])
    note = " (oversubscribed)" if n * t > cores else ""
    print(f"| {n} x {t}{note} | {float(r['tokens_per_s']):,.0f} | {float(r['tokens_per_s']) / base:.2f} | "
          f"{float(r['step_ms']):.1f} | {float(r['allreduce_bytes_per_step']):,.0f} | "
          f"{float(r['analytic_allreduce_bytes']):,.0f} | {float(r['ratio']):.4f} | "
          f"{float(r['agreement_bytes_per_step']):.0f} | {float(r['alltoall_bytes_per_step']):,.0f} | "
          f"{float(r['analytic_alltoall_bytes']):,.0f} |")
PY
