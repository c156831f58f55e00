// graphmoe/backend/cpu/detail/vexp.hpp: vectorised exp over arrays (internal).
//
// std::exp is one libm call per element; Eigen's packet exp evaluates 4 to 16 of them at once
// (SSE2 / AVX2 / AVX-512), within 2 ulp of std::exp for normal results. Where it differs in kind,
// the element is recomputed with std::exp, so callers keep std::exp's edge cases:
//   - below the smallest normal result (x < vexp_low: the -inf of masked entries, subnormals),
//     Eigen's SSE2/AVX2 exp clamps its argument and returns about 3e-39 (float) instead of 0
//     (where std::exp's result is 0, vexp_zero, that 0 is written without calling it);
//   - NaN, +inf and overflow go through std::exp too (x > vexp_high or x != x).
// Work is done in blocks of kVexpBlock elements in a stack buffer, so outputs may alias inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include <Eigen/Core>

#include "graphmoe/backend/cpu/detail/reduce.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe::detail {

inline constexpr index_t kVexpBlock = 256;

// The range where the packet exp's result is a normal number (std::exp is used outside it).
template <class T>
constexpr T vexp_low() {
  return sizeof(T) >= 8 ? T(-708) : T(-87);
}
template <class T>
constexpr T vexp_high() {
  return sizeof(T) >= 8 ? T(709) : T(88);
}
// Below this, exp rounds to +0 (float: x < -103.97, under half the smallest subnormal; double:
// x < -745.13), so the result is 0 without a libm call (std::exp would also set errno through
// its underflow path, a tenth of a long causal token graph's time when taken per element).
template <class T>
constexpr T vexp_zero() {
  return sizeof(T) >= 8 ? T(-746) : T(-104);
}

// Calls fn(j0, e, m) for consecutive blocks [j0, j0 + m) of [0, n), with e[0, m) holding
// exp(x[j0 + i] - shift) in an aligned stack buffer (fn may write x's block: e is a copy).
template <class T, class Fn>
void for_exp_blocks(const T* x, T shift, index_t n, Fn&& fn) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  alignas(64) T buf[kVexpBlock];
  for (index_t j0 = 0; j0 < n; j0 += kVexpBlock) {
    const index_t m = std::min(kVexpBlock, n - j0);
    Eigen::Map<Array, Eigen::Aligned64> e(buf, m);
    e = (Eigen::Map<const Array>(x + j0, m) - shift).exp();
    // outside the packet exp's normal range (rare: masked or far-below-max entries): std::exp
    for (index_t i = 0; i < m; ++i) {
      const T s = x[j0 + i] - shift;
      if (!(s >= vexp_low<T>() && s <= vexp_high<T>())) buf[i] = s < vexp_zero<T>() ? T(0) : std::exp(s);
    }
    fn(j0, static_cast<const T*>(buf), m);
  }
}

// y[j] = exp(x[j] - shift) for j < n (y may be x); returns sum_j y[j] in double.
template <class T>
double exp_shifted(const T* x, T shift, T* y, index_t n) {
  double total = 0;
  for_exp_blocks(x, shift, n, [&](index_t j0, const T* e, index_t m) {
    total += accumulate_double(m, [e](index_t i) { return e[i]; });
    std::copy(e, e + m, y + j0);
  });
  return total;
}

// e[j] = exp(z[j]) for j < n, z <= 0 (a softmax row shifted by its maximum; z and e must not
// overlap): Eigen's packet exp over the whole row, then the entries below its normal range (z <
// vexp_low, rare: checked with one vectorised compare) as std::exp gives them, 0 below vexp_zero.
// Eigen's exp alone returns about 1e-39 (float) there: a subnormal that takes the CPU's slow path
// in every product it reaches.
template <class T>
void exp_nonpositive(const T* z, T* e, index_t n) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  const Eigen::Map<const Array> zm(z, n);
  Eigen::Map<Array>(e, n) = zm.exp();
  if ((zm < vexp_low<T>()).any())
    for (index_t j = 0; j < n; ++j)
      if (z[j] < vexp_low<T>()) e[j] = z[j] < vexp_zero<T>() ? T(0) : std::exp(z[j]);
}

// sum_j exp(x[j] - shift) in double; nothing is stored.
template <class T>
double sum_exp_shifted(const T* x, T shift, index_t n) {
  double total = 0;
  for_exp_blocks(x, shift, n, [&](index_t, const T* e, index_t m) {
    total += accumulate_double(m, [e](index_t i) { return e[i]; });
  });
  return total;
}

}  // namespace graphmoe::detail
