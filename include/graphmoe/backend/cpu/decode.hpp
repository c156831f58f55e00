// graphmoe/backend/cpu/decode.hpp: the CPU system's incremental decoding ops (contract and
// argument checks: ops/decode.hpp, which calls these through the backend tag).
//
// Each row of a step is one token of one slot at position t (core/decode.hpp); a slot may have a
// chunk of rows at consecutive positions, and the row at t reads positions [0, t], which other
// rows of the same step may write. So every op runs an append pass (every row writes what later
// tokens read into its slot's caches at its position) before the passes that read. The
// arithmetic is the forward's (backend/cpu/attention.hpp, backend/cpu/token_graph.hpp) for one
// row: the same softmax, entropy and floor formulas, so a decoded row equals the forward's row up
// to the rounding of the products' summation order. Within a pass rows (and, for attention,
// heads) run in parallel; every item writes only its own row and its own position's cache entries.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "graphmoe/backend/cpu/attention.hpp"
#include "graphmoe/backend/cpu/token_graph.hpp"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/decode.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

namespace detail {
template <class T>
using RowVectorMap = Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>, Eigen::Unaligned>;
template <class T>
using ConstRowVectorMap = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>, Eigen::Unaligned>;
}  // namespace detail

// q (n, H dh), k, v (n, Hkv dh); kv (S, Hkv, L, dh); probs (n, H, L), row_entropy (n, H), out
// (n, H dh) prepared by ops/decode.hpp (probs zeroed beyond each row's position). Query head h
// reads cached head h / g (g = H / Hkv).
template <class T>
void attention_decode(cpu, const Tensor<T, cpu>& q, const Tensor<T, cpu>& k,
                      const Tensor<T, cpu>& v, const DecodeRows& rows, KVCache<T, cpu>& kv,
                      Tensor<T, cpu>& probs, Tensor<T, cpu>& row_entropy, Tensor<T, cpu>& out) {
  const index_t n = rows.size(), nh = kv.heads(), nkv = kv.kv_heads(), g = kv.group(),
                len_max = kv.max_len(), dh = kv.head_dim();
  const index_t width = nh * dh, kv_width = nkv * dh;
  const T scale = T(1) / std::sqrt(static_cast<T>(dh));
  auto base_of = [&](index_t i, index_t c) {  // slot of row i, cached head c
    return (rows.slot[static_cast<std::size_t>(i)] * nkv + c) * len_max * dh;
  };
  // (1) every row's k and v into the cache (a chunk's later rows read its earlier rows' entries)
  parallel_items(n, [&](index_t i) {
    const index_t t = rows.pos[static_cast<std::size_t>(i)];
    for (index_t c = 0; c < nkv; ++c) {
      std::copy_n(k.data() + i * kv_width + c * dh, dh, kv.k.data() + base_of(i, c) + t * dh);
      std::copy_n(v.data() + i * kv_width + c * dh, dh, kv.v.data() + base_of(i, c) + t * dh);
    }
  });
  // (2) per (row, head): the scores over positions 0..t, the softmax and o = A V
  parallel_items(n * nh, [&](index_t item) {
    const index_t i = item / nh, h = item % nh;
    const index_t len = rows.pos[static_cast<std::size_t>(i)] + 1;
    const MatrixMap<T> K(kv.k.data() + base_of(i, h / g), len, dh),
        V(kv.v.data() + base_of(i, h / g), len, dh);
    const detail::ConstRowVectorMap<T> qh(q.data() + i * width + h * dh, dh);
    detail::RowVectorMap<T> p(probs.data() + (i * nh + h) * len_max, len);
    p.noalias() = qh * K.transpose();  // raw scores; the scale is applied inside the softmax
    Eigen::Array<T, 1, Eigen::Dynamic> z;
    detail::softmax_scaled_row(p.data(), len, scale, row_entropy.data() + i * nh + h, z);
    detail::RowVectorMap<T>(out.data() + i * width + h * dh, dh).noalias() = p * V;
  });
}

// u (n, D), r (n, E); cache.u (S, L, D), cache.r (S, L, E); p (n, E) and weights (null or (n, L),
// zeroed) prepared by ops/decode.hpp; w_s is (D, D) under projection. inv_tau = 1 / tau.
//
// Three passes: (1) append u_i and r_i of every row (a chunk's later rows read them), q_i = u_i
// (or u_i W_s); (2) the scores q_i . u_j / tau in
// blocks of kSimilarityDecodeBlock positions, every (row, block) an item, so that a single row of
// a batch-1 step reads its slot's cache (L x D values, the step's largest read) on every thread;
// (3) per row, the forward's softmax_block and p_i = S_i R. Only the order in which pass 2's items
// run depends on the thread count; each score is the same sum.
inline constexpr index_t kSimilarityDecodeBlock = 256;

template <class T>
void similarity_graph_decode(cpu, const Tensor<T, cpu>& u, const Tensor<T, cpu>& r,
                             const DecodeRows& rows, const SimilarityGraphArgs& args,
                             const Tensor<T, cpu>& w_s, double tau,
                             SimilarityDecodeCache<T, cpu>& cache, Tensor<T, cpu>& p,
                             Tensor<T, cpu>* weights) {
  const index_t n = rows.size(), d = u.cols(), e = r.cols(), len_max = cache.u.dim(1);
  const T inv_tau = static_cast<T>(1.0 / tau);
  constexpr index_t block = kSimilarityDecodeBlock;
  auto slot_of = [&](index_t i) { return rows.slot[static_cast<std::size_t>(i)]; };
  auto len_of = [&](index_t i) { return rows.pos[static_cast<std::size_t>(i)] + 1; };
  // (1) the caches and the queries
  std::vector<T> q_store;
  if (args.projection) q_store.resize(static_cast<std::size_t>(n * d));
  parallel_items(n, [&](index_t i) {
    const index_t s = slot_of(i), t = len_of(i) - 1;
    std::copy_n(u.data() + i * d, d, cache.u.data() + (s * len_max + t) * d);
    std::copy_n(r.data() + i * e, e, cache.r.data() + (s * len_max + t) * e);
    if (args.projection)
      detail::RowVectorMap<T>(q_store.data() + i * d, d).noalias() =
          detail::ConstRowVectorMap<T>(u.data() + i * d, d) * as_matrix(w_s);
  });
  const T* q_all = args.projection ? q_store.data() : u.data();
  // (2) the scores, (row, block) items
  std::vector<T> scores(static_cast<std::size_t>(n * len_max));
  std::vector<index_t> first_item(static_cast<std::size_t>(n + 1), 0);
  for (index_t i = 0; i < n; ++i)
    first_item[static_cast<std::size_t>(i + 1)] =
        first_item[static_cast<std::size_t>(i)] + (len_of(i) + block - 1) / block;
  parallel_items(first_item.back(), [&](index_t item) {
    const index_t i = static_cast<index_t>(
        std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1);
    const index_t j0 = (item - first_item[static_cast<std::size_t>(i)]) * block;
    const index_t m = std::min(block, len_of(i) - j0);
    const MatrixMap<T> U(cache.u.data() + (slot_of(i) * len_max + j0) * d, m, d);
    detail::RowVectorMap<T>(scores.data() + i * len_max + j0, m).noalias() =
        inv_tau * (detail::ConstRowVectorMap<T>(q_all + i * d, d) * U.transpose());
  });
  // (3) the forward's softmax_block for one row (exclude_self: the own entry masked when the row
  // has another), then p_i
  parallel_items(n, [&](index_t i) {
    const index_t s = slot_of(i), len = len_of(i), t = len - 1;
    T* row = scores.data() + i * len_max;
    const bool mask = args.exclude_self && len > 1;
    detail::similarity_softmax_row(row, len, mask ? t : -1);
    const MatrixMap<T> R(cache.r.data() + s * len_max * e, len, e);
    detail::RowVectorMap<T>(p.data() + i * e, e).noalias() =
        detail::RowVectorMap<T>(row, len) * R;
    if (weights != nullptr) std::copy_n(row, len, weights->data() + i * len_max);
  });
}

// r (n, E); step from the attention layer of the same block (its KV cache of Hkv heads: query
// head h's values are cached head h / g); cache.r (S, L, E), cache.msq (S, H, L),
// cache.entropy_prefix (S L H); p (n, E) and weights (null or (n, L), zeroed) prepared by
// ops/decode.hpp; heads (n) assigned. Returns the first row whose chosen head's attention row is
// all at or below the prior floor (-1: none), as the forward reports such a row.
template <class T>
index_t attention_graph_decode(cpu, const Tensor<T, cpu>& r, const DecodeRows& rows,
                               const AttentionStep<T, cpu>& step, const AttentionGraphArgs& args,
                               AttentionDecodeCache<T, cpu>& cache, Tensor<T, cpu>& p,
                               Tensor<T, cpu>* weights, std::vector<int>& heads) {
  const index_t n = rows.size(), e = r.cols(), nh = step.num_heads;
  const KVCache<T, cpu>& kv = *step.kv;
  const index_t len_max = kv.max_len(), dh = kv.head_dim(), d = step.w_o.rows();
  const index_t nkv = kv.kv_heads(), g = kv.group();  // query head h reads cached head h / g
  const T fh = static_cast<T>(nh);
  const T inv_var = static_cast<T>(1.0 / (args.sigma * args.sigma));
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  constexpr T floor = attention_prior_floor<T>();
  const MatrixMap<T> Wo = as_matrix(step.w_o);
  heads.assign(static_cast<std::size_t>(n), 0);
  std::vector<index_t> bad(static_cast<std::size_t>(n), 0);
  // (1) every row's slot caches: r_t and |m_ht|^2 - |b_o|^2 of every head (the rows of a chunk
  // read each other's entries below)
  parallel_items(n, [&](index_t i) {
    const index_t s = rows.slot[static_cast<std::size_t>(i)];
    const index_t t = rows.pos[static_cast<std::size_t>(i)];
    std::copy_n(r.data() + i * e, e, cache.r.data() + (s * len_max + t) * e);
    Eigen::Matrix<T, Eigen::Dynamic, 1> y(d);
    for (index_t h = 0; h < nh; ++h) {
      const T* vt = kv.v.data() + ((s * nkv + h / g) * len_max + t) * dh;
      y.noalias() = Wo.middleCols(h * dh, dh) * VectorMap<T>(const_cast<T*>(vt), dh);
      T msq = fh * fh * y.squaredNorm();
      if (!step.b_o.empty()) msq += T(2) * fh * y.dot(as_vector(step.b_o));
      cache.msq.data()[(s * nh + h) * len_max + t] = msq;
    }
  });
  // (2) the entropy prefix sums and h*, in row order (entry t adds to entry t - 1, which an
  // earlier row of the same chunk may have written)
  for (index_t i = 0; i < n; ++i)
    heads[static_cast<std::size_t>(i)] = decode_choose_head(
        cache.entropy_prefix, rows.slot[static_cast<std::size_t>(i)],
        rows.pos[static_cast<std::size_t>(i)], len_max, nh, step.row_entropy.data() + i * nh);
  // (3) per row, the posterior over positions 0..t and p_i
  parallel_items(n, [&](index_t i) {
    const index_t s = rows.slot[static_cast<std::size_t>(i)];
    const index_t t = rows.pos[static_cast<std::size_t>(i)], len = t + 1;
    const index_t h = heads[static_cast<std::size_t>(i)];
    // q = H a W_o,h (dh); logits log A + (q . v_j - msq_j / 2) / sigma^2, -inf at or below the floor
    const detail::ConstRowVectorMap<T> a(step.out.data() + i * d, d);
    const Eigen::Matrix<T, 1, Eigen::Dynamic> q = fh * a * Wo.middleCols(h * dh, dh);
    const MatrixMap<T> V(kv.v.data() + (s * nkv + h / g) * len_max * dh, len, dh);
    const T* A = step.probs.data() + (i * nh + h) * len_max;
    const T* msq = cache.msq.data() + (s * nh + h) * len_max;
    Eigen::Matrix<T, 1, Eigen::Dynamic> row(len);
    row.noalias() = q * V.transpose();
    for (index_t j = 0; j < len; ++j)
      row(j) = A[j] > floor ? std::log(A[j]) + (row(j) - T(0.5) * msq[j]) * inv_var : kNegInf;
    const T mx = row.maxCoeff();
    if (!(mx > kNegInf)) {
      bad[static_cast<std::size_t>(i)] = 1;
      return;
    }
    double sum = 0;
    for (index_t j = 0; j < len; ++j) {
      row(j) = row(j) > kNegInf ? std::exp(row(j) - mx) : T(0);
      sum += static_cast<double>(row(j));
    }
    row *= static_cast<T>(1.0 / sum);
    const MatrixMap<T> R(cache.r.data() + s * len_max * e, len, e);
    detail::RowVectorMap<T>(p.data() + i * e, e).noalias() = row * R;
    if (weights != nullptr) std::copy_n(row.data(), len, weights->data() + i * len_max);
  });
  for (index_t i = 0; i < n; ++i)
    if (bad[static_cast<std::size_t>(i)]) return i;
  return -1;
}

}  // namespace graphmoe
