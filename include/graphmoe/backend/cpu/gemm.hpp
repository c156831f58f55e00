// graphmoe/backend/cpu/gemm.hpp: the CPU system's general matrix multiply, on Eigen (contract and
// argument checks: ops/gemm.hpp, which calls gemm(cpu{}, ...) through the backend tag; gemm's
// backward is two gemm calls there).
//
//   C = alpha * op(A) * op(B) + beta * C,   op(X) = X or X^T
//
// A, B and C are read as matrices (all dimensions but the last flattened into rows). With
// GRAPHMOE_USE_BLAS, Eigen hands the product to OpenBLAS's sgemm/dgemm. Large products are split
// into row (or column) panels over set_num_threads() threads (detail::gemm_matrix).
//
// detail::MatrixView, view_of and gemm_view are also the CPU token graph's product
// (routing/graphs/similarity.hpp).
#pragma once

#include <type_traits>

#include "graphmoe/backend/cpu/detail/extern_instances.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/core/trans.hpp"

namespace graphmoe {

namespace detail {
// A row-major matrix view with a run-time row stride: a whole MatrixMap, or any block of one
// (rows and columns). gemm and the Similarity graph (routing/graphs/similarity.hpp) do every
// product through gemm_view on this one type, so a translation unit instantiates Eigen's product
// code (GEMM, GEMV, coefficient-wise) four times per scalar type, one per transpose pair, however
// many call sites and operand expressions it has: those instantiations were most of the compile
// time of an MoE layer (docs/benchmarks.md, "Compile time"). A view passes the same pointers and
// strides to BLAS (or Eigen's kernels) as the block expressions it replaced: same results, bit
// for bit.
template <class T>
using MatrixView = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

// The view of a row-major Eigen matrix, map or block of one (m.data(), its shape and row stride).
template <class M>
auto view_of(M&& m) {
  using T = typename std::remove_cvref_t<M>::Scalar;
  static_assert(std::remove_cvref_t<M>::IsRowMajor, "view_of: row-major matrices only");
  return MatrixView<T>(const_cast<T*>(m.data()), m.rows(), m.cols(),
                       Eigen::OuterStride<>(m.outerStride()));
}

// C = alpha op(A) op(B) + beta C on views, single-threaded. beta == 0 means C's old contents
// (even NaN) are ignored, as in BLAS; C must already have its shape.
template <class T>
void gemm_view(Trans ta, Trans tb, T alpha, const MatrixView<T>& A, const MatrixView<T>& B,
               T beta, MatrixView<T> C) {
  if (beta == T(0)) {
    C.setZero();
  } else if (beta != T(1)) {
    C *= beta;
  }
  if (ta == Trans::N && tb == Trans::N) C.noalias() += alpha * A * B;
  if (ta == Trans::N && tb == Trans::T) C.noalias() += alpha * A * B.transpose();
  if (ta == Trans::T && tb == Trans::N) C.noalias() += alpha * A.transpose() * B;
  if (ta == Trans::T && tb == Trans::T) C.noalias() += alpha * A.transpose() * B.transpose();
}

// C (rows [r0, r0 + m) and columns [c0, c0 + n) of it) = alpha op(A) op(B) + beta C, single-threaded.
template <class T>
void gemm_part(Trans ta, Trans tb, T alpha, const MatrixMap<T>& A, const MatrixMap<T>& B, T beta,
               MatrixMap<T>& Cfull, index_t r0, index_t m, index_t c0, index_t n) {
  const index_t k = ta == Trans::N ? A.cols() : A.rows();
  // the rows [r0, r0 + m) of op(A) and the columns [c0, c0 + n) of op(B), untransposed
  const auto a = ta == Trans::N ? view_of(A.block(r0, 0, m, k)) : view_of(A.block(0, r0, k, m));
  const auto b = tb == Trans::N ? view_of(B.block(0, c0, k, n)) : view_of(B.block(c0, 0, n, k));
  gemm_view(ta, tb, alpha, a, b, beta, view_of(Cfull.block(r0, c0, m, n)));
}

// Splits C into num_threads() row (or column) panels, one single-threaded product each, when the
// product is large enough to pay for it (and we are not already inside a parallel region).
template <class T>
void gemm_matrix(Trans ta, Trans tb, T alpha, const MatrixMap<T>& A, const MatrixMap<T>& B,
                 T beta, MatrixMap<T>& C) {
  const index_t m = C.rows(), n = C.cols(), k = ta == Trans::N ? A.cols() : A.rows();
  const int threads = num_threads();
  constexpr double kMinFlopsPerThread = 4e6;
  // A skinny product (at most kSkinnyRows rows, a decode step's: one token per sequence) is bound
  // by reading the other operand, not by FLOPs: split it by columns once each thread reads at
  // least kMinSkinnyValuesPerThread of it (measured on the decode benchmark, bench_decode: the LM
  // head and the projections of a batch-1 step were single-threaded below the FLOP rule).
  constexpr index_t kSkinnyRows = 16;
  constexpr double kMinSkinnyValuesPerThread = 32768;
  const bool skinny = m <= kSkinnyRows && n >= 16 * threads &&
                      static_cast<double>(n) * static_cast<double>(k) >=
                          kMinSkinnyValuesPerThread * threads;
  if (threads > 1 && !in_parallel_region() &&
      (skinny || 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) >=
                     kMinFlopsPerThread * threads)) {
    const bool by_rows = m >= n;
    const index_t extent = by_rows ? m : n;
    const index_t parts = std::min<index_t>(threads, std::max<index_t>(1, extent / 16));
    parallel_for(0, parts, [&](index_t p) {
      // panel boundaries on multiples of 16 rows/columns
      const index_t lo = extent * p / parts / 16 * 16, hi = p + 1 == parts ? extent : extent * (p + 1) / parts / 16 * 16;
      if (hi <= lo) return;
      if (by_rows)
        gemm_part(ta, tb, alpha, A, B, beta, C, lo, hi - lo, 0, n);
      else
        gemm_part(ta, tb, alpha, A, B, beta, C, 0, m, lo, hi - lo);
    });
    return;
  }
  gemm_part(ta, tb, alpha, A, B, beta, C, 0, m, 0, n);
}
}  // namespace detail

// C (M, N) = alpha op(A) op(B) + beta C, with A, B and C checked (and an empty C allocated, beta
// then 0) by ops/gemm.hpp.
template <class T>
void gemm(cpu, Trans ta, Trans tb, T alpha, const Tensor<T, cpu>& A, const Tensor<T, cpu>& B,
          T beta, Tensor<T, cpu>& C) {
  auto a = as_matrix(A);
  auto b = as_matrix(B);
  auto c = as_matrix(C);
  detail::gemm_matrix(ta, tb, alpha, a, b, beta, c);
}

// This header's float and double instances, for graphmoe/backend/cpu/instances.hpp (M(, T): their
// explicit instantiation; extern before them with GRAPHMOE_EXTERN_CPU_KERNELS).
#define GRAPHMOE_CPU_GEMM_INSTANCES(EXTERN, T) \
  EXTERN template void gemm<T>(cpu, Trans, Trans, T, const Tensor<T, cpu>&, const Tensor<T, cpu>&, \
                               T, Tensor<T, cpu>&);
GRAPHMOE_CPU_EXTERN_INSTANCES(GRAPHMOE_CPU_GEMM_INSTANCES)

}  // namespace graphmoe
