// graphmoe/core/capacity.hpp: the capacity rule's host loop (internal), one definition for every
// backend: the CPU system runs it on its tensors (backend/cpu/gates.hpp), the CUDA system on host
// copies (backend/cuda/gates.cuh). Contract and argument checks: ops/gates.hpp (capacity_mask).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe {

// The capacity of each expert for n tokens choosing k of e experts each under capacity factor f:
// ceil(f n k / e), 0 (no limit) when f <= 0 (RouterConfig::capacity_factor).
inline index_t token_capacity(double capacity_factor, index_t n, index_t k, index_t e) {
  if (!(capacity_factor > 0)) return 0;
  return static_cast<index_t>(std::ceil(capacity_factor * static_cast<double>(n * k) /
                                        static_cast<double>(e)));
}

}  // namespace graphmoe

namespace graphmoe::detail {

// In token order, each expert keeps its first `capacity` assignments: keep[a] = 0 for the others.
// keep must hold 1 everywhere on entry. Returns the first expert id outside [0, num_experts), if
// any (keep is then partly written).
inline Offender capacity_mask_host(const std::int32_t* ids, index_t n, index_t num_experts,
                                   index_t capacity, std::uint8_t* keep) {
  std::vector<index_t> load(static_cast<std::size_t>(num_experts), 0);
  for (index_t a = 0; a < n; ++a) {
    const std::int32_t e = ids[a];
    if (!(e >= 0 && e < num_experts)) return {a, static_cast<double>(e)};
    auto& l = load[static_cast<std::size_t>(e)];
    if (l >= capacity) {
      keep[a] = 0;
    } else {
      ++l;
    }
  }
  return {};
}

}  // namespace graphmoe::detail
