// graphmoe/routing/graphs/common_cuda.cuh: what the CUDA token graphs (similarity_cuda.cuh,
// attention_cuda.cuh) share: the host-side mean of a device vector, for mean_entropy().
#pragma once

#if !defined(EIGEN_NO_CUDA)
#define EIGEN_NO_CUDA
#endif

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"

namespace graphmoe {

namespace detail {
// The mean of the n values of a device vector, in double (synchronises).
template <class T>
double device_mean(const Tensor<T, cuda>& x) {
  if (x.empty() || x.numel() == 0) return 0.0;
  const Tensor<T, cpu> h = to_host(x);
  double s = 0;
  for (index_t i = 0; i < h.numel(); ++i) s += static_cast<double>(h.data()[i]);
  return s / static_cast<double>(h.numel());
}
}  // namespace detail

}  // namespace graphmoe
