// graphmoe/backend/cpu/topk.hpp: the k largest entries of each row, and the backward scatter.
//
//   forward:   values[r, :] = the k largest entries of x[r, :] in descending order   x (N, E)
//              indices[r, j] = their column in x                                  both (N, k)
//   backward:  dx[r, indices[r, j]] = dvalues[r, j], zero elsewhere               (assigned)
//
// Ties: among equal values the LOWER column index wins and comes first, so the selection is a
// deterministic function of x (the same rule as a stable sort by descending value). -inf and +inf
// are ordinary values; a NaN in x throws, naming its row and column.
//
// The selection is an insertion into a sorted list of length k, O(E k) per row: for the router's
// case (E = 8 to 64 experts, k = 1 or 2) this is one pass over the row with a compare or two per
// entry, faster than any sort or heap.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

// values, indices = top-k of each row of x (N, E); 1 <= k <= E. Empty outputs are allocated.
template <class T>
void topk_forward(const Tensor<T, cpu>& x, index_t k, Tensor<T, cpu>& values,
                  Tensor<std::int32_t, cpu>& indices) {
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

  // Rows holding a NaN are recorded (smallest row wins) and reported after the loop, since the
  // loop body must not throw.
  std::atomic<index_t> bad_row{n};
  const T* xp = x.data();
  T* vp = values.data();
  std::int32_t* ip = indices.data();
  parallel_for(
      0, n,
      [&](index_t r) {
        const T* row = xp + r * e;
        T* val = vp + r * k;
        std::int32_t* idx = ip + r * k;
        index_t filled = 0;
        for (index_t c = 0; c < e; ++c) {
          const T v = row[c];
          if (v != v) {  // NaN
            index_t cur = bad_row.load(std::memory_order_relaxed);
            while (r < cur && !bad_row.compare_exchange_weak(cur, r, std::memory_order_relaxed)) {
            }
            return;
          }
          // Strictly greater: an equal value seen later (higher index) never displaces or passes
          // an earlier one.
          if (filled == k && !(v > val[k - 1])) continue;
          index_t p = filled < k ? filled++ : k - 1;
          for (; p > 0 && v > val[p - 1]; --p) {
            val[p] = val[p - 1];
            idx[p] = idx[p - 1];
          }
          val[p] = v;
          idx[p] = static_cast<std::int32_t>(c);
        }
      },
      std::max<index_t>(1, 4096 / e));
  const index_t r = bad_row.load();
  if (r < n) {
    index_t c = 0;
    while (!(xp[r * e + c] != xp[r * e + c])) ++c;
    GRAPHMOE_CHECK(false, op, "x ", x.shape(), " holds NaN at row ", r, ", column ", c);
  }
}

// dx = 0 except dx[r, indices[r, j]] = dvalues[r, j] (summed if an index repeats in a row).
// dx (N, E) must be allocated, since E cannot be inferred from the indices; it is overwritten.
template <class T>
void topk_backward(const Tensor<std::int32_t, cpu>& indices, const Tensor<T, cpu>& dvalues,
                   Tensor<T, cpu>& dx) {
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
  const std::int32_t* ip = indices.data();
  for (index_t i = 0; i < n * k; ++i) {
    GRAPHMOE_CHECK(ip[i] >= 0 && ip[i] < e, op, "index ", ip[i], " at row ", i / k, ", slot ",
                   i % k, " is out of range [0, E = ", e, ")");
  }
  const T* g = dvalues.data();
  T* d = dx.data();
  parallel_for(
      0, n,
      [&](index_t r) {
        T* row = d + r * e;
        std::fill(row, row + e, T(0));
        for (index_t j = 0; j < k; ++j) row[ip[r * k + j]] += g[r * k + j];
      },
      std::max<index_t>(1, 4096 / (e + 1)));
}

}  // namespace graphmoe
