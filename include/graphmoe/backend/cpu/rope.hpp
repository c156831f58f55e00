// graphmoe/backend/cpu/rope.hpp: the CPU system's rotary position embeddings (contract, formulas
// and argument checks: ops/rope.hpp, which calls these through the backend tag).
//
// The positions are scanned before anything is written. Rows are split over set_num_threads()
// threads; per row and pair, the angle, its cosine and sine are computed once in double and cast
// to T, and the rotation of every head runs in T. Each pair is read before it is written: the
// output may alias the input.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/rope.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {

// out = x rotated by +angle (inverse = false) or -angle (inverse = true); returns the first
// negative position (out untouched then).
template <class T>
Offender rope_rotate(const Tensor<T, cpu>& x, const Tensor<std::int32_t, cpu>& positions,
                     index_t num_heads, double theta, RopeLayout layout, bool inverse,
                     Tensor<T, cpu>& out) {
  const index_t n = x.rows(), cols = x.cols();
  const std::int32_t* pos = positions.data();
  for (index_t i = 0; i < n; ++i)
    if (pos[i] < 0) return {i, static_cast<double>(pos[i])};
  const index_t dh = cols / num_heads, half = dh / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (index_t p = 0; p < half; ++p)
    inv_freq[static_cast<std::size_t>(p)] = rope_inv_freq(theta, p, dh);
  const T* xs = x.data();
  T* ys = out.data();
  parallel_for(
      0, n,
      [&](index_t i) {
        const T* xr = xs + i * cols;
        T* yr = ys + i * cols;
        const double pi = static_cast<double>(pos[i]);
        for (index_t p = 0; p < half; ++p) {
          const double angle = pi * inv_freq[static_cast<std::size_t>(p)];
          const T c = static_cast<T>(std::cos(angle));
          const T s = inverse ? static_cast<T>(-std::sin(angle)) : static_cast<T>(std::sin(angle));
          const index_t ja = rope_first(layout, p), jb = rope_second(layout, p, dh);
          for (index_t h = 0; h < num_heads; ++h) {
            const T a = xr[h * dh + ja], b = xr[h * dh + jb];
            yr[h * dh + ja] = a * c - b * s;
            yr[h * dh + jb] = b * c + a * s;
          }
        }
      },
      std::max<index_t>(1, 8192 / cols));
  return {};
}

}  // namespace detail

// y (x's shape) prepared by ops/rope.hpp; returns the first negative position.
template <class T>
Offender rope_forward(cpu, const Tensor<T, cpu>& x, const Tensor<std::int32_t, cpu>& positions,
                      index_t num_heads, double theta, RopeLayout layout, Tensor<T, cpu>& y) {
  return detail::rope_rotate(x, positions, num_heads, theta, layout, false, y);
}

// dx (dy's shape) prepared by ops/rope.hpp; returns the first negative position.
template <class T>
Offender rope_backward(cpu, const Tensor<T, cpu>& dy, const Tensor<std::int32_t, cpu>& positions,
                       index_t num_heads, double theta, RopeLayout layout, Tensor<T, cpu>& dx) {
  return detail::rope_rotate(dy, positions, num_heads, theta, layout, true, dx);
}

}  // namespace graphmoe
