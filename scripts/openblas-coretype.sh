#!/usr/bin/env bash
# Prints the OPENBLAS_CORETYPE this machine should run with, or nothing when OpenBLAS's own
# choice is right.
#
# Debian 12's OpenBLAS (0.3.21, DYNAMIC_ARCH) picks its kernels by CPU model, and a model newer
# than the library (e.g. Intel family 6 model 207, a 2023 Xeon) falls back to its generic Prescott
# (SSE3) kernels: GEMMs at half speed or worse on an AVX-512 machine (docs/benchmarks.md,
# "OpenBLAS core type"). When OpenBLAS reports Prescott, this script names the core type the CPU's
# flags support: SkylakeX with AVX-512 (F, CD, BW, DQ, VL), Haswell with AVX2 and FMA. Linux lists
# those flags only when the kernel saves their registers, so the kernels it names can run.
#
#   ct=$(bash scripts/openblas-coretype.sh) && [[ -n "$ct" ]] && export OPENBLAS_CORETYPE=$ct
#
# Needs /usr/bin/python3 (ctypes) and libopenblas.so.0; prints nothing when either is missing.
set -uo pipefail
core=$(env -u OPENBLAS_CORETYPE /usr/bin/python3 -c '
import ctypes
lib = ctypes.CDLL("libopenblas.so.0")
lib.openblas_get_corename.restype = ctypes.c_char_p
print(lib.openblas_get_corename().decode())
' 2>/dev/null) || exit 0
[[ "$core" == "Prescott" ]] || exit 0
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
if has avx512f avx512cd avx512bw avx512dq avx512vl; then
  echo SkylakeX
elif has avx2 fma; then
  echo Haswell
fi
exit 0
