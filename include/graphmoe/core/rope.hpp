// graphmoe/core/rope.hpp: the layouts of rotary position embeddings and the formulas every
// backend's rope shares (the contract and the argument checks: ops/rope.hpp).
#pragma once

#include <cmath>

#include "graphmoe/config.hpp"
#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe {

// Which entries of a head of dh entries form the rotated pairs i = 0 .. dh/2 - 1:
//   HalfSplit    (i, i + dh/2): "rotate_half" of Hugging Face's Llama, Mixtral, Qwen, OLMoE,
//                DeepSeek
//   Interleaved  (2i, 2i + 1): GPT-J and Meta's original Llama code
enum class RopeLayout { HalfSplit, Interleaved };
inline constexpr EnumName<RopeLayout> kRopeLayoutNames[] = {{RopeLayout::HalfSplit, "half-split"},
                                                            {RopeLayout::Interleaved, "interleaved"}};
inline const char* rope_layout_name(RopeLayout l) { return name_of(kRopeLayoutNames, l); }
inline RopeLayout rope_layout_from_name(std::string_view s) {
  return value_of("rope_layout_from_name", "RoPE layout", kRopeLayoutNames, s);
}

namespace detail {

// The frequency of pair i, in double: 1 / theta^(2i / dh) (Hugging Face's
// inv_freq = 1 / (theta ** (arange(0, dh, 2) / dh))).
GRAPHMOE_HOST_DEVICE inline double rope_inv_freq(double theta, index_t i, index_t dh) {
  return 1.0 / ::pow(theta, static_cast<double>(2 * i) / static_cast<double>(dh));
}

// The offsets within a head of pair i's first and second entries.
GRAPHMOE_HOST_DEVICE inline index_t rope_first(RopeLayout layout, index_t i) {
  return layout == RopeLayout::HalfSplit ? i : 2 * i;
}
GRAPHMOE_HOST_DEVICE inline index_t rope_second(RopeLayout layout, index_t i, index_t dh) {
  return layout == RopeLayout::HalfSplit ? i + dh / 2 : 2 * i + 1;
}

}  // namespace detail

}  // namespace graphmoe
