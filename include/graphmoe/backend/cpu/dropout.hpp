// graphmoe/backend/cpu/dropout.hpp: inverted dropout with a counter-based mask.
//
// Element i (flat, row-major) of a call with (seed, offset) is dropped iff
//     uniform_float(philox_word(seed, offset + i)) < p
// and kept elements are scaled by 1 / (1 - p), so E[y] = x. The mask is a pure function of
// (seed, offset + i, p): the CUDA backend draws the same mask, any thread count gives the same
// mask, and backward needs only the stored mask (1 = kept, 0 = dropped).
//
// Callers must give every call its own range of the stream: advance offset by x.numel() after
// each call, which is what Rng::skip does:
//     const std::uint64_t offset = rng.skip(static_cast<std::uint64_t>(x.numel()));
//     dropout_forward(p, rng.seed(), offset, x, y, mask);
// Reusing an offset reuses the mask.
//
// p must lie in [0, 1); p = 0 is the identity (mask all ones). Outputs follow prepare_output
// (empty: allocated; otherwise the shape must match); y may alias x and dx may alias dy.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "graphmoe/backend/common/checks.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {

inline constexpr index_t kDropoutChunk = 4096;

// Calls fn(begin, end) for chunks covering [0, n), split over the threads.
template <class Fn>
void dropout_for_chunks(index_t n, Fn&& fn) {
  const index_t chunks = (n + kDropoutChunk - 1) / kDropoutChunk;
  parallel_for(
      0, chunks, [&](index_t c) { fn(c * kDropoutChunk, std::min(n, (c + 1) * kDropoutChunk)); },
      4);
}

}  // namespace detail

// y = x * mask / (1 - p) with mask_i = !(uniform_float(philox_word(seed, offset + i)) < p).
// Fills mask (x's shape, 1 = kept).
template <class T>
void dropout_forward(T p, std::uint64_t seed, std::uint64_t offset, const Tensor<T, cpu>& x,
                     Tensor<T, cpu>& y, Tensor<std::uint8_t, cpu>& mask) {
  detail::dropout_prepare_forward("dropout_forward", p, x, y, mask);
  const index_t n = x.numel();
  const T* xs = x.data();
  T* ys = y.data();
  std::uint8_t* ms = mask.data();
  if (p == T(0)) {
    detail::dropout_for_chunks(n, [&](index_t begin, index_t end) {
      for (index_t i = begin; i < end; ++i) {
        ys[i] = xs[i];
        ms[i] = 1;
      }
    });
    return;
  }
  const T scale = T(1) / (T(1) - p);
  detail::dropout_for_chunks(n, [&](index_t begin, index_t end) {
    // Word w of the stream is word w % 4 of Philox block w / 4: draw each block once.
    std::uint64_t w = offset + static_cast<std::uint64_t>(begin);
    std::array<std::uint32_t, 4> block = philox4x32_10(w / 4, seed);
    for (index_t i = begin; i < end; ++i, ++w) {
      if (w % 4 == 0 && i != begin) block = philox4x32_10(w / 4, seed);
      const bool keep = !(static_cast<T>(uniform_float(block[w % 4])) < p);
      ms[i] = keep ? 1 : 0;
      ys[i] = keep ? xs[i] * scale : T(0);
    }
  });
}

// dx = dy * mask / (1 - p), with the mask of the forward call. dx is assigned.
template <class T>
void dropout_backward(T p, const Tensor<std::uint8_t, cpu>& mask, const Tensor<T, cpu>& dy,
                      Tensor<T, cpu>& dx) {
  detail::dropout_prepare_backward("dropout_backward", p, mask, dy, dx);
  const T scale = T(1) / (T(1) - p);
  const std::uint8_t* ms = mask.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  detail::dropout_for_chunks(dy.numel(), [&](index_t begin, index_t end) {
    for (index_t i = begin; i < end; ++i) dxs[i] = ms[i] ? dys[i] * scale : T(0);
  });
}

}  // namespace graphmoe
