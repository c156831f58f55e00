// graphmoe/routing/selectors.hpp: selector implementations, p (N, E) -> k experts per token and
// their gates.
//
//   indices = the k largest entries of p_i (descending; ties: the lower expert index first)
//   gates   = keep o p_sel / sum_j p_sel_j       (Renormalize(TopK^0(p)), Appendix C.3)
//
// keep_ij is 0 for an assignment dropped by the capacity limit (RouterConfig::capacity_factor),
// else 1. Backward, with s = sum_j p_sel_j:  dp_sel_l = keep_l dg_l / s - sum_j g_j dg_j / s.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/backend/cpu/topk.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

template <class T, class B = cpu>
struct Selection {
  Tensor<std::int32_t, B> indices;  // (N, k)  expert ids, descending p
  Tensor<T, B> values;              // (N, k)  p at those experts
  Tensor<T, B> gates;               // (N, k)  renormalised (0 where dropped)
  Tensor<std::uint8_t, B> keep;     // (N, k)  0 where the capacity limit dropped the assignment
  index_t dropped = 0;              // number of dropped assignments
};

template <class Policy, class T, class B = cpu>
class SelectorImpl {
  static_assert(sizeof(Policy) == 0,
                "graphmoe: unknown selector policy; use TopK or ScheduledTopK "
                "(routing/policies.hpp)");
};

template <class T>
class TopKSelectorBase {
 public:
  void configure(const RouterConfig& cfg) { cfg_ = cfg; }

  void select(const Tensor<T, cpu>& p, index_t k, Selection<T, cpu>& sel) const {
    const index_t n = p.rows(), e = p.cols();
    GRAPHMOE_CHECK(k >= 1 && k <= e, "TopK", "k = ", k, " must be in [1, E = ", e, "]");
    sel.indices = Tensor<std::int32_t, cpu>();
    sel.values = Tensor<T, cpu>();
    topk_forward(p, k, sel.values, sel.indices);
    sel.keep = Tensor<std::uint8_t, cpu>(Shape{n, k});
    sel.keep.fill(1);
    sel.dropped = 0;
    if (cfg_.capacity_factor > 0) {
      const index_t cap = static_cast<index_t>(
          std::ceil(cfg_.capacity_factor * static_cast<double>(n * k) / static_cast<double>(e)));
      std::vector<index_t> load(static_cast<std::size_t>(e), 0);
      for (index_t i = 0; i < n * k; ++i) {  // token order, then choice order
        auto& l = load[static_cast<std::size_t>(sel.indices.data()[i])];
        if (l >= cap) {
          sel.keep.data()[i] = 0;
          ++sel.dropped;
        } else {
          ++l;
        }
      }
    }
    sel.gates = Tensor<T, cpu>(Shape{n, k});
    for (index_t i = 0; i < n; ++i) {
      T s = 0;
      for (index_t j = 0; j < k; ++j) s += sel.values(i, j);
      GRAPHMOE_CHECK(s > T(0), "TopK", "the selected scores of token ", i, " sum to ", s,
                     " (p must be a probability vector)");
      for (index_t j = 0; j < k; ++j)
        sel.gates(i, j) = sel.keep(i, j) ? sel.values(i, j) / s : T(0);
    }
  }

  // dp assigned (N, E): zero except at the selected experts.
  void backward(const Tensor<T, cpu>& p, const Selection<T, cpu>& sel, const Tensor<T, cpu>& dgates,
                Tensor<T, cpu>& dp) const {
    check_shape("TopK::backward", "dgates", dgates, sel.gates.shape());
    prepare_output("TopK::backward", "dp", dp, p.shape());
    dp.zero();
    const index_t n = p.rows(), k = sel.gates.cols();
    for (index_t i = 0; i < n; ++i) {
      T s = 0, gdg = 0;
      for (index_t j = 0; j < k; ++j) {
        s += sel.values(i, j);
        gdg += sel.gates(i, j) * dgates(i, j);
      }
      for (index_t j = 0; j < k; ++j) {
        const T d = (sel.keep(i, j) ? dgates(i, j) : T(0)) / s - gdg / s;
        dp(i, sel.indices(i, j)) += d;
      }
    }
  }

 protected:
  RouterConfig cfg_;
};

template <class T>
class SelectorImpl<TopK, T, cpu> : public TopKSelectorBase<T> {
 public:
  index_t current_k() const { return this->cfg_.k; }
  void set_step(std::int64_t) {}
};

// SMoE-Dropout's schedule: k(t) = clamp(round((k_max - k_min) t / T) + k_min, k_min, k_max), with
// round half to even as Python's round() in the reference code (VITA-Group/Random-MoE-as-Dropout).
// set_step(t) is called by the training loop; set_k_override(k) pins k (e.g. k = E for the dense
// evaluation of the SMoE-Dropout paper), 0 removes the pin.
template <class T>
class SelectorImpl<ScheduledTopK, T, cpu> : public TopKSelectorBase<T> {
 public:
  static index_t k_at(const RouterConfig& c, std::int64_t step) {
    const double t = static_cast<double>(std::max<std::int64_t>(step, 0));
    const double raw = std::nearbyint(static_cast<double>(c.k_max - c.k_min) * t /
                                  static_cast<double>(c.schedule_steps)) +
                       static_cast<double>(c.k_min);
    return std::clamp(static_cast<index_t>(raw), c.k_min, c.k_max);
  }
  index_t current_k() const { return override_ > 0 ? override_ : k_at(this->cfg_, step_); }
  void set_step(std::int64_t step) { step_ = step; }
  void set_k_override(index_t k) {
    GRAPHMOE_CHECK(k >= 0 && k <= this->cfg_.num_experts, "ScheduledTopK", "k override ", k,
                   " out of [0, ", this->cfg_.num_experts, "]");
    override_ = k;
  }

 private:
  std::int64_t step_ = 0;
  index_t override_ = 0;
};

}  // namespace graphmoe
