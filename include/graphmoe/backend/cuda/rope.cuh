// graphmoe/backend/cuda/rope.cuh: rotary position embeddings, on the GPU.
//
// The CUDA system's rope (contract, formulas and argument checks: ops/rope.hpp, which calls these
// through the backend tag), on Tensor<T, cuda>: pair i of every head of row r, entries (a, b) in
// the RopeLayout's order (core/rope.hpp), is rotated by the angle positions[r] inv_freq_i
// (forward), or by minus that angle (backward: the inverse rotation).
//
// One thread per (row, pair), looping over the row's heads: the frequency (1 / theta^(2i / dh),
// detail::rope_inv_freq, the CPU op's function), the angle, its cosine and sine are computed in
// double, converted to acc_t<T>, and every head's pair is rotated in acc_t<T> (fp32 for bf16 and
// half, rounded once per stored entry). Each thread reads its pairs before it writes them: the
// output may alias the input.
//
// A negative position is flagged on the device (the first bad row, a deferrable flag:
// detail::FirstIndexFlag); outside a deferred scope the flag is read back at once (which
// synchronises the stream), inside one it is read with the scope's next read. The rows with a
// negative position are rotated by their (negative) angle meanwhile.
#pragma once

#include <cstdint>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/rope.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void rope_rotate_kernel(const T* x, const std::int32_t* positions, index_t n,
                                   index_t heads, index_t dh, double theta, RopeLayout layout,
                                   bool inverse, T* y, unsigned long long* bad) {
  using A = acc_t<T>;
  const index_t half = dh / 2, cols = heads * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(e, n * half) {
    const index_t i = e / half, p = e % half;
    const std::int32_t pos = positions[i];
    if (pos < 0 && p == 0) flag_index(bad, i);
    const double angle = static_cast<double>(pos) * rope_inv_freq(theta, p, dh);
    const double sn = ::sin(angle);
    const A c = value_cast<A>(::cos(angle));
    const A s = value_cast<A>(inverse ? -sn : sn);
    const index_t ja = rope_first(layout, p), jb = rope_second(layout, p, dh);
    const T* xr = x + i * cols;
    T* yr = y + i * cols;
    for (index_t h = 0; h < heads; ++h) {
      const A a = to_acc(xr[h * dh + ja]), b = to_acc(xr[h * dh + jb]);
      yr[h * dh + ja] = from_acc<T>(a * c - b * s);
      yr[h * dh + jb] = from_acc<T>(b * c + a * s);
    }
  }
}

// out = x rotated (inverse: backward); the first negative position (deferrable).
template <class T>
Offender rope_rotate(const char* op, const Tensor<T, cuda>& x,
                     const Tensor<std::int32_t, cuda>& positions, index_t num_heads, double theta,
                     RopeLayout layout, bool inverse, Tensor<T, cuda>& out) {
  static_assert(cuda_float_type<T>,
                "graphmoe::rope on cuda: T must be float, double, __nv_bfloat16 or __half");
  const index_t n = x.rows(), dh = x.cols() / num_heads;
  FirstIndexFlag bad{FirstIndexFlag::Deferrable{}};
  if (n > 0 && dh > 0) {
    launch_kernel<rope_rotate_kernel<T>>(grid_for(n * (dh / 2)), kThreads, x.data(),
                                         positions.data(), n, num_heads, dh, theta, layout,
                                         inverse, out.data(), bad.get());
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  return bad.result<Offender>(op, [positions](index_t i) { return offender_at(positions, i); });
}

}  // namespace detail

// y (x's shape) prepared by ops/rope.hpp; returns the first negative position.
template <class T>
Offender rope_forward(cuda, const Tensor<T, cuda>& x, const Tensor<std::int32_t, cuda>& positions,
                      index_t num_heads, double theta, RopeLayout layout, Tensor<T, cuda>& y) {
  return detail::rope_rotate("rope_forward", x, positions, num_heads, theta, layout, false, y);
}

// dx (dy's shape) prepared by ops/rope.hpp; returns the first negative position.
template <class T>
Offender rope_backward(cuda, const Tensor<T, cuda>& dy,
                       const Tensor<std::int32_t, cuda>& positions, index_t num_heads,
                       double theta, RopeLayout layout, Tensor<T, cuda>& dx) {
  return detail::rope_rotate("rope_backward", dy, positions, num_heads, theta, layout, true, dx);
}

}  // namespace graphmoe
