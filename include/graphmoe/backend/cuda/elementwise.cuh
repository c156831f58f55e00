// graphmoe/backend/cuda/elementwise.cuh: the CUDA system's small element-wise and broadcast ops
// on Tensor<T, cuda> (contract and argument checks: ops/elementwise.hpp, which calls these through
// the backend tag).
//
//   add_row_vector(b, y)           y[i, :] += b            one thread per element
//   accumulate_column_sums(dy, db) db += sum_i dy[i, :]    one thread per column, rows in order
//                                                          (coalesced: neighbouring threads read
//                                                          neighbouring columns), the CPU's order
//   add(a, b, out)                 out = a + b             one thread per element
//   axpy(alpha, x, y)              y += alpha x            one thread per element
//   scale(t, alpha)                t *= alpha              one thread per element
//   fill(t, value)                 t[:] = value
//   fill_normal(t, rng, stddev)    drawn on the host from rng in flat order (the same values as
//                                  the CPU version for the same rng state), then copied: used
//                                  for initialisation only
//   check_finite(t)                a kernel finds the first NaN/Inf (one flag read back, which
//                                  synchronises) and returns it for ops/elementwise.hpp to throw
//   copy_from_host(dst, src)       a synchronous host-to-device copy into dst
//   read_scalar(t)                 one value read back (synchronises)
//   accumulate_dot                 one block, double partial sums in a fixed order
//   normalize_rows(_backward)      one block per row, block reductions in acc_t<T>
//   patchify(...)                  one thread per patch entry
//
// T = __nv_bfloat16 or __half (add_row_vector, accumulate_column_sums, add, axpy, scale, fill,
// check_finite): each element is widened to fp32 (detail::to_acc), computed in fp32 and rounded
// once when stored; accumulate_column_sums sums the whole column and db's old value in fp32 and
// rounds once at the end. alpha and value are given as T.
#pragma once

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void add_row_vector_kernel(const T* b, T* y, index_t n, index_t cols) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { y[i] = from_acc<T>(to_acc(y[i]) + to_acc(b[i % cols])); }
}

template <class T>
__global__ void column_sums_kernel(const T* dy, T* db, index_t rows, index_t cols) {
  GRAPHMOE_CUDA_GRID_STRIDE(c, cols) {
    acc_t<T> s = acc_t<T>(0);
    for (index_t r = 0; r < rows; ++r) s += to_acc(dy[r * cols + c]);
    db[c] = from_acc<T>(to_acc(db[c]) + s);
  }
}

template <class T>
__global__ void add_kernel(const T* a, const T* b, T* out, index_t n) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { out[i] = from_acc<T>(to_acc(a[i]) + to_acc(b[i])); }
}

template <class T>
__global__ void axpy_kernel(T alpha, const T* x, T* y, index_t n) {
  const acc_t<T> a = to_acc(alpha);
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { y[i] = from_acc<T>(to_acc(y[i]) + a * to_acc(x[i])); }
}

template <class T>
__global__ void first_non_finite_kernel(const T* t, index_t n, unsigned long long* first) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const acc_t<T> v = to_acc(t[i]);
    if (!(v - v == acc_t<T>(0))) flag_index(first, i);
  }
}

template <class T>
__global__ void scale_kernel(T* t, T alpha, index_t n) {
  const acc_t<T> a = to_acc(alpha);
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { t[i] = from_acc<T>(to_acc(t[i]) * a); }
}

template <class T>
__global__ void patchify_kernel(const T* images, T* patches, index_t n, index_t patch,
                                index_t width, index_t channels, index_t per_image, index_t pw,
                                index_t np, index_t pd) {
  GRAPHMOE_CUDA_GRID_STRIDE(o, n) {  // o = (i np + p) pd + (y patch + x) channels + c
    const index_t row = o / pd, within = o % pd;
    const index_t i = row / np, p = row % np, py = p / pw, px = p % pw;
    const index_t c = within % channels, yx = within / channels, y = yx / patch, x = yx % patch;
    patches[o] = images[i * per_image + ((py * patch + y) * width + (px * patch + x)) * channels + c];
  }
}

// One block: each thread sums a strided subset in double, then a block reduction (fixed order).
template <class T>
__global__ void accumulate_dot_kernel(const T* a, const T* b, index_t n, T alpha, T* d) {
  double s = 0;
  for (index_t i = threadIdx.x; i < n; i += blockDim.x)
    s += static_cast<double>(to_acc(a[i])) * static_cast<double>(to_acc(b[i]));
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) d[0] = from_acc<T>(to_acc(d[0]) + to_acc(alpha) * static_cast<acc_t<T>>(s));
}

// One block per row.
template <class T>
__global__ void normalize_rows_kernel(T* x, T* norms, index_t rows, index_t cols, T eps) {
  using A = acc_t<T>;
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* xr = x + r * cols;
    A s = A(0);
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x) s += to_acc(xr[j]) * to_acc(xr[j]);
    s = block_reduce(s, SumOp{}, A(0));
    const A nrm = max(sqrt(s), to_acc(eps));
    if (threadIdx.x == 0) norms[r] = from_acc<T>(nrm);
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x) xr[j] = from_acc<T>(to_acc(xr[j]) / nrm);
  }
}

template <class T>
__global__ void normalize_rows_backward_kernel(const T* y, const T* norms, T* g, index_t rows,
                                               index_t cols, T eps) {
  using A = acc_t<T>;
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * cols;
    T* gr = g + r * cols;
    A s = A(0);
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x) s += to_acc(yr[j]) * to_acc(gr[j]);
    s = block_reduce(s, SumOp{}, A(0));
    const A nrm = to_acc(norms[r]);
    const bool clamped = !(nrm > to_acc(eps));
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const A v = clamped ? to_acc(gr[j]) : to_acc(gr[j]) - to_acc(yr[j]) * s;
      gr[j] = from_acc<T>(v / nrm);
    }
  }
}

template <class T>
__global__ void scale_rows_kernel(const T* x, const T* s, T* y, index_t n, index_t c) {
  GRAPHMOE_CUDA_GRID_STRIDE(o, n * c) { y[o] = from_acc<T>(to_acc(x[o]) * to_acc(s[o / c])); }
}

// One thread per row, the sum in column order (the CPU's).
template <class T>
__global__ void row_dots_kernel(const T* a, const T* b, T* d, index_t n, index_t c) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    acc_t<T> sum = acc_t<T>(0);
    for (index_t j = 0; j < c; ++j) sum += to_acc(a[i * c + j]) * to_acc(b[i * c + j]);
    d[i] = from_acc<T>(sum);
  }
}

template <class T>
__global__ void sigmoid_forward_kernel(const T* x, T* y, index_t n) {
  using A = acc_t<T>;
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const A v = to_acc(x[i]);
    A r;
    if (v >= A(0)) {
      r = A(1) / (A(1) + exp(-v));
    } else {
      const A e = exp(v);
      r = e / (A(1) + e);
    }
    y[i] = from_acc<T>(r);
  }
}

template <class T>
__global__ void sigmoid_backward_kernel(const T* y, const T* dy, T* dx, index_t n) {
  using A = acc_t<T>;
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const A v = to_acc(y[i]);
    dx[i] = from_acc<T>(to_acc(dy[i]) * v * (A(1) - v));
  }
}

template <class T>
__global__ void fill_kernel(T* t, T value, index_t n) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { t[i] = value; }
}

}  // namespace detail

template <class T>
void add_row_vector(cuda, const Tensor<T, cuda>& b, const Tensor<T, cuda>& y) {
  const index_t n = y.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::add_row_vector_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                          b.data(), y.data(), n, y.cols());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void accumulate_column_sums(cuda, const Tensor<T, cuda>& dy, const Tensor<T, cuda>& db) {
  const index_t cols = dy.cols();
  if (cols == 0) return;
  detail::launch_kernel<detail::column_sums_kernel<T>>(detail::grid_for(cols), detail::kThreads,
                                                       dy.data(), db.data(), dy.rows(), cols);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void add(cuda, const Tensor<T, cuda>& a, const Tensor<T, cuda>& b, const Tensor<T, cuda>& out) {
  const index_t n = out.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::add_kernel<T>>(detail::grid_for(n), detail::kThreads, a.data(),
                                               b.data(), out.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void axpy(cuda, T alpha, const Tensor<T, cuda>& x, const Tensor<T, cuda>& y) {
  const index_t n = y.numel();
  detail::launch_kernel<detail::axpy_kernel<T>>(detail::grid_for(n), detail::kThreads, alpha,
                                                x.data(), y.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void scale(cuda, const Tensor<T, cuda>& t, T alpha) {
  const index_t n = t.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::scale_kernel<T>>(detail::grid_for(n), detail::kThreads, t.data(),
                                                 alpha, n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void fill(cuda, const Tensor<T, cuda>& t, T value) {
  const index_t n = t.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::fill_kernel<T>>(detail::grid_for(n), detail::kThreads, t.data(),
                                                value, n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// The first NaN or Inf entry of t, if any.
template <class T>
Offender check_finite(cuda, const Tensor<T, cuda>& t) {
  static_assert(detail::cuda_float_type<T>,
                "check_finite on cuda: T must be float, double, __nv_bfloat16 or __half");
  const index_t n = t.numel();
  if (n == 0) return {};
  detail::FirstIndexFlag first{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::first_non_finite_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                            t.data(), n, first.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return first.result<Offender>("check_finite", [t](index_t i) {
    return Offender{i, static_cast<double>(detail::to_acc(detail::read_device_value(t.data() + i)))};
  });
}

// Drawn on the host in flat order (the CPU system's loop), then copied.
template <class T>
void fill_normal(cuda, const Tensor<T, cuda>& t, Rng& rng, double stddev) {
  Tensor<T, cpu> h(t.shape());
  for (index_t i = 0; i < h.numel(); ++i) h.data()[i] = static_cast<T>(rng.normal(0.0, stddev));
  Tensor<T, cuda> d = t;
  to_device(h, d);
}

template <class T>
void copy_from_host(cuda, const Tensor<T, cuda>& dst, const Tensor<T, cpu>& src) {
  Tensor<T, cuda> d = dst;
  to_device(src, d);
}

template <class T>
T read_scalar(cuda, const Tensor<T, cuda>& t) {
  return detail::read_device_value(t.data());
}

template <class T>
void accumulate_dot(cuda, const Tensor<T, cuda>& a, const Tensor<T, cuda>& b, T alpha,
                    const Tensor<T, cuda>& d) {
  detail::launch_kernel<detail::accumulate_dot_kernel<T>>(1, detail::kThreads, a.data(), b.data(),
                                                          a.numel(), alpha, d.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void normalize_rows(cuda, const Tensor<T, cuda>& x, Tensor<T, cuda>& norms, T eps) {
  if (x.rows() == 0) return;
  detail::launch_kernel<detail::normalize_rows_kernel<T>>(
      detail::grid_for_rows(x.rows()), detail::threads_for_row(x.cols()), x.data(), norms.data(),
      x.rows(), x.cols(), eps);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void normalize_rows_backward(cuda, const Tensor<T, cuda>& y, const Tensor<T, cuda>& norms, T eps,
                             const Tensor<T, cuda>& dy) {
  if (y.rows() == 0) return;
  detail::launch_kernel<detail::normalize_rows_backward_kernel<T>>(
      detail::grid_for_rows(y.rows()), detail::threads_for_row(y.cols()), y.data(), norms.data(),
      dy.data(), y.rows(), y.cols(), eps);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void scale_rows(cuda, const Tensor<T, cuda>& x, const Tensor<T, cuda>& s, const Tensor<T, cuda>& y) {
  const index_t n = x.rows(), c = x.cols();
  if (n * c == 0) return;
  detail::launch_kernel<detail::scale_rows_kernel<T>>(detail::grid_for(n * c), detail::kThreads,
                                                      x.data(), s.data(), y.data(), n, c);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void row_dots(cuda, const Tensor<T, cuda>& a, const Tensor<T, cuda>& b, const Tensor<T, cuda>& d) {
  const index_t n = a.rows(), c = a.cols();
  if (n == 0) return;
  detail::launch_kernel<detail::row_dots_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                    a.data(), b.data(), d.data(), n, c);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void sigmoid_forward(cuda, const Tensor<T, cuda>& x, const Tensor<T, cuda>& y) {
  const index_t n = x.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::sigmoid_forward_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                           x.data(), y.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void sigmoid_backward(cuda, const Tensor<T, cuda>& y, const Tensor<T, cuda>& dy,
                      const Tensor<T, cuda>& dx) {
  const index_t n = y.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::sigmoid_backward_kernel<T>>(
      detail::grid_for(n), detail::kThreads, y.data(), dy.data(), dx.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// One thread per patch entry (the CPU op's order, as a gather).
template <class T>
void patchify(cuda, const Tensor<T, cuda>& images, index_t patch, index_t height, index_t width,
              index_t channels, Tensor<T, cuda>& patches) {
  const index_t per_image = height * width * channels;
  const index_t pw = width / patch, np = (height / patch) * pw, pd = patch * patch * channels;
  const index_t n = patches.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::patchify_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                    images.data(), patches.data(), n, patch, width,
                                                    channels, per_image, pw, np, pd);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
