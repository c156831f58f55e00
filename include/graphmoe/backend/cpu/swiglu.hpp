// graphmoe/backend/cpu/swiglu.hpp: the CPU system's SwiGLU activation (contract, formulas and
// argument checks: ops/swiglu.hpp, which calls these through the backend tag).
//
// In T's precision, rows split over set_num_threads() threads. sigmoid takes exp of a
// non-positive argument only (no overflow).
#pragma once

#include <algorithm>
#include <cmath>

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {

template <class T>
T swiglu_sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

}  // namespace detail

// h (gu's shape with F last) prepared by ops/swiglu.hpp.
template <class T>
void swiglu_forward(cpu, const Tensor<T, cpu>& gu, Tensor<T, cpu>& h) {
  const index_t n = gu.rows(), f = gu.cols() / 2;
  const T* g = gu.data();
  T* hs = h.data();
  parallel_for(
      0, n,
      [&](index_t i) {
        const T* gr = g + i * 2 * f;
        T* hr = hs + i * f;
        for (index_t j = 0; j < f; ++j) {
          const T a = gr[j];
          hr[j] = a * detail::swiglu_sigmoid(a) * gr[f + j];
        }
      },
      std::max<index_t>(1, 8192 / std::max<index_t>(f, 1)));
}

// dgu (gu's shape) prepared by ops/swiglu.hpp; may alias gu.
template <class T>
void swiglu_backward(cpu, const Tensor<T, cpu>& gu, const Tensor<T, cpu>& dh,
                     Tensor<T, cpu>& dgu) {
  const index_t n = gu.rows(), f = gu.cols() / 2;
  const T* g = gu.data();
  const T* d = dh.data();
  T* out = dgu.data();
  parallel_for(
      0, n,
      [&](index_t i) {
        const T* gr = g + i * 2 * f;
        const T* dr = d + i * f;
        T* o = out + i * 2 * f;
        for (index_t j = 0; j < f; ++j) {
          const T a = gr[j], u = gr[f + j], dv = dr[j];
          const T s = detail::swiglu_sigmoid(a);
          o[j] = dv * u * (s * (T(1) + a * (T(1) - s)));
          o[f + j] = dv * (a * s);
        }
      },
      std::max<index_t>(1, 8192 / std::max<index_t>(f, 1)));
}

}  // namespace graphmoe
