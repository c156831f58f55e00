// graphmoe/ops/heads.hpp: grouped-query attention's sharing of key and value heads, and heads
// joined and split by columns.
//
//   repeat_heads(x, kv_heads, heads, y)
//       x (N, kv_heads dh) -> y (N, heads dh), heads a multiple of kv_heads (g = heads / kv_heads):
//       y[:, h dh + j] = x[:, (h / g) dh + j]   (query head h reads key/value head h / g, Hugging
//       Face's repeat_kv; kv_heads = 1 is multi-query attention)
//   repeat_heads_backward(dy, kv_heads, heads, dx)
//       dx[:, c dh + j] = sum over the g heads h of group c of dy[:, h dh + j]   (assigned; the sum
//       in head order)
//
//   concat_heads(a, b, heads, y)
//       a (N, heads wa), b (N, heads wb) -> y (N, heads (wa + wb)): head h of y is head h of a
//       followed by head h of b (multi-head latent attention's [qnope_h | qpe_h])
//   split_heads(x, heads, wa, a, b)
//       the inverse: x (N, heads (wa + wb)) -> a (N, heads wa), b (N, heads wb); each is the
//       other's backward (both outputs assigned)
//
// Outputs follow prepare_output (empty: allocated; otherwise the shape must match).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// X(B{}, ...) runs the backend's system (backend/cpu/heads.hpp, backend/cuda/heads.cuh, or a user
// backend's overload found by argument-dependent lookup).
#pragma once

#include "graphmoe/backend/cpu/heads.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {
inline void check_head_groups(const char* op, index_t kv_heads, index_t heads) {
  GRAPHMOE_CHECK(kv_heads >= 1 && heads >= 1 && heads % kv_heads == 0, op, "num_kv_heads = ",
                 kv_heads, " must be >= 1 and divide num_heads = ", heads);
}
}  // namespace detail

template <class T, Backend B>
void repeat_heads(const Tensor<T, B>& x, index_t kv_heads, index_t heads, Tensor<T, B>& y) {
  constexpr const char* op = "repeat_heads";
  detail::check_head_groups(op, kv_heads, heads);
  GRAPHMOE_CHECK(!x.empty() && x.rank() == 2 && x.cols() % kv_heads == 0, op,
                 "x must be an (N, kv_heads * dh) matrix with kv_heads = ", kv_heads, ", got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  const index_t dh = x.cols() / kv_heads;
  prepare_output(op, "y", y, Shape{x.rows(), heads * dh});
  repeat_heads(B{}, x, kv_heads, heads, y);
}

template <class T, Backend B>
void repeat_heads_backward(const Tensor<T, B>& dy, index_t kv_heads, index_t heads,
                           Tensor<T, B>& dx) {
  constexpr const char* op = "repeat_heads_backward";
  detail::check_head_groups(op, kv_heads, heads);
  GRAPHMOE_CHECK(!dy.empty() && dy.rank() == 2 && dy.cols() % heads == 0, op,
                 "dy must be an (N, heads * dh) matrix with heads = ", heads, ", got ",
                 (dy.empty() ? "an empty tensor" : dy.shape().str()));
  const index_t dh = dy.cols() / heads;
  prepare_output(op, "dx", dx, Shape{dy.rows(), kv_heads * dh});
  repeat_heads_backward(B{}, dy, kv_heads, heads, dx);
}

template <class T, Backend B>
void concat_heads(const Tensor<T, B>& a, const Tensor<T, B>& b, index_t heads, Tensor<T, B>& y) {
  constexpr const char* op = "concat_heads";
  GRAPHMOE_CHECK(heads >= 1, op, "heads must be >= 1, got ", heads);
  for (const Tensor<T, B>* t : {&a, &b})
    GRAPHMOE_CHECK(!t->empty() && t->rank() == 2 && t->cols() % heads == 0, op, (t == &a ? "a" : "b"),
                   " must be an (N, heads * w) matrix with heads = ", heads, ", got ",
                   (t->empty() ? "an empty tensor" : t->shape().str()));
  GRAPHMOE_CHECK(a.rows() == b.rows(), op, "a has ", a.rows(), " rows and b ", b.rows());
  prepare_output(op, "y", y, Shape{a.rows(), a.cols() + b.cols()});
  concat_heads(B{}, a, b, heads, y);
}

template <class T, Backend B>
void split_heads(const Tensor<T, B>& x, index_t heads, index_t width_a, Tensor<T, B>& a,
                 Tensor<T, B>& b) {
  constexpr const char* op = "split_heads";
  GRAPHMOE_CHECK(heads >= 1, op, "heads must be >= 1, got ", heads);
  GRAPHMOE_CHECK(!x.empty() && x.rank() == 2 && x.cols() % heads == 0, op,
                 "x must be an (N, heads * w) matrix with heads = ", heads, ", got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  const index_t w = x.cols() / heads;
  GRAPHMOE_CHECK(width_a >= 1 && width_a < w, op, "width_a = ", width_a,
                 " must be in [1, ", w - 1, "] (a head of x is ", w, " wide)");
  prepare_output(op, "a", a, Shape{x.rows(), heads * width_a});
  prepare_output(op, "b", b, Shape{x.rows(), heads * (w - width_a)});
  split_heads(B{}, x, heads, width_a, a, b);
}

}  // namespace graphmoe
