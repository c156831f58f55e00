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
// Products: strided-batched GEMMs (gemm.cuh's batched_gemm) on the strided head matrices,
// without copies. Head h of sequence b of a (B, T, H dh) tensor is a (T, dh) row-major matrix
// with row stride H dh at offset b T H dh + h dh. The (b, h) pairs are not one strided batch (the
// stride from head to head is dh, from sequence to sequence T H dh), so each call batches one of
// the two: the H heads of one sequence (B calls) or one head of all B sequences (H calls),
// whichever makes fewer calls (HeadBatches). For every pair:
//
//   forward    probs = Q K^T                      raw scores
//              softmax rows (masked, scaled)      one block per row, in place, with the entropy
//              out = probs V
//   backward   dS = dO V^T                        into a (B, H, T, T) buffer
//              dS = P (dS + extra - rowsum) / sqrt(dh)     one block per row, in place
//              dv = P^T dO, dq = dS K, dk = dS^T Q
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

// Where the matrices of the (b, h) pairs lie, call by call: each call is one batched_gemm over
// the H heads of one sequence (B calls) or over one head of all B sequences (H calls). A "head"
// operand is a (B, T, H dh) tensor (q, k, v, out and their gradients), a (T, dh) matrix per pair
// with row stride H dh; a "pair" operand is (B, H, T, T) (probs, dS).
class HeadBatches {
 public:
  explicit HeadBatches(const AttentionDims& d) : d_(d), over_heads_(d.batch <= d.heads) {}

  index_t calls() const { return over_heads_ ? d_.batch : d_.heads; }
  index_t batch() const { return over_heads_ ? d_.heads : d_.batch; }
  // Call `call`'s matrices of a head operand and of a pair operand.
  template <class T>
  MatrixBatch<T> heads(T* x, index_t call) const {
    return {x + (over_heads_ ? call * d_.seq * d_.width : call * d_.head_dim), d_.width,
            over_heads_ ? d_.head_dim : d_.seq * d_.width};
  }
  template <class T>
  MatrixBatch<T> pairs(T* x, index_t call) const {
    const index_t nn = d_.seq * d_.seq;
    return {x + (over_heads_ ? call * d_.heads * nn : call * nn), d_.seq,
            over_heads_ ? nn : d_.heads * nn};
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
  const index_t n = dims.seq, dh = dims.head_dim;
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  const detail::HeadBatches hb(dims);
  // probs = Q K^T: raw scores, scaled inside the softmax
  for (index_t g = 0; g < hb.calls(); ++g)
    detail::batched_gemm(n, n, dh, T(1), hb.heads(q.data(), g), hb.heads(k.data(), g).t(), T(0),
                         hb.pairs(probs.data(), g), hb.batch(), detail::GemmMath::Default, op);
  const index_t rows = dims.pairs() * dims.seq;
  detail::launch_kernel<detail::attention_softmax_kernel<T>>(
      detail::grid_for_rows(rows), detail::threads_for_row(dims.seq), probs.data(),
      row_entropy != nullptr ? row_entropy->data() : nullptr, rows, dims.seq, causal, scale);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // out = probs V
  for (index_t g = 0; g < hb.calls(); ++g)
    detail::batched_gemm(n, dh, n, T(1), hb.pairs(probs.data(), g), hb.heads(v.data(), g), T(0),
                         hb.heads(out.data(), g), hb.batch(), detail::GemmMath::Default, op);
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
  const index_t n = dims.seq, dh = dims.head_dim;
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  const detail::HeadBatches hb(dims);
  auto ds = Tensor<T, cuda>::uninitialized(dims.probs_shape());  // (B, H, T, T), a GEMM's output
  // dP = dO V^T
  for (index_t g = 0; g < hb.calls(); ++g)
    detail::batched_gemm(n, n, dh, T(1), hb.heads(dout.data(), g), hb.heads(v.data(), g).t(), T(0),
                         hb.pairs(ds.data(), g), hb.batch(), detail::GemmMath::Default, op);
  const index_t rows = dims.pairs() * dims.seq;
  detail::launch_kernel<detail::attention_softmax_backward_kernel<T>>(
      detail::grid_for_rows(rows), detail::threads_for_row(dims.seq), probs.data(), ds.data(),
      extra ? dprobs_extra.data() : nullptr, rows, dims.seq, causal, scale);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  for (index_t g = 0; g < hb.calls(); ++g) {
    const auto dsg = hb.pairs(ds.data(), g);
    // dv = P^T dO;  dq = dS K;  dk = dS^T Q
    detail::batched_gemm(n, dh, n, T(1), hb.pairs(probs.data(), g).t(), hb.heads(dout.data(), g),
                         T(0), hb.heads(dv.data(), g), hb.batch(), detail::GemmMath::Default, op);
    detail::batched_gemm(n, dh, n, T(1), dsg, hb.heads(k.data(), g), T(0), hb.heads(dq.data(), g),
                         hb.batch(), detail::GemmMath::Default, op);
    detail::batched_gemm(n, dh, n, T(1), dsg.t(), hb.heads(q.data(), g), T(0),
                         hb.heads(dk.data(), g), hb.batch(), detail::GemmMath::Default, op);
  }
}

}  // namespace graphmoe
