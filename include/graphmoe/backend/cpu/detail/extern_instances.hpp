// graphmoe/backend/cpu/detail/extern_instances.hpp: GRAPHMOE_CPU_EXTERN_INSTANCES (internal).
//
// The CPU kernels that cost the most to compile (the token graphs, the attention, the experts'
// FFN, the GEMM: 2 to 12 CPU-seconds of g++ per kernel and scalar type, each time a translation
// unit uses one) each list their float and double instances in a macro M(EXTERN, T), whose
// expansion M(, T) is an explicit instantiation definition and M(extern, T) a declaration.
// With GRAPHMOE_EXTERN_CPU_KERNELS defined, each such header declares its instances extern, so
// that a translation unit neither instantiates nor compiles them: one object file of the program
// must then define them (graphmoe/backend/cpu/instances.hpp; graphmoe's own build does it in the
// graphmoe_cpu_kernels library, CMakeLists.txt's GRAPHMOE_PRECOMPILED_CPU_KERNELS). Without the
// definition nothing changes: every translation unit instantiates what it uses, as usual.
#pragma once

#if defined(GRAPHMOE_EXTERN_CPU_KERNELS)
#define GRAPHMOE_CPU_EXTERN_INSTANCES(M) M(extern, float) M(extern, double)
#else
#define GRAPHMOE_CPU_EXTERN_INSTANCES(M)
#endif
