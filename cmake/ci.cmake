# cmake/ci.cmake: the test suite's build settings (`cmake -C cmake/ci.cmake ...`, the README's test
# command and .ci/run). CI runs on 2 cores without a GPU and must stay well inside its time limit;
# each setting below cuts what a full matrix builds twice without testing anything more.
# A user's build without this file gets the defaults (every router, sm_80 and sm_90).

# The examples' CPU training loops and routing_report probes: one translation unit per router and
# program (5 programs x 9 routers by default, 15-40 CPU s of g++ each). The example tests drive
# the softmax router, and generate's --explain test a Similarity one; the library's own tests
# cover every router inside every model. A third router (AttentionSMoEDropoutRouter: 139 CPU s
# over the five programs) compiled the same generic loops once more and tested nothing more.
set(GRAPHMOE_EXAMPLE_ROUTERS "SoftmaxRouter;SimilarityXMoERouter;SigmoidBiasRouter"
    CACHE STRING "Routers of the examples' CPU training loops (CI subset: cmake/ci.cmake)")

# The examples' --device cuda loops (one nvcc translation unit of a few minutes per router): they
# cannot run without a GPU; one router keeps the loop compiling.
set(GRAPHMOE_CUDA_EXAMPLE_ROUTERS "SoftmaxRouter"
    CACHE STRING "Routers of the examples' --device cuda training loops (CI subset: cmake/ci.cmake)")
# Only train_lm's CUDA loop: it instantiates the CUDA decoder too (its closing sample), so
# generate's --device cuda unit would compile nothing new for another nvcc minute or two.
set(GRAPHMOE_CUDA_EXAMPLES "train_lm"
    CACHE STRING "Examples built with --device cuda loops (CI subset: cmake/ci.cmake)")

# One GPU architecture for the nvcc translation units: sm_80 code plus its PTX, which the driver
# compiles for any later GPU (sm_90 included) at load time. Device code is compiled once per
# architecture, so this halves nvcc's device work; no kernel is architecture-specific.
set(CMAKE_CUDA_ARCHITECTURES "80" CACHE STRING "CUDA architectures (CI: cmake/ci.cmake)")

# The nvcc test binaries (test_cuda_*, test_cuda_nccl): compiled, never run without a GPU, about
# 15 CPU minutes of nvcc on an AVX-512 machine of CI's kind (more on an AVX2 one): the largest
# single cost of a CI run (docs/benchmarks.md, "CI time"). Their sources run in CI under the CPU
# emulation (test_emu_cuda_*), and nvcc still compiles every CUDA header, the CUDA training loop
# and bench_cuda. scripts/gpu-check.sh builds them on a machine with a GPU.
set(GRAPHMOE_CUDA_DEVICE_TESTS OFF CACHE BOOL "Build the nvcc test binaries (CI subset: cmake/ci.cmake)")

# The sanitizer subset's test programs (tests/sanitize_subset.txt: the model tests test_classifier
# and test_vision, the checkpoint, data and inference tests, ...) run in scripts/sanitize.sh's
# ASan + UBSan build, which .ci/run runs after ctest, with the same assertions: this build leaves
# them out instead of compiling them a second time at -O3 (about 190 CPU-s).
set(GRAPHMOE_SKIP_SANITIZED_TESTS ON CACHE BOOL "Run the sanitizer subset's programs only in scripts/sanitize.sh's build (CI subset: cmake/ci.cmake)")

# What the subsets above leave out is still compiled through template instantiation: each example
# program's loop for the eleven other routers, its --device cuda loop for the default CUDA routers
# (under the CUDA emulation) and routing_report's probes, one -fsyntax-only translation unit per
# program (examples/CMakeLists.txt), so that a router that only a full build instantiates cannot
# break it unseen.
set(GRAPHMOE_EXAMPLE_SYNTAX_CHECK ON CACHE BOOL "Syntax-check the examples' left-out routers (CI: cmake/ci.cmake)")

# graphmoe's own programs at -O1 (CMakeLists.txt, GRAPHMOE_OPTIMIZATION): CI checks them and times
# nothing. A model test's translation unit compiles in well under half its -O3 time (test_lm:
# 190 -> 74 CPU-s), the examples' training loops in about half, and ctest's run time barely moves
# (docs/benchmarks.md, "CI time"). Time benchmarks in a build without this file.
set(GRAPHMOE_OPTIMIZATION "-O1" CACHE STRING "Optimisation flag of graphmoe's own programs (CI: cmake/ci.cmake)")


# The benchmark programs, which CI never runs, with -fsyntax-only instead of built
# (benchmarks/CMakeLists.txt, GRAPHMOE_BENCHMARK_SYNTAX_CHECK): their templates are instantiated,
# no code is generated; nvcc's bench_cuda is left out (bench_cuda_emulated, which a smoke test
# runs, compiles the same source). About 230 CPU-s less on an AVX-512 EPYC.
set(GRAPHMOE_BENCHMARK_SYNTAX_CHECK ON CACHE BOOL "Syntax-check the benchmark programs instead of building them (CI: cmake/ci.cmake)")

# GCC's garbage collector once per GiB of heap instead of every 128 MiB (CMakeLists.txt,
# GRAPHMOE_GCC_GC_MIN_HEAP_MB): 6-9% less CPU per translation unit, about 1.2 GB at the peak of a
# model test instead of 0.85 (two compilers at a time fit CI's 24 GiB many times over).
set(GRAPHMOE_GCC_GC_MIN_HEAP_MB "1024" CACHE STRING "GCC's garbage-collection threshold in MiB (CI: cmake/ci.cmake)")
