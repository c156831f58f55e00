// graphmoe/backend/cuda/attention_graph.cuh: the CUDA system's Attention token graph, the
// posterior A^p of the lowest-entropy head h* (contract, options and argument checks:
// ops/token_graph.hpp, which calls the entry points at the end of this file through the backend
// tag; how the CUDA graphs differ from the CPU's: token_graph.cuh). The element math is in
// detail/token_graph_math.hpp, shared with the host test.
//
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
// from forward to backward (state.backend.queries); scratch: G (N, T) in forward, dL (N, T) and dQ~
// (N, D) in backward. A causal attention layer (AttentionCache::causal) has A = 0 above the
// diagonal, so A^p and dL are 0 there: the (T, T)-sized products (G, p, dr, dp r^T, dQ~, dV) run
// in blocks of kAttentionCausalRows rows of every sequence whose columns stop at the block's last
// row (attention_row_blocks), about half the work at long sequences (9/16 at T = 2048 in blocks
// of 256, 3/4 at T = 512); the kernels write 0 above the diagonal without reading the uncomputed
// half. Under GraphPrecision::TF32 the (T, T) products (G, p, dr, dp r^T, dQ~, dV)
// run on TF32 tensor cores (graph_gemm_math of detail/graph_products.cuh), and so do the
// (N, D, dm)-sized ones (Q~, dout, dW_o); the Gram terms (O(N dh^2)) stay fp32. Under
// GraphPrecision::BF16 the (T, T) products read bf16 copies of their operands (GraphOperands of
// detail/graph_products.cuh: Q~, V, A^p, r, dp, dL, each converted once per call) with fp32
// accumulation and output, and the (N, D, dm) ones (which read float) run on TF32, as the
// Similarity graph's projection does (similarity_projection_precision).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/graph_products.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/token_graph_math.hpp"
#include "graphmoe/backend/cuda/similarity_blocks.cuh"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

// What the CUDA Attention graph keeps of a forward (core/token_graph.hpp): everything stays on
// the device.
template <class T>
struct AttentionGraphBackendState<T, cuda> {
  Tensor<T, cuda> entropy;              // (N) H(A^p[i, :])
  Tensor<std::int32_t, cuda> head_dev;  // (N) h*
  Tensor<T, cuda> queries;              // (N, H dh) each row's queries, masked to its head
};

}  // namespace graphmoe

namespace graphmoe::detail {

namespace tgm = graph_math;

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

// ---- the shapes and the products ----------------------------------------------------------------

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

// One call's dimensions: N = nb len tokens, E experts, H heads of dh (dvc = H dh), d_model dm;
// the row blocks of its (T, T) products and how they compute (tt), and the (N, D, dm)-sized ones
// (nd: float on TF32 under either reduced precision).
template <class In, class T>
struct AttentionCall {
  index_t n, len, nb, e, nh, dh, dvc, dm;
  bool bias;
  std::vector<AttentionRowBlock> blocks;
  GemmMath tt, nd;

  AttentionCall(const Tensor<T, cuda>& r, const AttentionCache<T, cuda>& c,
                const AttentionGraphArgs& args)
      : n(r.rows()), len(args.seq_len), nb(r.rows() / args.seq_len), e(r.cols()),
        nh(c.num_heads), dh(c.v.cols() / c.num_heads), dvc(c.v.cols()), dm(args.d_model),
        bias(!c.b_o.empty()), blocks(attention_row_blocks(args.seq_len, c.causal)),
        tt(graph_gemm_math<In>(args.precision)), nd(graph_gemm_math<T>(args.precision)) {}

  // An (N, cols) tensor's matrices per sequence, and an (N, H dh) or (dm, H dh) tensor's per head.
  template <class X>
  MatrixBatch<X> seqs(X* x, index_t cols) const {
    return per_sequence(x, cols, len);
  }
  template <class X>
  MatrixBatch<X> heads(X* x) const {
    return {x, dvc, dh};
  }
  // The (dh, dh) matrices of a (H, dh, dh) tensor and the dh-vectors of a (H, dh) one.
  template <class X>
  MatrixBatch<X> squares(X* x) const {
    return {x, dh, dh * dh};
  }
  template <class X>
  MatrixBatch<X> columns(X* x) const {
    return {x, 1, dh};
  }
};

// The Gram terms of the means (the kernels' comment above): g (H, dh, dh) = W_h^T W_h, z (N, H dh)
// with z_h = V_h G_h, and with a bias cvec (H, dh) = W_h^T b_o; three products batched over the
// heads.
template <class In, class T>
void attention_gram_terms(const AttentionCall<In, T>& s, const AttentionCache<T, cuda>& c,
                          Tensor<T, cuda>& g, Tensor<T, cuda>& z, Tensor<T, cuda>& cvec) {
  constexpr const char* op = "Attention";
  batched_gemm(s.dh, s.dh, s.dm, T(1), s.heads(c.w_o.data()).t(), s.heads(c.w_o.data()), T(0),
               s.squares(g.data()), s.nh, GemmMath::Default, op);
  batched_gemm(s.n, s.dh, s.dh, T(1), s.heads(c.v.data()), s.squares(g.data()), T(0),
               s.heads(z.data()), s.nh, GemmMath::Default, op);
  if (s.bias)
    batched_gemm(s.dh, index_t(1), s.dm, T(1), s.heads(c.w_o.data()).t(), whole(c.b_o.data(), 1),
                 T(0), s.columns(cvec.data()), s.nh, GemmMath::Default, op);
}

// q~ = mask_heads(H Aout W_o) (N, H dh): row i holds its head's queries q_{h*(i) i} in that head's
// columns and 0 in the others (a_i . m_hj = q_hi . v_hj + a_i . b_o).
template <class In, class T>
void attention_masked_queries(const AttentionCall<In, T>& s, const AttentionCache<T, cuda>& c,
                              const Tensor<std::int32_t, cuda>& heads, Tensor<T, cuda>& q) {
  batched_gemm(s.n, s.dvc, s.dm, static_cast<T>(s.nh), whole(c.out.data(), s.dm),
               whole(c.w_o.data(), s.dvc), T(0), whole(q.data(), s.dvc), 1, s.nd, "Attention");
  launch_kernel<attention_mask_heads_kernel<T>>(grid_for(s.n * s.dvc), kThreads, q.data(),
                                                heads.data(), s.n, s.nh, s.dh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// ---- forward ------------------------------------------------------------------------------------

// Attention forward: h* per token from the attention-row entropies (the cache's row_entropy, or
// computed from probs), |m_hj|^2 of every head (M_h = H V_h W_o,h^T + b_o), the logits
// log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2 of every row with its head (the masked queries:
// see the file comment), their softmax (stored, (N, T)) and p = A^p r. Returns the first
// all-zero attention row (index b * len + i). The (T, T) products read their operands as In:
// T (Exact, TF32) or bf16 copies (BF16; attention_graph_forward chooses).
template <class In, class T>
Offender attention_forward_as(const Tensor<T, cuda>& r, const AttentionCache<T, cuda>& c,
                              const AttentionGraphArgs& args, AttentionGraphState<T, cuda>& state,
                              Tensor<T, cuda>& p) {
  const AttentionCall<In, T> s(r, c, args);
  const index_t n = s.n, len = s.len, nh = s.nh, nb = s.nb;
  state.stores = true;
  state.seq_len = len;
  if (state.post.empty() || state.post.shape() != Shape{n, len})
    state.post = Tensor<T, cuda>::uninitialized(Shape{n, len});  // every row written below
  if (state.backend.entropy.empty() || state.backend.entropy.shape() != Shape{n})
    state.backend.entropy = Tensor<T, cuda>::uninitialized(Shape{n});
  if (state.backend.head_dev.empty() || state.backend.head_dev.shape() != Shape{n})
    state.backend.head_dev = Tensor<std::int32_t, cuda>::uninitialized(Shape{n});
  if (n == 0) return {};
  const T inv_var = static_cast<T>(1.0 / (args.sigma * args.sigma));

  // h* per token
  // (the cache's entropies when it has them; otherwise computed into scratch; no copy either way)
  Tensor<T, cuda> ent_scratch;
  const T* ent = c.row_entropy.data();
  if (c.row_entropy.empty()) {
    ent_scratch = Tensor<T, cuda>::uninitialized(Shape{nb, nh, len});
    launch_kernel<attention_row_entropy_kernel<T>>(graph_warp_rows_blocks(nb * nh * len), kThreads,
                                                   c.probs.data(), ent_scratch.data(),
                                                   nb * nh * len, len);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    ent = ent_scratch.data();
  }
  auto prefix = Tensor<double, cuda>::uninitialized(Shape{nb, nh});  // zeroed by the kernel
  launch_kernel<attention_choose_heads_kernel<T>>(grid_for(nb), kThreads, ent, nb, nh, len,
                                                  args.causal_heads, prefix.data(),
                                                  state.backend.head_dev.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // the posterior rows of every head at once (file comment)
  FirstIndexFlag bad{FirstIndexFlag::Deferrable{}};
  // scratch, every entry written before it is read (GEMMs with beta = 0 and row kernels)
  auto gram = Tensor<T, cuda>::uninitialized(Shape{nh, s.dh, s.dh});
  auto z = Tensor<T, cuda>::uninitialized(Shape{n, s.dvc});
  auto cvec = Tensor<T, cuda>::uninitialized(Shape{s.bias ? nh * s.dh : 0});
  auto msq = Tensor<T, cuda>::uninitialized(Shape{n, nh});
  // the masked queries, kept for the backward (every entry written)
  if (state.backend.queries.empty() || state.backend.queries.shape() != Shape{n, s.dvc})
    state.backend.queries = Tensor<T, cuda>::uninitialized(Shape{n, s.dvc});
  Tensor<T, cuda>& q = state.backend.queries;
  auto g = Tensor<T, cuda>::uninitialized(Shape{n, len});
  // |m_hj|^2 - |b_o|^2 of every head (N, H)
  attention_gram_terms(s, c, gram, z, cvec);
  launch_kernel<attention_msq_kernel<T>>(grid_for(n * nh), kThreads, c.v.data(), z.data(),
                                         s.bias ? cvec.data() : nullptr, msq.data(), n, nh, s.dh,
                                         static_cast<T>(nh));
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  attention_masked_queries(s, c, state.backend.head_dev, q);
  // G = Q~ V^T per sequence (T, T): q_hi . v_hj (a_i . b_o cancels in the softmax); causal: the
  // row blocks' columns only (the kernel reads no column above the diagonal)
  GraphOperands<T, In> ops;
  const In* qin = ops(q);
  const In* vin = ops(c.v);
  for (const AttentionRowBlock& blk : s.blocks)
    batched_gemm(blk.rows, blk.cols, s.dvc, T(1), s.seqs(qin, s.dvc).from_row(blk.i0),
                 s.seqs(vin, s.dvc).t(), T(0), s.seqs(g.data(), len).from_row(blk.i0), nb, s.tt,
                 "Attention");
  launch_kernel<attention_posterior_rows_kernel<T>>(
      grid_for_rows(n), threads_for_row(len), c.probs.data(), g.data(), msq.data(),
      state.backend.head_dev.data(), state.post.data(), state.backend.entropy.data(), bad.get(), n, nh, len,
      inv_var, c.causal);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // p = A^p r per sequence (on a flagged row's values when the check is deferred: arithmetic)
  const In* postin = ops(state.post);
  const In* rin = ops(r);
  for (const AttentionRowBlock& blk : s.blocks)
    batched_gemm(blk.rows, s.e, blk.cols, T(1), s.seqs(postin, len).from_row(blk.i0),
                 s.seqs(rin, s.e), T(0), s.seqs(p.data(), s.e).from_row(blk.i0), nb, s.tt,
                 "Attention");
  // flagged index (b nh + h) len + i -> token row b len + i
  return bad.result<Offender>("Attention", [nh, len](index_t f) {
    return Offender{(f / (nh * len)) * len + f % len, 0.0};
  });
}

// ---- backward, one helper per gradient ----------------------------------------------------------
// (the file comment has the math; In: the (T, T) products' operand type, as in forward)

// dr = A^p^T dp per sequence; causal: block by block from the last (which reaches column len and
// assigns), each earlier one adding to the rows below its last column.
template <class In, class T>
void attention_backward_dr(const AttentionCall<In, T>& s, const In* post, const In* dp,
                           Tensor<T, cuda>& dr) {
  for (std::size_t k = s.blocks.size(); k-- > 0;) {
    const AttentionRowBlock& blk = s.blocks[k];
    batched_gemm(blk.cols, s.e, blk.rows, T(1), s.seqs(post, s.len).from_row(blk.i0).t(),
                 s.seqs(dp, s.e).from_row(blk.i0), k + 1 == s.blocks.size() ? T(0) : T(1),
                 s.seqs(dr.data(), s.e), s.nb, s.tt, "Attention");
  }
}

// dL = A^p o (dp r^T - rowdot(dp, p))   (N, T); causal: 0 above the diagonal, so that dL is whole
// for the column sums.
template <class In, class T>
Tensor<T, cuda> attention_backward_dlogits(const AttentionCall<In, T>& s,
                                           const Tensor<T, cuda>& post, const Tensor<T, cuda>& p,
                                           const Tensor<T, cuda>& dp, const In* dpin,
                                           const In* rin, bool causal) {
  // scratch: every entry written before it is read (GEMMs with beta = 0, row kernels)
  auto rowdot = Tensor<T, cuda>::uninitialized(Shape{s.n});
  auto dl = Tensor<T, cuda>::uninitialized(Shape{s.n, s.len});
  graph_row_dot_cuda(dp, p, rowdot);
  for (const AttentionRowBlock& blk : s.blocks)
    batched_gemm(blk.rows, blk.cols, s.e, T(1), s.seqs(dpin, s.e).from_row(blk.i0),
                 s.seqs(rin, s.e).t(), T(0), s.seqs(dl.data(), s.len).from_row(blk.i0), s.nb,
                 s.tt, "Attention");
  launch_kernel<attention_dlogit_kernel<T>>(grid_for(s.n * s.len), kThreads, post.data(),
                                            rowdot.data(), dl.data(), s.n, s.len, causal);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return dl;
}

// dA at each row's head += dL / A where A > 0.
template <class In, class T>
void attention_backward_dprobs(const AttentionCall<In, T>& s, const Tensor<T, cuda>& dl,
                               AttentionCache<T, cuda>& c,
                               const Tensor<std::int32_t, cuda>& heads) {
  launch_kernel<attention_dprobs_kernel<T>>(grid_for(s.n * s.len), kThreads, dl.data(),
                                            c.probs.data(), heads.data(), c.dprobs.data(), s.n,
                                            s.nh, s.len, c.causal);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dQ~ = mask_heads((H / sigma^2) dL V) per sequence;  dout += dQ~ W_o^T;  dW_o += Aout^T dQ~.
template <class In, class T>
void attention_backward_dqueries(const AttentionCall<In, T>& s, const In* dl, const In* v,
                                 AttentionCache<T, cuda>& c,
                                 const Tensor<std::int32_t, cuda>& heads, T inv_var) {
  constexpr const char* op = "Attention";
  auto dq = Tensor<T, cuda>::uninitialized(Shape{s.n, s.dvc});
  for (const AttentionRowBlock& blk : s.blocks)
    batched_gemm(blk.rows, s.dvc, blk.cols, static_cast<T>(s.nh) * inv_var,
                 s.seqs(dl, s.len).from_row(blk.i0), s.seqs(v, s.dvc), T(0),
                 s.seqs(dq.data(), s.dvc).from_row(blk.i0), s.nb, s.tt, op);
  launch_kernel<attention_mask_heads_kernel<T>>(grid_for(s.n * s.dvc), kThreads, dq.data(),
                                                heads.data(), s.n, s.nh, s.dh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  if (!c.dout.empty())
    batched_gemm(s.n, s.dm, s.dvc, T(1), whole(dq.data(), s.dvc), whole(c.w_o.data(), s.dvc).t(),
                 T(1), whole(c.dout.data(), s.dm), 1, s.nd, op);
  if (!c.dw_o.empty())
    batched_gemm(s.dm, s.dvc, s.n, T(1), whole(c.out.data(), s.dm).t(), whole(dq.data(), s.dvc),
                 T(1), whole(c.dw_o.data(), s.dvc), 1, s.nd, op);
}

// dV += dL^T Q~ / sigma^2 per sequence (the logits' a_i . m_j term).
template <class In, class T>
void attention_backward_dv_logits(const AttentionCall<In, T>& s, const In* dl, const In* q,
                                  Tensor<T, cuda>& dv, T inv_var) {
  for (const AttentionRowBlock& blk : s.blocks)
    batched_gemm(blk.cols, s.dvc, blk.rows, inv_var, s.seqs(dl, s.len).from_row(blk.i0).t(),
                 s.seqs(q, s.dvc).from_row(blk.i0), T(1), s.seqs(dv.data(), s.dvc), s.nb, s.tt,
                 "Attention");
}

// colsum[j, h] = sum over the rows i of head h of dL_ij (N, H): per sequence dL^T onehot(h*).
template <class In, class T>
Tensor<T, cuda> attention_backward_colsums(const AttentionCall<In, T>& s, const Tensor<T, cuda>& dl,
                                           const Tensor<std::int32_t, cuda>& heads) {
  auto onehot = Tensor<T, cuda>::uninitialized(Shape{s.n, s.nh});
  auto colsum = Tensor<T, cuda>::uninitialized(Shape{s.n, s.nh});
  launch_kernel<attention_head_onehot_kernel<T>>(grid_for(s.n * s.nh), kThreads, heads.data(),
                                                 onehot.data(), s.n, s.nh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  batched_gemm(s.len, s.nh, s.len, T(1), s.seqs(dl.data(), s.len).t(), s.seqs(onehot.data(), s.nh),
               T(0), s.seqs(colsum.data(), s.nh), s.nb, GemmMath::Default, "Attention");
  return colsum;
}

// dV_h -= (H / sigma^2) colsum_h o (M_h W_h), M_h W_h = H Z_h + c_h (the Gram terms): the
// -|m_j|^2 / (2 sigma^2) term's gradient in V.
template <class In, class T>
void attention_backward_dv_means(const AttentionCall<In, T>& s, AttentionCache<T, cuda>& c,
                                 const Tensor<T, cuda>& colsum, T inv_var) {
  auto gram = Tensor<T, cuda>::uninitialized(Shape{s.nh, s.dh, s.dh});
  auto z = Tensor<T, cuda>::uninitialized(Shape{s.n, s.dvc});
  auto cvec = Tensor<T, cuda>::uninitialized(Shape{s.bias ? s.nh * s.dh : 0});
  attention_gram_terms(s, c, gram, z, cvec);
  const T fh = static_cast<T>(s.nh);
  launch_kernel<attention_dv_mean_kernel<T>>(grid_for(s.n * s.dvc), kThreads, z.data(),
                                             s.bias ? cvec.data() : nullptr, colsum.data(),
                                             c.dv.data(), s.n, s.nh, s.dh, fh, fh * inv_var);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// s_h = V_h^T colsum_h (H, dh).
template <class In, class T>
Tensor<T, cuda> attention_backward_head_sums(const AttentionCall<In, T>& s,
                                             const AttentionCache<T, cuda>& c,
                                             const Tensor<T, cuda>& colsum) {
  auto svec = Tensor<T, cuda>::uninitialized(Shape{s.dvc});
  batched_gemm(s.dh, index_t(1), s.n, T(1), s.heads(c.v.data()).t(),
               MatrixBatch{colsum.data(), s.nh, index_t(1)}, T(0), s.columns(svec.data()), s.nh,
               GemmMath::Default, "Attention");
  return svec;
}

// dW_o,h -= (H / sigma^2) M_h^T (colsum_h o V_h) = (H / sigma^2) (H W_h V_h^T Y_h + b_o s_h^T),
// Y_h = colsum_h o V_h.
template <class In, class T>
void attention_backward_dw_o_means(const AttentionCall<In, T>& s, AttentionCache<T, cuda>& c,
                                   const Tensor<T, cuda>& colsum, const Tensor<T, cuda>& svec,
                                   T inv_var) {
  constexpr const char* op = "Attention";
  const T fh = static_cast<T>(s.nh);
  auto y = Tensor<T, cuda>::uninitialized(Shape{s.n, s.dvc});
  auto kmat = Tensor<T, cuda>::uninitialized(Shape{s.nh, s.dh, s.dh});
  launch_kernel<attention_scale_heads_kernel<T>>(grid_for(s.n * s.dvc), kThreads, c.v.data(),
                                                 colsum.data(), y.data(), s.n, s.nh, s.dh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // K_h = V_h^T Y_h;  dW_o,h -= (H^2 / sigma^2) W_h K_h
  batched_gemm(s.dh, s.dh, s.n, T(1), s.heads(c.v.data()).t(), s.heads(y.data()), T(0),
               s.squares(kmat.data()), s.nh, GemmMath::Default, op);
  batched_gemm(s.dm, s.dh, s.dh, -fh * fh * inv_var, s.heads(c.w_o.data()), s.squares(kmat.data()),
               T(1), s.heads(c.dw_o.data()), s.nh, GemmMath::Default, op);
  if (s.bias)  // dW_o -= (H / sigma^2) b_o s^T
    batched_gemm(s.dm, s.dvc, index_t(1), -fh * inv_var, whole(c.b_o.data(), 1),
                 whole(svec.data(), s.dvc), T(1), whole(c.dw_o.data(), s.dvc), 1,
                 GemmMath::Default, op);
}

// db_o -= sum_h M_h^T colsum_h / sigma^2 = (H W_o s + b_o sum(colsum)) / sigma^2.
template <class In, class T>
void attention_backward_db_o_means(const AttentionCall<In, T>& s, AttentionCache<T, cuda>& c,
                                   const Tensor<T, cuda>& colsum, const Tensor<T, cuda>& svec,
                                   T inv_var) {
  const T fh = static_cast<T>(s.nh);
  batched_gemm(s.dm, index_t(1), s.dvc, -fh * inv_var, whole(c.w_o.data(), s.dvc),
               whole(svec.data(), 1), T(1), whole(c.db_o.data(), 1), 1, GemmMath::Default,
               "Attention");
  launch_kernel<attention_db_bias_kernel<T>>(1, kThreads, colsum.data(), s.n * s.nh,
                                             c.b_o.data(), c.db_o.data(), s.dm, inv_var);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// Attention backward: dr = A^p^T dp assigned; unless detached, dL into dprobs, dout, dv, dw_o and
// db_o (accumulated), each by its helper above.
template <class In, class T>
void attention_backward_as(const Tensor<T, cuda>& r, const Tensor<T, cuda>& p,
                           const Tensor<T, cuda>& dp, AttentionCache<T, cuda>& c,
                           const AttentionGraphArgs& args, AttentionGraphState<T, cuda>& state,
                           Tensor<T, cuda>& dr) {
  const AttentionCall<In, T> s(r, c, args);
  if (s.n == 0) return;
  GraphOperands<T, In> ops;
  const In* postin = ops(state.post);
  const In* dpin = ops(dp);
  attention_backward_dr(s, postin, dpin, dr);
  if (args.detach) return;
  const T inv_var = static_cast<T>(1.0 / (args.sigma * args.sigma));
  const Tensor<T, cuda> dl =
      attention_backward_dlogits(s, state.post, p, dp, dpin, ops(r), c.causal);
  if (!c.dprobs.empty()) attention_backward_dprobs(s, dl, c, state.backend.head_dev);
  const bool dq_needed = !c.dout.empty() || !c.dw_o.empty();
  const In* dlin = dq_needed || !c.dv.empty() ? ops(dl) : nullptr;
  if (dq_needed) attention_backward_dqueries(s, dlin, ops(c.v), c, state.backend.head_dev, inv_var);
  if (!c.dv.empty()) attention_backward_dv_logits(s, dlin, ops(state.backend.queries), c.dv, inv_var);
  // the terms of -|m_hj|^2 / (2 sigma^2), every head at once through the Gram terms
  if (c.dw_o.empty() && c.dv.empty() && c.db_o.empty()) return;
  const Tensor<T, cuda> colsum = attention_backward_colsums(s, dl, state.backend.head_dev);
  if (!c.dv.empty()) attention_backward_dv_means(s, c, colsum, inv_var);
  const bool to_bias = !c.db_o.empty() && s.bias;
  if (c.dw_o.empty() && !to_bias) return;
  const Tensor<T, cuda> svec = attention_backward_head_sums(s, c, colsum);
  if (!c.dw_o.empty()) attention_backward_dw_o_means(s, c, colsum, svec, inv_var);
  if (to_bias) attention_backward_db_o_means(s, c, colsum, svec, inv_var);
}

}  // namespace graphmoe::detail

namespace graphmoe {

// ---- the backend entry points (ops/token_graph.hpp checks the arguments and prepares p / dr) ----

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
  if (state.backend.head_dev.empty()) return {};
  const Tensor<std::int32_t, cpu> h = to_host(state.backend.head_dev);
  return std::vector<int>(h.data(), h.data() + h.numel());
}

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
  return detail::device_mean(state.backend.entropy);
}

}  // namespace graphmoe
