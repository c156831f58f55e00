// graphmoe/backend/cuda/dropout.cuh: inverted dropout with a counter-based mask, on the GPU.
//
// The CUDA system's dropout (contract and argument checks: ops/dropout.hpp, which calls these
// through the backend tag), on Tensor<T, cuda>: element i
// (flat, row-major) of a call with (seed, offset) is dropped iff
//     uniform_float(philox_word(seed, offset + i)) < p,
// kept elements are scaled by 1 / (1 - p), and mask holds 1 for kept, 0 for dropped. The Philox
// stream is core/rng.hpp's, compiled for the device, and the comparison is the CPU op's, so the
// mask is bit-identical to the CPU backend's and y, dx are equal entry for entry (one rounded
// multiplication by the same scale). Give every call its own range of the stream, as on the CPU:
//     const std::uint64_t offset = rng.skip(static_cast<std::uint64_t>(x.numel()));
//
// One thread per Philox block (four consecutive words, so up to four elements): each block is
// drawn once. Asynchronous (nothing is read back). p = 0 is the identity. y may alias x and dx
// may alias dy.
#pragma once

#include <cstdint>

#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// y = x * mask / (1 - p) with mask_i = !(uniform_float(philox_word(seed, offset + i)) < p);
// y and mask (x's shape, 1 = kept) prepared by ops/dropout.hpp.
template <class T>
void dropout_forward(cuda, T p, std::uint64_t seed, std::uint64_t offset,
                     const Tensor<T, cuda>& x, Tensor<T, cuda>& y,
                     Tensor<std::uint8_t, cuda>& mask) {
  const index_t n = x.numel();
  const T scale = T(1) / (T(1) - p);
  detail::for_each_index(detail::dropout_blocks(offset, n),
                         detail::DropoutForwardOp<T>{p, scale, seed, offset, n, x.data(),
                                                     y.data(), mask.data()});
}

// dx = dy * mask / (1 - p), assigned; dx prepared by ops/dropout.hpp.
template <class T>
void dropout_backward(cuda, T p, const Tensor<std::uint8_t, cuda>& mask,
                      const Tensor<T, cuda>& dy, Tensor<T, cuda>& dx) {
  const T scale = T(1) / (T(1) - p);
  detail::for_each_index(dy.numel(),
                         detail::DropoutBackwardOp<T>{scale, mask.data(), dy.data(), dx.data()});
}

}  // namespace graphmoe
