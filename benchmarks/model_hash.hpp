// benchmarks/model_hash.hpp: the hashes model_hash.cpp and model_hash_cuda.cu print (FNV-1a 64
// over a host tensor's bytes; a double's bit pattern).
#pragma once

#include <cstdint>
#include <cstring>

#include "graphmoe/core/tensor.hpp"

namespace graphmoe::bench {

inline std::uint64_t fnv(const void* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
template <class T>
std::uint64_t fnv_tensor(const Tensor<T, cpu>& t, std::uint64_t h = 1469598103934665603ull) {
  return fnv(t.data(), static_cast<std::size_t>(t.numel()) * sizeof(T), h);
}
inline std::uint64_t double_bits(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

}  // namespace graphmoe::bench
