// graphmoe/ops/topk.hpp: the k largest entries of each row, and the backward scatter.
//
//   forward:   values[r, :] = the k largest entries of x[r, :] in descending order   x (N, E)
//              indices[r, j] = their column in x                                  both (N, k)
//   backward:  dx[r, indices[r, j]] = dvalues[r, j], zero elsewhere               (assigned)
//
// Ties: among equal values the LOWER column index wins and comes first, so the selection is a
// deterministic function of x (the same rule as a stable sort by descending value). -inf and +inf
// are ordinary values; a NaN in x throws, naming its row and column. Every backend gives the same
// selection bit for bit (it only compares and copies).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// topk_forward(B{}, ...) / topk_backward(B{}, ...) runs the backend's system (backend/cpu/topk.hpp,
// backend/cuda/topk.cuh, or a user backend's overload found by argument-dependent lookup), which
// returns the first offending entry of the data it scanned (core/offender.hpp).
#pragma once

#include <cstdint>
#include <limits>

#include "graphmoe/backend/cpu/topk.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// values, indices = top-k of each row of x (N, E); 1 <= k <= E. Empty outputs are allocated.
template <class T, Backend B>
void topk_forward(const Tensor<T, B>& x, index_t k, Tensor<T, B>& values,
                  Tensor<std::int32_t, B>& indices) {
  constexpr const char* op = "topk_forward";
  GRAPHMOE_CHECK(!x.empty() && x.rank() == 2, op, "x must be an (N, E) matrix, got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  const index_t n = x.dim(0), e = x.dim(1);
  GRAPHMOE_CHECK(e <= std::numeric_limits<std::int32_t>::max(), op, "E = ", e,
                 " does not fit the int32 indices");
  GRAPHMOE_CHECK(k >= 1 && k <= e, op, "k = ", k, " is out of range [1, E = ", e, "] for x ",
                 x.shape());
  prepare_output(op, "values", values, Shape{n, k});
  prepare_output(op, "indices", indices, Shape{n, k});
  report_check(topk_forward(B{}, x, k, values, indices),
               [shape = x.shape(), e](const Offender& nan) {
                 detail::throw_error(op, "x ", shape, " holds NaN at row ", nan.index / e,
                                     ", column ", nan.index % e);
               });
}

// dx = 0 except dx[r, indices[r, j]] = dvalues[r, j] (summed if an index repeats in a row).
// dx (N, E) must be allocated, since E cannot be inferred from the indices; it is overwritten.
template <class T, Backend B>
void topk_backward(const Tensor<std::int32_t, B>& indices, const Tensor<T, B>& dvalues,
                   Tensor<T, B>& dx) {
  constexpr const char* op = "topk_backward";
  GRAPHMOE_CHECK(!indices.empty() && indices.rank() == 2, op,
                 "indices must be an (N, k) matrix, got ",
                 (indices.empty() ? "an empty tensor" : indices.shape().str()));
  check_shape(op, "dvalues", dvalues, indices.shape());
  GRAPHMOE_CHECK(!dx.empty() && dx.rank() == 2, op,
                 "dx must be an allocated (N, E) matrix, got ",
                 (dx.empty() ? "an empty tensor" : dx.shape().str()));
  const index_t n = indices.dim(0), k = indices.dim(1), e = dx.dim(1);
  GRAPHMOE_CHECK(dx.dim(0) == n, op, "dx has shape ", dx.shape(), " but indices ",
                 indices.shape(), " have ", n, " rows");
  const Offender bad = topk_backward(B{}, indices, dvalues, dx);
  GRAPHMOE_CHECK(!bad.found(), op, "index ", static_cast<std::int64_t>(bad.value), " at row ",
                 bad.index / k, ", slot ", bad.index % k, " is out of range [0, E = ", e, ")");
}

}  // namespace graphmoe
