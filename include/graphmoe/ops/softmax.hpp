// graphmoe/ops/softmax.hpp: softmax and log-softmax over the last dimension, and their backwards.
//
//   softmax:      y_j = exp(x_j - m) / sum_k exp(x_k - m),        m = max_k x_k
//                 dx_j = y_j * (dy_j - sum_k dy_k y_k)
//   log_softmax:  y_j = x_j - m - log(sum_k exp(x_k - m))
//                 dx_j = dy_j - exp(y_j) * sum_k dy_k
//
// Every tensor is read as a (rows, cols) matrix, all dimensions but the last flattened into rows.
// -inf entries (masked positions) are fine as long as the row has a finite entry: their
// probability is exactly 0.
//
// A row whose maximum is not finite (every entry -inf, or an entry +inf) has no defined softmax,
// and a row holding a NaN would be NaN throughout: the forward functions throw graphmoe::Error
// naming the first such row and the cause instead of writing NaN (as topk does for NaN).
// Such a row is left untouched in y; other rows of y may already be written when it throws.
//
// Outputs follow prepare_output (empty: allocated; otherwise the shape must match) and may alias
// their inputs: y may be x, dx may be dy.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// softmax_forward(B{}, ...) etc. run the backend's system (backend/cpu/softmax.hpp,
// backend/cuda/softmax.cuh, or a user backend's overload found by argument-dependent lookup). The
// forward functions of a backend return the first row without a finite maximum
// (core/bad_row.hpp), which is thrown here (or, inside with_deferred_checks on a backend that
// defers, when the backend has read its flag: core/deferred_check.hpp).
#pragma once

#include "graphmoe/backend/cpu/softmax.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/bad_row.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// Throws describing why row bad.row of x (named `what`, of shape `shape`) has no finite maximum.
[[noreturn]] inline void throw_softmax_bad_row(const char* op, const char* what,
                                               const Shape& shape, const BadRow& bad) {
  if (bad.nan > 0)
    throw_error(op, "row ", bad.row, " of ", what, " (shape ", shape, ") contains NaN (", bad.nan,
                " entries)");
  if (bad.pos_inf > 0)
    throw_error(op, "row ", bad.row, " of ", what, " (shape ", shape, ") contains +inf (",
                bad.pos_inf, " entries): the softmax of that row is undefined");
  throw_error(op, "row ", bad.row, " of ", what, " (shape ", shape,
              ") is entirely -inf (fully masked): the softmax of that row is undefined");
}

template <class T, class B>
void softmax_check_forward(const char* op, const Tensor<T, B>& x, Tensor<T, B>& y) {
  GRAPHMOE_CHECK(!x.empty(), op, "x is empty");
  prepare_output(op, "y", y, x.shape());
}

template <class T, class B>
void softmax_check_backward(const char* op, const Tensor<T, B>& y, const Tensor<T, B>& dy,
                            Tensor<T, B>& dx) {
  GRAPHMOE_CHECK(!y.empty() && !dy.empty(), op, "y or dy is empty");
  GRAPHMOE_CHECK(dy.shape() == y.shape(), op, "dy has shape ", dy.shape(), ", expected y's shape ",
                 y.shape());
  prepare_output(op, "dx", dx, y.shape());
}

}  // namespace detail

// y = softmax(x) over the last dimension. Throws for a row without a finite maximum.
template <class T, Backend B>
void softmax_forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
  constexpr const char* op = "softmax_forward";
  detail::softmax_check_forward(op, x, y);
  report_check(softmax_forward(B{}, x, y), [shape = x.shape()](const BadRow& bad) {
    detail::throw_softmax_bad_row(op, "x", shape, bad);
  });
}

// dx = y * (dy - sum(dy * y)) per row, from the forward output y. dx is assigned.
template <class T, Backend B>
void softmax_backward(const Tensor<T, B>& y, const Tensor<T, B>& dy, Tensor<T, B>& dx) {
  detail::softmax_check_backward("softmax_backward", y, dy, dx);
  softmax_backward(B{}, y, dy, dx);
}

// y = log_softmax(x) over the last dimension. Throws for a row without a finite maximum.
template <class T, Backend B>
void log_softmax_forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
  constexpr const char* op = "log_softmax_forward";
  detail::softmax_check_forward(op, x, y);
  report_check(log_softmax_forward(B{}, x, y), [shape = x.shape()](const BadRow& bad) {
    detail::throw_softmax_bad_row(op, "x", shape, bad);
  });
}

// dx = dy - exp(y) * sum(dy) per row, from the forward output y. dx is assigned.
template <class T, Backend B>
void log_softmax_backward(const Tensor<T, B>& y, const Tensor<T, B>& dy, Tensor<T, B>& dx) {
  detail::softmax_check_backward("log_softmax_backward", y, dy, dx);
  log_softmax_backward(B{}, y, dy, dx);
}

}  // namespace graphmoe
