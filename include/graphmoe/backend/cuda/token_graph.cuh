// graphmoe/backend/cuda/token_graph.cuh: the CUDA system's token graphs, Similarity and Attention
// (contract, options and argument checks: ops/token_graph.hpp, which calls the entry points at the
// end of this file through the backend tag). The element math is in detail/token_graph_math.hpp,
// shared with the host test.
//
// Differences from the CPU graphs (backend/cpu/token_graph.hpp), none of them in the results
// beyond rounding:
//   - Similarity has two paths. The block path (similarity_blocks.cuh: cuBLAS products, on
//     TF32 / bf16 tensor cores under a reduced precision, and fused masked-softmax row kernels)
//     runs for GraphPrecision::TF32 / BF16 and for any of a learned temperature, exclude_self
//     and projection; it keeps what the CPU keeps. The fused kernel below (GraphPrecision::Exact
//     without those options, the fp32 reference) never stores S: one online-softmax kernel
//     keeps the row log-sum-exp and entropy (O(N)), and the backward recomputes S tile by tile.
//     So there args.store is ignored (state.stores stays false; it costs one more U U^T product
//     in backward, as GraphMemory::Recompute does on the CPU) and there are no self weights
//     (state.self stays empty).
//   - Attention always keeps A^p (args.store is ignored, state.stores is true); its row entropies
//     stay on the device (state.entropy; state.row_entropy, state.lse and state.self stay empty);
//     h* stays on the device (state.head_dev; attention_graph_heads reads it back on request):
//     every head's work runs at once with each row's queries masked to its head (below), so the
//     forward has no read back to the host: its all-zero-row flag is a deferrable check
//     (core/deferred_check.hpp).
//   - The mean entropies read the N row entropies back to the host (synchronises) and average
//     them in double (detail::device_mean).
//   - Sums run in other orders (tiles, warp reductions, cuBLAS) and the float kernels use fused
//     multiply-adds: float results agree with the CPU to about 1e-6 relative.
//
// ---- Similarity: p_i = sum_j softmax_j(u_i . u_j / tau) r_j, fused (flash-attention style) ----
// No (N, T) matrix is ever written: a thread block owns kOwnTile = 16 rows of one sequence and
// streams the columns j in tiles of kStreamTile = 32 (causal: only up to the owned rows' end).
// Per step, with 256 threads (8 warps):
//   1. logits tile (16, 32) = U_own U_tile^T: the depth D is walked in chunks of 32, both
//      operands staged in shared memory (16 x 33 and 32 x 33 entries, padded against bank
//      conflicts); thread t computes entries (t / 32, t % 32) and (t / 32 + 8, t % 32)
//   2. online softmax: warp w owns rows 2w and 2w + 1, one lane per column; warp reductions give
//      the tile's max, sum exp(l - m) and sum exp(l - m)(l - m); each row keeps its running
//      max / sum / entropy sum in registers (graph_math::OnlineSoftmax), the tile's weights and
//      the rows' rescale factors go to shared memory
//   3. p_own = p_own * rescale + W r_tile: thread c owns column c of E (16 register
//      accumulators, one per row); the rows of p being built are the accumulator, written by this
//      block only
// At the end p_own /= sum, and only lse (N) and the row entropy (N) are kept.
// Shared memory: 4 tiles of 16 or 32 by 33 entries, 21 KiB for double.
//
// Backward, S recomputed from u and the stored lse; c_i = dp_i . p_i,
// ds_ij = S_ij (dp_i . r_j - c_i):
//   rows kernel     (owns rows i, streams columns j)   du_i += (1/tau) sum_j ds_ij u_j
//   columns kernel  (owns columns j, streams rows i)   dr_j  = sum_i S_ij dp_i
//                                                      du_j += (1/tau) sum_i ds_ij u_i
// Each output row is written by one block of one kernel, the two kernels run one after the
// other on the backend's stream, and every sum runs in a fixed order: deterministic, no atomics.
//
// ---- Attention posterior graph ----------------------------------------------------------------
// Row entropies of the attention heads when the cache has none (one warp per row), h* per token
// (one thread per sequence, graph_math::choose_heads: per sequence, or per row from its prefix
// under HeadChoice::PerSequenceCausal, so the rows of one sequence may take different heads).
// As on the CPU, the (T, T) products run in the heads' dimensions: a_i . m_hj = q_hi . v_hj +
// a_i . b_o with Q_h = H Aout W_o,h (N, dh), and a_i . b_o is the same for every j of row i, so it
// cancels in the row's softmax. Every head's work is done at once, with each row's queries
// masked to its own head (rather than one pass per head over (N, T) scratch, H (T, T, dh)
// products each writing a full (N, T) matrix, H times over):
//   Q~ = mask_heads(H Aout W_o)          (N, D): row i keeps the dh columns of head h*(i), 0 else
//   G  = Q~ V^T per sequence             (T, T, D) products, one strided-batched call:
//                                        G_ij = q_{h*(i) i} . v_{h*(i) j} exactly (the masked
//                                        terms are exact zeros)
//   |m_hj|^2 for every (j, h)            m_hj = H W_h v_hj + b_o (W_h = W_o,h), through the Gram
//                                        matrices G_h = W_h^T W_h: |m_hj|^2 = v_hj . (H^2 G_h v_hj
//                                        + 2 H W_h^T b_o) + |b_o|^2 (the last term cancels in the
//                                        softmax, as on the CPU), O(N dh^2) per head, no (N, dm)
//                                        mean formed (products batched over the heads)
//   posterior rows                       one block per row, reading A of its head: logits, max,
//                                        sum, entropy, stored (N, T)
//   p = A^p r                            per sequence
// Backward, with dL = A^p o (dp r^T - rowdot(dp, p)) and colsum[j, h] = sum_{i: h*(i) = h} dL_ij
// (per sequence dL^T onehot(h*), one product):
//   dQ~ = mask_heads((H / sigma^2) dL V)  dout += dQ~ W_o^T            dW_o += Aout^T dQ~
//   dV += dL^T Q~ / sigma^2               dprobs at each row's head += dL / A (one pass)
//   dV_h -= (H / sigma^2) colsum_h o (M_h W_h)        M_h W_h = H V_h G_h + b_o^T W_h
//   dW_o,h -= (H / sigma^2) M_h^T (colsum_h o V_h)    = H W_h (V_h^T (colsum_h o V_h)) + b_o s_h^T
//   db_o -= sum_h M_h^T colsum_h / sigma^2            M_h^T colsum_h = H W_h s_h + b_o sum(colsum_h)
// with s_h = V_h^T colsum_h, every head at once (batched products of dh x dh and the like)
// (the first lines from a_i . m_j, the rest from -|m_j|^2 / (2 sigma^2); rows of dL sum to 0, so
// a_i . b_o adds nothing). The earlier form built M_h (N, dm) per head: O(N dm D) per pass.
// The (T, T)-sized work is O(T^2 D) per sequence, as H passes of T^2 dh were, in three large
// products instead of 3 H small ones, and the (N, T) passes (posterior, dprobs, the column sums)
// run once instead of once per head. A^p is stored (N, T), as on the CPU, and so is Q~ (N, D)
// from forward to backward (state.queries); scratch: G (N, T) in forward, dL (N, T) and dQ~
// (N, D) in backward. A causal attention layer (AttentionCache::causal) has A = 0 above the
// diagonal, so A^p and dL are 0 there: the (T, T)-sized products (G, p, dr, dp r^T, dQ~, dV) run
// in blocks of kAttentionCausalRows rows of every sequence whose columns stop at the block's last
// row (attention_row_blocks), about half the work at long sequences (9/16 at T = 2048 in blocks
// of 256, 3/4 at T = 512); the kernels write 0 above the diagonal without reading the uncomputed
// half. Under GraphPrecision::TF32 the (T, T) products (G, p, dr, dp r^T, dQ~, dV)
// run on TF32 tensor cores (graph_gemm_prec of similarity_blocks.cuh), and so do the
// (N, D, dm)-sized ones (Q~, dout, dW_o); the Gram terms (O(N dh^2)) stay fp32. Under
// GraphPrecision::BF16 the (T, T) products read bf16 copies of their operands (GraphOperands of
// similarity_blocks.cuh: Q~, V, A^p, r, dp, dL, each converted once per call) with fp32
// accumulation and output, and the (N, D, dm) ones (which read float) run on TF32, as the
// Similarity graph's projection does (similarity_projection_precision).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/graph_blas.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/token_graph_math.hpp"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/similarity_blocks.cuh"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe::detail {

namespace tgm = graph_math;

static_assert(tgm::kStreamTile == 32 && tgm::kThreads == 256 &&
                  2 * (tgm::kThreads / tgm::kStreamTile) == tgm::kOwnTile,
              "token_graph.cuh: the thread mapping needs 256 threads, 16 owned rows, 32 lanes");

// ---- Similarity tiles ---------------------------------------------------------------------------

template <class T>
struct SimilarityTiles {
  T xs[tgm::kOwnTile][tgm::kDepthTile + 1];     // owned rows, one depth chunk
  T ys[tgm::kStreamTile][tgm::kDepthTile + 1];  // streamed rows, one depth chunk
  T a[tgm::kOwnTile][tgm::kStreamTile + 1];     // logits, then weights / S
  T b[tgm::kOwnTile][tgm::kStreamTile + 1];     // backward: dp . r, then ds
  T factor[tgm::kOwnTile];                     // per owned row: rescale of the accumulator
};

template <class T>
using TileMatrix = T[tgm::kOwnTile][tgm::kStreamTile + 1];

// out[a][b] = sum_k X[(x0 + a) ldx + k] Y[(y0 + b) ldy + k] for a < nx, b < ny (0 elsewhere),
// k in [0, depth) in order. Every thread of the block must call it; out is complete after the
// caller's next __syncthreads().
template <class T>
__device__ void similarity_tile_dot(const T* X, index_t ldx, index_t x0, int nx, const T* Y,
                                    index_t ldy, index_t y0, int ny, index_t depth,
                                    SimilarityTiles<T>& sh, TileMatrix<T>& out) {
  constexpr int kRowsPerPass = tgm::kThreads / tgm::kStreamTile;  // 8
  const int t = static_cast<int>(threadIdx.x);
  const int b = t % tgm::kStreamTile, a = t / tgm::kStreamTile;
  T acc0 = T(0), acc1 = T(0);
  for (index_t k0 = 0; k0 < depth; k0 += tgm::kDepthTile) {
    const index_t kn = depth - k0 < tgm::kDepthTile ? depth - k0 : tgm::kDepthTile;
    for (int idx = t; idx < tgm::kOwnTile * tgm::kDepthTile; idx += tgm::kThreads) {
      const int row = idx / tgm::kDepthTile, k = idx % tgm::kDepthTile;
      sh.xs[row][k] = row < nx && k < kn ? X[(x0 + row) * ldx + k0 + k] : T(0);
    }
    for (int idx = t; idx < tgm::kStreamTile * tgm::kDepthTile; idx += tgm::kThreads) {
      const int row = idx / tgm::kDepthTile, k = idx % tgm::kDepthTile;
      sh.ys[row][k] = row < ny && k < kn ? Y[(y0 + row) * ldy + k0 + k] : T(0);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < tgm::kDepthTile; ++k) {
      const T y = sh.ys[b][k];
      acc0 += sh.xs[a][k] * y;
      acc1 += sh.xs[a + kRowsPerPass][k] * y;
    }
    __syncthreads();
  }
  out[a][b] = acc0;
  out[a + kRowsPerPass][b] = acc1;
}

// out[(o0 + a) ldo + c] = rescale_add(out, factor[a], alpha sum_b W[a][b] Y[(y0 + b) ldy + c])
// for a < nx, b < ny, c < cols; factor nullptr means 1 (accumulate). Thread c owns column c.
template <class T>
__device__ void similarity_tile_accumulate(const TileMatrix<T>& W, int nx, int ny, const T* Y,
                                           index_t ldy, index_t y0, index_t cols, T alpha,
                                           const T* factor, T* out, index_t ldo, index_t o0) {
  for (index_t c = threadIdx.x; c < cols; c += blockDim.x) {
    T acc[tgm::kOwnTile];
#pragma unroll
    for (int a = 0; a < tgm::kOwnTile; ++a) acc[a] = T(0);
    for (int b = 0; b < ny; ++b) {
      const T y = Y[(y0 + b) * ldy + c];
#pragma unroll
      for (int a = 0; a < tgm::kOwnTile; ++a) acc[a] += W[a][b] * y;
    }
#pragma unroll
    for (int a = 0; a < tgm::kOwnTile; ++a) {
      if (a < nx) {
        T& o = out[(o0 + a) * ldo + c];
        o = tgm::rescale_add(o, factor != nullptr ? factor[a] : T(1), alpha * acc[a]);
      }
    }
  }
}

// Forward: one block per (sequence, tile of 16 rows); see the file comment.
template <class T>
__global__ void __launch_bounds__(tgm::kThreads)
    similarity_forward_kernel(const T* u, const T* r, T* p, T* lse, T* entropy, index_t len,
                              index_t tiles, index_t d, index_t e, T inv_tau, bool causal) {
  __shared__ SimilarityTiles<T> sh;
  const index_t seq = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * tgm::kOwnTile;
  const index_t s0 = seq * len;
  const int ni = static_cast<int>(len - i0 < tgm::kOwnTile ? len - i0 : tgm::kOwnTile);
  const index_t jend = tgm::stream_end_for_rows(i0, ni, len, causal);
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  tgm::OnlineSoftmax<T> st[2];
  for (index_t j0 = 0; j0 < jend; j0 += tgm::kStreamTile) {
    const int nj = static_cast<int>(jend - j0 < tgm::kStreamTile ? jend - j0 : tgm::kStreamTile);
    similarity_tile_dot(u, d, s0 + i0, ni, u, d, s0 + j0, nj, d, sh, sh.a);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int a = 2 * warp + q;
      const T l = tgm::masked_logit(sh.a[a][lane], inv_tau,
                                   tgm::visible(i0 + a, j0 + lane, len, causal) && lane < nj);
      const T m = st[q].next_max(warp_reduce(l, MaxNanOp{}));
      const T w = tgm::softmax_weight(l, m);
      const T tile_sum = warp_reduce(w, SumOp{});
      const T tile_dot = warp_reduce(tgm::entropy_weight(l, m), SumOp{});
      if (lane == 0) sh.factor[a] = st[q].rescale(m);
      st[q].merge(m, tile_sum, tile_dot);
      sh.a[a][lane] = w;
    }
    __syncthreads();
    similarity_tile_accumulate(sh.a, ni, nj, r, e, s0 + j0, e, T(1), sh.factor, p, e, s0 + i0);
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int a = 2 * warp + q;
    if (a < ni && lane == 0) {
      lse[s0 + i0 + a] = st[q].lse();
      entropy[s0 + i0 + a] = st[q].entropy();
      sh.factor[a] = st[q].sum;
    }
  }
  __syncthreads();
  for (index_t idx = threadIdx.x; idx < ni * e; idx += blockDim.x) {
    const index_t a = idx / e, c = idx % e;
    p[(s0 + i0 + a) * e + c] /= sh.factor[a];
  }
}

// Backward, rows: du_i += (1/tau) sum_j ds_ij u_j.
template <class T>
__global__ void __launch_bounds__(tgm::kThreads)
    similarity_backward_rows_kernel(const T* u, const T* r, const T* dp, const T* c,
                                    const T* lse, T* du, index_t len, index_t tiles, index_t d,
                                    index_t e, T inv_tau, bool causal) {
  __shared__ SimilarityTiles<T> sh;
  const index_t seq = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * tgm::kOwnTile;
  const index_t s0 = seq * len;
  const int ni = static_cast<int>(len - i0 < tgm::kOwnTile ? len - i0 : tgm::kOwnTile);
  const index_t jend = tgm::stream_end_for_rows(i0, ni, len, causal);
  for (index_t j0 = 0; j0 < jend; j0 += tgm::kStreamTile) {
    const int nj = static_cast<int>(jend - j0 < tgm::kStreamTile ? jend - j0 : tgm::kStreamTile);
    similarity_tile_dot(u, d, s0 + i0, ni, u, d, s0 + j0, nj, d, sh, sh.a);
    similarity_tile_dot(dp, e, s0 + i0, ni, r, e, s0 + j0, nj, e, sh, sh.b);
    __syncthreads();
    for (int idx = static_cast<int>(threadIdx.x); idx < tgm::kOwnTile * tgm::kStreamTile;
         idx += tgm::kThreads) {
      const int a = idx / tgm::kStreamTile, b = idx % tgm::kStreamTile;
      const bool vis = a < ni && b < nj && tgm::visible(i0 + a, j0 + b, len, causal);
      T ds = T(0);
      if (vis) {
        const index_t i = s0 + i0 + a;
        const T s = tgm::prob_from_lse(tgm::masked_logit(sh.a[a][b], inv_tau, true), lse[i]);
        ds = tgm::softmax_dlogit(s, sh.b[a][b], c[i]);
      }
      sh.a[a][b] = ds;
    }
    __syncthreads();
    similarity_tile_accumulate(sh.a, ni, nj, u, d, s0 + j0, d, inv_tau,
                               static_cast<const T*>(nullptr), du, d, s0 + i0);
    __syncthreads();
  }
}

// Backward, columns: dr_j = sum_i S_ij dp_i; with to_u, du_j += (1/tau) sum_i ds_ij u_i.
template <class T>
__global__ void __launch_bounds__(tgm::kThreads)
    similarity_backward_cols_kernel(const T* u, const T* r, const T* dp, const T* c,
                                    const T* lse, T* dr, T* du, index_t len, index_t tiles,
                                    index_t d, index_t e, T inv_tau, bool causal, bool to_u) {
  __shared__ SimilarityTiles<T> sh;
  const index_t seq = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * tgm::kOwnTile;
  const index_t s0 = seq * len;
  const int nj = static_cast<int>(len - j0 < tgm::kOwnTile ? len - j0 : tgm::kOwnTile);
  bool first = true;
  for (index_t i0 = tgm::stream_begin_for_cols(j0, causal); i0 < len; i0 += tgm::kStreamTile) {
    const int ni = static_cast<int>(len - i0 < tgm::kStreamTile ? len - i0 : tgm::kStreamTile);
    similarity_tile_dot(u, d, s0 + j0, nj, u, d, s0 + i0, ni, d, sh, sh.a);    // u_j . u_i
    if (to_u)  // r_j . dp_i
      similarity_tile_dot(r, e, s0 + j0, nj, dp, e, s0 + i0, ni, e, sh, sh.b);
    if (threadIdx.x < tgm::kOwnTile) sh.factor[threadIdx.x] = first ? T(0) : T(1);  // dr assigned
    __syncthreads();
    for (int idx = static_cast<int>(threadIdx.x); idx < tgm::kOwnTile * tgm::kStreamTile;
         idx += tgm::kThreads) {
      const int a = idx / tgm::kStreamTile, b = idx % tgm::kStreamTile;  // column j0 + a, row i0 + b
      const bool vis = a < nj && b < ni && tgm::visible(i0 + b, j0 + a, len, causal);
      T s = T(0), ds = T(0);
      if (vis) {
        const index_t i = s0 + i0 + b;
        s = tgm::prob_from_lse(tgm::masked_logit(sh.a[a][b], inv_tau, true), lse[i]);
        if (to_u) ds = tgm::softmax_dlogit(s, sh.b[a][b], c[i]);
      }
      sh.a[a][b] = s;
      if (to_u) sh.b[a][b] = ds;
    }
    __syncthreads();
    similarity_tile_accumulate(sh.a, nj, ni, dp, e, s0 + i0, e, T(1),
                               static_cast<const T*>(sh.factor), dr, e, s0 + j0);
    if (to_u)
      similarity_tile_accumulate(sh.b, nj, ni, u, d, s0 + i0, d, inv_tau,
                                 static_cast<const T*>(nullptr), du, d, s0 + j0);
    __syncthreads();
    first = false;
  }
}

// ---- small row / column kernels -----------------------------------------------------------------

// ent[row] = -sum_j A log A over the rows of probs (B H T rows of T), one warp per row.
template <class T>
__global__ void attention_row_entropy_kernel(const T* probs, T* ent, index_t rows, index_t len) {
  const index_t warps_per_block = blockDim.x / 32;
  const index_t total = static_cast<index_t>(gridDim.x) * warps_per_block;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (index_t row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < rows; row += total) {
    T s = T(0);
    for (index_t j = lane; j < len; j += 32) s += tgm::plogp(probs[row * len + j]);
    s = warp_reduce(s, SumOp{});
    if (lane == 0) ent[row] = -s;
  }
}

// heads[b len + i] = h* of every row, one thread per sequence.
template <class T>
__global__ void attention_choose_heads_kernel(const T* ent, index_t nb, index_t nh, index_t len,
                                              bool per_row_prefix, double* prefix,
                                              std::int32_t* heads) {
  GRAPHMOE_CUDA_GRID_STRIDE(b, nb) {
    tgm::choose_heads(ent + b * nh * len, nh, len, per_row_prefix, prefix + b * nh, heads + b * len);
  }
}

// The means m_hj = H W_h v_hj + b_o (W_h = W_o,h, (dm, dh)) through the heads' Gram matrices
// G_h = W_h^T W_h (dh, dh) and c_h = W_h^T b_o (dh), with Z_h = V_h G_h (N, dh):
//   |m_hj|^2 = v_hj . (H^2 z_hj + 2 H c_h) + |b_o|^2          m_hj^T W_h = H z_hj + c_h
// so that no (N, dm) mean is formed (O(N dh^2) per head instead of O(N dm dh)).

// msq[j, h] (N, H) = v_hj . (H^2 z_hj + 2 H c_h), which is |m_hj|^2 less |b_o|^2 (the same for
// every j: it cancels in each row's softmax, as on the CPU); v, z (N, H dh); c (H dh) null
// without a bias. One thread per (j, h).
template <class T>
__global__ void attention_msq_kernel(const T* v, const T* z, const T* c, T* msq, index_t n,
                                     index_t nh, index_t dh, T fh) {
  using A = acc_t<T>;
  const index_t cols = nh * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * nh) {
    const index_t j = k / nh, h = k % nh;
    const T* vr = v + j * cols + h * dh;
    const T* zr = z + j * cols + h * dh;
    A s = A(0);
    for (index_t col = 0; col < dh; ++col) {
      T w = fh * fh * zr[col];
      if (c != nullptr) w += T(2) * fh * c[h * dh + col];
      s += static_cast<A>(vr[col]) * static_cast<A>(w);
    }
    msq[k] = static_cast<T>(s);
  }
}

// dv[j, col] -= alpha colsum[j, h] (H z[j, col] + c[col]) over (N, H dh), h = col / dh (c null
// without a bias): the |m_hj|^2 term's gradient in v.
template <class T>
__global__ void attention_dv_mean_kernel(const T* z, const T* c, const T* colsum, T* dv, index_t n,
                                         index_t nh, index_t dh, T fh, T alpha) {
  const index_t cols = nh * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * cols) {
    const index_t j = k / cols, col = k % cols;
    T w = fh * z[k];
    if (c != nullptr) w += c[col];
    dv[k] -= alpha * colsum[j * nh + col / dh] * w;
  }
}

// y[j, col] = colsum[j, h] v[j, col] over (N, H dh), h = col / dh.
template <class T>
__global__ void attention_scale_heads_kernel(const T* v, const T* colsum, T* y, index_t n,
                                             index_t nh, index_t dh) {
  const index_t cols = nh * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * cols) { y[k] = colsum[(k / cols) * nh + (k % cols) / dh] * v[k]; }
}

// db[r] -= alpha b[r] sum(colsum) over the N H column sums (one block): the bias's own share of
// db_o -= sum_h M_h^T colsum_h / sigma^2 (the sum is 0 up to rounding: rows of dL sum to 0).
template <class T>
__global__ void attention_db_bias_kernel(const T* colsum, index_t count, const T* b, T* db,
                                         index_t dm, T alpha) {
  using A = acc_t<T>;
  A s = A(0);
  for (index_t k = threadIdx.x; k < count; k += blockDim.x) s += static_cast<A>(colsum[k]);
  s = block_reduce(s, SumOp{}, A(0));
  const T total = static_cast<T>(s);
  for (index_t r = threadIdx.x; r < dm; r += blockDim.x) db[r] -= alpha * b[r] * total;
}

// The posterior rows, one block per row i, with its head h = heads[i]: g (N, T) the logits
// q_hi . v_hj, msq (N, H) the |m_hj|^2; post and ent_row receive the row and its entropy. A row
// without a positive probability flags (b H + h) T + i (the CPU reports the first such row by
// sequence, head, row).
template <class T>
__global__ void attention_posterior_rows_kernel(const T* probs, const T* g, const T* msq,
                                                const std::int32_t* heads, T* post, T* ent_row,
                                                unsigned long long* bad, index_t n, index_t nh,
                                                index_t len, T inv_var, bool causal) {
  using A = acc_t<T>;
  const T ninf = tgm::neg_inf<T>();
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    const index_t h = heads[i];  // the same for the whole block
    const index_t b = i / len, il = i % len;
    const T* arow = probs + ((b * nh + h) * len + il) * len;
    const T* grow = g + i * len;
    T* row = post + i * len;
    const index_t valid = causal ? il + 1 : len;  // causal: g is not computed beyond the row
    T mx = ninf;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T l = j < valid
                      ? tgm::posterior_logit(arow[j], grow[j], msq[(b * len + j) * nh + h], inv_var)
                      : ninf;
      row[j] = l;
      mx = MaxNanOp{}(mx, l);
    }
    mx = block_reduce(mx, MaxNanOp{}, ninf);
    if (!(mx > ninf)) {
      if (threadIdx.x == 0) flag_index(bad, (b * nh + h) * len + il);
      continue;
    }
    A s = A(0), dot = A(0);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T l = row[j];
      const T w = tgm::softmax_weight(l, mx);
      row[j] = w;
      s += static_cast<A>(w);
      dot += static_cast<A>(tgm::entropy_weight(l, mx));
    }
    s = block_reduce(s, SumOp{}, A(0));
    dot = block_reduce(dot, SumOp{}, A(0));
    const T sum = static_cast<T>(s);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) row[j] /= sum;
    if (threadIdx.x == 0) ent_row[i] = tgm::log_of(sum) - static_cast<T>(dot) / sum;
  }
}

// q = post o (q - c_i) over (N, T): the gradient of the posterior's logits. Causal: 0 above the
// diagonal, where q was not computed (the block products stop at the block's last column).
template <class T>
__global__ void attention_dlogit_kernel(const T* post, const T* c, T* q, index_t n, index_t len,
                                        bool causal) {
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * len) {
    const index_t i = k / len, j = k % len;
    q[k] = causal && j > i % len ? T(0) : post[k] * (q[k] - c[i]);
  }
}

// x (N, H dh): row i keeps the dh columns of its head heads[i], the others become 0.
template <class T>
__global__ void attention_mask_heads_kernel(T* x, const std::int32_t* heads, index_t n, index_t nh,
                                            index_t dh) {
  const index_t cols = nh * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * cols) {
    if ((k % cols) / dh != heads[k / cols]) x[k] = T(0);
  }
}

// onehot (N, H): onehot[i, h] = 1 where h = heads[i], else 0.
template <class T>
__global__ void attention_head_onehot_kernel(const std::int32_t* heads, T* onehot, index_t n,
                                             index_t nh) {
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * nh) { onehot[k] = heads[k / nh] == k % nh ? T(1) : T(0); }
}

// dprobs[b, h, i, j] += dl_ij / A_ij (A > 0), h the head of row i.
template <class T>
__global__ void attention_dprobs_kernel(const T* dl, const T* probs, const std::int32_t* heads,
                                        T* dprobs, index_t n, index_t nh, index_t len,
                                        bool causal) {
  GRAPHMOE_CUDA_GRID_STRIDE(k, n * len) {
    const index_t i = k / len, j = k % len;
    const index_t h = heads[i];
    const index_t b = i / len, il = i % len;
    if (causal && j > il) continue;  // A = 0 there (dL too)
    const index_t at = ((b * nh + h) * len + il) * len + j;
    dprobs[at] += tgm::dprob_term(dl[k], probs[at]);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

inline unsigned graph_tile_blocks(index_t nseq, index_t len) {
  const index_t tiles = (len + tgm::kOwnTile - 1) / tgm::kOwnTile;
  GRAPHMOE_CHECK(nseq * tiles <= INT_MAX, "Similarity", nseq * tiles,
                 " row tiles exceed the grid limit");
  return static_cast<unsigned>(nseq * tiles);
}

// p (N, E), lse (N), entropy (N) from u (N, D), r (N, E); N a multiple of len.
template <class T>
void similarity_forward_cuda(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                             Tensor<T, cuda>& p, Tensor<T, cuda>& lse, Tensor<T, cuda>& entropy,
                             index_t len, T inv_tau, bool causal) {
  const index_t n = u.rows(), nseq = n / len, tiles = (len + tgm::kOwnTile - 1) / tgm::kOwnTile;
  if (n == 0) return;
  launch_kernel<similarity_forward_kernel<T>>(graph_tile_blocks(nseq, len), tgm::kThreads, u.data(),
                                              r.data(), p.data(), lse.data(), entropy.data(), len,
                                              tiles, u.cols(), r.cols(), inv_tau, causal);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dr assigned; du accumulated when du is not null (the graph is not detached).
template <class T>
void similarity_backward_cuda(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                              const Tensor<T, cuda>& p, const Tensor<T, cuda>& dp,
                              const Tensor<T, cuda>& lse, Tensor<T, cuda>& dr, T* du, index_t len,
                              T inv_tau, bool causal) {
  const index_t n = u.rows(), nseq = n / len, tiles = (len + tgm::kOwnTile - 1) / tgm::kOwnTile;
  const index_t d = u.cols(), e = r.cols();
  if (n == 0) return;
  const unsigned blocks = graph_tile_blocks(nseq, len);
  Tensor<T, cuda> c;
  if (du != nullptr) {
    c = Tensor<T, cuda>::uninitialized(Shape{n});  // one per row
    launch_kernel<graph_row_dot_kernel<T>>(graph_warp_rows_blocks(n), kThreads, dp.data(), p.data(),
                                           c.data(), n, e);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    launch_kernel<similarity_backward_rows_kernel<T>>(blocks, tgm::kThreads, u.data(), r.data(),
                                                      dp.data(), c.data(), lse.data(), du, len,
                                                      tiles, d, e, inv_tau, causal);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  launch_kernel<similarity_backward_cols_kernel<T>>(
      blocks, tgm::kThreads, u.data(), r.data(), dp.data(), c.data(), lse.data(), dr.data(), du,
      len, tiles, d, e, inv_tau, causal, du != nullptr);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe::detail

namespace graphmoe {

namespace detail {
// The mean of the n values of a device vector, in double (synchronises).
template <class T>
double device_mean(const Tensor<T, cuda>& x) {
  if (x.empty() || x.numel() == 0) return 0.0;
  const Tensor<T, cpu> h = to_host(x);
  double s = 0;
  for (index_t i = 0; i < h.numel(); ++i) s += static_cast<double>(h.data()[i]);
  return s / static_cast<double>(h.numel());
}

// The Gram terms of the means (the kernels' comment above): g (H, dh, dh) = W_h^T W_h, z (N, H dh)
// with z_h = V_h G_h, and with a bias cvec (H, dh) = W_h^T b_o; three strided-batched products
// over the heads.
template <class T>
void attention_gram_terms(const AttentionCache<T, cuda>& c, index_t dm, Tensor<T, cuda>& g,
                          Tensor<T, cuda>& z, Tensor<T, cuda>& cvec) {
  const index_t n = c.v.rows(), dvc = c.v.cols(), nh = c.num_heads, dh = dvc / nh;
  graph_gemm(Trans::T, Trans::N, dh, dh, dm, T(1), c.w_o.data(), dvc, dh, c.w_o.data(), dvc, dh,
             T(0), g.data(), dh, dh * dh, nh);
  graph_gemm(Trans::N, Trans::N, n, dh, dh, T(1), c.v.data(), dvc, dh, g.data(), dh, dh * dh, T(0),
             z.data(), dvc, dh, nh);
  if (!c.b_o.empty())
    graph_gemm(Trans::T, Trans::N, dh, index_t(1), dm, T(1), c.w_o.data(), dvc, dh, c.b_o.data(),
               index_t(1), 0, T(0), cvec.data(), index_t(1), dh, nh);
}

// A causal cache's rows per block of the (T, T) products: the Similarity block path's causal
// block (which that path widens beyond 2,048 tokens to keep at most 8 blocks and bounds by its
// scratch; this graph's products write into whole (N, T) buffers, so it keeps 256 at any length).
inline constexpr index_t kAttentionCausalRows = kSimilarityCausalRows;

// The rows [i0, i0 + rows) of every sequence whose (T, T) products read or write the columns
// [0, cols): one block of all len rows and columns, or for a causal cache blocks of
// kAttentionCausalRows rows that stop at their last row's column (the half above the diagonal,
// where A and so A^p are 0, skipped). The last block always ends at column len.
struct AttentionRowBlock {
  index_t i0, rows, cols;
};
inline std::vector<AttentionRowBlock> attention_row_blocks(index_t len, bool causal) {
  const index_t bi = causal ? std::min(len, kAttentionCausalRows) : len;
  std::vector<AttentionRowBlock> blocks;
  for (index_t i0 = 0; i0 < len; i0 += bi) {
    const index_t rows = std::min(bi, len - i0);
    blocks.push_back({i0, rows, causal ? i0 + rows : len});
  }
  return blocks;
}

// q~ = mask_heads(H Aout W_o) (N, H dh): row i holds its head's queries q_{h*(i) i} in that head's
// columns and 0 in the others (a_i . m_hj = q_hi . v_hj + a_i . b_o). On TF32 tensor cores under
// GraphPrecision::TF32.
template <class T>
void attention_masked_queries(GraphPrecision prec, const AttentionCache<T, cuda>& c, index_t dm,
                              const Tensor<std::int32_t, cuda>& heads, Tensor<T, cuda>& q) {
  const index_t n = c.v.rows(), dvc = c.v.cols(), nh = c.num_heads;
  graph_gemm_prec<T, T>(prec, Trans::N, Trans::N, n, dvc, dm, static_cast<T>(nh), c.out.data(), dm,
                        0, c.w_o.data(), dvc, 0, T(0), q.data(), dvc, 0, 1);
  launch_kernel<attention_mask_heads_kernel<T>>(grid_for(n * dvc), kThreads, q.data(),
                                                heads.data(), n, nh, dvc / nh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}
}  // namespace detail

// ---- the backend entry points (ops/token_graph.hpp checks the arguments and prepares p / dr) ----

// The CUDA graphs implement every option: the Similarity block path (similarity_blocks.cuh)
// covers a learned temperature, exclude_self, projection and the tensor-core precisions.
constexpr TokenGraphSupport token_graph_support(cuda) { return TokenGraphSupport{true, true, true, true}; }

// The value of a one-entry parameter (copied to the host).
template <class T>
double token_graph_scalar(cuda, const Tensor<T, cuda>& t) {
  return static_cast<double>(to_host(t).data()[0]);
}

namespace detail {
// Whether a Similarity call runs the fused SIMT kernels (Exact, no option beyond detach and
// memory) rather than the block path.
inline bool similarity_fused(const SimilarityGraphArgs& args) {
  return args.precision == GraphPrecision::Exact && !args.learned_tau && !args.exclude_self &&
         !args.projection;
}
}  // namespace detail

// Similarity forward: p (N, E) prepared. Fused kernel: keeps lse and the row entropy (N) only
// (S never stored, no self weights). Block path: as the CPU (S stored when args.store).
template <class T>
void similarity_graph_forward(cuda, const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                              const SimilarityGraphArgs& args,
                              const SimilarityGraphParams<T, cuda>& params,
                              SimilarityGraphState<T, cuda>& state, Tensor<T, cuda>& p) {
  const index_t n = u.rows();
  if (!detail::similarity_fused(args)) {
    if constexpr (std::is_same_v<T, float>) {
      if (args.precision == GraphPrecision::BF16) {
        detail::similarity_blocks_forward<T, __nv_bfloat16>(u, r, args, params, state, p);
        return;
      }
    }
    detail::similarity_blocks_forward<T, T>(u, r, args, params, state, p);
    return;
  }
  state.stores = false;
  state.s = Tensor<T, cuda>();
  state.self = Tensor<T, cuda>();
  state.q = Tensor<T, cuda>();
  if (state.lse.empty() || state.lse.shape() != Shape{n})
    state.lse = Tensor<T, cuda>::uninitialized(Shape{n});
  state.entropy = Tensor<T, cuda>::uninitialized(Shape{n});  // lse and entropy: one per row
  detail::similarity_forward_cuda(u, r, p, state.lse, state.entropy, args.seq_len,
                                  static_cast<T>(1.0 / state.tau), args.causal);
}

// Similarity backward: dr assigned (S recomputed from u and lse); du accumulated unless detached.
template <class T>
void similarity_graph_backward(cuda, const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                               const Tensor<T, cuda>& p, const Tensor<T, cuda>& dp,
                               const SimilarityGraphArgs& args, SimilarityGraphParams<T, cuda>& params,
                               SimilarityGraphState<T, cuda>& state, Tensor<T, cuda>& dr,
                               Tensor<T, cuda>& du) {
  if (!detail::similarity_fused(args)) {
    if constexpr (std::is_same_v<T, float>) {
      if (args.precision == GraphPrecision::BF16) {
        detail::similarity_blocks_backward<T, __nv_bfloat16>(u, r, p, dp, args, params, state,
                                                             dr, du);
        return;
      }
    }
    detail::similarity_blocks_backward<T, T>(u, r, p, dp, args, params, state, dr, du);
    return;
  }
  detail::similarity_backward_cuda(u, r, p, dp, state.lse, dr, args.detach ? nullptr : du.data(),
                                   args.seq_len, static_cast<T>(1.0 / state.tau), args.causal);
}

// log_tau = log(tau) and W_s = I, for the parameters that are not empty (written on the host,
// copied to the device).
template <class T>
void similarity_graph_init(cuda, SimilarityGraphParams<T, cuda>& params, double tau) {
  if (!params.log_tau.empty()) {
    Tensor<T, cpu> h(Shape{1});
    h.data()[0] = static_cast<T>(std::log(tau));
    to_device(h, params.log_tau);
  }
  if (!params.w_s.empty()) {
    Tensor<T, cpu> h(params.w_s.shape());  // zero-initialised
    const index_t d = h.dim(0);
    for (index_t i = 0; i < d; ++i) h.data()[i * d + i] = T(1);
    to_device(h, params.w_s);
  }
}

template <class T>
double similarity_graph_mean_entropy(cuda, const SimilarityGraphState<T, cuda>& state) {
  return detail::device_mean(state.entropy);
}

// Attention forward: h* per token from the attention-row entropies (the cache's row_entropy, or
// computed from probs), |m_hj|^2 of every head (M_h = H V_h W_o,h^T + b_o), the logits
// log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2 of every row with its head (the masked queries:
// see the file comment), their softmax (stored, (N, T)) and p = A^p r. Returns the first
// all-zero attention row (index b * len + i). The (T, T) products read their operands as In:
// T (Exact, TF32) or bf16 copies (BF16; attention_graph_forward chooses).
namespace detail {
template <class In, class T>
Offender attention_forward_as(const Tensor<T, cuda>& r, const AttentionCache<T, cuda>& c,
                              const AttentionGraphArgs& args, AttentionGraphState<T, cuda>& state,
                              Tensor<T, cuda>& p) {
  const index_t n = r.rows(), len = args.seq_len, nh = c.num_heads, nb = n / len, e = r.cols();
  const index_t dm = args.d_model;
  state.stores = true;
  state.seq_len = len;
  if (state.post.empty() || state.post.shape() != Shape{n, len})
    state.post = Tensor<T, cuda>::uninitialized(Shape{n, len});  // every row written below
  if (state.entropy.empty() || state.entropy.shape() != Shape{n})
    state.entropy = Tensor<T, cuda>::uninitialized(Shape{n});
  if (state.head_dev.empty() || state.head_dev.shape() != Shape{n})
    state.head_dev = Tensor<std::int32_t, cuda>::uninitialized(Shape{n});
  state.heads.clear();  // on the device only (attention_graph_heads)
  if (n == 0) return {};
  const T inv_var = static_cast<T>(1.0 / (args.sigma * args.sigma));

  // h* per token
  // (the cache's entropies when it has them; otherwise computed into scratch; no copy either way)
  Tensor<T, cuda> ent_scratch;
  const T* ent = c.row_entropy.data();
  if (c.row_entropy.empty()) {
    ent_scratch = Tensor<T, cuda>::uninitialized(Shape{nb, nh, len});
    detail::launch_kernel<detail::attention_row_entropy_kernel<T>>(
        detail::graph_warp_rows_blocks(nb * nh * len), detail::kThreads, c.probs.data(),
        ent_scratch.data(), nb * nh * len, len);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    ent = ent_scratch.data();
  }
  auto prefix = Tensor<double, cuda>::uninitialized(Shape{nb, nh});  // zeroed by the kernel
  detail::launch_kernel<detail::attention_choose_heads_kernel<T>>(
      detail::grid_for(nb), detail::kThreads, ent, nb, nh, len, args.causal_heads,
      prefix.data(), state.head_dev.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // the posterior rows of every head at once (file comment)
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  const index_t dvc = c.v.cols();
  // scratch, every entry written before it is read (GEMMs with beta = 0 and row kernels)
  const index_t dh = dvc / nh;
  const bool bias = !c.b_o.empty();
  auto gram = Tensor<T, cuda>::uninitialized(Shape{nh, dh, dh});
  auto z = Tensor<T, cuda>::uninitialized(Shape{n, dvc});
  auto cvec = Tensor<T, cuda>::uninitialized(Shape{bias ? nh * dh : 0});
  auto msq = Tensor<T, cuda>::uninitialized(Shape{n, nh});
  // the masked queries, kept for the backward (every entry written)
  if (state.queries.empty() || state.queries.shape() != Shape{n, dvc})
    state.queries = Tensor<T, cuda>::uninitialized(Shape{n, dvc});
  Tensor<T, cuda>& q = state.queries;
  auto g = Tensor<T, cuda>::uninitialized(Shape{n, len});
  // |m_hj|^2 - |b_o|^2 of every head (N, H)
  detail::attention_gram_terms(c, dm, gram, z, cvec);
  detail::launch_kernel<detail::attention_msq_kernel<T>>(
      detail::grid_for(n * nh), detail::kThreads, c.v.data(), z.data(),
      bias ? cvec.data() : nullptr, msq.data(), n, nh, dh, static_cast<T>(nh));
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::attention_masked_queries(args.precision, c, dm, state.head_dev, q);
  // g = Q~ V^T per sequence (T, T): q_hi . v_hj (a_i . b_o cancels in the softmax); causal: the
  // row blocks' columns only (the kernel reads no column above the diagonal)
  const std::vector<detail::AttentionRowBlock> blocks = detail::attention_row_blocks(len, c.causal);
  detail::GraphOperands<T, In> ops;
  const In* qin = ops(q);
  const In* vin = ops(c.v);
  for (const detail::AttentionRowBlock& blk : blocks)
    detail::graph_gemm_prec<In, T>(args.precision, Trans::N, Trans::T, blk.rows, blk.cols, dvc,
                                   T(1), qin + blk.i0 * dvc, dvc, len * dvc, vin, dvc, len * dvc,
                                   T(0), g.data() + blk.i0 * len, len, len * len, nb);
  detail::launch_kernel<detail::attention_posterior_rows_kernel<T>>(
      detail::grid_for_rows(n), detail::threads_for_row(len), c.probs.data(), g.data(), msq.data(),
      state.head_dev.data(), state.post.data(), state.entropy.data(), bad.get(), n, nh, len,
      inv_var, c.causal);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // p = A^p r per sequence (on a flagged row's values when the check is deferred: arithmetic)
  const In* postin = ops(state.post);
  const In* rin = ops(r);
  for (const detail::AttentionRowBlock& blk : blocks)
    detail::graph_gemm_prec<In, T>(args.precision, Trans::N, Trans::N, blk.rows, e, blk.cols, T(1),
                                   postin + blk.i0 * len, len, len * len, rin, e, len * e, T(0),
                                   p.data() + blk.i0 * e, e, len * e, nb);
  // flagged index (b nh + h) len + i -> token row b len + i
  return bad.result<Offender>("Attention", [nh, len](index_t f) {
    return Offender{(f / (nh * len)) * len + f % len, 0.0};
  });
}
}  // namespace detail

template <class T>
Offender attention_graph_forward(cuda, const Tensor<T, cuda>& r, const AttentionCache<T, cuda>& c,
                                 const AttentionGraphArgs& args,
                                 AttentionGraphState<T, cuda>& state, Tensor<T, cuda>& p) {
  if constexpr (std::is_same_v<T, float>) {
    if (args.precision == GraphPrecision::BF16)
      return detail::attention_forward_as<__nv_bfloat16>(r, c, args, state, p);
  }
  return detail::attention_forward_as<T>(r, c, args, state, p);
}

// h* of every token of the last forward, read back from the device.
template <class T>
std::vector<int> attention_graph_heads(cuda, const AttentionGraphState<T, cuda>& state) {
  if (state.head_dev.empty()) return {};
  const Tensor<std::int32_t, cpu> h = to_host(state.head_dev);
  return std::vector<int>(h.data(), h.data() + h.numel());
}

// Attention backward: dr = A^p^T dp assigned; unless detached, dl = A^p o (dp r^T - rowdot(dp, p))
// into dprobs, dout, dv, dw_o and db_o (accumulated; the file comment has the products). The
// (T, T) products' operands as In, as in forward.
namespace detail {
template <class In, class T>
void attention_backward_as(const Tensor<T, cuda>& r, const Tensor<T, cuda>& p,
                           const Tensor<T, cuda>& dp, AttentionCache<T, cuda>& c,
                           const AttentionGraphArgs& args, AttentionGraphState<T, cuda>& state,
                           Tensor<T, cuda>& dr) {
  const index_t n = r.rows(), len = args.seq_len, nh = c.num_heads, nb = n / len, e = r.cols();
  const index_t dm = args.d_model, dvc = c.v.cols(), dh = dvc / nh;
  if (n == 0) return;
  // dr = A^p^T dp per sequence; causal: block by block from the last (which reaches column len
  // and assigns), each earlier one adding to the rows below its last column
  const GraphPrecision prec = args.precision;
  const std::vector<detail::AttentionRowBlock> blocks = detail::attention_row_blocks(len, c.causal);
  detail::GraphOperands<T, In> ops;
  const In* postin = ops(state.post);
  const In* dpin = ops(dp);
  for (std::size_t k = blocks.size(); k-- > 0;) {
    const detail::AttentionRowBlock& blk = blocks[k];
    detail::graph_gemm_prec<In, T>(prec, Trans::T, Trans::N, blk.cols, e, blk.rows, T(1),
                                   postin + blk.i0 * len, len, len * len, dpin + blk.i0 * e, e,
                                   len * e, k + 1 == blocks.size() ? T(0) : T(1), dr.data(), e,
                                   len * e, nb);
  }
  if (args.detach) return;
  const T inv_var = static_cast<T>(1.0 / (args.sigma * args.sigma));
  const T fh = static_cast<T>(nh);
  const index_t nt = n * len;

  // dl = A^p o (dp r^T - rowdot(dp, p))   (N, T)
  // scratch below: every entry written before it is read (GEMMs with beta = 0, row kernels)
  auto rowdot = Tensor<T, cuda>::uninitialized(Shape{n});
  auto dl = Tensor<T, cuda>::uninitialized(Shape{n, len});
  detail::graph_row_dot_cuda(dp, p, rowdot);
  const In* rin = ops(r);
  for (const detail::AttentionRowBlock& blk : blocks)
    detail::graph_gemm_prec<In, T>(prec, Trans::N, Trans::T, blk.rows, blk.cols, e, T(1),
                                   dpin + blk.i0 * e, e, len * e, rin, e, len * e, T(0),
                                   dl.data() + blk.i0 * len, len, len * len, nb);
  // (causal: every entry above the diagonal set to 0, so that dL is whole for the column sums)
  detail::launch_kernel<detail::attention_dlogit_kernel<T>>(
      detail::grid_for(nt), detail::kThreads, state.post.data(), rowdot.data(), dl.data(), n, len,
      c.causal);
  GRAPHMOE_CUDA_CHECK_LAUNCH();

  // each row's dL into dA at its head: dA += dl / A where A > 0
  if (!c.dprobs.empty()) {
    detail::launch_kernel<detail::attention_dprobs_kernel<T>>(
        detail::grid_for(nt), detail::kThreads, dl.data(), c.probs.data(), state.head_dev.data(),
        c.dprobs.data(), n, nh, len, c.causal);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  // the masked queries (the forward's) and their gradient, every head at once
  const Tensor<T, cuda>& q = state.queries;
  const bool dq_needed = !c.dout.empty() || !c.dw_o.empty();
  const In* dlin = dq_needed || !c.dv.empty() ? ops(dl) : nullptr;
  // dQ~ = mask_heads((H / sigma^2) dL V) per sequence; dout += dQ~ W_o^T; dW_o += Aout^T dQ~
  if (dq_needed) {
    auto dq = Tensor<T, cuda>::uninitialized(Shape{n, dvc});
    const In* vin = ops(c.v);
    for (const detail::AttentionRowBlock& blk : blocks)
      detail::graph_gemm_prec<In, T>(prec, Trans::N, Trans::N, blk.rows, dvc, blk.cols,
                                     fh * inv_var, dlin + blk.i0 * len, len, len * len, vin, dvc,
                                     len * dvc, T(0), dq.data() + blk.i0 * dvc, dvc, len * dvc, nb);
    detail::launch_kernel<detail::attention_mask_heads_kernel<T>>(
        detail::grid_for(n * dvc), detail::kThreads, dq.data(), state.head_dev.data(), n, nh, dh);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    if (!c.dout.empty())
      detail::graph_gemm_prec<T, T>(prec, Trans::N, Trans::T, n, dm, dvc, T(1), dq.data(), dvc, 0,
                                    c.w_o.data(), dvc, 0, T(1), c.dout.data(), dm, 0, 1);
    if (!c.dw_o.empty())
      detail::graph_gemm_prec<T, T>(prec, Trans::T, Trans::N, dm, dvc, n, T(1), c.out.data(), dm, 0,
                                    dq.data(), dvc, 0, T(1), c.dw_o.data(), dvc, 0, 1);
  }
  // dV += dL^T Q~ / sigma^2 per sequence
  if (!c.dv.empty()) {
    const In* qin = ops(q);
    for (const detail::AttentionRowBlock& blk : blocks)
      detail::graph_gemm_prec<In, T>(prec, Trans::T, Trans::N, blk.cols, dvc, blk.rows, inv_var,
                                     dlin + blk.i0 * len, len, len * len, qin + blk.i0 * dvc, dvc,
                                     len * dvc, T(1), c.dv.data(), dvc, len * dvc, nb);
  }
  // the terms of -|m_hj|^2 / (2 sigma^2), every head at once through the Gram terms (the kernels'
  // comment): with Y_h = colsum_h o V_h and s_h = V_h^T colsum_h,
  //   dV_h   -= (H / sigma^2) colsum_h o (H Z_h + c_h)
  //   dW_o,h -= (H / sigma^2) (H W_h V_h^T Y_h + b_o s_h^T)
  //   db_o   -= (H W_o s + b_o sum(colsum)) / sigma^2
  if (c.dw_o.empty() && c.dv.empty() && c.db_o.empty()) return;
  // colsum[j, h] = sum over the rows i of head h of dl_ij: per sequence dl^T onehot(h*)
  auto onehot = Tensor<T, cuda>::uninitialized(Shape{n, nh});
  auto colsum = Tensor<T, cuda>::uninitialized(Shape{n, nh});
  detail::launch_kernel<detail::attention_head_onehot_kernel<T>>(
      detail::grid_for(n * nh), detail::kThreads, state.head_dev.data(), onehot.data(), n, nh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::graph_gemm(Trans::T, Trans::N, len, nh, len, T(1), dl.data(), len, len * len,
                     onehot.data(), nh, len * nh, T(0), colsum.data(), nh, len * nh, nb);
  const bool bias = !c.b_o.empty();
  auto svec = Tensor<T, cuda>::uninitialized(Shape{dvc});
  if (!c.dv.empty()) {  // the Gram terms: only this one needs them
    auto gram = Tensor<T, cuda>::uninitialized(Shape{nh, dh, dh});
    auto z = Tensor<T, cuda>::uninitialized(Shape{n, dvc});
    auto cvec = Tensor<T, cuda>::uninitialized(Shape{bias ? nh * dh : 0});
    detail::attention_gram_terms(c, dm, gram, z, cvec);
    detail::launch_kernel<detail::attention_dv_mean_kernel<T>>(
        detail::grid_for(n * dvc), detail::kThreads, z.data(), bias ? cvec.data() : nullptr,
        colsum.data(), c.dv.data(), n, nh, dh, fh, fh * inv_var);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  if (!c.dw_o.empty() || !c.db_o.empty())  // s_h = V_h^T colsum_h (H dh)
    detail::graph_gemm(Trans::T, Trans::N, dh, index_t(1), n, T(1), c.v.data(), dvc, dh,
                       colsum.data(), nh, 1, T(0), svec.data(), index_t(1), dh, nh);
  if (!c.dw_o.empty()) {
    auto y = Tensor<T, cuda>::uninitialized(Shape{n, dvc});
    auto kmat = Tensor<T, cuda>::uninitialized(Shape{nh, dh, dh});
    detail::launch_kernel<detail::attention_scale_heads_kernel<T>>(
        detail::grid_for(n * dvc), detail::kThreads, c.v.data(), colsum.data(), y.data(), n, nh, dh);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    // K_h = V_h^T Y_h; dW_o,h -= (H^2 / sigma^2) W_h K_h
    detail::graph_gemm(Trans::T, Trans::N, dh, dh, n, T(1), c.v.data(), dvc, dh, y.data(), dvc, dh,
                       T(0), kmat.data(), dh, dh * dh, nh);
    detail::graph_gemm(Trans::N, Trans::N, dm, dh, dh, -fh * fh * inv_var, c.w_o.data(), dvc, dh,
                       kmat.data(), dh, dh * dh, T(1), c.dw_o.data(), dvc, dh, nh);
    if (bias)  // dW_o -= (H / sigma^2) b_o s^T
      detail::graph_gemm(Trans::N, Trans::N, dm, dvc, index_t(1), -fh * inv_var, c.b_o.data(),
                         index_t(1), 0, svec.data(), dvc, 0, T(1), c.dw_o.data(), dvc, 0, 1);
  }
  if (!c.db_o.empty() && bias) {  // db_o -= (H W_o s + b_o sum(colsum)) / sigma^2
    detail::graph_gemm(Trans::N, Trans::N, dm, index_t(1), dvc, -fh * inv_var, c.w_o.data(), dvc, 0,
                       svec.data(), index_t(1), 0, T(1), c.db_o.data(), index_t(1), 0, 1);
    detail::launch_kernel<detail::attention_db_bias_kernel<T>>(
        1, detail::kThreads, colsum.data(), n * nh, c.b_o.data(), c.db_o.data(), dm, inv_var);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace detail

template <class T>
void attention_graph_backward(cuda, const Tensor<T, cuda>& r, const Tensor<T, cuda>& p,
                              const Tensor<T, cuda>& dp, AttentionCache<T, cuda>& c,
                              const AttentionGraphArgs& args, AttentionGraphState<T, cuda>& state,
                              Tensor<T, cuda>& dr) {
  if constexpr (std::is_same_v<T, float>) {
    if (args.precision == GraphPrecision::BF16) {
      detail::attention_backward_as<__nv_bfloat16>(r, p, dp, c, args, state, dr);
      return;
    }
  }
  detail::attention_backward_as<T>(r, p, dp, c, args, state, dr);
}

template <class T>
double attention_graph_mean_entropy(cuda, const AttentionGraphState<T, cuda>& state) {
  return detail::device_mean(state.entropy);
}

// The mean of the self weights, in double (the CUDA graphs leave them empty: never called there
// by the graph classes, which answer 1 for an empty tensor).
template <class T>
double token_graph_mean_self_weight(cuda, const Tensor<T, cuda>& self) {
  return detail::device_mean(self);
}

}  // namespace graphmoe
