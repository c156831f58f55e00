// graphmoe/backend/cuda/dropout.cuh: inverted dropout with a counter-based mask, on the GPU.
//
// The same functions and contract as backend/cpu/dropout.hpp, on Tensor<T, cuda>: element i
// (flat, row-major) of a call with (seed, offset) is dropped iff
//     uniform_float(philox_word(seed, offset + i)) < p,
// kept elements are scaled by 1 / (1 - p), and mask holds 1 for kept, 0 for dropped. The Philox
// stream is core/rng.hpp's, compiled for the device, and the comparison is the CPU op's, so the
// mask is bit-identical to the CPU backend's and y, dx are equal entry for entry (one rounded
// multiplication by the same scale). Give every call its own range of the stream, as on the CPU:
//     const std::uint64_t offset = rng.skip(static_cast<std::uint64_t>(x.numel()));
//
// One thread per Philox block (four consecutive words, so up to four elements): each block is
// drawn once. Asynchronous (nothing is read back). p must lie in [0, 1); p = 0 is the identity.
// Outputs follow prepare_output; y may alias x and dx may alias dy.
#pragma once

#include <cstdint>

#include "graphmoe/backend/common/checks.hpp"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// y = x * mask / (1 - p) with mask_i = !(uniform_float(philox_word(seed, offset + i)) < p).
// Fills mask (x's shape, 1 = kept).
template <class T>
void dropout_forward(T p, std::uint64_t seed, std::uint64_t offset, const Tensor<T, cuda>& x,
                     Tensor<T, cuda>& y, Tensor<std::uint8_t, cuda>& mask) {
  detail::dropout_prepare_forward("dropout_forward", p, x, y, mask);
  const index_t n = x.numel();
  const T scale = T(1) / (T(1) - p);
  detail::for_each_index(detail::dropout_blocks(offset, n),
                         detail::DropoutForwardOp<T>{p, scale, seed, offset, n, x.data(),
                                                     y.data(), mask.data()});
}

// dx = dy * mask / (1 - p), with the mask of the forward call. dx is assigned.
template <class T>
void dropout_backward(T p, const Tensor<std::uint8_t, cuda>& mask, const Tensor<T, cuda>& dy,
                      Tensor<T, cuda>& dx) {
  detail::dropout_prepare_backward("dropout_backward", p, mask, dy, dx);
  const T scale = T(1) / (T(1) - p);
  detail::for_each_index(dy.numel(),
                         detail::DropoutBackwardOp<T>{scale, mask.data(), dy.data(), dx.data()});
}

}  // namespace graphmoe
