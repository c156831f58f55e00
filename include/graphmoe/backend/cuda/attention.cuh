// graphmoe/backend/cuda/attention.cuh: multi-head scaled dot-product attention that keeps the
// per-head probabilities, and its backward, on the GPU.
//
// The CUDA system's attention (contract and argument checks: ops/attention.hpp, which calls these
// through the backend tag), on Tensor<T, cuda> (T = float or double): q, k, v (B, T, H dh); probs
// (B, H, T, T) kept as an output; causal rows hold exact zeros above the diagonal; the optional
// row entropy (B, H, T) comes out of the softmax; the backward takes an optional dprobs_extra
// (B, H, T, T) added to dL/dP (entries above the diagonal ignored when causal) and assigns dq, dk,
// dv. Dimensions beyond cuBLAS's int range throw (a limit of this system).
//
// Products: cuBLAS strided-batched GEMMs on the strided head matrices, without copies. Head h of
// sequence b of a (B, T, H dh) tensor is a (T, dh) row-major matrix with row stride H dh at
// offset b T H dh + h dh, the column-major (dh, T) matrix with lda = H dh that cuBLAS reads (see
// gemm.cuh for the row-/column-major correspondence). The (b, h) pairs are not one strided batch
// (the stride from head to head is dh, from sequence to sequence T H dh), so each call batches
// one of the two: the H heads of one sequence (B calls) or one head of all B sequences (H calls),
// whichever makes fewer calls. For every pair, row-major:
//
//   forward    probs = Q K^T                      cublas(T, N) into probs, raw scores
//              softmax rows (masked, scaled)      one block per row, in place, with the entropy
//              out = probs V                      cublas(N, N)
//   backward   dS = dO V^T                        cublas(T, N) into a (B, H, T, T) buffer
//              dS = P (dS + extra - rowsum) / sqrt(dh)     one block per row, in place
//              dv = P^T dO, dq = dS K, dk = dS^T Q         cublas(N, T), (N, N), (N, T)
//
// Unlike the CPU op, the causal products are dense (the masked half is computed and then
// overwritten with zeros by the row kernels): two GEMM shapes per product instead of a block
// loop. Row sums are accumulated in T (fp32 for float, as softmax.cuh does; the CPU op's Eigen
// sums are in T too); the math mode is gemm.cuh's (true fp32, no TF32). The two backends agree
// to rounding (tests/cuda/test_cuda_attention_optim.cu).
#pragma once

#include <cublas_v2.h>

#include <climits>
#include <cmath>
#include <limits>
#include <type_traits>

#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/core/attention_dims.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

inline void cublas_gemm_strided_batched(cublasHandle_t h, cublasOperation_t ta,
                                        cublasOperation_t tb, int m, int n, int k, float alpha,
                                        const float* a, int lda, long long sa, const float* b,
                                        int ldb, long long sb, float beta, float* c, int ldc,
                                        long long sc, int batch) {
  GRAPHMOE_CUBLAS_CHECK(cublasSgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb,
                                                  sb, &beta, c, ldc, sc, batch));
}
inline void cublas_gemm_strided_batched(cublasHandle_t h, cublasOperation_t ta,
                                        cublasOperation_t tb, int m, int n, int k, double alpha,
                                        const double* a, int lda, long long sa, const double* b,
                                        int ldb, long long sb, double beta, double* c, int ldc,
                                        long long sc, int batch) {
  GRAPHMOE_CUBLAS_CHECK(cublasDgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb,
                                                  sb, &beta, c, ldc, sc, batch));
}

// Where the matrices of the (b, h) pairs lie, batch by batch. A "head" operand is a (B, T, H dh)
// tensor (q, k, v, out and their gradients); a "pair" operand is (B, H, T, T) (probs, dS).
class HeadBatches {
 public:
  explicit HeadBatches(const AttentionDims& d) : d_(d), over_heads_(d.batch <= d.heads) {}

  index_t calls() const { return over_heads_ ? d_.batch : d_.heads; }
  int batch_count() const { return static_cast<int>(over_heads_ ? d_.heads : d_.batch); }
  index_t base(bool pair, index_t call) const {
    const index_t nn = d_.seq * d_.seq;
    if (over_heads_) return pair ? call * d_.heads * nn : call * d_.seq * d_.width;
    return pair ? call * nn : call * d_.head_dim;
  }
  long long stride(bool pair) const {
    const index_t nn = d_.seq * d_.seq;
    if (over_heads_) return pair ? nn : d_.head_dim;
    return pair ? d_.heads * nn : d_.seq * d_.width;
  }

  // For every pair, column-major C = op(A) op(B) (alpha 1, beta 0: C is assigned, never read).
  template <class T>
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const T* a,
            bool a_pair, int lda, const T* b, bool b_pair, int ldb, T* c, bool c_pair,
            int ldc) const {
    const cublasHandle_t h = cublas_handle();
    for (index_t call = 0; call < calls(); ++call)
      cublas_gemm_strided_batched(h, ta, tb, m, n, k, T(1), a + base(a_pair, call), lda,
                                  stride(a_pair), b + base(b_pair, call), ldb, stride(b_pair),
                                  T(0), c + base(c_pair, call), ldc, stride(c_pair),
                                  batch_count());
  }

 private:
  AttentionDims d_;
  bool over_heads_;  // true: one call per sequence, batched over its heads
};

inline void check_cublas_dims(const char* op, const AttentionDims& d) {
  const index_t limit = INT_MAX;
  GRAPHMOE_CHECK(d.seq <= limit && d.width <= limit && d.batch <= limit && d.heads <= limit, op,
                 "dimensions (B, T, H*dh) = (", d.batch, ", ", d.seq, ", ", d.width,
                 ") exceed cuBLAS's int range");
}

// Row r of the (B H T, T) scores, r = pair T + i: keys [0, len) with len = i + 1 when causal.
// In place: P = softmax((s - max) scale) over the keys, exact zeros after them; entropy[r] =
// log Z - sum_j P_j z_j (z = (s - max) scale), as the CPU op computes it, when entropy != null.
template <class T>
__global__ void attention_softmax_kernel(T* s, T* entropy, index_t rows, index_t n, bool causal,
                                         T scale) {
  using A = acc_t<T>;
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = s + r * n;
    const index_t len = causal ? r % n + 1 : n;
    T m = ninf;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) m = MaxNanOp{}(m, row[j]);
    m = block_reduce(m, MaxNanOp{}, ninf);
    A sum = A(0), zsum = A(0);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T z = (row[j] - m) * scale;
      const T e = exp_t(z);
      row[j] = e;
      sum += static_cast<A>(e);
      if (entropy != nullptr) zsum += static_cast<A>(z) * static_cast<A>(e);
    }
    sum = block_reduce(sum, SumOp{}, A(0));
    if (entropy != nullptr) zsum = block_reduce(zsum, SumOp{}, A(0));  // uniform over the block
    const T inv = static_cast<T>(A(1) / sum);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) row[j] *= inv;
    for (index_t j = len + threadIdx.x; j < n; j += blockDim.x) row[j] = T(0);
    if (entropy != nullptr && threadIdx.x == 0)
      entropy[r] = static_cast<T>(log_t(sum) - zsum / sum);
  }
}

// Row r of dS (holding dO V^T on entry): d = dS + extra (extra may be null), then
// dS = (scale P) (d - sum_j P_j d_j) over the keys, exact zeros after them (extra is not read
// there).
template <class T>
__global__ void attention_softmax_backward_kernel(const T* probs, T* ds, const T* extra,
                                                  index_t rows, index_t n, bool causal, T scale) {
  using A = acc_t<T>;
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* p = probs + r * n;
    T* d = ds + r * n;
    const index_t len = causal ? r % n + 1 : n;
    A dot = A(0);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      T dj = d[j];
      if (extra != nullptr) {
        dj += extra[r * n + j];
        d[j] = dj;
      }
      dot += static_cast<A>(p[j]) * static_cast<A>(dj);
    }
    const T sum = static_cast<T>(block_reduce(dot, SumOp{}, A(0)));
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) d[j] = scale * p[j] * (d[j] - sum);
    for (index_t j = len + threadIdx.x; j < n; j += blockDim.x) d[j] = T(0);
  }
}

}  // namespace detail

// probs (B, H, T, T), out (B, T, H dh) and row_entropy (null or (B, H, T)) prepared by
// ops/attention.hpp.
template <class T>
void attention_forward(cuda, const Tensor<T, cuda>& q, const Tensor<T, cuda>& k,
                       const Tensor<T, cuda>& v, index_t num_heads, bool causal,
                       Tensor<T, cuda>& probs, Tensor<T, cuda>& out,
                       Tensor<T, cuda>* row_entropy) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "graphmoe::attention_forward on cuda: T must be float or double");
  constexpr const char* op = "attention_forward";
  const AttentionDims dims = AttentionDims::of(q.shape(), num_heads);
  if (q.numel() == 0) return;
  detail::check_cublas_dims(op, dims);
  const int n = static_cast<int>(dims.seq), dh = static_cast<int>(dims.head_dim);
  const int w = static_cast<int>(dims.width);
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  const detail::HeadBatches batches(dims);
  constexpr bool kHead = false, kPair = true;
  // probs^T = K Q^T (column-major): raw scores, scaled inside the softmax.
  batches.gemm(CUBLAS_OP_T, CUBLAS_OP_N, n, n, dh, k.data(), kHead, w, q.data(), kHead, w,
               probs.data(), kPair, n);
  const index_t rows = dims.pairs() * dims.seq;
  detail::launch_kernel<detail::attention_softmax_kernel<T>>(
      detail::grid_for_rows(rows), detail::threads_for_row(dims.seq), probs.data(),
      row_entropy != nullptr ? row_entropy->data() : nullptr, rows, dims.seq, causal, scale);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // out^T = V^T probs^T
  batches.gemm(CUBLAS_OP_N, CUBLAS_OP_N, dh, n, n, v.data(), kHead, w, probs.data(), kPair, n,
               out.data(), kHead, w);
}

// dq, dk, dv (B, T, H dh), assigned, prepared by ops/attention.hpp; dprobs_extra is empty or
// (B, H, T, T).
template <class T>
void attention_backward(cuda, const Tensor<T, cuda>& q, const Tensor<T, cuda>& k,
                        const Tensor<T, cuda>& v, index_t num_heads, bool causal,
                        const Tensor<T, cuda>& probs, const Tensor<T, cuda>& dout,
                        const Tensor<T, cuda>& dprobs_extra, Tensor<T, cuda>& dq,
                        Tensor<T, cuda>& dk, Tensor<T, cuda>& dv) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "graphmoe::attention_backward on cuda: T must be float or double");
  constexpr const char* op = "attention_backward";
  const AttentionDims dims = AttentionDims::of(q.shape(), num_heads);
  const bool extra = !dprobs_extra.empty();
  if (q.numel() == 0) return;
  detail::check_cublas_dims(op, dims);
  const int n = static_cast<int>(dims.seq), dh = static_cast<int>(dims.head_dim);
  const int w = static_cast<int>(dims.width);
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  const detail::HeadBatches batches(dims);
  constexpr bool kHead = false, kPair = true;
  auto ds = Tensor<T, cuda>::uninitialized(dims.probs_shape());  // (B, H, T, T), a GEMM's output
  // dS^T = V dO^T: dP = dO V^T, row-major
  batches.gemm(CUBLAS_OP_T, CUBLAS_OP_N, n, n, dh, v.data(), kHead, w, dout.data(), kHead, w,
               ds.data(), kPair, n);
  const index_t rows = dims.pairs() * dims.seq;
  detail::launch_kernel<detail::attention_softmax_backward_kernel<T>>(
      detail::grid_for_rows(rows), detail::threads_for_row(dims.seq), probs.data(), ds.data(),
      extra ? dprobs_extra.data() : nullptr, rows, dims.seq, causal, scale);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // dv^T = dO^T P
  batches.gemm(CUBLAS_OP_N, CUBLAS_OP_T, dh, n, n, dout.data(), kHead, w, probs.data(), kPair, n,
               dv.data(), kHead, w);
  // dq^T = K^T dS^T
  batches.gemm(CUBLAS_OP_N, CUBLAS_OP_N, dh, n, n, k.data(), kHead, w, ds.data(), kPair, n,
               dq.data(), kHead, w);
  // dk^T = Q^T dS
  batches.gemm(CUBLAS_OP_N, CUBLAS_OP_T, dh, n, n, q.data(), kHead, w, ds.data(), kPair, n,
               dk.data(), kHead, w);
}

}  // namespace graphmoe
