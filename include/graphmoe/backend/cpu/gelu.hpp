// graphmoe/backend/cpu/gelu.hpp: the CPU system's GELU activation (contract, formulas and argument
// checks: ops/gelu.hpp, which calls these through the backend tag; GeluForm and the formulas'
// constants: core/gelu.hpp).
//
// Evaluated in forms without cancellation for large negative x: Phi(x) = 0.5 erfc(-x / sqrt(2))
// and 0.5 (1 + tanh u) = sigmoid(2u), 0.5 (1 - tanh^2 u) = 2 sigmoid(2u) (1 - sigmoid(2u)).
// Gradients stay finite for every finite x (the derivative's x^3 factor is never multiplied by an
// underflowed zero).
//
// The tanh form is vectorised (Eigen's packet exp, detail/vexp.hpp); the erf form is scalar.
// Elements are split over set_num_threads() threads in fixed chunks. Outputs may alias the inputs.
#pragma once

#include <algorithm>
#include <cmath>

#include <Eigen/Core>

#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/core/gelu.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {

inline constexpr index_t kGeluChunk = 4096;

template <class T>
T gelu_value(GeluForm form, T x) {
  if (form == GeluForm::Erf) return x * (T(0.5) * std::erfc(-x * T(kGeluInvSqrt2)));
  const T u = T(kGeluSqrt2OverPi) * (x + T(kGeluCubic) * x * x * x);
  return x / (T(1) + std::exp(T(-2) * u));
}

template <class T>
T gelu_derivative(GeluForm form, T x) {
  if (form == GeluForm::Erf) {
    const T cdf = T(0.5) * std::erfc(-x * T(kGeluInvSqrt2));
    const T pdf = T(kGeluInvSqrt2Pi) * std::exp(T(-0.5) * x * x);
    return pdf == T(0) ? cdf : cdf + x * pdf;
  }
  const T u = T(kGeluSqrt2OverPi) * (x + T(kGeluCubic) * x * x * x);
  const T s = T(1) / (T(1) + std::exp(T(-2) * u));  // 0.5 (1 + tanh u)
  const T sech2_quarter = s * (T(1) - s);              // 0.25 (1 - tanh^2 u)
  if (sech2_quarter == T(0)) return s;
  const T du = T(kGeluSqrt2OverPi) * (T(1) + T(3 * kGeluCubic) * x * x);
  return s + T(2) * x * sech2_quarter * du;
}

// Calls fn(begin, end) for the chunks [begin, end) of kGeluChunk elements of [0, n), over the
// threads.
template <class Fn>
void gelu_for_chunks(index_t n, Fn&& fn) {
  const index_t chunks = (n + kGeluChunk - 1) / kGeluChunk;
  parallel_for(
      0, chunks, [&](index_t c) { fn(c * kGeluChunk, std::min(n, (c + 1) * kGeluChunk)); }, 4);
}

// The tanh form over a block of at most kVexpBlock elements, vectorised: with t = -2u,
// e = exp(t) (Eigen's packet exp), y = x / (1 + e) and, when dy is given, dx = dy * (s + 2 x s (1 - s)
// du/dx) with s = 1 / (1 + e). Elements whose t is outside the packet exp's normal range (|x|
// beyond about 9 in float, NaN, inf) are recomputed with gelu_value / gelu_derivative, which
// handle overflow exactly; elsewhere the two agree to a few ulp. out may alias x or dy.
template <class T>
void gelu_tanh_block(const T* x, const T* dy, T* out, index_t m) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  alignas(64) T tb[kVexpBlock];
  alignas(64) T rb[kVexpBlock];
  const Eigen::Map<const Array> X(x, m);
  Eigen::Map<Array, Eigen::Aligned64> t(tb, m), r(rb, m);
  const T c = T(kGeluSqrt2OverPi), a = T(kGeluCubic);
  t = T(-2) * c * (X + a * X * X * X);
  if (dy == nullptr) {
    r = X / (T(1) + t.exp());
  } else {
    r = T(1) / (T(1) + t.exp());  // s = 0.5 (1 + tanh u)
    r = Eigen::Map<const Array>(dy, m) *
        (r + T(2) * X * (r * (T(1) - r)) * (c * (T(1) + T(3) * a * X * X)));
  }
  for (index_t i = 0; i < m; ++i)
    if (!(tb[i] >= vexp_low<T>() && tb[i] <= vexp_high<T>()))
      rb[i] = dy == nullptr ? gelu_value(GeluForm::Tanh, x[i])
                            : dy[i] * gelu_derivative(GeluForm::Tanh, x[i]);
  std::copy(rb, rb + m, out);
}

}  // namespace detail

// y = gelu(x), elementwise; y prepared by ops/gelu.hpp.
template <class T>
void gelu_forward(cpu, GeluForm form, const Tensor<T, cpu>& x, Tensor<T, cpu>& y) {
  const T* xs = x.data();
  T* ys = y.data();
  detail::gelu_for_chunks(x.numel(), [&](index_t begin, index_t end) {
    if (form == GeluForm::Erf) {
      for (index_t i = begin; i < end; ++i) ys[i] = detail::gelu_value(form, xs[i]);
      return;
    }
    for (index_t b = begin; b < end; b += detail::kVexpBlock)
      detail::gelu_tanh_block<T>(xs + b, nullptr, ys + b, std::min(detail::kVexpBlock, end - b));
  });
}

// dx = dy * gelu'(x), elementwise; dx prepared by ops/gelu.hpp.
template <class T>
void gelu_backward(cpu, GeluForm form, const Tensor<T, cpu>& x, const Tensor<T, cpu>& dy,
                   Tensor<T, cpu>& dx) {
  const T* xs = x.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  detail::gelu_for_chunks(x.numel(), [&](index_t begin, index_t end) {
    if (form == GeluForm::Erf) {
      for (index_t i = begin; i < end; ++i) dxs[i] = dys[i] * detail::gelu_derivative(form, xs[i]);
      return;
    }
    for (index_t b = begin; b < end; b += detail::kVexpBlock)
      detail::gelu_tanh_block(xs + b, dys + b, dxs + b, std::min(detail::kVexpBlock, end - b));
  });
}

}  // namespace graphmoe
