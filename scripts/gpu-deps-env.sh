# Sourced (not run) by scripts/gpu-check.sh and scripts/main-job.sh (OFFLINE=1): when the build
# dependencies were carried to a machine without package access (scripts/gpu-deps.sh unpacks the
# Debian packages into .gpu-deps/root), sets dep_args to the CMake arguments that find them there
# and puts their libraries on LD_LIBRARY_PATH; otherwise dep_args is empty (the system's).
#   source scripts/gpu-deps-env.sh ROOT     (ROOT: the repository root)
dep_args=()
gpu_deps=${1:?usage: source gpu-deps-env.sh REPOSITORY_ROOT}/.gpu-deps/root
if [[ -d "$gpu_deps/usr" ]]; then
  gpu_deps_libdir=$gpu_deps/usr/lib/x86_64-linux-gnu
  dep_args=("-DCMAKE_PREFIX_PATH=$gpu_deps/usr;$gpu_deps_libdir/cmake;$gpu_deps/usr/lib/cmake;$gpu_deps/usr/share"
            "-DZLIB_INCLUDE_DIR=$gpu_deps/usr/include" "-DZLIB_LIBRARY=$gpu_deps_libdir/libz.a")
  export LD_LIBRARY_PATH=$gpu_deps_libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
