// graphmoe/ops/gemm.hpp: general matrix multiply and its backward.
//
//   C = alpha * op(A) * op(B) + beta * C,   op(X) = X or X^T
//
// A, B and C are read as matrices (all dimensions but the last flattened into rows). An empty C is
// allocated as (M, N), and beta is then ignored (treated as +0); a non-empty C must already be
// (M, N). beta == 0 means C's old contents (even NaN) are ignored, as in BLAS.
//
// Element types: A and B share one type TA and C has type TC, with alpha and beta in TC. Every
// backend takes TA = TC (float and double on the CPU; float, double, __nv_bfloat16 and __half on
// CUDA); the CUDA system also takes 16-bit A and B with a float C, accumulating in fp32 (the
// tensor-core GEMMs of an expert bank whose compute type is bf16, layers/expert_bank.hpp).
//
// Op layer: the shapes are checked and C prepared here, once for every backend; then
// gemm(B{}, ...) runs the backend's system (backend/cpu/gemm.hpp on Eigen, backend/cuda/gemm.cuh
// on cuBLAS, or a user backend's overload found by argument-dependent lookup). gemm_backward is
// two calls of gemm, so it serves every backend.
#pragma once

#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/gemm_shape.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/trans.hpp"

namespace graphmoe {

// C = alpha * op(A) op(B) + beta * C. An empty C is allocated as (M, N) (then beta is ignored).
template <class TA, class TC, Backend Bk>
void gemm(Trans ta, Trans tb, TC alpha, const Tensor<TA, Bk>& A, const Tensor<TA, Bk>& B,
          TC beta, Tensor<TC, Bk>& C) {
  index_t m = 0, n = 0, k = 0;
  detail::gemm_prepare(ta, tb, A, B, C, beta, m, n, k);
  gemm(Bk{}, ta, tb, alpha, A, B, beta, C);
}

// Backward of C = alpha * op(A) op(B) (the beta * C term carries no gradient to A or B):
//   dA = beta_a * dA + alpha * d op(A)   and   dB = beta_b * dB + alpha * d op(B)
// with d op(A) = dC op(B)^T and d op(B) = op(A)^T dC, transposed back when op is a transpose.
// Pass beta = 0 to assign, 1 to accumulate. An empty dA (or dB) is skipped.
template <class T, Backend Bk>
void gemm_backward(Trans ta, Trans tb, T alpha, const Tensor<T, Bk>& A, const Tensor<T, Bk>& B,
                   const Tensor<T, Bk>& dC, T beta_a, Tensor<T, Bk>& dA, T beta_b,
                   Tensor<T, Bk>& dB) {
  const index_t m = ta == Trans::N ? A.rows() : A.cols();
  const index_t n = tb == Trans::N ? B.cols() : B.rows();
  GRAPHMOE_CHECK(dC.rows() == m && dC.cols() == n, "gemm_backward", "dC has shape ", dC.shape(),
                 ", expected (", m, ", ", n, ") for A ", A.shape(), " and B ", B.shape());
  if (!dA.empty()) {
    check_shape("gemm_backward", "dA", dA, A.shape());
    // op(A) = A:   dA = dC op(B)^T        op(A) = A^T:  dA = op(B) dC^T
    if (ta == Trans::N)
      gemm(Trans::N, tb == Trans::N ? Trans::T : Trans::N, alpha, dC, B, beta_a, dA);
    else
      gemm(tb, Trans::T, alpha, B, dC, beta_a, dA);
  }
  if (!dB.empty()) {
    check_shape("gemm_backward", "dB", dB, B.shape());
    // op(B) = B:   dB = op(A)^T dC        op(B) = B^T:  dB = dC^T op(A)
    if (tb == Trans::N)
      gemm(ta == Trans::N ? Trans::T : Trans::N, Trans::N, alpha, A, dC, beta_b, dB);
    else
      gemm(Trans::T, ta, alpha, dC, A, beta_b, dB);
  }
}

}  // namespace graphmoe
