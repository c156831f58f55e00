// graphmoe/backend/cpu/detail/reduce.hpp: row sums in double and row maxima (internal).
//
// Row sums of the CPU ops (softmax normaliser, layernorm mean and variance, dot products in the
// backward passes) are accumulated in double, so float rows of any length lose no accuracy. A
// single running sum is one long chain of dependent additions, which the compiler may not reorder
// or vectorise; eight independent partial sums combined pairwise at the end run several times
// faster. The order is fixed, so results are deterministic.
#pragma once

#include <limits>

#include "graphmoe/core/shape.hpp"

namespace graphmoe::detail {

// sum_{j < n} f(j) in double, f(j) convertible to double.
template <class F>
double accumulate_double(index_t n, F&& f) {
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  index_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) a[k] += static_cast<double>(f(j + k));
  double s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; j < n; ++j) s += static_cast<double>(f(j));
  return s;
}

// max_{j < n} x[j] (-inf for n = 0), or NaN if any x[j] is NaN. Eight independent lanes of
// branch-free compares, so that the loop vectorises (a single running maximum is a chain of
// mispredicted branches on unsorted data).
template <class T>
T max_or_nan(const T* x, index_t n) {
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  T m[8] = {lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  int nan[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  index_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) {
      const T v = x[j + k];
      m[k] = m[k] < v ? v : m[k];
      nan[k] |= v != v;
    }
  for (; j < n; ++j) {
    m[0] = m[0] < x[j] ? x[j] : m[0];
    nan[0] |= x[j] != x[j];
  }
  T r = m[0];
  int any_nan = nan[0];
  for (int k = 1; k < 8; ++k) {
    r = r < m[k] ? m[k] : r;
    any_nan |= nan[k];
  }
  return any_nan ? std::numeric_limits<T>::quiet_NaN() : r;
}

}  // namespace graphmoe::detail
