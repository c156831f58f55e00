#!/usr/bin/env bash
# Installs a current PyTorch from PyPI into a clean virtual environment (no system site packages)
# for the comparison scripts benchmarks/compare/lm_torch.py and moe_layer_torch.py, and prints the
# environment's python on the last line. Idempotent: an environment whose torch imports is kept.
#
#   bash scripts/install-torch-current.sh            # newest torch, into the default venv
#   GRAPHMOE_TORCH_VENV=/path TORCH_SPEC='torch==2.15.0' bash scripts/install-torch-current.sh
#
# GRAPHMOE_TORCH_VENV: the environment (default ~/.cache/graphmoe/venv-torch, which the comparison
#   scripts also look for); BASE_PYTHON: the python that creates it (default /usr/bin/python3,
#   Debian's, which needs python3-venv); TORCH_SPEC: the pip requirement (default torch).
#
# PyPI has no CPU-only torch wheel for Linux x86_64: its wheel is the CUDA build, whose libtorch
# links the CUDA runtime libraries (libcudart, libcublas, libcufile, libcudnn, libnccl, ...) even
# to run on the CPU. They are PyPI packages too (cuda-toolkit[...], nvidia-*), named in torch's
# own requirements, so a plain `pip install torch` brings them (about 5 GiB in all); a torch
# installed without them (`--no-deps`) fails to import with e.g. "libcufile.so.0: cannot open
# shared object file". If the import still names a missing library, this script installs the
# PyPI package that ships it once and tries again. Nothing here is used by CI.
set -euo pipefail

VENV=${GRAPHMOE_TORCH_VENV:-$HOME/.cache/graphmoe/venv-torch}
BASE_PYTHON=${BASE_PYTHON:-/usr/bin/python3}
TORCH_SPEC=${TORCH_SPEC:-torch}
PY=$VENV/bin/python

die() { echo "install-torch-current: $*" >&2; exit 1; }

ERR=$(mktemp)
trap 'rm -f "$ERR"' EXIT
probe() {  # prints torch's version; the import error's last line goes to $ERR
  local rc=0
  "$PY" -c 'import torch; print(torch.__version__)' 2>"$ERR.full" || rc=$?
  tail -n 1 "$ERR.full" >"$ERR"; rm -f "$ERR.full"
  return $rc
}

if [[ -x "$PY" ]] && v=$(probe); then
  echo "install-torch-current: torch $v already imports in $VENV" >&2
  echo "$PY"
  exit 0
fi

command -v "$BASE_PYTHON" >/dev/null || die "no $BASE_PYTHON (set BASE_PYTHON to a python3)"
if [[ ! -x "$PY" ]]; then
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PYTHON" -m venv "$VENV" \
    || die "'$BASE_PYTHON -m venv $VENV' failed (Debian: apt-get install -y python3-venv)"
fi
"$PY" -m pip install --upgrade "$TORCH_SPEC" numpy \
  || die "'pip install $TORCH_SPEC numpy' failed in $VENV (PyPI reachable? disk space: ~5 GiB)"

# PyPI package of each CUDA library libtorch links (for a dependency pip did not bring)
declare -A PKG=(
  [libcudart]=nvidia-cuda-runtime [libcublas]=nvidia-cublas [libcublasLt]=nvidia-cublas
  [libcufile]=nvidia-cufile [libcufft]=nvidia-cufft [libcusparse]=nvidia-cusparse
  [libcusparseLt]=nvidia-cusparselt-cu13 [libcusolver]=nvidia-cusolver
  [libcudnn]=nvidia-cudnn-cu13 [libnccl]=nvidia-nccl-cu13 [libnvshmem_host]=nvidia-nvshmem-cu13
  [libnvrtc]=nvidia-cuda-nvrtc [libcupti]=nvidia-cuda-cupti [libnvJitLink]=nvidia-nvjitlink
)
tried=" "
while ! v=$(probe); do
  err=$(cat "$ERR")
  lib=$(sed -n 's/.*\(lib[A-Za-z_]*\)\.so[.0-9]*: cannot open shared object file.*/\1/p' <<<"$err")
  pkg=${PKG[$lib]:-}
  [[ -n "$pkg" && "$tried" != *" $pkg "* ]] || die "torch does not import from $VENV: $err"
  echo "install-torch-current: $lib missing, installing $pkg" >&2
  "$PY" -m pip install "$pkg" || die "'pip install $pkg' failed"
  tried+="$pkg "
done
echo "install-torch-current: torch $v imports in $VENV" >&2
echo "$PY"
