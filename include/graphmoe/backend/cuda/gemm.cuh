// graphmoe/backend/cuda/gemm.cuh: the CUDA system's general matrix multiply, on cuBLAS (contract
// and argument checks: ops/gemm.hpp, which calls gemm(cuda{}, ...) through the backend tag; gemm's
// backward is two gemm calls there).
//
//   C = alpha * op(A) * op(B) + beta * C,   op(X) = X or X^T
//
// On Tensor<T, cuda> (T = float, double, __nv_bfloat16 or __half). Tensors are row-major and
// cuBLAS is column-major; a row-major (r, c) matrix is the column-major (c, r) matrix of its
// transpose, so C = op(A) op(B) is computed as the column-major
//   C^T = op(B)^T op(A)^T   :   cublas<t>gemm(op_b, op_a, n, m, k, B, ldb, A, lda, C, ldc = n)
// with lda = A.cols(), ldb = B.cols() and the transpose flags unchanged (no data is moved).
//
// float and double run cublasSgemm / cublasDgemm. __nv_bfloat16 and __half run cublasGemmEx with
// A, B and C in CUDA_R_16BF / CUDA_R_16F and CUBLAS_COMPUTE_32F: products and sums in fp32,
// alpha and beta widened to float (the scale type of COMPUTE_32F), one rounding of each C entry
// (beta C is read from the 16-bit C). The handle also sets
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, so that split-K reductions run in fp32 rather
// than in the 16-bit output type; the flag does not affect the float and double routines.
//
// One cuBLAS handle per (thread, device), created on first use, bound to cuda_stream() and
// destroyed when the thread exits. The math mode is CUBLAS_DEFAULT_MATH (plus the flag above):
// float products are true fp32 (no TF32 tensor cores), so the CUDA and CPU results agree to fp32
// rounding; allowing TF32 would be a separate, opt-in precision choice. (The 16-bit types use
// tensor cores with fp32 accumulation whatever the math mode.)
//
// cuBLAS takes int dimensions: a product whose dimensions exceed INT_MAX throws here (a limit of
// this backend, not of the op).
//
// detail::batched_gemm, at the end, is the backend's one strided-batched product (many problems
// of one shape, each operand a MatrixBatch view: pointer, row stride, batch stride, op): the
// attention op's heads, the token graphs' per-sequence products and the padded experts.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <type_traits>
#include <utility>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/gemm_shape.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/trans.hpp"

namespace graphmoe {

namespace detail {

// The workspace each cuBLAS handle gets (cublasSetWorkspace): fixed, so that cuBLAS never
// allocates while a CUDA graph is being captured (graph.cuh) and a captured GEMM's workspace
// address stays valid; 32 MiB, what cuBLAS's documentation recommends for Hopper.
inline constexpr std::size_t kCublasWorkspaceBytes = std::size_t(32) << 20;

// The calling thread's cuBLAS handle for the current device.
inline cublasHandle_t cublas_handle() {
  struct Handles {
    std::vector<cublasHandle_t> by_device;
    std::vector<void*> workspaces;
    ~Handles() {
      for (cublasHandle_t h : by_device)
        if (h != nullptr) (void)cublasDestroy(h);
      for (void* w : workspaces) (void)cudaFree(w);  // at exit the runtime may be gone: ignored
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
    void* workspace = nullptr;
    GRAPHMOE_CUDA_CHECK(cudaMalloc(&workspace, kCublasWorkspaceBytes));
    handles.workspaces.push_back(workspace);
    GRAPHMOE_CUBLAS_CHECK(cublasSetWorkspace(h, workspace, kCublasWorkspaceBytes));
    GRAPHMOE_CUBLAS_CHECK(cublasSetMathMode(
        h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
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

// The cudaDataType of a 16-bit element type.
template <class T>
inline constexpr cudaDataType_t cuda_data_type_v =
    std::is_same_v<T, __nv_bfloat16> ? CUDA_R_16BF : CUDA_R_16F;

// bf16 / half storage, fp32 compute: alpha and beta are already float.
template <class T>
  requires(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>)
void cublas_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                 int k, float alpha, const T* a, int lda, const T* b, int ldb, float beta, T* c,
                 int ldc) {
  GRAPHMOE_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, m, n, k, &alpha, a, cuda_data_type_v<T>, lda, b,
                                     cuda_data_type_v<T>, ldb, &beta, c, cuda_data_type_v<T>, ldc,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The scalar handed to cuBLAS: T for float and double, float for bf16 and half.
template <class T>
auto cublas_scalar(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else
    return v;
}

}  // namespace detail

namespace detail {

// cuBLAS's int range: throws if a dimension of the product (m, n, k) or a leading dimension of A
// or B exceeds it.
template <class TA>
void cublas_check_dims(const Tensor<TA, cuda>& A, const Tensor<TA, cuda>& B, index_t m, index_t n,
                       index_t k) {
  const index_t limit = INT_MAX;
  GRAPHMOE_CHECK(m <= limit && n <= limit && k <= limit && A.cols() <= limit && B.cols() <= limit,
                 "gemm", "dimensions of A ", A.shape(), " and B ", B.shape(),
                 " exceed cuBLAS's int range");
}

// The product's (m, n, k) of operands checked by ops/gemm.hpp.
template <class TA>
void gemm_dims(Trans ta, Trans tb, const Tensor<TA, cuda>& A, const Tensor<TA, cuda>& B,
               index_t& m, index_t& n, index_t& k) {
  m = ta == Trans::N ? A.rows() : A.cols();
  k = ta == Trans::N ? A.cols() : A.rows();
  n = tb == Trans::N ? B.cols() : B.rows();
}

// grouped_gemm's per-problem checks (backend/cuda/grouped.cuh): the gemm op's
// (core/gemm_shape.hpp), plus cuBLAS's int range.
template <class TA, class TC, class S>
void cublas_gemm_prepare(Trans ta, Trans tb, const Tensor<TA, cuda>& A,
                         const Tensor<TA, cuda>& B, Tensor<TC, cuda>& C, S& beta, index_t& m,
                         index_t& n, index_t& k) {
  gemm_prepare(ta, tb, A, B, C, beta, m, n, k);
  cublas_check_dims(A, B, m, n, k);
}

// cuBLAS requires leading dimensions >= 1 even when k = 0 (then C = beta C).
inline int cublas_ld(index_t cols) { return static_cast<int>(cols < 1 ? 1 : cols); }

}  // namespace detail

// C (M, N) = alpha op(A) op(B) + beta C, with A, B and C checked (and an empty C allocated, beta
// then 0) by ops/gemm.hpp.
template <class T>
void gemm(cuda, Trans ta, Trans tb, T alpha, const Tensor<T, cuda>& A, const Tensor<T, cuda>& B,
          T beta, Tensor<T, cuda>& C) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                    std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "graphmoe::gemm on cuda: T must be float, double, __nv_bfloat16 or __half");
  index_t m = 0, n = 0, k = 0;
  detail::gemm_dims(ta, tb, A, B, m, n, k);
  detail::cublas_check_dims(A, B, m, n, k);
  if (m == 0 || n == 0) return;
  detail::cublas_gemm(detail::cublas_handle(), detail::cublas_op(tb), detail::cublas_op(ta),
                      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                      detail::cublas_scalar(alpha), B.data(), detail::cublas_ld(B.cols()),
                      A.data(), detail::cublas_ld(A.cols()), detail::cublas_scalar(beta), C.data(),
                      static_cast<int>(n));
}

// Mixed precision: 16-bit A and B (bf16 or half), fp32 C, fp32 accumulation (cublasGemmEx with
// CUBLAS_COMPUTE_32F): the tensor-core GEMMs of an expert bank whose compute type is bf16 while
// its parameters, activations and gradients stay fp32 (layers/expert_bank.hpp). Same contract
// as gemm (checked by ops/gemm.hpp); beta = 1 accumulates into C in fp32.
template <class T>
  requires(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>)
void gemm(cuda, Trans ta, Trans tb, float alpha, const Tensor<T, cuda>& A,
          const Tensor<T, cuda>& B, float beta, Tensor<float, cuda>& C) {
  index_t m = 0, n = 0, k = 0;
  detail::gemm_dims(ta, tb, A, B, m, n, k);
  detail::cublas_check_dims(A, B, m, n, k);
  if (m == 0 || n == 0) return;
  GRAPHMOE_CUBLAS_CHECK(cublasGemmEx(
      detail::cublas_handle(), detail::cublas_op(tb), detail::cublas_op(ta), static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, B.data(), detail::cuda_data_type_v<T>,
      detail::cublas_ld(B.cols()), A.data(), detail::cuda_data_type_v<T>,
      detail::cublas_ld(A.cols()), &beta, C.data(), CUDA_R_32F, static_cast<int>(n),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

namespace detail {

// ---- strided-batched products --------------------------------------------------------------

// One operand of a strided-batched product: a row-major matrix per problem, problem g's at
// data + g * stride (stride 0: the same matrix for every problem), its rows ld elements apart (a
// column slice of a wider matrix has the wider row as ld), read as op(X). T is the element type,
// const for an operand that is only read.
template <class T>
struct MatrixBatch {
  T* data = nullptr;
  index_t ld = 0;
  index_t stride = 0;
  Trans op = Trans::N;

  // The same matrices read transposed.
  MatrixBatch t() const { return {data, ld, stride, op == Trans::N ? Trans::T : Trans::N}; }
  // The matrices from their row `row` on (the view of a block of rows).
  MatrixBatch from_row(index_t row) const { return {data + row * ld, ld, stride, op}; }
};
template <class T>
MatrixBatch(T*, index_t, index_t) -> MatrixBatch<T>;
template <class T>
MatrixBatch(T*, index_t) -> MatrixBatch<T>;
template <class T>
MatrixBatch(T*, index_t, index_t, Trans) -> MatrixBatch<T>;

// How the products of a batched GEMM are computed: Default in the operands' type (float: true
// fp32, gemm's math mode; 16-bit operands: fp32 accumulation); TF32 on TF32 tensor cores (float
// operands only, CUBLAS_COMPUTE_32F_FAST_TF32).
enum class GemmMath { Default, TF32 };

// The scalar type of a product with C of element type T: T for float and double, float for bf16
// and half.
template <class T>
using gemm_scalar_t = decltype(cublas_scalar(T{}));

template <class T>
inline constexpr cudaDataType_t gemm_data_type_v =
    std::is_same_v<T, float>    ? CUDA_R_32F
    : std::is_same_v<T, double> ? CUDA_R_64F
                                : cuda_data_type_v<T>;

inline void cublas_gemm_strided(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                int n, int k, float alpha, const float* a, int lda, long long sa,
                                const float* b, int ldb, long long sb, float beta, float* c,
                                int ldc, long long sc, int batch) {
  GRAPHMOE_CUBLAS_CHECK(cublasSgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb,
                                                  sb, &beta, c, ldc, sc, batch));
}
inline void cublas_gemm_strided(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                int n, int k, double alpha, const double* a, int lda, long long sa,
                                const double* b, int ldb, long long sb, double beta, double* c,
                                int ldc, long long sc, int batch) {
  GRAPHMOE_CUBLAS_CHECK(cublasDgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb,
                                                  sb, &beta, c, ldc, sc, batch));
}

// For each of `batch` problems g, row-major
//   C_g (m, n) = alpha op(A_g) op(B_g) + beta C_g
// (beta = 0: C is not read). A and B of one element type TA, C of TC: TA = TC (float, double,
// bf16 or half) or 16-bit TA with float TC. float and double with GemmMath::Default run
// cublas<S|D>gemmStridedBatched; the others cublasGemmStridedBatchedEx (fp32 accumulation, fp64
// for double, TF32 tensor cores under GemmMath::TF32). As gemm, computed as the column-major
// C^T = op(B)^T op(A)^T. `what` names the caller in the error when a dimension exceeds cuBLAS's
// int range.
template <class A, class B, class C>
void batched_gemm(index_t m, index_t n, index_t k, std::type_identity_t<gemm_scalar_t<C>> alpha,
                  MatrixBatch<A> a, MatrixBatch<B> b, std::type_identity_t<gemm_scalar_t<C>> beta,
                  MatrixBatch<C> c, index_t batch, GemmMath math = GemmMath::Default,
                  const char* what = "batched gemm") {
  using TA = std::remove_const_t<A>;
  static_assert(std::is_same_v<TA, std::remove_const_t<B>> && !std::is_const_v<C>,
                "batched_gemm: A and B of one element type, C writable");
  static_assert(std::is_same_v<TA, C> ||
                    (std::is_same_v<C, float> &&
                     (std::is_same_v<TA, __nv_bfloat16> || std::is_same_v<TA, __half>)),
                "batched_gemm: A, B and C of one type, or 16-bit A and B with a float C");
  GRAPHMOE_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && a.ld <= INT_MAX &&
                     b.ld <= INT_MAX && c.ld <= INT_MAX && batch <= INT_MAX,
                 what, "products (", m, ", ", n, ", ", k, ") x ", batch,
                 " exceed cuBLAS's int range");
  constexpr bool float_operands = std::is_same_v<TA, float>;
  GRAPHMOE_CHECK(math == GemmMath::Default || float_operands, what,
                 "TF32 products need float operands");
  if (m == 0 || n == 0 || batch == 0) return;
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  const int lda = cublas_ld(a.ld), ldb = cublas_ld(b.ld), ldc = cublas_ld(c.ld);
  const auto sa = static_cast<long long>(a.stride), sb = static_cast<long long>(b.stride),
             sc = static_cast<long long>(c.stride);
  // row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
  if constexpr (std::is_same_v<TA, C> && (std::is_same_v<C, float> || std::is_same_v<C, double>)) {
    if (math == GemmMath::Default) {
      cublas_gemm_strided(cublas_handle(), cublas_op(b.op), cublas_op(a.op), in, im, ik, alpha,
                          b.data, ldb, sb, a.data, lda, sa, beta, c.data, ldc, sc,
                          static_cast<int>(batch));
      return;
    }
  }
  const cublasComputeType_t compute = std::is_same_v<C, double> ? CUBLAS_COMPUTE_64F
                                      : math == GemmMath::TF32  ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                : CUBLAS_COMPUTE_32F;
  GRAPHMOE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      cublas_handle(), cublas_op(b.op), cublas_op(a.op), in, im, ik, &alpha, b.data,
      gemm_data_type_v<TA>, ldb, sb, a.data, gemm_data_type_v<TA>, lda, sa, &beta, c.data,
      gemm_data_type_v<C>, ldc, sc, static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace detail

}  // namespace graphmoe
