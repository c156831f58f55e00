// graphmoe/backend/cpu/attention.hpp: the CPU system's multi-head attention that keeps the
// per-head probabilities, and its backward (contract and argument checks: ops/attention.hpp,
// which calls these through the backend tag).
//
// The causal products skip the masked half: rows are taken in blocks of kAttentionBlock, and row
// block [r0, r1) only multiplies against keys [0, r1) (and, in the backward, column block
// [c0, c1) only against rows [c0, T)), so every product is still one ordinary GEMM on strided
// Eigen maps into q, k, v, without copies, doing about (1 + kAttentionBlock / T) / 2 of the dense
// work.
//
// Threads: the (b, h) pairs run in parallel (parallel_items: each pair's GEMMs single-threaded,
// OpenBLAS included), so results do not depend on the thread count. A schedule that instead gave
// the threads to each pair's GEMMs and split the softmax rows over OpenMP was tried: on a loaded
// machine, OpenMP's spinning workers and OpenBLAS's threads fought over the cores (up to 10x
// slower than one thread).
#pragma once

#include <algorithm>
#include <cmath>

#include "graphmoe/backend/cpu/detail/extern_instances.hpp"
#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/core/attention_dims.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {
// Row-block size of the causal products.
inline constexpr index_t kAttentionBlock = 64;

template <class T>
using HeadMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstHeadMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

// In place: the raw scores x[0, len) of one row -> softmax(z), z = (x - max x) * scale (kept in
// the workspace z); with entropy, *entropy = log Z - sum_j P_j z_j. The exponentials go through
// exp_nonpositive (detail/vexp.hpp): an entry far below the row's maximum is exactly 0, as with
// std::exp, not Eigen's subnormal. The forward's rows and a decode step's rows
// (backend/cpu/decode.hpp) both use it.
template <class T>
void softmax_scaled_row(T* x, index_t len, T scale, T* entropy,
                        Eigen::Array<T, 1, Eigen::Dynamic>& z) {
  Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> row(x, len);
  const T m = row.maxCoeff();
  z = (row - m) * scale;
  exp_nonpositive(z.data(), x, len);
  if (entropy != nullptr) {
    const T sum = row.sum();
    *entropy = std::log(sum) - (z * row).sum() / sum;
  }
  row *= T(1) / row.sum();
}
}  // namespace detail

// probs (B, H, T, T), out (B, T, H dh) and row_entropy (null or (B, H, T)) prepared by
// ops/attention.hpp. The row entropy is computed from the scores inside the softmax
// (log Z - sum_j P_ij z_ij, no logarithm per entry).
template <class T>
void attention_forward(cpu, const Tensor<T, cpu>& q, const Tensor<T, cpu>& k,
                       const Tensor<T, cpu>& v, index_t num_heads, bool causal,
                       Tensor<T, cpu>& probs, Tensor<T, cpu>& out, Tensor<T, cpu>* row_entropy) {
  const AttentionDims dims = AttentionDims::of(q.shape(), num_heads);
  const index_t n = dims.seq, dh = dims.head_dim;
  const index_t block = causal ? detail::kAttentionBlock : std::max<index_t>(n, 1);
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  parallel_items(dims.pairs(), [&](index_t pair) {
    const index_t off = dims.head_offset(pair);
    const Eigen::OuterStride<> stride(dims.width);
    detail::ConstHeadMap<T> Q(q.data() + off, n, dh, stride);
    detail::ConstHeadMap<T> K(k.data() + off, n, dh, stride);
    detail::ConstHeadMap<T> V(v.data() + off, n, dh, stride);
    detail::HeadMap<T> O(out.data() + off, n, dh, stride);
    MatrixMap<T> P(probs.data() + pair * n * n, n, n);
    // Raw scores Q K^T; row block [r0, r1) needs keys [0, r1) when causal. The scale is applied
    // inside the softmax.
    for (index_t r0 = 0; r0 < n; r0 += block) {
      const index_t r1 = std::min(n, r0 + block), keys = causal ? r1 : n;
      P.block(r0, 0, r1 - r0, keys).noalias() =
          Q.middleRows(r0, r1 - r0) * K.topRows(keys).transpose();
    }
    T* ent = row_entropy != nullptr ? row_entropy->data() + pair * n : nullptr;
    Eigen::Array<T, 1, Eigen::Dynamic> z;
    for (index_t i = 0; i < n; ++i) {
      const index_t len = causal ? i + 1 : n;
      detail::softmax_scaled_row(P.row(i).data(), len, scale, ent != nullptr ? ent + i : nullptr, z);
      if (len < n) P.row(i).tail(n - len).setZero();
    }
    for (index_t r0 = 0; r0 < n; r0 += block) {
      const index_t r1 = std::min(n, r0 + block), keys = causal ? r1 : n;
      O.middleRows(r0, r1 - r0).noalias() = P.block(r0, 0, r1 - r0, keys) * V.topRows(keys);
    }
  });
}

// dq, dk, dv (B, T, H dh), assigned, prepared by ops/attention.hpp; dprobs_extra is empty or
// (B, H, T, T).
template <class T>
void attention_backward(cpu, const Tensor<T, cpu>& q, const Tensor<T, cpu>& k,
                        const Tensor<T, cpu>& v, index_t num_heads, bool causal,
                        const Tensor<T, cpu>& probs, const Tensor<T, cpu>& dout,
                        const Tensor<T, cpu>& dprobs_extra, Tensor<T, cpu>& dq,
                        Tensor<T, cpu>& dk, Tensor<T, cpu>& dv) {
  const AttentionDims dims = AttentionDims::of(q.shape(), num_heads);
  const bool extra = !dprobs_extra.empty();
  const index_t n = dims.seq, dh = dims.head_dim;
  const index_t block = causal ? detail::kAttentionBlock : std::max<index_t>(n, 1);
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  parallel_items(dims.pairs(), [&](index_t pair) {
    const index_t off = dims.head_offset(pair);
    const Eigen::OuterStride<> stride(dims.width);
    detail::ConstHeadMap<T> Q(q.data() + off, n, dh, stride);
    detail::ConstHeadMap<T> K(k.data() + off, n, dh, stride);
    detail::ConstHeadMap<T> V(v.data() + off, n, dh, stride);
    detail::ConstHeadMap<T> dO(dout.data() + off, n, dh, stride);
    detail::HeadMap<T> dQ(dq.data() + off, n, dh, stride);
    detail::HeadMap<T> dK(dk.data() + off, n, dh, stride);
    detail::HeadMap<T> dV(dv.data() + off, n, dh, stride);
    Eigen::Map<const RowMatrix<T>> P(probs.data() + pair * n * n, n, n);
    // dP = dO V^T, then dS in place. When causal only the blocks on or below the diagonal are
    // computed, and the part above the diagonal inside them is zeroed: the products below read
    // exactly those blocks.
    RowMatrix<T> dS(n, n);
    for (index_t r0 = 0; r0 < n; r0 += block) {
      const index_t r1 = std::min(n, r0 + block), keys = causal ? r1 : n;
      dS.block(r0, 0, r1 - r0, keys).noalias() =
          dO.middleRows(r0, r1 - r0) * V.topRows(keys).transpose();
    }
    for (index_t i = 0; i < n; ++i) {
      const index_t len = causal ? i + 1 : n;
      auto drow = dS.row(i).head(len).array();
      if (extra)
        drow += Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>(
            dprobs_extra.data() + (pair * n + i) * n, len);
      const auto prow = P.row(i).head(len).array();
      const T dot = (prow * drow).sum();
      drow = scale * prow * (drow - dot);
      const index_t block_end = std::min(n, (i / block + 1) * block);
      if (len < block_end) dS.row(i).segment(len, block_end - len).setZero();
    }
    // dQ = dS K by row blocks; dV = P^T dO and dK = dS^T Q by column blocks, where column block
    // [c0, c1) has nonzeros only in rows [c0, T) when causal.
    for (index_t r0 = 0; r0 < n; r0 += block) {
      const index_t r1 = std::min(n, r0 + block), keys = causal ? r1 : n;
      dQ.middleRows(r0, r1 - r0).noalias() = dS.block(r0, 0, r1 - r0, keys) * K.topRows(keys);
    }
    for (index_t c0 = 0; c0 < n; c0 += block) {
      const index_t c1 = std::min(n, c0 + block), first = causal ? c0 : 0;
      dV.middleRows(c0, c1 - c0).noalias() =
          P.block(first, c0, n - first, c1 - c0).transpose() * dO.bottomRows(n - first);
      dK.middleRows(c0, c1 - c0).noalias() =
          dS.block(first, c0, n - first, c1 - c0).transpose() * Q.bottomRows(n - first);
    }
  });
}
// This header's float and double instances, for graphmoe/backend/cpu/instances.hpp (M(, T): their
// explicit instantiation; extern before them with GRAPHMOE_EXTERN_CPU_KERNELS).
#define GRAPHMOE_CPU_ATTENTION_INSTANCES(EXTERN, T) \
  EXTERN template void attention_forward<T>(cpu, const Tensor<T, cpu>&, const Tensor<T, cpu>&,      \
                                            const Tensor<T, cpu>&, index_t, bool, Tensor<T, cpu>&, \
                                            Tensor<T, cpu>&, Tensor<T, cpu>*);                     \
  EXTERN template void attention_backward<T>(                                                     \
      cpu, const Tensor<T, cpu>&, const Tensor<T, cpu>&, const Tensor<T, cpu>&, index_t, bool,    \
      const Tensor<T, cpu>&, const Tensor<T, cpu>&, const Tensor<T, cpu>&, Tensor<T, cpu>&,       \
      Tensor<T, cpu>&, Tensor<T, cpu>&);
GRAPHMOE_CPU_EXTERN_INSTANCES(GRAPHMOE_CPU_ATTENTION_INSTANCES)

}  // namespace graphmoe
