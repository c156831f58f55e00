// graphmoe/routing/selectors.hpp: selector implementations, p (N, E) -> k experts per token and
// their gates.
//
//   indices = the k largest entries of p_i (descending; ties: the lower expert index first)
//   gates   = keep o p_sel / sum_j p_sel_j       (Renormalize(TopK^0(p)), Appendix C.3)
//
// keep_ij is 0 for an assignment dropped by the capacity limit (RouterConfig::capacity_factor),
// else 1. Backward, with s = sum_j p_sel_j:  dp_sel_l = keep_l dg_l / s - sum_j g_j dg_j / s.
// The arithmetic is in the ops of backend/*/gates.*, so the selectors run on every backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/backend/cpu/gates.hpp"
#include "graphmoe/backend/cpu/topk.hpp"
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

template <class T, class B>
class TopKSelectorBase {
 public:
  void configure(const RouterConfig& cfg) { cfg_ = cfg; }

  void select(const Tensor<T, B>& p, index_t k, Selection<T, B>& sel) const {
    const index_t n = p.rows(), e = p.cols();
    GRAPHMOE_CHECK(k >= 1 && k <= e, "TopK", "k = ", k, " must be in [1, E = ", e, "]");
    sel.indices = Tensor<std::int32_t, B>();
    sel.values = Tensor<T, B>();
    sel.keep = Tensor<std::uint8_t, B>();
    sel.gates = Tensor<T, B>();
    topk_forward(p, k, sel.values, sel.indices);
    const index_t cap =
        cfg_.capacity_factor > 0
            ? static_cast<index_t>(std::ceil(cfg_.capacity_factor * static_cast<double>(n * k) /
                                             static_cast<double>(e)))
            : 0;
    sel.dropped = capacity_mask(sel.indices, e, cap, sel.keep);
    renormalized_gates(sel.values, sel.keep, sel.gates);
  }

  // dp assigned (N, E): zero except at the selected experts.
  void backward(const Tensor<T, B>& p, const Selection<T, B>& sel, const Tensor<T, B>& dgates,
                Tensor<T, B>& dp) const {
    renormalized_gates_backward(sel.values, sel.indices, sel.keep, sel.gates, dgates, p.cols(),
                                dp);
  }

 protected:
  RouterConfig cfg_;
};

template <class T, class B>
class SelectorImpl<TopK, T, B> : public TopKSelectorBase<T, B> {
 public:
  index_t current_k() const { return this->cfg_.k; }
  void set_step(std::int64_t) {}
};

// SMoE-Dropout's schedule: k(t) = clamp(round((k_max - k_min) t / T) + k_min, k_min, k_max), with
// round half to even as Python's round() in the reference code (VITA-Group/Random-MoE-as-Dropout).
// set_step(t) is called by the training loop; set_k_override(k) pins k (e.g. k = E for the dense
// evaluation of the SMoE-Dropout paper), 0 removes the pin.
template <class T, class B>
class SelectorImpl<ScheduledTopK, T, B> : public TopKSelectorBase<T, B> {
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
