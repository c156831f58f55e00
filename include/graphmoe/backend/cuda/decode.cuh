// graphmoe/backend/cuda/decode.cuh: the CUDA system's incremental decoding ops (contract and
// argument checks: ops/decode.hpp, which calls these through the backend tag), on Tensor<T, cuda>
// with T = float or double.
//
// A decode step has n rows (a new token at position t of its slot; a slot may have a chunk of
// rows at consecutive positions, core/decode.hpp), and each row costs O(t): one thread block per
// row (and, for attention, per head) does the row's work in global memory, with block reductions
// for the maxima and sums. The row at t reads its slot's positions 0..t, which other rows (other
// blocks) of the same step may write, so each op appends in one kernel launch and reads in the
// next (a launch boundary orders every block's writes before the next kernel's reads):
//
//   attention_decode         an append kernel (k and v of every row at position t of its slot),
//                            then one block per (row, head): scores q . K_j for j <= t into the
//                            probs row, the softmax and its entropy (the forward's formulas,
//                            backend/cuda/attention.cuh), then o = A V
//   similarity_graph_decode  an append kernel (u and r of every row, q = u or u W_s), then one
//                            block per row: the row of S over j <= t (exclude_self as the CPU
//                            masks it), then p = S R
//   attention_graph_decode   the row entropies (n H values) are read back to the host, where the
//                            prefix sums and h* are computed in double in row order
//                            (decode_choose_head, core/decode.hpp, the CPU's code); then one
//                            block per (row, head) appends r and |m_ht|^2, and one block per row
//                            computes
//                            q = H a W_o,h*, the posterior logits over j <= t (the prior floor,
//                            core/attention_cache.hpp, as the CPU applies it), their softmax
//                            (summed in double, as the CPU sums it) and p = A^p R. A row whose
//                            logits are all -inf is flagged; the first such row is returned.
//
// The step's slots and positions (and h*) go to the device in one small copy per op; the
// Attention graph synchronises twice more (the entropies, the flag). Every block writes only its
// own rows of the outputs and its own row's cache entries (the rows of a step are at distinct
// (slot, position) pairs), so no atomics are needed beyond the flag. The rows' products are plain loops in T, in another
// order than the CPU's Eigen products: double agrees with the CPU to about 1e-15 relative, float
// to about 1e-6. args.precision is not read (the CPU decodes in T too).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/decode.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

namespace detail {

// The step's rows on the device, (k, n): row 0 the slots, row 1 the positions, row 2 h* when
// heads is given. One host-to-device copy.
inline Tensor<index_t, cuda> decode_rows_to_device(const DecodeRows& rows,
                                                   const std::vector<int>* heads = nullptr) {
  const index_t n = rows.size(), k = heads != nullptr ? 3 : 2;
  Tensor<index_t, cpu> h(Shape{k, n});
  std::copy(rows.slot.begin(), rows.slot.end(), h.data());
  std::copy(rows.pos.begin(), rows.pos.end(), h.data() + n);
  if (heads != nullptr) std::copy(heads->begin(), heads->end(), h.data() + 2 * n);
  return to_device(h);
}

// Threads per block for the step's rows: one per position of the longest row (max pos + 1) or
// per entry of a `width`-long vector, whichever is more, as a multiple of the warp size and at
// most kThreads.
inline int decode_threads(const DecodeRows& rows, index_t width) {
  const index_t len = *std::max_element(rows.pos.begin(), rows.pos.end()) + 1;
  return threads_for_row(std::max(len, width));
}

// out[c] = sum_k x[k] w[k ldw + c] for c < cols (x (depth), w row-major with row stride ldw),
// scaled by alpha; the block's threads share the columns.
template <class T>
__device__ void decode_row_times_matrix(const T* x, const T* w, index_t ldw, index_t depth,
                                        index_t cols, T alpha, T* out) {
  for (index_t c = threadIdx.x; c < cols; c += blockDim.x) {
    T acc = T(0);
    for (index_t k = 0; k < depth; ++k) acc += x[k] * w[k * ldw + c];
    out[c] = alpha * acc;
  }
}

// x . y over n entries.
template <class T>
__device__ T decode_dot(const T* x, const T* y, index_t n) {
  T acc = T(0);
  for (index_t c = 0; c < n; ++c) acc += x[c] * y[c];
  return acc;
}

// Block row i: k_i and v_i (every cached head) at position t of the slot's cache. kc, vc
// (S, Hkv, L, dh); k, v (n, Hkv dh); rows (2, n).
template <class T>
__global__ void attention_decode_append_kernel(const T* k, const T* v, const index_t* rows, T* kc,
                                               T* vc, index_t n, index_t nkv, index_t len_max,
                                               index_t dh) {
  const index_t width = nkv * dh;
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    const index_t s = rows[i], t = rows[n + i];
    for (index_t c = threadIdx.x; c < width; c += blockDim.x) {
      const index_t h = c / dh, at = ((s * nkv + h) * len_max + t) * dh + c % dh;
      kc[at] = k[i * width + c];
      vc[at] = v[i * width + c];
    }
  }
}

// Block (row i, query head h), item = i H + h, after the append kernel. kc, vc (S, Hkv, L, dh)
// (query head h reads cached head h / g); probs (n, H, L); entropy (n, H); q, out (n, H dh);
// rows (2, n).
template <class T>
__global__ void attention_decode_kernel(const T* q, const index_t* rows, const T* kc, const T* vc,
                                        T* probs, T* entropy, T* out, index_t n, index_t nh,
                                        index_t g, index_t len_max, index_t dh, T scale) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  const index_t width = nh * dh;
  for (index_t item = blockIdx.x; item < n * nh; item += gridDim.x) {
    const index_t i = item / nh, h = item % nh;
    const index_t s = rows[i], t = rows[n + i], len = t + 1;
    const index_t at = i * width + h * dh;  // row i, head h of q and out
    const T* kh = kc + (s * (nh / g) + h / g) * len_max * dh;
    const T* vh = vc + (s * (nh / g) + h / g) * len_max * dh;
    T* row = probs + item * len_max;
    T m = ninf;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T sc = decode_dot(q + at, kh + j * dh, dh);  // raw; scaled inside the softmax
      row[j] = sc;
      m = MaxNanOp{}(m, sc);
    }
    m = block_reduce(m, MaxNanOp{}, ninf);
    T sum = T(0), zsum = T(0);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T z = (row[j] - m) * scale;
      const T e = exp_t(z);
      row[j] = e;
      sum += e;
      zsum += z * e;
    }
    sum = block_reduce(sum, SumOp{}, T(0));
    zsum = block_reduce(zsum, SumOp{}, T(0));
    const T inv = T(1) / sum;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) row[j] *= inv;
    if (threadIdx.x == 0) entropy[item] = log_t(sum) - zsum / sum;
    __syncthreads();  // the whole row before o = A V
    for (index_t c = threadIdx.x; c < dh; c += blockDim.x) {
      T acc = T(0);
      for (index_t j = 0; j < len; ++j) acc += row[j] * vh[j * dh + c];
      out[at + c] = acc;
    }
  }
}

// Block row i: u_i and r_i at position t of the slot's caches, q_i = u_i W_s when w_s is given.
// uc (S, L, D), rc (S, L, E); u, q (n, D); r (n, E); rows (2, n).
template <class T>
__global__ void similarity_decode_append_kernel(const T* u, const T* r, const index_t* rows,
                                                const T* w_s, T* q, T* uc, T* rc, index_t n,
                                                index_t d, index_t e, index_t len_max) {
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    const index_t s = rows[i], t = rows[n + i];
    for (index_t c = threadIdx.x; c < d; c += blockDim.x) uc[(s * len_max + t) * d + c] = u[i * d + c];
    for (index_t c = threadIdx.x; c < e; c += blockDim.x) rc[(s * len_max + t) * e + c] = r[i * e + c];
    if (w_s != nullptr) decode_row_times_matrix(u + i * d, w_s, d, d, d, T(1), q + i * d);
  }
}

// Block row i, after the append kernel. uc (S, L, D), rc (S, L, E); qs (n, D) the queries (u, or
// u W_s); p (n, E); w (n, L) the rows of S; rows (2, n).
template <class T>
__global__ void similarity_decode_kernel(const T* qs, const index_t* rows, const T* uc,
                                         const T* rc, T* w, T* p, index_t n, index_t d, index_t e,
                                         index_t len_max, T inv_tau, bool exclude_self) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  constexpr T lowest = std::numeric_limits<T>::lowest();
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    const index_t s = rows[i], t = rows[n + i], len = t + 1;
    const T* us = uc + s * len_max * d;
    const T* rs = rc + s * len_max * e;
    const T* qi = qs + i * d;
    // the forward's row softmax; exclude_self leaves the own entry out when the row has another
    const bool mask = exclude_self && len > 1;
    T* row = w + i * len_max;
    T mx = ninf;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T l = mask && j == t ? lowest : inv_tau * decode_dot(qi, us + j * d, d);
      row[j] = l;
      mx = MaxNanOp{}(mx, l);
    }
    mx = block_reduce(mx, MaxNanOp{}, ninf);
    T sum = T(0);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T ex = mask && j == t ? T(0) : exp_t(row[j] - mx);
      row[j] = ex;
      sum += ex;
    }
    sum = block_reduce(sum, SumOp{}, T(0));
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) row[j] /= sum;
    __syncthreads();  // the whole row before p = S R
    for (index_t c = threadIdx.x; c < e; c += blockDim.x) {
      T acc = T(0);
      for (index_t j = 0; j < len; ++j) acc += row[j] * rs[j * e + c];
      p[i * e + c] = acc;
    }
  }
}

// Block (row i, head h), item = i H + h: r_i into rc (S, L, E) (head 0's block) and
// msq[s, h, t] = H^2 |y|^2 + 2 H y . b_o with y = W_o,h v_ht (D) (|m_ht|^2 less |b_o|^2, which
// cancels in the posterior). v (S, Hkv, L, dh) (head h reads cached head h / g); w_o (D, H dh);
// b_o (D) or null; rows (2+, n).
template <class T>
__global__ void attention_graph_decode_append_kernel(const T* r, const index_t* rows, const T* v,
                                                     const T* w_o, const T* b_o, T* rc, T* msq,
                                                     index_t n, index_t nh, index_t g,
                                                     index_t len_max, index_t dh, index_t d,
                                                     index_t e, T fh) {
  const index_t hd = nh * dh;  // w_o's row length
  for (index_t item = blockIdx.x; item < n * nh; item += gridDim.x) {
    const index_t i = item / nh, h = item % nh;
    const index_t s = rows[i], t = rows[n + i];
    if (h == 0)
      for (index_t c = threadIdx.x; c < e; c += blockDim.x)
        rc[(s * len_max + t) * e + c] = r[i * e + c];
    const T* vt = v + ((s * (nh / g) + h / g) * len_max + t) * dh;
    T sq = T(0), yb = T(0);
    for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
      const T y = decode_dot(w_o + k * hd + h * dh, vt, dh);
      sq += y * y;
      if (b_o != nullptr) yb += y * b_o[k];
    }
    sq = block_reduce(sq, SumOp{}, T(0));
    yb = block_reduce(yb, SumOp{}, T(0));
    if (threadIdx.x == 0) {
      T m = fh * fh * sq;
      if (b_o != nullptr) m += T(2) * fh * yb;
      msq[(s * nh + h) * len_max + t] = m;
    }
  }
}

// Block row i with head h = rows[2 n + i]: q = H a_i W_o,h (dh, into q (n, dh)), the logits
// log A_j + (q . v_hj - msq_hj / 2) / sigma^2 for A_j above the floor (-inf at or below it), over
// j <= t into w (n, L), their softmax in place and p_i = A^p R. a (n, D); w_o (D, H dh);
// probs (n, H, L);
// v (S, Hkv, L, dh) (head h reads cached head h / g); msq (S, H, L); rc (S, L, E). A row without
// a finite logit flags i.
template <class T>
__global__ void attention_graph_decode_rows_kernel(const index_t* rows, const T* a, const T* w_o,
                                                   const T* v, const T* probs, const T* msq,
                                                   const T* rc, T* q, T* w, T* p,
                                                   unsigned long long* bad, index_t n, index_t nh,
                                                   index_t g, index_t len_max, index_t dh,
                                                   index_t d, index_t e, T fh, T inv_var) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  constexpr T prior_floor = attention_prior_floor<T>();
  const index_t hd = nh * dh;  // w_o's row length
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    const index_t s = rows[i], t = rows[n + i], h = rows[2 * n + i], len = t + 1;
    decode_row_times_matrix(a + i * d, w_o + h * dh, hd, d, dh, fh, q + i * dh);
    __syncthreads();  // q complete
    const T* vh = v + (s * (nh / g) + h / g) * len_max * dh;
    const T* arow = probs + (i * nh + h) * len_max;
    const T* ms = msq + (s * nh + h) * len_max;
    T* row = w + i * len_max;
    T mx = ninf;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T g = decode_dot(q + i * dh, vh + j * dh, dh);
      const T l = arow[j] > prior_floor ? log_t(arow[j]) + (g - T(0.5) * ms[j]) * inv_var : ninf;
      row[j] = l;
      mx = MaxNanOp{}(mx, l);
    }
    mx = block_reduce(mx, MaxNanOp{}, ninf);
    if (!(mx > ninf)) {  // the same for the whole block
      if (threadIdx.x == 0) flag_index(bad, i);
      continue;
    }
    double sum = 0;
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) {
      const T x = row[j] > ninf ? exp_t(row[j] - mx) : T(0);
      row[j] = x;
      sum += static_cast<double>(x);
    }
    sum = block_reduce(sum, SumOp{}, 0.0);
    const T inv = static_cast<T>(1.0 / sum);
    for (index_t j = threadIdx.x; j < len; j += blockDim.x) row[j] *= inv;
    __syncthreads();  // the whole row before p = A^p R
    const T* rs = rc + s * len_max * e;
    for (index_t c = threadIdx.x; c < e; c += blockDim.x) {
      T acc = T(0);
      for (index_t j = 0; j < len; ++j) acc += row[j] * rs[j * e + c];
      p[i * e + c] = acc;
    }
  }
}

template <class T>
constexpr void check_decode_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "graphmoe's CUDA decode ops: T must be float or double");
}

}  // namespace detail

// q (n, H dh), k, v (n, Hkv dh); kv (S, Hkv, L, dh); probs (n, H, L), row_entropy (n, H), out
// (n, H dh) prepared by ops/decode.hpp (probs zeroed beyond each row's position).
template <class T>
void attention_decode(cuda, const Tensor<T, cuda>& q, const Tensor<T, cuda>& k,
                      const Tensor<T, cuda>& v, const DecodeRows& rows, KVCache<T, cuda>& kv,
                      Tensor<T, cuda>& probs, Tensor<T, cuda>& row_entropy, Tensor<T, cuda>& out) {
  detail::check_decode_type<T>();
  const index_t n = rows.size(), nh = kv.heads(), nkv = kv.kv_heads(), dh = kv.head_dim();
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  const Tensor<index_t, cuda> dev_rows = detail::decode_rows_to_device(rows);
  // every row's k and v first: a chunk's rows read each other's (the header comment)
  detail::launch_kernel<detail::attention_decode_append_kernel<T>>(
      detail::grid_for_rows(n), detail::threads_for_row(nkv * dh), k.data(), v.data(),
      dev_rows.data(), kv.k.data(), kv.v.data(), n, nkv, kv.max_len(), dh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::attention_decode_kernel<T>>(
      detail::grid_for_rows(n * nh), detail::decode_threads(rows, dh), q.data(), dev_rows.data(),
      kv.k.data(), kv.v.data(), probs.data(), row_entropy.data(), out.data(), n, nh, kv.group(),
      kv.max_len(), dh, scale);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// u (n, D), r (n, E); cache.u (S, L, D), cache.r (S, L, E); p (n, E) and weights (null or (n, L),
// zeroed) prepared by ops/decode.hpp; w_s is (D, D) under projection; tau resolved by the op
// layer (the learned one included).
template <class T>
void similarity_graph_decode(cuda, const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
                             const DecodeRows& rows, const SimilarityGraphArgs& args,
                             const Tensor<T, cuda>& w_s, double tau,
                             SimilarityDecodeCache<T, cuda>& cache, Tensor<T, cuda>& p,
                             Tensor<T, cuda>* weights) {
  detail::check_decode_type<T>();
  const index_t n = rows.size(), d = u.cols(), e = r.cols(), len_max = cache.u.dim(1);
  const Tensor<index_t, cuda> dev_rows = detail::decode_rows_to_device(rows);
  Tensor<T, cuda> q = args.projection ? Tensor<T, cuda>(Shape{n, d}) : Tensor<T, cuda>();
  Tensor<T, cuda> scratch = weights == nullptr ? Tensor<T, cuda>(Shape{n, len_max})
                                               : Tensor<T, cuda>();
  T* w = weights != nullptr ? weights->data() : scratch.data();
  // every row's u, r (and query) first: a chunk's rows read each other's (the header comment)
  detail::launch_kernel<detail::similarity_decode_append_kernel<T>>(
      detail::grid_for_rows(n), detail::threads_for_row(std::max(d, e)), u.data(), r.data(),
      dev_rows.data(), args.projection ? w_s.data() : nullptr,
      args.projection ? q.data() : nullptr, cache.u.data(), cache.r.data(), n, d, e, len_max);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::similarity_decode_kernel<T>>(
      detail::grid_for_rows(n), detail::decode_threads(rows, std::max(d, e)),
      args.projection ? q.data() : u.data(), dev_rows.data(), cache.u.data(), cache.r.data(), w,
      p.data(), n, d, e, len_max, static_cast<T>(1.0 / tau), args.exclude_self);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// r (n, E); step from the attention layer of the same block; cache.r (S, L, E), cache.msq
// (S, H, L), cache.entropy_prefix (S L H, host); p (n, E) and weights (null or (n, L), zeroed)
// prepared by ops/decode.hpp; heads (n) assigned. Returns the first row whose chosen head's
// attention row is all at or below the prior floor (-1: none); p is not written for such a row.
template <class T>
index_t attention_graph_decode(cuda, const Tensor<T, cuda>& r, const DecodeRows& rows,
                               const AttentionStep<T, cuda>& step, const AttentionGraphArgs& args,
                               AttentionDecodeCache<T, cuda>& cache, Tensor<T, cuda>& p,
                               Tensor<T, cuda>* weights, std::vector<int>& heads) {
  detail::check_decode_type<T>();
  const index_t n = rows.size(), e = r.cols(), nh = step.num_heads;
  const KVCache<T, cuda>& kv = *step.kv;
  // d: the block's width (w_o's rows); H dh, w_o's columns, differs from it when head_dim is set
  const index_t len_max = kv.max_len(), dh = kv.head_dim(), d = step.w_o.rows();
  const T fh = static_cast<T>(nh);
  const T inv_var = static_cast<T>(1.0 / (args.sigma * args.sigma));
  // h* on the host, from the step's row entropies (one read-back), in the CPU's arithmetic, in row
  // order (a chunk's row at t adds to the prefix sum of the row at t - 1)
  const Tensor<T, cpu> ent = to_host(step.row_entropy);  // (n, H)
  heads.assign(static_cast<std::size_t>(n), 0);
  for (index_t i = 0; i < n; ++i)
    heads[static_cast<std::size_t>(i)] =
        decode_choose_head(cache.entropy_prefix, rows.slot[static_cast<std::size_t>(i)],
                           rows.pos[static_cast<std::size_t>(i)], len_max, nh,
                           ent.data() + i * nh);
  const Tensor<index_t, cuda> dev_rows = detail::decode_rows_to_device(rows, &heads);
  const T* b_o = step.b_o.empty() ? nullptr : step.b_o.data();
  detail::launch_kernel<detail::attention_graph_decode_append_kernel<T>>(
      detail::grid_for_rows(n * nh), detail::threads_for_row(std::max(d, e)), r.data(),
      dev_rows.data(), kv.v.data(), step.w_o.data(), b_o, cache.r.data(), cache.msq.data(), n,
      nh, kv.group(), len_max, dh, d, e, fh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  Tensor<T, cuda> q(Shape{n, dh});
  Tensor<T, cuda> scratch = weights == nullptr ? Tensor<T, cuda>(Shape{n, len_max})
                                               : Tensor<T, cuda>();
  T* w = weights != nullptr ? weights->data() : scratch.data();
  detail::FirstIndexFlag bad;
  detail::launch_kernel<detail::attention_graph_decode_rows_kernel<T>>(
      detail::grid_for_rows(n), detail::decode_threads(rows, std::max(dh, e)), dev_rows.data(),
      step.out.data(), step.w_o.data(), kv.v.data(), step.probs.data(), cache.msq.data(),
      cache.r.data(), q.data(), w, p.data(), bad.get(), n, nh, kv.group(), len_max, dh, d, e, fh,
      inv_var);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.read();
}

}  // namespace graphmoe
