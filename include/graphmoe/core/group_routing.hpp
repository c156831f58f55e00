// graphmoe/core/group_routing.hpp: group-limited routing's per-token arithmetic (internal), one
// definition for the host and the device (ops/gates.hpp's group_limited_mask runs it per row).
//
// The E experts form n_group contiguous groups of E / n_group; a group's score is the sum of its two
// largest entries (DeepSeek-V3; a group of one expert: that entry), and a token keeps the
// topk_group groups of largest score (ties: the lower group index first).
#pragma once

#include <cstdint>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe::detail {

template <class T>
GRAPHMOE_HOST_DEVICE void group_scores(const T* x, index_t n_group, index_t size, T* score) {
  for (index_t g = 0; g < n_group; ++g) {
    const T* xg = x + g * size;
    if (size == 1) {
      score[g] = xg[0];
      continue;
    }
    // the two largest (first, second), the earlier one first among equals
    T first = xg[0] >= xg[1] ? xg[0] : xg[1];
    T second = xg[0] >= xg[1] ? xg[1] : xg[0];
    for (index_t c = 2; c < size; ++c) {
      const T v = xg[c];
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    score[g] = first + second;
  }
}

// chosen[g] = 1 for the topk_group groups of largest score, 0 otherwise (n_group small: a scan per
// pick; a NaN score is never chosen over a number).
template <class T>
GRAPHMOE_HOST_DEVICE void choose_groups(const T* score, index_t n_group, index_t topk_group,
                                        std::uint8_t* chosen) {
  for (index_t g = 0; g < n_group; ++g) chosen[g] = 0;
  for (index_t pick = 0; pick < topk_group; ++pick) {
    index_t best = -1;
    for (index_t g = 0; g < n_group; ++g) {
      if (chosen[g]) continue;
      if (best < 0 || score[g] > score[best]) best = g;
    }
    if (best < 0) break;  // every group chosen (topk_group > n_group)
    chosen[best] = 1;
  }
}

}  // namespace graphmoe::detail
