// graphmoe/backend/cpu/instances.hpp: the costliest CPU kernels compiled once per program.
//
// A program of many translation units that use graphmoe's models compiles the same float and
// double kernels (the token graphs, the attention, the experts' FFN, the GEMM) in each of them:
// 2 to 12 CPU-seconds of g++ per kernel and type, each time. Compile every file of the program
// with GRAPHMOE_EXTERN_CPU_KERNELS defined and add one file that defines the instances:
//
//   // graphmoe_cpu_kernels.cpp
//   #include <graphmoe/backend/cpu/instances.hpp>
//   GRAPHMOE_INSTANTIATE_CPU_KERNELS(float)
//   GRAPHMOE_INSTANTIATE_CPU_KERNELS(double)
//
// The code is the same as without: only where it is compiled changes. A file compiled without
// the definition instantiates the kernels itself, as usual, and links with the others (the
// instances are vague-linkage symbols). graphmoe's own tests, examples and benchmarks are built
// this way (CMakeLists.txt, GRAPHMOE_PRECOMPILED_CPU_KERNELS; docs/benchmarks.md, "Compile time").
// Each group's macro (GRAPHMOE_CPU_TOKEN_GRAPH_INSTANCES(, T), ...) may also be expanded in its
// own file, so that a parallel build compiles the groups side by side.
#pragma once

#include "graphmoe/backend/cpu/attention.hpp"
#include "graphmoe/backend/cpu/experts.hpp"
#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/backend/cpu/token_graph.hpp"

#define GRAPHMOE_INSTANTIATE_CPU_KERNELS(T)     \
  namespace graphmoe {                          \
  GRAPHMOE_CPU_GEMM_INSTANCES(, T)              \
  GRAPHMOE_CPU_ATTENTION_INSTANCES(, T)         \
  GRAPHMOE_CPU_EXPERTS_INSTANCES(, T)           \
  GRAPHMOE_CPU_TOKEN_GRAPH_INSTANCES(, T)       \
  }
