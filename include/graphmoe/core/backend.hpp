// graphmoe/core/backend.hpp: execution backend tags, and what makes a type a backend.
//
// A backend is an empty tag type passed as a template parameter (as thrust::host / thrust::device
// are). Tensor<T, Backend> carries its backend in its type. Every op is written once in ops/: it
// checks its arguments, prepares its outputs and then calls the backend's implementation with the
// tag as first argument, `softmax_forward(B{}, x, y)`, found by argument-dependent lookup in the
// tag's namespace. The built-in backends implement their ops in backend/cpu/ and backend/cuda/;
// a user's backend is a tag in the user's own namespace with the same tag-first overloads there
// (docs/extending.md, "A new backend"; tests/core/test_backend_plugin.cpp plugs in a third one).
//
// What a tag must provide (the Backend concept below):
//   static constexpr const char* name   for messages
//   static constexpr bool host_memory   true when its tensors live in host memory that the CPU
//                                       may read and write directly (element access t(i, j),
//                                       fill, to_vector; a host-memory tensor also borrows as a
//                                       Tensor<T, cpu> of the same bytes)
// plus a specialisation of backend_allocator<B> (core/tensor.hpp) for its storage. What a backend
// may offer beyond that is a trait read here (a tag opts in with a static member; without it, no):
//   static constexpr bool mixed_precision   its GEMMs take operands of a compute type C other
//                                       than the parameters' T (bf16 / fp16 with fp32
//                                       accumulation: Linear, ExpertBank and the models with
//                                       C != T); backend_mixed_precision<B>
#pragma once

#include <concepts>
#include <type_traits>

namespace graphmoe {

struct cpu {
  static constexpr const char* name = "cpu";
  static constexpr bool host_memory = true;
};

struct cuda {
  static constexpr const char* name = "cuda";
  static constexpr bool host_memory = false;
  static constexpr bool mixed_precision = true;
};

template <class B>
concept Backend = std::is_empty_v<B> && std::default_initializable<B> && requires {
  { B::name } -> std::convertible_to<const char*>;
  { B::host_memory } -> std::convertible_to<bool>;
};

// Whether B computes with GEMM operands of a type other than the parameters' (see above).
template <class B>
inline constexpr bool backend_mixed_precision = requires { requires B::mixed_precision; };

}  // namespace graphmoe
