// --device for the examples' main(): calls the training loop instantiated for the chosen backend.
//
// The CPU loops are built for the routers of GRAPHMOE_EXAMPLE_ROUTERS (default: all fourteen; the
// generated examples_routers.hpp says which: built_for_cpu<Policy>, cpu_router_list). With
// GRAPHMOE_ENABLE_CUDA the examples in
// GRAPHMOE_CUDA_EXAMPLES (default: train_lm) also get CUDA instantiations for the routers in
// GRAPHMOE_CUDA_EXAMPLE_ROUTERS (each is an nvcc translation unit of a few minutes, so the
// default list is short); the build defines GRAPHMOE_EXAMPLES_CUDA and generates
// examples_cuda_routers.hpp, which says which routers those are.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "examples_routers.hpp"  // generated: built_for_cpu<Policy>, cpu_router_list
#include "graphmoe/config.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/routing/registry.hpp"

#if defined(GRAPHMOE_EXAMPLES_CUDA)
#include "examples_cuda_routers.hpp"  // generated: built_for_cuda<Policy>, cuda_router_list
#endif

namespace examples {

// The names (as --router takes them) of the routers whose loops this binary has: on the CPU
// (device "cpu"), on the GPU ("cuda"), or on either ("").
inline std::vector<std::string> built_router_names(const std::string& device = "") {
  std::vector<std::string> out;
  for (const std::string& n : graphmoe::router_names()) {
    const bool built = graphmoe::with_router(n, [&]<class P>() {
      bool on_gpu = false;
#if defined(GRAPHMOE_EXAMPLES_CUDA)
      on_gpu = built_for_cuda<P>;
#endif
      return device == "cpu" ? built_for_cpu<P> : device == "cuda" ? on_gpu : built_for_cpu<P> || on_gpu;
    });
    if (built) out.push_back(n);
  }
  return out;
}

// names joined by ", " ("none" for no name).
inline std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "none" : s;
}

inline std::string device_help() {
#if defined(GRAPHMOE_EXAMPLES_CUDA)
  return "cpu or cuda (built for cuda: " + joined(built_router_names("cuda")) + ")";
#else
  return "cpu (this binary was built without CUDA: GRAPHMOE_ENABLE_CUDA and GRAPHMOE_CUDA_EXAMPLES)";
#endif
}

// --device cuda on a binary built without CUDA code: refused before any work, saying so.
inline void require_device_built(const char* program, const std::string& device) {
#if !defined(GRAPHMOE_EXAMPLES_CUDA)
  GRAPHMOE_CHECK(device != "cuda", program, "--device cuda: this ", program,
                 " was built without CUDA (GRAPHMOE_ENABLE_CUDA off, or ", program,
                 " not in GRAPHMOE_CUDA_EXAMPLES): use --device cpu, or reconfigure with "
                 "-DGRAPHMOE_ENABLE_CUDA=ON and ", program, " in -DGRAPHMOE_CUDA_EXAMPLES");
#endif
  (void)program;
  (void)device;
}

// Throws graphmoe::Error when this binary has no CPU loop for Policy (GRAPHMOE_EXAMPLE_ROUTERS).
template <class Policy>
void require_cpu_router(const char* program, const std::string& router) {
  if constexpr (!built_for_cpu<Policy>)
    GRAPHMOE_CHECK(false, program, "router '", router, "' is not built in this binary (built: ",
                   joined(built_router_names("cpu")),
                   "; configure with -DGRAPHMOE_EXAMPLE_ROUTERS=... to add it)");
  (void)program;
  (void)router;
}

// The same check by the router's name, for main() to call before it reads any data.
inline void require_cpu_router(const char* program, const std::string& router,
                               const std::string& device) {
  if (device != "cpu") return;  // on_device checks the CUDA loops
  graphmoe::with_router(router, [&]<class Policy>() {
    require_cpu_router<Policy>(program, router);
    return 0;
  });
}

// fn.template operator()<B>() for the backend named by `device` ("cpu" or "cuda").
template <class Policy, class Fn>
int on_device(const char* program, const std::string& device, const std::string& router, Fn&& fn) {
  if (device == "cpu") {
    require_cpu_router<Policy>(program, router);
    if constexpr (built_for_cpu<Policy>) return fn.template operator()<graphmoe::cpu>();
    return 1;
  }
  GRAPHMOE_CHECK(device == "cuda", program, "unknown --device '", device, "' (cpu or cuda)");
#if defined(GRAPHMOE_EXAMPLES_CUDA)
  if constexpr (built_for_cuda<Policy>) {
    return fn.template operator()<graphmoe::cuda>();
  } else {
    GRAPHMOE_CHECK(false, program, "router '", router,
                   "' is not built for --device cuda in this binary (built: ",
                   joined(built_router_names("cuda")),
                   "; configure with -DGRAPHMOE_CUDA_EXAMPLE_ROUTERS=...)");
  }
#else
  (void)router;
  require_device_built(program, device);
#endif
  return 1;
}

}  // namespace examples
