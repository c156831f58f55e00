// custom_router/top_p_selector.hpp: top-p (nucleus) selection, written as a graphmoe selector
// policy outside namespace graphmoe.
//
// Per token i, with k = current_k() (RouterConfig::k) and the threshold TopP::Options::threshold:
//   indices_i = the k experts of largest p_i, descending (ties: the lower expert index first)
//   values_i  = p_i at those experts
//   keep_i    = 1 for the smallest prefix of them whose cumulative p reaches the threshold
//               (at least one expert; all k when even their sum stays below it), 0 for the rest
//   gates_i   = keep o values / s,   s = sum_l keep_l values_l
// so a confident token uses one expert and an uncertain one up to k. An assignment with keep = 0
// is "dropped" in graphmoe's sense: dropped_count(selection) counts them, and MoELayer routes
// them to no expert (they cost nothing and contribute nothing; Selection::may_drop stays true).
//
// Backward (the kept set is piecewise constant in p): for the selected experts,
//   dp_l = keep_l (dg_l - sum_j g_j dg_j) / s
// and dp = 0 elsewhere (a dropped expert's p enters neither gates nor s).
//
// RouterConfig::capacity_factor is not supported (the selector checks that it is off).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <numeric>
#include <vector>

#include <graphmoe/graphmoe.hpp>

namespace custom_router {

// The policy's options (TopP::Options), defined before the implementation that reads them.
struct TopPOptions {
  double threshold = 0.6;  // keep experts until their cumulative p reaches it
  void validate() const {
    GRAPHMOE_USER_CHECK(threshold > 0 && threshold <= 1, "TopP::Options", "threshold must be in (0, 1], got ",
                   threshold);
  }
};

template <class T, class B>
  requires std::same_as<B, graphmoe::cpu>
class TopPSelectorImpl {
 public:
  using index_t = graphmoe::index_t;

  void configure(const graphmoe::RouterConfig& cfg);  // defined below TopP, whose options it reads
  index_t current_k() const { return k_; }
  double threshold() const { return threshold_; }
  void set_step(std::int64_t) {}

  void select(const graphmoe::Tensor<T, B>& p, index_t k, graphmoe::Selection<T, B>& sel) const {
    const index_t n = p.rows(), e = p.cols();
    GRAPHMOE_USER_CHECK(k >= 1 && k <= e, "TopP", "k = ", k, " must be in [1, E = ", e, "]");
    const graphmoe::Shape shape{n, k};
    sel.indices = graphmoe::Tensor<std::int32_t, B>(shape);
    sel.values = graphmoe::Tensor<T, B>(shape);
    sel.gates = graphmoe::Tensor<T, B>(shape);
    sel.keep = graphmoe::Tensor<std::uint8_t, B>(shape);
    sel.may_drop = true;
    std::vector<index_t> order(static_cast<std::size_t>(e));
    for (index_t i = 0; i < n; ++i) {
      std::iota(order.begin(), order.end(), index_t(0));
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](index_t a, index_t b) {
        return p(i, a) > p(i, b) || (p(i, a) == p(i, b) && a < b);
      });
      double cum = 0;
      bool reached = false;
      T s = 0;
      for (index_t l = 0; l < k; ++l) {
        const index_t c = order[static_cast<std::size_t>(l)];
        sel.indices(i, l) = static_cast<std::int32_t>(c);
        sel.values(i, l) = p(i, c);
        sel.keep(i, l) = reached ? 0 : 1;
        if (!reached) {
          s += p(i, c);
          cum += static_cast<double>(p(i, c));
          reached = cum >= threshold_;
        }
      }
      for (index_t l = 0; l < k; ++l)
        sel.gates(i, l) = sel.keep(i, l) ? sel.values(i, l) / s : T(0);
    }
  }

  void backward(const graphmoe::Tensor<T, B>& p, const graphmoe::Selection<T, B>& sel,
                const graphmoe::Tensor<T, B>& dgates, graphmoe::Tensor<T, B>& dp) const {
    const index_t n = p.rows(), k = sel.indices.cols();
    graphmoe::check_shape("TopP::backward", "dgates", dgates, sel.gates.shape());
    dp = graphmoe::Tensor<T, B>(p.shape());
    for (index_t i = 0; i < n; ++i) {
      T s = 0, gdg = 0;
      for (index_t l = 0; l < k; ++l) {
        if (!sel.keep(i, l)) continue;
        s += sel.values(i, l);
        gdg += sel.gates(i, l) * dgates(i, l);
      }
      for (index_t l = 0; l < k; ++l)
        if (sel.keep(i, l)) dp(i, sel.indices(i, l)) = (dgates(i, l) - gdg) / s;
    }
  }

 private:
  index_t k_ = 1;
  double threshold_ = 0.6;
};

struct TopP {
  static constexpr const char* name = "top-p";
  using Options = TopPOptions;  // cfg.options<TopP>().threshold = 0.8
  template <class T, class B>
  using impl = TopPSelectorImpl<T, B>;
};

template <class T, class B>
  requires std::same_as<B, graphmoe::cpu>
void TopPSelectorImpl<T, B>::configure(const graphmoe::RouterConfig& cfg) {
  GRAPHMOE_USER_CHECK(cfg.capacity_factor <= 0, "TopP", "capacity_factor ", cfg.capacity_factor,
                 " is not supported by the top-p selector (use 0: dropless)");
  const TopP::Options& opts = cfg.options<TopP>();
  opts.validate();
  k_ = cfg.k;
  threshold_ = opts.threshold;
}

}  // namespace custom_router
