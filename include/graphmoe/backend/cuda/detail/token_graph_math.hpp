// graphmoe/backend/cuda/detail/token_graph_math.hpp: the per-element and per-tile math of the
// token-graph kernels (backend/cuda/similarity_graph.cuh, attention_graph.cuh), as host/device
// functions (internal).
//
// The kernels call these functions; so does tests/cuda/test_host_graphs.cpp, compiled by g++,
// which drives them in the kernels' tile order and compares with the CPU GraphImpl. This header
// therefore includes nothing of CUDA and marks every function GRAPHMOE_HOST_DEVICE.
//
// Similarity graph, one sequence of `len` tokens, logits l_ij = u_i . u_j / tau:
//   visible(i, j)   j < len, and j <= i when causal: the columns of row i's softmax
//   tiles           a block owns kOwnTile rows (forward, row backward) or columns (column
//                   backward) and streams the other side in tiles of kStreamTile, from
//                   stream_begin to stream_end (causal tiles stop at the owned rows' end)
//   OnlineSoftmax   running max m, sum s = sum_j exp(l_j - m) and d = sum_j exp(l_j - m)(l_j - m)
//                   over the tiles seen so far; merging a tile rescales s and d by exp(m - m')
//                   (d also gains (m - m') s), so that at the end
//                   lse = m + log s,   H = -sum_j S_j log S_j = log s - d / s
//   backward        S_ij = exp(l_ij - lse_i),  ds_ij = S_ij (dp_i . r_j - c_i),  c_i = dp_i . p_i
//
// Attention graph, rows of the head h* = heads[i]:
//   posterior_logit log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2, -inf where A = 0
//   choose_heads    h* by the lowest mean attention-row entropy (sequence or causal prefix),
//                   the same double-precision sums and tie rule as the CPU GraphImpl
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/attention_cache.hpp"

namespace graphmoe::detail::graph_math {

// Tile sizes of the Similarity kernels (similarity_graph.cuh); the host test uses the same.
inline constexpr int kOwnTile = 16;     // rows (or columns) owned by one thread block
inline constexpr int kStreamTile = 32;  // streamed columns (or rows) per step, one per warp lane
inline constexpr int kDepthTile = 32;   // depth of one step of a tile's dot products
inline constexpr int kThreads = 256;    // 8 warps: warp w owns rows 2w and 2w + 1 of the tile

template <class T>
GRAPHMOE_HOST_DEVICE inline T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// exp and log in T's precision on both compilers.
GRAPHMOE_HOST_DEVICE inline float exp_of(float x) { return ::expf(x); }
GRAPHMOE_HOST_DEVICE inline double exp_of(double x) { return ::exp(x); }
GRAPHMOE_HOST_DEVICE inline float log_of(float x) { return ::logf(x); }
GRAPHMOE_HOST_DEVICE inline double log_of(double x) { return ::log(x); }

// ---- Similarity ---------------------------------------------------------------------------------

// Column j (sequence position) belongs to row i's softmax.
GRAPHMOE_HOST_DEVICE inline bool visible(index_t i, index_t j, index_t len, bool causal) {
  return i < len && j < len && (!causal || j <= i);
}

// Streamed columns for owned rows [i0, i0 + n): [0, stream_end).
GRAPHMOE_HOST_DEVICE inline index_t stream_end_for_rows(index_t i0, index_t n, index_t len,
                                                        bool causal) {
  return causal ? (i0 + n < len ? i0 + n : len) : len;
}
// Streamed rows for owned columns [j0, ...): [stream_begin, len).
GRAPHMOE_HOST_DEVICE inline index_t stream_begin_for_cols(index_t j0, bool causal) {
  return causal ? j0 : 0;
}

// The logit of a tile entry, -inf where it is masked.
template <class T>
GRAPHMOE_HOST_DEVICE inline T masked_logit(T dot, T inv_tau, bool is_visible) {
  return is_visible ? dot * inv_tau : neg_inf<T>();
}

// exp(l - m) for a logit l against the running max m (0 for a masked logit).
template <class T>
GRAPHMOE_HOST_DEVICE inline T softmax_weight(T l, T m) {
  return l == neg_inf<T>() ? T(0) : exp_of(l - m);
}
// exp(l - m) (l - m), 0 for a masked logit (where the product would be 0 * -inf).
template <class T>
GRAPHMOE_HOST_DEVICE inline T entropy_weight(T l, T m) {
  return l == neg_inf<T>() ? T(0) : exp_of(l - m) * (l - m);
}

template <class T>
struct OnlineSoftmax {
  T max = neg_inf<T>();
  T sum = T(0);
  T dot = T(0);  // sum_j exp(l_j - max) (l_j - max)

  // The running max after a tile whose visible logits have maximum tile_max (-inf if none).
  GRAPHMOE_HOST_DEVICE T next_max(T tile_max) const { return tile_max > max ? tile_max : max; }
  // The factor exp(max - new_max) that turns sums against max into sums against new_max
  // (0 before the first visible logit).
  GRAPHMOE_HOST_DEVICE T rescale(T new_max) const {
    return max == neg_inf<T>() ? T(0) : exp_of(max - new_max);
  }
  // Adds a tile: tile_sum = sum exp(l - new_max), tile_dot = sum exp(l - new_max)(l - new_max).
  GRAPHMOE_HOST_DEVICE void merge(T new_max, T tile_sum, T tile_dot) {
    if (max == neg_inf<T>()) {
      sum = tile_sum;
      dot = tile_dot;
    } else {
      const T s = exp_of(max - new_max);
      // sum_j e_j (l_j - new_max) = sum_j e_j (l_j - max) + (max - new_max) sum_j e_j
      dot = s * (dot + (max - new_max) * sum) + tile_dot;
      sum = s * sum + tile_sum;
    }
    max = new_max;
  }
  GRAPHMOE_HOST_DEVICE T lse() const { return max + log_of(sum); }
  GRAPHMOE_HOST_DEVICE T entropy() const { return log_of(sum) - dot / sum; }
};

// The new value of an accumulator row entry: acc * factor + add, where factor 0 assigns (so that
// whatever the output held before, NaN included, is dropped).
template <class T>
GRAPHMOE_HOST_DEVICE inline T rescale_add(T acc, T factor, T add) {
  return factor == T(0) ? add : acc * factor + add;
}

// S_ij recomputed from the logit and the row's log-sum-exp (0 where masked).
template <class T>
GRAPHMOE_HOST_DEVICE inline T prob_from_lse(T l, T lse) {
  return l == neg_inf<T>() ? T(0) : exp_of(l - lse);
}

// The gradient of the logit: ds = S (g - c), g = dp_i . r_j, c = dp_i . p_i.
template <class T>
GRAPHMOE_HOST_DEVICE inline T softmax_dlogit(T s, T g, T c) {
  return s * (g - c);
}

// ---- Attention ------------------------------------------------------------------------------

// log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2 for A > attention_prior_floor, -inf otherwise (as
// the CPU; core/attention_cache.hpp says why there is a floor).
template <class T>
GRAPHMOE_HOST_DEVICE inline T posterior_logit(T a, T g, T msq, T inv_var) {
  return a > attention_prior_floor<T>() ? log_of(a) + (g - T(0.5) * msq) * inv_var : neg_inf<T>();
}

// a log a with 0 log 0 = 0: one term of an attention row's negative entropy.
template <class T>
GRAPHMOE_HOST_DEVICE inline T plogp(T a) {
  const T tiny = std::numeric_limits<T>::min();
  return a * log_of(a > tiny ? a : tiny);
}

// The gradient into an attention probability: dl / A where A > attention_prior_floor, 0 where
// the forward treated A as 0.
template <class T>
GRAPHMOE_HOST_DEVICE inline T dprob_term(T dl, T a) {
  return a > attention_prior_floor<T>() ? dl / a : T(0);
}

// The head with the lowest prefix[h] / count (ties to the lower head; NaN never wins).
GRAPHMOE_HOST_DEVICE inline std::int32_t argmin_mean(const double* prefix, index_t nh,
                                                     index_t count) {
  std::int32_t best = 0;
  double best_v = std::numeric_limits<double>::infinity();
  for (index_t h = 0; h < nh; ++h) {
    const double v = prefix[h] / static_cast<double>(count);
    if (v < best_v) {
      best_v = v;
      best = static_cast<std::int32_t>(h);
    }
  }
  return best;
}

// h* for the rows of one sequence from its attention-row entropies ent[h * len + i] (H, len):
// the head with the lowest mean entropy over the whole sequence (per_row_prefix false) or over
// rows 0..i for row i (true); ties go to the lower head, sums in double in row order.
// prefix: caller scratch of nh doubles. heads: len outputs.
template <class E>
GRAPHMOE_HOST_DEVICE inline void choose_heads(const E* ent, index_t nh, index_t len,
                                              bool per_row_prefix, double* prefix,
                                              std::int32_t* heads) {
  for (index_t h = 0; h < nh; ++h) prefix[h] = 0.0;
  if (!per_row_prefix) {
    for (index_t h = 0; h < nh; ++h)
      for (index_t i = 0; i < len; ++i) prefix[h] += static_cast<double>(ent[h * len + i]);
    const std::int32_t best = argmin_mean(prefix, nh, len);
    for (index_t i = 0; i < len; ++i) heads[i] = best;
  } else {
    for (index_t i = 0; i < len; ++i) {
      for (index_t h = 0; h < nh; ++h) prefix[h] += static_cast<double>(ent[h * len + i]);
      heads[i] = argmin_mean(prefix, nh, i + 1);
    }
  }
}

}  // namespace graphmoe::detail::graph_math
