// graphmoe/ops/gelu.hpp: the GELU activation, elementwise, in its two usual forms (core/gelu.hpp).
//
//   Erf  (exact):  y = x Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
//                  dy/dx = Phi(x) + x phi(x),   phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   Tanh (GPT-2):  y = 0.5 x (1 + tanh(u)),   u = sqrt(2 / pi) (x + 0.044715 x^3)
//                  dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx,
//                  du/dx = sqrt(2 / pi) (1 + 3 * 0.044715 x^2)
//   backward:      dx = dy * gelu'(x)                                      (assigned)
//
// Gradients stay finite for every finite x. Any shape. Outputs follow prepare_output (empty:
// allocated; otherwise the shape must match) and may alias the inputs (y may be x, dx may be dy).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// gelu_forward(B{}, ...) / gelu_backward(B{}, ...) runs the backend's system (backend/cpu/gelu.hpp,
// backend/cuda/gelu.cuh, or a user backend's overload found by argument-dependent lookup).
#pragma once

#include "graphmoe/backend/cpu/gelu.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/gelu.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

inline void gelu_check_form(const char* op, GeluForm form) {
  GRAPHMOE_CHECK(form == GeluForm::Tanh || form == GeluForm::Erf, op, "unknown GeluForm ",
                 static_cast<int>(form));
}

}  // namespace detail

// y = gelu(x), elementwise.
template <class T, Backend B>
void gelu_forward(GeluForm form, const Tensor<T, B>& x, Tensor<T, B>& y) {
  constexpr const char* op = "gelu_forward";
  detail::gelu_check_form(op, form);
  GRAPHMOE_CHECK(!x.empty(), op, "x is empty");
  prepare_output(op, "y", y, x.shape());
  gelu_forward(B{}, form, x, y);
}

// dx = dy * gelu'(x), elementwise, from the forward input x. dx is assigned.
template <class T, Backend B>
void gelu_backward(GeluForm form, const Tensor<T, B>& x, const Tensor<T, B>& dy, Tensor<T, B>& dx) {
  constexpr const char* op = "gelu_backward";
  detail::gelu_check_form(op, form);
  GRAPHMOE_CHECK(!x.empty() && !dy.empty(), op, "x or dy is empty");
  GRAPHMOE_CHECK(dy.shape() == x.shape(), op, "dy has shape ", dy.shape(), ", expected x's shape ",
                 x.shape());
  prepare_output(op, "dx", dx, x.shape());
  gelu_backward(B{}, form, x, dy, dx);
}

}  // namespace graphmoe
