// graphmoe/ops/swiglu.hpp: the SwiGLU activation on a fused gate|up tensor (the MLP of Llama,
// Mixtral, Qwen, OLMoE, DeepSeek: down(silu(gate(x)) * up(x)) with gate and up as one GEMM).
//
//   gu (N, 2F) read as rows [gate | up]:   gate = gu[:, :F],  up = gu[:, F:]
//   forward:   h = silu(gate) * up                            h (N, F)
//   backward:  dgate = dh * up * silu'(gate),  dup = dh * silu(gate)    dgu = [dgate | dup] (assigned)
//   silu(x) = x sigmoid(x),   silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
//
// sigmoid is evaluated without overflow (exp of a non-positive argument only): values and
// gradients stay finite for every finite input. gu may have any rank >= 1 with an even last
// dimension 2F (all dimensions but the last are the rows; h has gu's shape with F last): a
// grouped expert buffer (rows of all experts, one after another) is simply one such tensor.
// Outputs follow prepare_output; dgu may alias gu (each entry pair is read before it is written).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// swiglu_forward(B{}, ...) / swiglu_backward(B{}, ...) runs the backend's system
// (backend/cpu/swiglu.hpp, backend/cuda/swiglu.cuh, or a user backend's overload found by
// argument-dependent lookup).
#pragma once

#include <vector>

#include "graphmoe/backend/cpu/swiglu.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// The shape of swiglu's h: gu's shape with its last dimension halved (checked to be even).
template <class T, class B>
Shape swiglu_h_shape(const char* op, const Tensor<T, B>& gu) {
  GRAPHMOE_CHECK(!gu.empty() && gu.rank() >= 1, op,
                 "gu must be a non-empty tensor of rank >= 1, got ",
                 (gu.empty() ? "an empty tensor" : gu.shape().str()));
  GRAPHMOE_CHECK(gu.cols() % 2 == 0, op, "gu has shape ", gu.shape(),
                 ": its last dimension must be even (gate | up, 2F)");
  std::vector<index_t> dims(gu.shape().begin(), gu.shape().end());
  dims.back() /= 2;
  return Shape::from_range(dims.begin(), dims.end());
}

}  // namespace detail

// h = silu(gu[:, :F]) * gu[:, F:], row by row.
template <class T, Backend B>
void swiglu_forward(const Tensor<T, B>& gu, Tensor<T, B>& h) {
  constexpr const char* op = "swiglu_forward";
  const Shape hs = detail::swiglu_h_shape(op, gu);
  prepare_output(op, "h", h, hs);
  swiglu_forward(B{}, gu, h);
}

// dgu = [dh * up * silu'(gate) | dh * silu(gate)], from the forward's input gu. dgu is assigned.
template <class T, Backend B>
void swiglu_backward(const Tensor<T, B>& gu, const Tensor<T, B>& dh, Tensor<T, B>& dgu) {
  constexpr const char* op = "swiglu_backward";
  const Shape hs = detail::swiglu_h_shape(op, gu);
  check_shape(op, "dh", dh, hs);
  prepare_output(op, "dgu", dgu, gu.shape());
  swiglu_backward(B{}, gu, dh, dgu);
}

}  // namespace graphmoe
