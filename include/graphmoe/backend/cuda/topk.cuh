// graphmoe/backend/cuda/topk.cuh: the CUDA system's top-k (contract and argument checks:
// ops/topk.hpp, which calls these through the backend tag).
//
// One thread per row runs the CPU op's insertion into a sorted list of length k (O(E k)): for the
// router (E = 8 to 64 experts, k = 1 or 2, many tokens) rows are short and plentiful. Long rows
// (E in the thousands, k large) would want one warp or block per row; not needed yet.
//
// Both functions check their input on the device and read one flag back (they synchronise the
// stream). topk_backward finds an out-of-range index while the kernel runs, so dx may be partly
// written when the op throws (the CPU system checks first).
//
// T = __nv_bfloat16 or __half: entries are compared after exact widening to fp32 (the same order
// as comparing the 16-bit values), values are copied unchanged; topk_backward sums repeated
// indices in fp32, rounding after each addition as the CPU op does in T.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void topk_forward_kernel(const T* x, index_t n, index_t e, index_t k, T* values,
                                    std::int32_t* indices, unsigned long long* bad_row) {
  GRAPHMOE_CUDA_GRID_STRIDE(r, n) {
    const T* row = x + r * e;
    T* val = values + r * k;
    std::int32_t* idx = indices + r * k;
    index_t filled = 0;
    for (index_t c = 0; c < e; ++c) {
      const T raw = row[c];
      const acc_t<T> v = to_acc(raw);
      if (v != v) {  // NaN
        flag_index(bad_row, r);
        break;
      }
      // Strictly greater: an equal value seen later (higher index) never displaces or passes an
      // earlier one.
      if (filled == k && !(v > to_acc(val[k - 1]))) continue;
      index_t p = filled < k ? filled++ : k - 1;
      for (; p > 0 && v > to_acc(val[p - 1]); --p) {
        val[p] = val[p - 1];
        idx[p] = idx[p - 1];
      }
      val[p] = raw;
      idx[p] = static_cast<std::int32_t>(c);
    }
  }
}

template <class T>
__global__ void topk_backward_kernel(const std::int32_t* indices, const T* dvalues, index_t n,
                                     index_t k, index_t e, T* dx, unsigned long long* bad_entry) {
  GRAPHMOE_CUDA_GRID_STRIDE(r, n) {
    T* row = dx + r * e;
    for (index_t c = 0; c < e; ++c) row[c] = from_acc<T>(acc_t<T>(0));
    for (index_t j = 0; j < k; ++j) {  // in order, so repeated indices sum as on the CPU
      const std::int32_t c = indices[r * k + j];
      if (c < 0 || c >= e) {
        flag_index(bad_entry, r * k + j);
        continue;
      }
      row[c] = from_acc<T>(to_acc(row[c]) + to_acc(dvalues[r * k + j]));
    }
  }
}

}  // namespace detail

// values, indices (N, k) prepared by ops/topk.hpp; returns the first NaN of x (N, E), if any.
template <class T>
Offender topk_forward(cuda, const Tensor<T, cuda>& x, index_t k, Tensor<T, cuda>& values,
                      Tensor<std::int32_t, cuda>& indices) {
  const index_t n = x.dim(0), e = x.dim(1);
  if (n == 0) return {};
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::topk_forward_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                        x.data(), n, e, k, values.data(),
                                                        indices.data(), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<Offender>("topk_forward", [x, e](index_t r) {
    std::vector<T> row(static_cast<std::size_t>(e));
    GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(row.data(), x.data() + r * e, sizeof(T) * row.size(),
                                        cudaMemcpyDeviceToHost, cuda_stream()));
    cuda_stream_synchronize();
    index_t c = 0;
    while (!std::isnan(detail::to_acc(row[static_cast<std::size_t>(c)]))) ++c;
    return Offender{r * e + c, static_cast<double>(detail::to_acc(row[static_cast<std::size_t>(c)]))};
  });
}

// dx (N, E) checked by ops/topk.hpp; returns the first index out of [0, E).
template <class T>
Offender topk_backward(cuda, const Tensor<std::int32_t, cuda>& indices,
                       const Tensor<T, cuda>& dvalues, Tensor<T, cuda>& dx) {
  const index_t n = indices.dim(0), k = indices.dim(1), e = dx.dim(1);
  if (n == 0) return {};
  detail::FirstIndexFlag bad;
  detail::launch_kernel<detail::topk_backward_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                         indices.data(), dvalues.data(), n, k, e,
                                                         dx.data(), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  const index_t i = bad.read();
  if (i < 0) return {};
  return {i, static_cast<double>(detail::read_device_value(indices.data() + i))};
}

}  // namespace graphmoe
