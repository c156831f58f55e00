// custom_router/knn_graph.hpp: a k-nearest-neighbour token graph, written as a graphmoe token-graph
// policy outside namespace graphmoe.
//
// Within each sequence of ctx.seq_len consecutive tokens, token i's candidates are the tokens j
// of its sequence (only j <= i when RouterConfig::causal), i itself among them. With
//   l_ij = u_i . u_j / sqrt(D)
// token i keeps the K candidates of largest l_ij (all of them when there are fewer than K; ties:
// the lower j first), its neighbourhood N_i, and
//   w_ij = softmax over j in N_i of l_ij,     p_i = sum_{j in N_i} w_ij r_j.
// (Whether i is in N_i depends on u: usually it is, since l_ii = |u_i|^2 / sqrt(D).)
//
// Backward: N_i is piecewise constant in u, so the gradient flows through the weights only:
//   dr_j  = sum_i w_ij dp_i                                       (assigned)
//   dw_ij = dp_i . r_j,   dl_ij = w_ij (dw_ij - sum_{m in N_i} w_im dw_im)
//   du_i += sum_j dl_ij u_j / sqrt(D),   du_j += dl_ij u_i / sqrt(D)   (accumulated)
// KnnGraph::Options::detach stops the gradient to u (r still gets its gradient).
// mean_entropy() is the mean over tokens of -sum_j w_ij log w_ij of the last forward.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <vector>

#include <graphmoe/graphmoe.hpp>

namespace custom_router {

// The policy's options (KnnGraph<K>::Options), defined before the implementation that reads them.
// K, the neighbourhood size, is a template parameter instead (it sizes a stack array in backward).
struct KnnGraphOptions {
  bool detach = false;  // no gradient to u through the weights w
};
template <int K>
struct KnnGraph;

template <int K, class T, class B>
  requires(K >= 1 && std::same_as<B, graphmoe::cpu>)
class KnnGraphImpl {
 public:
  using Tensor = graphmoe::Tensor<T, B>;
  using index_t = graphmoe::index_t;

  void configure(index_t d_model, const graphmoe::RouterConfig& cfg) {
    // KnnGraph<K> is dependent on K here, so it is complete when this is instantiated
    detach_ = cfg.options<KnnGraph<K>>().detach;
    causal_ = cfg.causal;
    d_model_ = d_model;
  }

  void forward(const Tensor& u, const Tensor& r, const graphmoe::GraphContext<T, B>& ctx,
               Tensor& p) {
    const index_t n = u.rows(), d = u.cols(), e = r.cols(), len = ctx.seq_len;
    GRAPHMOE_USER_CHECK(u.rank() == 2 && r.rank() == 2 && r.rows() == n, "KnnGraph",
                   "u must be (N, D) and r (N, E) with the same N, got u ", u.shape(), " and r ",
                   r.shape());
    GRAPHMOE_USER_CHECK(d == d_model_, "KnnGraph", "u has ", d, " columns, configured for D = ",
                   d_model_);
    GRAPHMOE_USER_CHECK(len >= 1 && n % len == 0, "KnnGraph", "seq_len = ", len,
                   " does not divide the ", n, " tokens");
    const T scale = T(1) / std::sqrt(static_cast<T>(d));
    p = Tensor(r.shape());
    nbr_.assign(static_cast<std::size_t>(n * K), -1);
    w_.assign(static_cast<std::size_t>(n * K), T(0));
    count_.assign(static_cast<std::size_t>(n), 0);
    double entropy = 0;
    std::vector<std::pair<T, index_t>> cand;
    for (index_t i = 0; i < n; ++i) {
      const index_t s0 = i / len * len, s1 = causal_ ? i + 1 : s0 + len;
      cand.clear();
      for (index_t j = s0; j < s1; ++j) cand.emplace_back(dot(u, i, j, d) * scale, j);
      const index_t m = std::min<index_t>(K, static_cast<index_t>(cand.size()));
      // the m largest l_ij, descending, ties to the lower j
      std::partial_sort(cand.begin(), cand.begin() + m, cand.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      const T mx = cand[0].first;
      T z = 0;
      for (index_t q = 0; q < m; ++q) z += std::exp(cand[q].first - mx);
      count_[i] = m;
      for (index_t q = 0; q < m; ++q) {
        const T w = std::exp(cand[q].first - mx) / z;
        const index_t j = cand[q].second;
        nbr_[slot(i, q)] = j;
        w_[slot(i, q)] = w;
        for (index_t c = 0; c < e; ++c) p(i, c) += w * r(j, c);
        if (w > T(0)) entropy -= static_cast<double>(w) * std::log(static_cast<double>(w));
      }
    }
    entropy_ = n > 0 ? entropy / static_cast<double>(n) : 0.0;
  }

  void backward(const Tensor& u, const Tensor& r, const Tensor& /*p*/, const Tensor& dp,
                const graphmoe::GraphContext<T, B>& /*ctx*/, Tensor& dr, Tensor& du) {
    const index_t n = u.rows(), d = u.cols(), e = r.cols();
    GRAPHMOE_USER_CHECK(static_cast<index_t>(count_.size()) == n, "KnnGraph::backward",
                   "no forward of these ", n, " tokens to take the gradient of");
    graphmoe::check_shape("KnnGraph::backward", "dp", dp, r.shape());
    dr = Tensor(r.shape());
    const bool to_u = !detach_;
    if (to_u) graphmoe::check_shape("KnnGraph::backward", "du", du, u.shape());
    const T scale = T(1) / std::sqrt(static_cast<T>(d));
    T dw[K];
    for (index_t i = 0; i < n; ++i) {
      const index_t m = count_[i];
      T wdw = 0;
      for (index_t q = 0; q < m; ++q) {
        const index_t j = nbr_[slot(i, q)];
        const T w = w_[slot(i, q)];
        T acc = 0;
        for (index_t c = 0; c < e; ++c) {
          dr(j, c) += w * dp(i, c);
          acc += dp(i, c) * r(j, c);
        }
        dw[q] = acc;
        wdw += w * acc;
      }
      if (!to_u) continue;
      for (index_t q = 0; q < m; ++q) {
        const index_t j = nbr_[slot(i, q)];
        const T dl = w_[slot(i, q)] * (dw[q] - wdw) * scale;
        for (index_t c = 0; c < d; ++c) {
          du(i, c) += dl * u(j, c);
          du(j, c) += dl * u(i, c);
        }
      }
    }
  }

  double mean_entropy() const { return entropy_; }
  // Mean G[i, i] of the last forward (read by graphmoe's routing_report, optional).
  double mean_self_weight() const {
    const index_t n = static_cast<index_t>(count_.size());
    double s = 0;
    for (index_t i = 0; i < n; ++i)
      for (index_t q = 0; q < count_[i]; ++q)
        if (nbr_[slot(i, q)] == i) s += static_cast<double>(w_[slot(i, q)]);
    return n > 0 ? s / static_cast<double>(n) : 0.0;
  }
  // Neighbourhood of the last forward: neighbours(i)[q] for q < neighbour_count(i), with weights.
  index_t neighbour_count(index_t i) const { return count_[static_cast<std::size_t>(i)]; }
  index_t neighbour(index_t i, index_t q) const { return nbr_[slot(i, q)]; }
  T weight(index_t i, index_t q) const { return w_[slot(i, q)]; }

 private:
  static std::size_t slot(index_t i, index_t q) { return static_cast<std::size_t>(i * K + q); }
  static T dot(const Tensor& u, index_t i, index_t j, index_t d) {
    const T* a = u.data() + i * d;
    const T* b = u.data() + j * d;
    T s = 0;
    for (index_t c = 0; c < d; ++c) s += a[c] * b[c];
    return s;
  }

  bool detach_ = false, causal_ = false;
  index_t d_model_ = 0;
  // forward cache: for token i, slots [i K, i K + count_[i]) hold its neighbours and weights
  std::vector<index_t> nbr_;
  std::vector<T> w_;
  std::vector<index_t> count_;
  double entropy_ = 0;
};

template <int K>
struct KnnGraph {
  static_assert(K >= 1, "KnnGraph<K>: K must be at least 1");
  static constexpr const char* name = "knn";
  static constexpr int neighbours = K;
  using Options = KnnGraphOptions;  // cfg.options<KnnGraph<K>>().detach = true
  template <class T, class B>
  using impl = KnnGraphImpl<K, T, B>;
};

}  // namespace custom_router
