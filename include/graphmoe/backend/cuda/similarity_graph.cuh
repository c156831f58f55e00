// graphmoe/backend/cuda/similarity_graph.cuh: the CUDA system's Similarity token graph (contract,
// options and argument checks: ops/token_graph.hpp, which calls the entry points at the end of
// this file through the backend tag; how the CUDA graphs differ from the CPU's: token_graph.cuh).
// Two paths: the block path (similarity_blocks.cuh: cuBLAS products, on TF32 / bf16 tensor cores
// under a reduced precision, and fused masked-softmax row kernels) for GraphPrecision::TF32 / BF16
// and any of a learned temperature, exclude_self and projection; and the fused kernels below
// (GraphPrecision::Exact without those options, the fp32 reference), which never store S. The
// element math is in detail/token_graph_math.hpp, shared with the host test.
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
#pragma once

#include <climits>
#include <cmath>
#include <type_traits>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/graph_products.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/token_graph_math.hpp"
#include "graphmoe/backend/cuda/similarity_blocks.cuh"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe::detail {

namespace tgm = graph_math;

static_assert(tgm::kStreamTile == 32 && tgm::kThreads == 256 &&
                  2 * (tgm::kThreads / tgm::kStreamTile) == tgm::kOwnTile,
              "similarity_graph.cuh: the thread mapping needs 256 threads, 16 owned rows, "
              "32 lanes");

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

// ---- the backend entry points (ops/token_graph.hpp checks the arguments and prepares p / dr) ----

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

}  // namespace graphmoe
