// graphmoe/backend/cpu/dropout.hpp: the CPU system's inverted dropout (contract and argument
// checks: ops/dropout.hpp, which calls these through the backend tag).
//
// Element i is dropped iff uniform_float(philox_word(seed, offset + i)) < p (core/rng.hpp). The
// elements are split over the threads in fixed chunks of kDropoutChunk; each chunk draws each
// Philox block it touches once. p = 0 copies x and fills the mask with ones.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

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

// y = x * mask / (1 - p) with mask_i = !(uniform_float(philox_word(seed, offset + i)) < p);
// y and mask (x's shape, 1 = kept) prepared by ops/dropout.hpp.
template <class T>
void dropout_forward(cpu, T p, std::uint64_t seed, std::uint64_t offset, const Tensor<T, cpu>& x,
                     Tensor<T, cpu>& y, Tensor<std::uint8_t, cpu>& mask) {
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

// dx = dy * mask / (1 - p), assigned; dx prepared by ops/dropout.hpp.
template <class T>
void dropout_backward(cpu, T p, const Tensor<std::uint8_t, cpu>& mask, const Tensor<T, cpu>& dy,
                      Tensor<T, cpu>& dx) {
  const T scale = T(1) / (T(1) - p);
  const std::uint8_t* ms = mask.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  detail::dropout_for_chunks(dy.numel(), [&](index_t begin, index_t end) {
    for (index_t i = begin; i < end; ++i) dxs[i] = ms[i] ? dys[i] * scale : T(0);
  });
}

}  // namespace graphmoe
