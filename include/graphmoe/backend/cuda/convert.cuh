// graphmoe/backend/cuda/convert.cuh: element-type conversion of tensors, for the 16-bit storage
// types of the CUDA backend.
//
//   convert(src, dst)   dst[i] = src[i] as D, for S and D each float, double, __nv_bfloat16 or
//                       __half; on Tensor<., cuda> (one thread per element, asynchronous, on
//                       cuda_stream()) or on Tensor<., cpu> (a host loop, for tests and for
//                       preparing inputs on the host)
//
// Widening (bf16 / half to float or double, float to double) is exact. Narrowing rounds to
// nearest, ties to even, once: double goes to bf16 / half directly (__double2bfloat16,
// __double2half), never through float, and bf16 <-> half goes through float, which holds both
// exactly. Signed zeros and infinities are kept, NaN stays NaN, a finite value that rounds beyond
// D's largest finite value becomes +-inf, subnormals of D are produced (rounded like any other
// value). Both backends use the same conversion (detail::value_cast: the CUDA intrinsics, which
// are host and device functions), so a tensor converted on the host equals the same tensor
// converted on the device, NaN payloads aside.
//
// Output convention: an empty dst is allocated with src's shape; a non-empty one must have it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class S, class D>
__global__ void convert_kernel(const S* src, D* dst, index_t n) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { dst[i] = value_cast<D>(src[i]); }
}

}  // namespace detail

// dst = src as D, on the device.
template <class S, class D>
  requires(detail::cuda_float_type<S> && detail::cuda_float_type<D>)
void convert(const Tensor<S, cuda>& src, Tensor<D, cuda>& dst) {
  GRAPHMOE_CHECK(!src.empty(), "convert", "src is empty");
  prepare_output("convert", "dst", dst, src.shape());
  const index_t n = src.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::convert_kernel<S, D>>(detail::grid_for(n), detail::kThreads,
                                                      src.data(), dst.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dst = src as D, on the host: the same values as the device conversion.
template <class S, class D>
  requires(detail::cuda_float_type<S> && detail::cuda_float_type<D>)
void convert(const Tensor<S, cpu>& src, Tensor<D, cpu>& dst) {
  GRAPHMOE_CHECK(!src.empty(), "convert", "src is empty");
  prepare_output("convert", "dst", dst, src.shape());
  const S* s = src.data();
  D* d = dst.data();
  for (index_t i = 0; i < src.numel(); ++i) d[i] = detail::value_cast<D>(s[i]);
}

// src as a new Tensor<D, B>.
template <class D, class S, class B>
  requires(detail::cuda_float_type<S> && detail::cuda_float_type<D>)
Tensor<D, B> converted(const Tensor<S, B>& src) {
  Tensor<D, B> dst;
  convert(src, dst);
  return dst;
}

}  // namespace graphmoe
