// graphmoe/backend/cuda/gemm.cuh: general matrix multiply and its backward, on cuBLAS.
//
//   C = alpha * op(A) * op(B) + beta * C,   op(X) = X or X^T
//
// The same functions and contract as backend/cpu/gemm.hpp, on Tensor<T, cuda> (T = float or
// double). Tensors are row-major and cuBLAS is column-major; a row-major (r, c) matrix is the
// column-major (c, r) matrix of its transpose, so C = op(A) op(B) is computed as the column-major
//   C^T = op(B)^T op(A)^T   :   cublas<t>gemm(op_b, op_a, n, m, k, B, ldb, A, lda, C, ldc = n)
// with lda = A.cols(), ldb = B.cols() and the transpose flags unchanged (no data is moved).
//
// One cuBLAS handle per (thread, device), created on first use, bound to cuda_stream() and
// destroyed when the thread exits. The math mode is CUBLAS_DEFAULT_MATH: float products are true
// fp32 (no TF32 tensor cores), so the CUDA and CPU results agree to fp32 rounding; allowing TF32
// would be a separate, opt-in precision choice.
//
// `Trans` is the CPU header's enum, so this header includes backend/cpu/gemm.hpp (and with it
// Eigen, host-only: EIGEN_NO_CUDA keeps nvcc from compiling Eigen for the device).
#pragma once

#if !defined(EIGEN_NO_CUDA)
#define EIGEN_NO_CUDA
#endif

#include <cublas_v2.h>

#include <climits>
#include <vector>

#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// The calling thread's cuBLAS handle for the current device.
inline cublasHandle_t cublas_handle() {
  struct Handles {
    std::vector<cublasHandle_t> by_device;
    ~Handles() {
      for (cublasHandle_t h : by_device)
        if (h != nullptr) (void)cublasDestroy(h);
    }
  };
  thread_local Handles handles;
  const int device = cuda_current_device();
  if (static_cast<std::size_t>(device) >= handles.by_device.size())
    handles.by_device.resize(static_cast<std::size_t>(device) + 1, nullptr);
  cublasHandle_t& h = handles.by_device[static_cast<std::size_t>(device)];
  if (h == nullptr) {
    GRAPHMOE_CUBLAS_CHECK(cublasCreate(&h));
    GRAPHMOE_CUBLAS_CHECK(cublasSetStream(h, cuda_stream()));
    GRAPHMOE_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
  return h;
}

inline cublasOperation_t cublas_op(Trans t) { return t == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T; }

inline void cublas_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                        int k, float alpha, const float* a, int lda, const float* b, int ldb,
                        float beta, float* c, int ldc) {
  GRAPHMOE_CUBLAS_CHECK(cublasSgemm(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc));
}
inline void cublas_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                        int k, double alpha, const double* a, int lda, const double* b, int ldb,
                        double beta, double* c, int ldc) {
  GRAPHMOE_CUBLAS_CHECK(cublasDgemm(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc));
}

}  // namespace detail

// C = alpha * op(A) op(B) + beta * C. An empty C is allocated as (M, N) (then beta is ignored).
template <class T>
void gemm(Trans ta, Trans tb, T alpha, const Tensor<T, cuda>& A, const Tensor<T, cuda>& B, T beta,
          Tensor<T, cuda>& C) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "graphmoe::gemm on cuda: T must be float or double");
  GRAPHMOE_CHECK(!A.empty() && !B.empty(), "gemm", "A or B is empty");
  GRAPHMOE_CHECK(A.rank() >= 1 && B.rank() >= 1, "gemm", "A and B must have rank >= 1, got ",
                 A.shape(), " and ", B.shape());
  const index_t m = ta == Trans::N ? A.rows() : A.cols();
  const index_t ka = ta == Trans::N ? A.cols() : A.rows();
  const index_t kb = tb == Trans::N ? B.rows() : B.cols();
  const index_t n = tb == Trans::N ? B.cols() : B.rows();
  GRAPHMOE_CHECK(ka == kb, "gemm", "inner dimensions differ: op(A) is (", m, ", ", ka,
                 ") from A ", A.shape(), (ta == Trans::T ? " transposed" : ""), ", op(B) is (", kb,
                 ", ", n, ") from B ", B.shape(), (tb == Trans::T ? " transposed" : ""));
  if (C.empty()) {
    C = Tensor<T, cuda>(Shape{m, n});
    beta = T(0);
  }
  GRAPHMOE_CHECK(C.rows() == m && C.cols() == n, "gemm", "C has shape ", C.shape(),
                 ", expected ", m, " rows and ", n, " columns for A ", A.shape(), " and B ",
                 B.shape());
  const index_t limit = INT_MAX;
  GRAPHMOE_CHECK(m <= limit && n <= limit && ka <= limit && A.cols() <= limit && B.cols() <= limit,
                 "gemm", "dimensions of A ", A.shape(), " and B ", B.shape(),
                 " exceed cuBLAS's int range");
  if (m == 0 || n == 0) return;
  // cuBLAS requires leading dimensions >= 1 even when k = 0 (then C = beta C).
  const auto ld = [](index_t cols) { return static_cast<int>(cols < 1 ? 1 : cols); };
  detail::cublas_gemm(detail::cublas_handle(), detail::cublas_op(tb), detail::cublas_op(ta),
                      static_cast<int>(n), static_cast<int>(m), static_cast<int>(ka), alpha,
                      B.data(), ld(B.cols()), A.data(), ld(A.cols()), beta, C.data(),
                      static_cast<int>(n));
}

// gemm_backward for Tensor<T, cuda> is the backend-independent one in backend/cpu/gemm.hpp
// (two gemm calls, which resolve to the cuBLAS gemm above).

}  // namespace graphmoe
