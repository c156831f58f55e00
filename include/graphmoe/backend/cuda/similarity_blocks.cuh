// graphmoe/backend/cuda/similarity_blocks.cuh: the CUDA Similarity graph's block path, its
// (T, T) products on cuBLAS (tensor cores under GraphPrecision::TF32 / BF16) and its row work in
// fused masked-softmax kernels (internal; called by similarity_graph.cuh's entry points, which choose
// it for a reduced precision or any of exclude_self, projection and a learned temperature).
//
// As the CPU graph (backend/cpu/token_graph.hpp), in blocks of `bi` rows of every sequence at
// once (cuBLAS strided-batched over the sequences); a causal block only touches the columns
// j < i0 + bi, so causal products cost about half:
//   forward   L = Q_blk U^T / tau (nb, bi, jn)        one batched GEMM
//             S = masked row softmax of L; lse, H, S[i,i] per row     one kernel, a block per row
//             p_blk = S R                               one batched GEMM
//   backward  S recomputed (GEMM + the kernel below) or read from the stored rows;
//             G = dp_blk R^T;  dL = S o (G - c_i), c_i = dp_i . p_i   one GEMM, one kernel
//             dr += S^T dp_blk;  dQ_blk += dL U / tau;  dU += dL^T Q_blk / tau   three GEMMs
//             (learned tau: d loss / d log_tau = -sum_ij dL_ij L_ij, per row in the dL kernel,
//             summed on the host in double; projection: dU += dQ W_s^T, dW_s += U^T dQ)
// Q = U, or Q = U W_s under projection (that product in fp32, TF32 when the precision is not
// Exact).
//
// Precision: Exact runs every product in T (cublasSgemm / Dgemm, CUBLAS_DEFAULT_MATH: no TF32);
// TF32 hands the float operands to cuBLAS with CUBLAS_COMPUTE_32F_FAST_TF32 (GemmMath::TF32);
// BF16 converts U, Q, R and dp to bf16 once per call and the kernels write S and dL a second
// time in bf16, the GEMMs' inputs (CUDA_R_16BF, fp32 output and accumulation). Softmax, lse,
// entropies, c_i and every output stay fp32.
//
// Memory: with args.store S is kept (N, T) in state.s, as on the CPU; the block scratch (L or
// S, G, and their bf16 copies) lives in state.backend.work, which grows to the largest block seen and is
// kept between calls (no allocation or zero-fill per step). Block rows: as many as keep the
// scratch under kSimilarityBlockEntries entries per buffer, at most kSimilarityCausalRows in a
// causal graph (more blocks skip more of the masked half).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <deque>
#include <limits>
#include <type_traits>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/graph_products.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/config.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

// What the CUDA Similarity graph keeps for itself (core/token_graph.hpp): the block path's
// scratch, kept between calls (it grows to the largest block seen, never shrinks).
template <class T>
struct SimilarityGraphBackendState<T, cuda> {
  Tensor<T, cuda> work;
};

}  // namespace graphmoe

namespace graphmoe::detail {

// At most this many entries per (nb, bi, jn) scratch buffer (64 Mi: 256 MiB in float).
inline constexpr index_t kSimilarityBlockEntries = index_t(1) << 26;
// A causal graph's rows per block (at least; the scratch bound may allow fewer only).
inline constexpr index_t kSimilarityCausalRows = 256;

// ---- row kernels --------------------------------------------------------------------------------

// Where a block's rows lie: row a of sequence b at base + b * batch_stride + a * row_stride.
template <class T>
struct BlockRows {
  T* base;
  index_t batch_stride, row_stride;
  GRAPHMOE_HOST_DEVICE T* row(index_t b, index_t a) const {
    return base + b * batch_stride + a * row_stride;
  }
  // The rows as one operand of a batched_gemm over the sequences.
  MatrixBatch<T> batch() const { return {base, row_stride, batch_stride}; }
};

// The columns of row i (in its sequence) that take part in its softmax: [0, valid), minus i
// itself when exclude_self masks it (a row with no other entry keeps it).
struct SimilarityRowMask {
  index_t valid;
  index_t masked;  // the masked column, or -1
  GRAPHMOE_HOST_DEVICE bool visible(index_t j) const { return j < valid && j != masked; }
};

GRAPHMOE_HOST_DEVICE inline SimilarityRowMask similarity_row_mask(index_t i, index_t jn,
                                                                   bool causal, bool exclude_self) {
  const index_t valid = causal ? (i + 1 < jn ? i + 1 : jn) : jn;
  return {valid, exclude_self && valid > 1 ? i : index_t(-1)};
}

// Forward, one thread block per row of the (nb, bi, jn) logits block (already scaled by 1/tau):
// the masked softmax in place (write_rows; zeros up to `width`, the stored rows' full length),
// S also into sb (contiguous (nb, bi, jn)) when given; lse, entropy and S[i,i] of the row's
// token. The bf16 path that does not store S writes sb only (the products read that copy).
template <class T, class In>
__global__ void similarity_softmax_rows_kernel(BlockRows<T> rows, bool write_rows, In* sb,
                                               index_t nb, index_t bi, index_t jn, index_t width,
                                               index_t i0, index_t len, bool causal,
                                               bool exclude_self, T* lse, T* ent, T* self) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (index_t row = blockIdx.x; row < nb * bi; row += gridDim.x) {
    const index_t b = row / bi, a = row % bi, i = i0 + a, g = b * len + i;
    T* l = rows.row(b, a);
    const SimilarityRowMask mk = similarity_row_mask(i, jn, causal, exclude_self);
    const T own = l[i];  // read before any thread writes the row (the reductions synchronise)
    T mx = ninf;
    for (index_t j = threadIdx.x; j < mk.valid; j += blockDim.x)
      if (j != mk.masked) mx = MaxNanOp{}(mx, l[j]);
    mx = block_reduce(mx, MaxNanOp{}, ninf);
    T s = T(0), dot = T(0);
    for (index_t j = threadIdx.x; j < mk.valid; j += blockDim.x) {
      if (j == mk.masked) continue;
      const T x = l[j] - mx;
      const T w = exp_t(x);
      s += w;
      dot += w * x;
    }
    s = block_reduce(s, SumOp{}, T(0));
    dot = block_reduce(dot, SumOp{}, T(0));
    const T inv = T(1) / s;
    const index_t end = write_rows ? width : jn;
    for (index_t j = threadIdx.x; j < end; j += blockDim.x) {
      const T v = mk.visible(j) ? exp_t(l[j] - mx) * inv : T(0);
      if (write_rows) l[j] = v;
      if (sb != nullptr && j < jn) sb[row * jn + j] = value_cast<In>(v);
    }
    if (threadIdx.x == 0) {
      lse[g] = mx + log_t(s);
      ent[g] = log_t(s) - dot / s;
      self[g] = mk.masked == i ? T(0) : exp_t(own - mx) * inv;
    }
  }
}

// Backward, one thread block per row: S from the logits block (from_logits: scaled logits in
// place, replaced by S unless sb takes it) or the stored rows; g (contiguous (nb, bi, jn),
// dp_i . r_j) replaced by dL = S (g - c_i) unless db takes it; bf16 copies of S and dL into sb /
// db when given (the products then read those only); tau_rows[token] = sum_j dL_ij L_ij when
// given. g null: S only (a detached graph's backward recomputing S).
template <class T, class In>
__global__ void similarity_dlogit_rows_kernel(BlockRows<T> rows, bool from_logits, T* g, In* sb,
                                              In* db, const T* lse, const T* c, T* tau_rows,
                                              index_t nb, index_t bi, index_t jn, index_t i0,
                                              index_t len, bool causal, bool exclude_self) {
  for (index_t row = blockIdx.x; row < nb * bi; row += gridDim.x) {
    const index_t b = row / bi, a = row % bi, i = i0 + a, tok = b * len + i;
    T* l = rows.row(b, a);
    const SimilarityRowMask mk = similarity_row_mask(i, jn, causal, exclude_self);
    const T row_lse = lse[tok], ci = g != nullptr ? c[tok] : T(0);
    T tau = T(0);
    for (index_t j = threadIdx.x; j < jn; j += blockDim.x) {
      T s, logit;
      if (from_logits) {
        logit = l[j];
        s = mk.visible(j) ? exp_t(logit - row_lse) : T(0);
        if (sb == nullptr) l[j] = s;
      } else {
        s = l[j];
        logit = s > T(0) ? log_t(s) + row_lse : T(0);
      }
      if (sb != nullptr) sb[row * jn + j] = value_cast<In>(s);
      if (g != nullptr) {
        const T ds = s * (g[row * jn + j] - ci);
        if (db != nullptr)
          db[row * jn + j] = value_cast<In>(ds);
        else
          g[row * jn + j] = ds;
        tau += ds * logit;
      }
    }
    if (tau_rows != nullptr) {
      tau = block_reduce(tau, SumOp{}, T(0));
      if (threadIdx.x == 0) tau_rows[tok] = tau;
    }
  }
}

template <class T>
__global__ void similarity_add_scalar_kernel(T* x, T v) {
  if (blockIdx.x == 0 && threadIdx.x == 0) x[0] += v;
}

// ---- the block path -----------------------------------------------------------------------------

// Rows per block for nb sequences of len tokens.
inline index_t similarity_block_rows(index_t nb, index_t len, bool causal) {
  index_t bi = std::max<index_t>(1, kSimilarityBlockEntries / std::max<index_t>(1, nb * len));
  if (causal) bi = std::min(bi, std::max(kSimilarityCausalRows, (len + 7) / 8));
  return std::min(bi, len);
}

// Scratch carved out of state.backend.work (T entries, 64-entry aligned pieces; bf16 pieces take half).
template <class T>
class SimilarityScratch {
 public:
  explicit SimilarityScratch(Tensor<T, cuda>& work) : work_(work) {}
  // Reserves `count` entries of type E; pointers are valid after commit().
  template <class E>
  index_t reserve(index_t count) {
    const index_t at = used_;
    const index_t units = (count * static_cast<index_t>(sizeof(E)) + sizeof(T) - 1) / sizeof(T);
    used_ += (units + 63) / 64 * 64;
    return at;
  }
  void commit() {
    if (work_.numel() < used_) work_ = Tensor<T, cuda>(Shape{used_});
  }
  template <class E>
  E* at(index_t offset) const {
    return reinterpret_cast<E*>(work_.data() + offset);
  }

 private:
  Tensor<T, cuda>& work_;
  index_t used_ = 0;
};

// The precision of the projection products (Q = U W_s and its gradients): Exact stays Exact,
// the tensor-core precisions use TF32 (W_s and U stay float).
inline GraphPrecision similarity_projection_precision(GraphPrecision p) {
  return p == GraphPrecision::Exact ? p : GraphPrecision::TF32;
}

// Block [i0, i0 + bi) x [0, jn) of S: the stored rows (state.s, row stride len) or the scratch
// block (row stride jn) at off_l.
template <class T>
BlockRows<T> similarity_block_at(const SimilarityGraphState<T, cuda>& st,
                                 const SimilarityScratch<T>& scratch, index_t off_l, index_t i0,
                                 index_t bi, index_t jn, index_t len) {
  return st.stores ? BlockRows<T>{st.s.data() + i0 * len, len * len, len}
                   : BlockRows<T>{scratch.template at<T>(off_l), bi * jn, jn};
}

// The block's logits L = Q_blk U^T / tau (every sequence) into rows.
template <class In, class T>
void similarity_block_logits(GraphPrecision prec, const BlockRows<T>& rows, const In* qin,
                             const In* uin, index_t i0, index_t bi, index_t jn, index_t d,
                             index_t len, index_t nb, T inv_tau) {
  batched_gemm(bi, jn, d, inv_tau, per_sequence(qin, d, len).from_row(i0),
               per_sequence(uin, d, len).t(), T(0), rows.batch(), nb, graph_gemm_math<In>(prec),
               "Similarity");
}

template <class T, class In>
void similarity_blocks_forward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                               const SimilarityGraphArgs& args,
                               const SimilarityGraphParams<T, cuda>& params,
                               SimilarityGraphState<T, cuda>& st, Tensor<T, cuda>& p) {
  const index_t n = u.rows(), len = args.seq_len, nb = n / len, d = u.cols(), e = r.cols();
  const GraphPrecision prec = args.precision;
  const T inv_tau = static_cast<T>(1.0 / st.tau);
  for (Tensor<T, cuda>* t : {&st.lse, &st.entropy, &st.self})
    if (t->shape() != Shape{n}) *t = Tensor<T, cuda>(Shape{n});
  st.stores = args.store;
  if (st.stores && st.s.shape() != (Shape{n, len})) st.s = Tensor<T, cuda>(Shape{n, len});
  if (!st.stores) st.s = Tensor<T, cuda>();
  if (args.projection) {
    if (st.q.shape() != u.shape()) st.q = Tensor<T, cuda>(u.shape());
    const GemmMath pm = graph_gemm_math<T>(similarity_projection_precision(prec));
    batched_gemm(n, d, d, T(1), whole(u.data(), d), whole(params.w_s.data(), d), T(0),
                 whole(st.q.data(), d), 1, pm, "Similarity");
  } else {
    st.q = Tensor<T, cuda>();
  }
  if (n == 0) return;
  GraphOperands<T, In> ops;
  const In* uin = ops(u);
  const In* qin = args.projection ? ops(st.q) : uin;
  const In* rin = ops(r);
  constexpr bool kCopies = !std::is_same_v<In, T>;

  const index_t bi_max = similarity_block_rows(nb, len, args.causal);
  SimilarityScratch<T> scratch(st.backend.work);
  const index_t block = nb * bi_max * len;
  const index_t off_l = st.stores ? 0 : scratch.template reserve<T>(block);
  const index_t off_sb = kCopies ? scratch.template reserve<In>(block) : 0;
  scratch.commit();

  for (index_t i0 = 0; i0 < len; i0 += bi_max) {
    const index_t bi = std::min(bi_max, len - i0), jn = args.causal ? i0 + bi : len;
    const BlockRows<T> rows = similarity_block_at(st, scratch, off_l, i0, bi, jn, len);
    In* sb = kCopies ? scratch.template at<In>(off_sb) : nullptr;
    similarity_block_logits(prec, rows, qin, uin, i0, bi, jn, d, len, nb, inv_tau);
    launch_kernel<similarity_softmax_rows_kernel<T, In>>(
        grid_for_rows(nb * bi), threads_for_row(jn), rows, st.stores || !kCopies, sb, nb, bi, jn,
        st.stores ? len : jn, i0, len, args.causal, args.exclude_self, st.lse.data(),
        st.entropy.data(), st.self.data());
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    // p_blk = S R (S: the bf16 copy, or the rows themselves)
    const MatrixBatch<const In> s_blk =
        kCopies ? MatrixBatch<const In>{sb, jn, bi * jn}
                : MatrixBatch<const In>{reinterpret_cast<const In*>(rows.base), rows.row_stride,
                                        rows.batch_stride};
    batched_gemm(bi, e, jn, T(1), s_blk, per_sequence(rin, e, len), T(0),
                 per_sequence(p.data(), e, len).from_row(i0), nb, graph_gemm_math<In>(prec),
                 "Similarity");
  }
}

template <class T, class In>
void similarity_blocks_backward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                                const Tensor<T, cuda>& p, const Tensor<T, cuda>& dp,
                                const SimilarityGraphArgs& args,
                                SimilarityGraphParams<T, cuda>& params,
                                SimilarityGraphState<T, cuda>& st, Tensor<T, cuda>& dr,
                                Tensor<T, cuda>& du) {
  const index_t n = u.rows(), len = args.seq_len, nb = n / len, d = u.cols(), e = r.cols();
  const GraphPrecision prec = args.precision;
  const T inv_tau = static_cast<T>(1.0 / st.tau);
  const bool to_u = !args.detach, proj = args.projection;
  const bool to_tau = to_u && args.learned_tau && !params.dlog_tau.empty();
  const GemmMath math = graph_gemm_math<In>(prec);
  dr.zero();
  if (n == 0) return;
  constexpr bool kCopies = !std::is_same_v<In, T>;

  Tensor<T, cuda> c, dq, tau_rows;
  if (to_u) {
    c = Tensor<T, cuda>(Shape{n});
    graph_row_dot_cuda(dp, p, c);
  }
  if (proj && to_u) dq = Tensor<T, cuda>(u.shape());
  if (to_tau) tau_rows = Tensor<T, cuda>(Shape{n});
  T* dq_rows = proj && to_u ? dq.data() : du.data();  // the query side's gradient

  GraphOperands<T, In> ops;
  const In* uin = ops(u);
  const In* qin = proj ? ops(st.q) : uin;
  const In* rin = ops(r);
  const In* dpin = ops(dp);

  const index_t bi_max = similarity_block_rows(nb, len, args.causal);
  SimilarityScratch<T> scratch(st.backend.work);
  const index_t block = nb * bi_max * len;
  const index_t off_l = st.stores ? 0 : scratch.template reserve<T>(block);
  const index_t off_g = to_u ? scratch.template reserve<T>(block) : 0;
  const index_t off_sb = kCopies ? scratch.template reserve<In>(block) : 0;
  const index_t off_db = kCopies && to_u ? scratch.template reserve<In>(block) : 0;
  scratch.commit();

  for (index_t i0 = 0; i0 < len; i0 += bi_max) {
    const index_t bi = std::min(bi_max, len - i0), jn = args.causal ? i0 + bi : len;
    const BlockRows<T> rows = similarity_block_at(st, scratch, off_l, i0, bi, jn, len);
    T* g = to_u ? scratch.template at<T>(off_g) : nullptr;
    In* sb = kCopies ? scratch.template at<In>(off_sb) : nullptr;
    In* db = kCopies && to_u ? scratch.template at<In>(off_db) : nullptr;
    if (!st.stores)  // L, turned into S by the kernel
      similarity_block_logits(prec, rows, qin, uin, i0, bi, jn, d, len, nb, inv_tau);
    if (to_u)  // G = dp_blk R^T
      batched_gemm(bi, jn, e, T(1), per_sequence(dpin, e, len).from_row(i0),
                   per_sequence(rin, e, len).t(), T(0), MatrixBatch{g, jn, bi * jn}, nb, math,
                   "Similarity");
    if (!st.stores || to_u || kCopies) {
      launch_kernel<similarity_dlogit_rows_kernel<T, In>>(
          grid_for_rows(nb * bi), threads_for_row(jn), rows, !st.stores, g, sb, db,
          st.lse.data(), to_u ? c.data() : static_cast<const T*>(nullptr),
          to_tau ? tau_rows.data() : static_cast<T*>(nullptr), nb, bi, jn, i0, len, args.causal,
          args.exclude_self);
      GRAPHMOE_CUDA_CHECK_LAUNCH();
    }
    // dr[:jn] += S^T dp_blk (S: the bf16 copy, or the rows)
    const MatrixBatch<const In> s_blk =
        kCopies ? MatrixBatch<const In>{sb, jn, bi * jn}
                : MatrixBatch<const In>{reinterpret_cast<const In*>(rows.base), rows.row_stride,
                                        rows.batch_stride};
    batched_gemm(jn, e, bi, T(1), s_blk.t(), per_sequence(dpin, e, len).from_row(i0), T(1),
                 per_sequence(dr.data(), e, len), nb, math, "Similarity");
    if (!to_u) continue;
    // dL: the bf16 copy, or G overwritten
    const MatrixBatch<const In> dl_blk{kCopies ? static_cast<const In*>(db)
                                               : reinterpret_cast<const In*>(g),
                                       jn, bi * jn};
    // dQ_blk += dL U / tau;  dU[:jn] += dL^T Q_blk / tau
    batched_gemm(bi, d, jn, inv_tau, dl_blk, per_sequence(uin, d, len), T(1),
                 per_sequence(dq_rows, d, len).from_row(i0), nb, math, "Similarity");
    batched_gemm(jn, d, bi, inv_tau, dl_blk.t(), per_sequence(qin, d, len).from_row(i0), T(1),
                 per_sequence(du.data(), d, len), nb, math, "Similarity");
  }
  if (to_tau) {
    const Tensor<T, cpu> h = to_host(tau_rows);
    double total = 0;
    for (index_t i = 0; i < n; ++i) total += static_cast<double>(h.data()[i]);
    launch_kernel<similarity_add_scalar_kernel<T>>(1, 32, params.dlog_tau.data(),
                                                   static_cast<T>(-total));
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  if (proj && to_u) {  // dU += dQ W_s^T;  dW_s += U^T dQ
    const GemmMath pm = graph_gemm_math<T>(similarity_projection_precision(prec));
    batched_gemm(n, d, d, T(1), whole(dq.data(), d), whole(params.w_s.data(), d).t(), T(1),
                 whole(du.data(), d), 1, pm, "Similarity");
    batched_gemm(d, d, n, T(1), whole(u.data(), d).t(), whole(dq.data(), d), T(1),
                 whole(params.dw_s.data(), d), 1, pm, "Similarity");
  }
}

}  // namespace graphmoe::detail
