// graphmoe/backend/cpu/topk.hpp: the CPU system's top-k (contract and argument checks:
// ops/topk.hpp, which calls these through the backend tag).
//
// The selection is an insertion into a sorted list of length k, O(E k) per row: for the router's
// case (E = 8 to 64 experts, k = 1 or 2) this is one pass over the row with a compare or two per
// entry, faster than any sort or heap.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

// values, indices (N, k) prepared by ops/topk.hpp; returns the first NaN of x (N, E), if any.
template <class T>
Offender topk_forward(cpu, const Tensor<T, cpu>& x, index_t k, Tensor<T, cpu>& values,
                      Tensor<std::int32_t, cpu>& indices) {
  const index_t n = x.dim(0), e = x.dim(1);
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
  if (r >= n) return {};
  index_t c = 0;
  while (!(xp[r * e + c] != xp[r * e + c])) ++c;
  return {r * e + c, static_cast<double>(xp[r * e + c])};
}

// dx (N, E) checked by ops/topk.hpp; returns the first index out of [0, E) (dx untouched then).
template <class T>
Offender topk_backward(cpu, const Tensor<std::int32_t, cpu>& indices, const Tensor<T, cpu>& dvalues,
                       Tensor<T, cpu>& dx) {
  const index_t n = indices.dim(0), k = indices.dim(1), e = dx.dim(1);
  const std::int32_t* ip = indices.data();
  for (index_t i = 0; i < n * k; ++i)
    if (ip[i] < 0 || ip[i] >= e) return {i, static_cast<double>(ip[i])};
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
  return {};
}

}  // namespace graphmoe
