// graphmoe/routing/selectors.hpp: selector implementations, p (N, E) -> each token's experts and
// their gates, as a Selection: an (N, m) table whose row t lists token t's assignments (expert,
// p value, gate, keep). The MoE layer dispatches every kept slot and sends the others (keep = 0) to
// no expert.
//
// Token choice (TopK, ScheduledTopK), m = k:
//   indices = the k largest entries of p_i (descending; ties: the lower expert index first)
//   gates   = keep o p_sel / sum_j p_sel_j       (Renormalize(TopK^0(p)), Appendix C.3)
// keep_ij is 0 for an assignment dropped by the capacity limit (RouterConfig::capacity_factor),
// else 1. Backward, with s = sum_j p_sel_j:  dp_sel_l = keep_l dg_l / s - sum_j g_j dg_j / s.
// The arithmetic is in the ops of backend/*/gates.*, so these selectors run on every backend.
//
// Expert choice (ExpertChoice), m = the most experts any token got in this call (>= 1):
//   within each sequence of L tokens, expert e takes the c tokens with the largest p[:, e]
//   (ties: the lower token index first), c = min(L, ceil(f L k / E)); row t lists the experts
//   that took token t, by descending p (ties: the lower expert first), gate = p[t, e]; the rest of
//   the row is padding (expert -1, value 0, gate 0, keep 0). Backward: dp[t, e] = dg at kept slots.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/capacity.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gates.hpp"
#include "graphmoe/ops/topk.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

template <class T, class B = cpu>
struct Selection {
  Tensor<std::int32_t, B> indices;  // (N, m)  expert ids, descending p (-1: an ExpertChoice pad)
  Tensor<T, B> values;              // (N, m)  p at those experts
  Tensor<T, B> gates;               // (N, m)  the gates (0 where dropped)
  Tensor<std::uint8_t, B> keep;     // (N, m)  0 where the slot is dropped (capacity) or padding
  // Whether keep may hold a 0 (false: every entry is 1, which the selector guarantees). The MoE
  // layer sends the slots with keep = 0 to no expert only when this is set; a selector that is
  // unsure leaves it true. The number of zeros is dropped_count(selection), computed on request
  // (on a GPU a read back to the host, which a training step does not need).
  bool may_drop = true;
};

// The number of slots with keep = 0 (capacity drops and padding).
template <class T, class B>
index_t dropped_count(const Selection<T, B>& sel) {
  return sel.keep.empty() ? 0 : count_dropped(sel.keep);
}

// Token choice with TokenChoiceOptions (policies.hpp): the k experts are the top-k of p (plus a
// selection bias, BiasBalancedTopK's, when given), within each token's best groups when n_group >
// 1; the values are p at those experts and the gates follow GateScaling (renormalised over the k or
// not, times routed_scaling_factor). With the defaults (no bias, one group) this is the paper's
// top-k: top-k of p, its values, Renormalize.
template <class T, class B>
class TopKSelectorBase {
 public:
  void configure(const RouterConfig& cfg) { cfg_ = cfg; }

  void select(const Tensor<T, B>& p, index_t k, Selection<T, B>& sel) const {
    select_with(p, k, cfg_.capacity_factor, sel, nullptr);
  }
  // The same without the capacity limit (incremental decoding routes every token to its k
  // experts, RouterImpl::decode).
  void select_dropless(const Tensor<T, B>& p, index_t k, Selection<T, B>& sel) const {
    select_with(p, k, 0.0, sel, nullptr);
  }

  // dp assigned (N, E): zero except at the selected experts.
  void backward(const Tensor<T, B>& p, const Selection<T, B>& sel, const Tensor<T, B>& dgates,
                Tensor<T, B>& dp) const {
    renormalized_gates_backward(sel.values, sel.indices, sel.keep, sel.gates, dgates, p.cols(),
                                dp, scaling());
  }
  const TokenChoiceOptions& choice() const { return choice_; }

 protected:
  // cfg and the choice options (checked against cfg's num_experts and k).
  void configure_choice(const RouterConfig& cfg, const TokenChoiceOptions& choice) {
    choice.validate_for(cfg.num_experts, cfg.k);
    cfg_ = cfg;
    choice_ = choice;
  }
  GateScaling scaling() const {
    return GateScaling{choice_.norm_topk_prob, choice_.routed_scaling_factor};
  }
  void select_with(const Tensor<T, B>& p, index_t k, double capacity_factor, Selection<T, B>& sel,
                   const Tensor<T, B>* bias) const {
    const index_t n = p.rows(), e = p.cols();
    GRAPHMOE_CHECK(k >= 1 && k <= e, "TopK", "k = ", k, " must be in [1, E = ", e, "]");
    sel.indices = Tensor<std::int32_t, B>();
    sel.values = Tensor<T, B>();
    sel.keep = Tensor<std::uint8_t, B>();
    sel.gates = Tensor<T, B>();
    const bool grouped = choice_.n_group > 1;
    if (bias == nullptr && !grouped) {
      topk_forward(p, k, sel.values, sel.indices);
    } else {
      // the scores that choose: p + b, masked to the token's best groups; the values: p there
      Tensor<T, B> choose = p;
      if (bias != nullptr) {
        choose = p.clone();
        add_row_vector(*bias, choose);
      }
      if (grouped) {
        Tensor<T, B> masked;
        group_limited_mask(choose, choice_.n_group, choice_.topk_group, masked);
        choose = masked;
      }
      Tensor<T, B> chosen_values;
      topk_forward(choose, k, chosen_values, sel.indices);
      gather_columns(p, sel.indices, sel.values);
    }
    const index_t cap = token_capacity(capacity_factor, n, k, e);
    capacity_mask(sel.indices, e, cap, sel.keep);
    sel.may_drop = cap > 0;
    renormalized_gates(sel.values, sel.keep, sel.gates, scaling());
  }

  RouterConfig cfg_;
  TokenChoiceOptions choice_;
};

template <class T, class B>
class SelectorImpl<TopK, T, B> : public TopKSelectorBase<T, B> {
 public:
  void configure(const RouterConfig& cfg) { this->configure_choice(cfg, cfg.options<TopK>()); }
  index_t current_k() const { return this->cfg_.k; }
  void set_step(std::int64_t) {}
};

// Auxiliary-loss-free balancing (policies.hpp): top-k of p + b, gates from p; b updated after each
// optimizer step from the step's loads (RouterImpl::after_step counts them in training forwards
// and sums them over the data-parallel ranks) by the op expert_bias_update, on the backend.
template <class T, class B>
class SelectorImpl<BiasBalancedTopK, T, B> : public TopKSelectorBase<T, B> {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t /*d_model*/,
               const RouterConfig& cfg) {
    opts_ = cfg.options<BiasBalancedTopK>();
    validate_options(opts_);
    this->configure_choice(cfg, cfg.options<TopK>());  // TopK's token choice (policies.hpp)
    id_bias_ = arena.add(prefix + "expert_bias", Shape{cfg.num_experts}, /*trainable=*/false);
  }
  void bind(const ParameterArena<T, B>& arena) { bias_ = arena.value(id_bias_); }
  void init(Rng&) { fill(bias_, T(0)); }
  index_t current_k() const { return this->cfg_.k; }
  void set_step(std::int64_t) {}

  void select(const Tensor<T, B>& p, index_t k, Selection<T, B>& sel) const {
    this->select_with(p, k, this->cfg_.capacity_factor, sel, &bias_);
  }
  void select_dropless(const Tensor<T, B>& p, index_t k, Selection<T, B>& sel) const {
    this->select_with(p, k, 0.0, sel, &bias_);
  }

  // b_e += rate * sign(mean load - load_e); nothing when the step routed no token (loads all 0).
  // The op expert_bias_update (ops/gates.hpp) on the step's summed counts where the tensors live
  // (on a GPU a kernel, nothing copied): in double from the stored T values, the same bits on
  // every backend and every rank, so a resumed run continues bit for bit.
  void after_step(const RouterStep<T, B>& step) {
    const index_t e = bias_.numel();
    GRAPHMOE_CHECK(step.load_counts.numel() == e, "BiasBalancedTopK", "got loads of ",
                   step.load_counts.numel(), " experts; the router has ", e);
    expert_bias_update(bias_, step.load_counts, opts_.bias_update_rate);
    step.arena.mark_values_written();
  }
  const Tensor<T, B>& expert_bias() const { return bias_; }
  const BiasBalancedTopK::Options& options() const { return opts_; }

 private:
  BiasBalancedTopK::Options opts_;
  index_t id_bias_ = -1;
  Tensor<T, B> bias_;
};

// SMoE-Dropout's schedule: k(t) = clamp(round((k_max - k_min) t / T) + k_min, k_min, k_max), with
// round half to even as Python's round() in the reference code (VITA-Group/Random-MoE-as-Dropout).
// set_step(t) is called by the training loop; set_k_override(k) pins k (e.g. k = E for the dense
// evaluation of the SMoE-Dropout paper), 0 removes the pin.
template <class T, class B>
class SelectorImpl<ScheduledTopK, T, B> : public TopKSelectorBase<T, B> {
 public:
  void configure(const RouterConfig& cfg) {
    opts_ = cfg.options<ScheduledTopK>();
    validate_options(opts_);
    GRAPHMOE_CHECK(opts_.k_max <= cfg.num_experts, "ScheduledTopK", "k_max = ", opts_.k_max,
                   " exceeds num_experts = ", cfg.num_experts);
    TopKSelectorBase<T, B>::configure(cfg);
  }
  static index_t k_at(const ScheduledTopK::Options& c, std::int64_t step) {
    const double t = static_cast<double>(std::max<std::int64_t>(step, 0));
    const double raw = std::nearbyint(static_cast<double>(c.k_max - c.k_min) * t /
                                  static_cast<double>(c.schedule_steps)) +
                       static_cast<double>(c.k_min);
    return std::clamp(static_cast<index_t>(raw), c.k_min, c.k_max);
  }
  index_t current_k() const { return override_ > 0 ? override_ : k_at(opts_, step_); }
  void set_step(std::int64_t step) { step_ = step; }
  void set_k_override(index_t k) {
    GRAPHMOE_CHECK(k >= 0 && k <= this->cfg_.num_experts, "ScheduledTopK", "k override ", k,
                   " out of [0, ", this->cfg_.num_experts, "]");
    override_ = k;
  }

 private:
  ScheduledTopK::Options opts_;
  std::int64_t step_ = 0;
  index_t override_ = 0;
};

// Expert choice (policies.hpp). Its selection depends on the sequence length, so it provides the
// grouped form select(p, k, seq_len, sel), which the router calls with GraphContext::seq_len.
template <class T, class B>
class SelectorImpl<ExpertChoice, T, B> {
  static_assert(B::host_memory,
                "graphmoe::ExpertChoice reads the scores and writes its selection on the host: it "
                "needs a backend whose tensors live in host memory (graphmoe::cpu)");

 public:
  void configure(const RouterConfig& cfg) {
    GRAPHMOE_CHECK(cfg.load_balance_coef == 0, "ExpertChoice",
                   "every expert takes the same number of tokens, so the load-balancing loss has "
                   "nothing to do: set load_balance_coef = 0 (got ", cfg.load_balance_coef, ")");
    GRAPHMOE_CHECK(cfg.seq_aux_loss_coef == 0, "ExpertChoice",
                   "every expert takes the same number of tokens of each sequence, so the "
                   "sequence-wise balance loss has nothing to do: set seq_aux_loss_coef = 0 (got ",
                   cfg.seq_aux_loss_coef, ")");
    GRAPHMOE_CHECK(std::isfinite(cfg.capacity_factor), "ExpertChoice",
                   "capacity_factor must be finite, got ", cfg.capacity_factor);
    cfg_ = cfg;
  }
  // k is the average number of experts per token (the compute of top-k with the same k).
  index_t current_k() const { return cfg_.k; }
  void set_step(std::int64_t) {}

  // Tokens each expert takes from a sequence of seq_len tokens.
  index_t capacity(index_t seq_len, index_t k, index_t num_experts) const {
    const double f = cfg_.capacity_factor > 0 ? cfg_.capacity_factor : 1.0;
    const double c = std::ceil(f * static_cast<double>(seq_len) * static_cast<double>(k) /
                               static_cast<double>(num_experts));
    return std::clamp<index_t>(static_cast<index_t>(std::min(c, 1e18)), 1, seq_len);
  }

  void select(const Tensor<T, B>& p, index_t k, index_t seq_len, Selection<T, B>& sel) const {
    constexpr const char* op = "ExpertChoice";
    GRAPHMOE_CHECK(!p.empty() && p.rank() == 2, op, "p must be a non-empty (N, E) matrix, got ",
                   (p.empty() ? std::string("an empty tensor") : p.shape().str()));
    const index_t n = p.rows(), e = p.cols();
    GRAPHMOE_CHECK(k >= 1 && k <= e, op, "k = ", k, " must be in [1, E = ", e, "]");
    GRAPHMOE_CHECK(seq_len >= 1 && n % seq_len == 0, op, "seq_len = ", seq_len,
                   " does not divide the ", n, " tokens");
    const T* pp = p.data();
    for (index_t a = 0; a < n * e; ++a)
      GRAPHMOE_CHECK(std::isfinite(static_cast<double>(pp[a])), op, "p holds ", pp[a],
                     " at token ", a / e, ", expert ", a % e);
    const index_t c = capacity(seq_len, k, e), nseq = n / seq_len;

    // chosen[t E + e] = 1 when expert e took token t: one (sequence, expert) pair per task, each
    // writing its own column of its own rows.
    std::vector<std::uint8_t> chosen(static_cast<std::size_t>(n * e), 0);
    parallel_for(0, nseq * e, [&](index_t task) {
      const index_t b = task / e, x = task % e, t0 = b * seq_len;
      std::vector<index_t> order(static_cast<std::size_t>(seq_len));
      for (index_t i = 0; i < seq_len; ++i) order[static_cast<std::size_t>(i)] = t0 + i;
      std::partial_sort(order.begin(), order.begin() + c, order.end(), [&](index_t s, index_t t) {
        const T ps = pp[s * e + x], pt = pp[t * e + x];
        return ps > pt || (ps == pt && s < t);
      });
      for (index_t i = 0; i < c; ++i) chosen[static_cast<std::size_t>(order[i] * e + x)] = 1;
    });
    index_t m = 1, total = 0;
    for (index_t t = 0; t < n; ++t) {
      index_t cnt = 0;
      for (index_t x = 0; x < e; ++x) cnt += chosen[static_cast<std::size_t>(t * e + x)];
      m = std::max(m, cnt);
      total += cnt;
    }
    sel.indices = Tensor<std::int32_t, B>(Shape{n, m});
    sel.values = Tensor<T, B>(Shape{n, m});
    sel.gates = Tensor<T, B>(Shape{n, m});
    sel.keep = Tensor<std::uint8_t, B>(Shape{n, m});
    sel.may_drop = total < n * m;
    parallel_for(0, n, [&](index_t t) {
      std::int32_t* idx = sel.indices.data() + t * m;
      index_t cnt = 0;
      for (index_t x = 0; x < e; ++x)
        if (chosen[static_cast<std::size_t>(t * e + x)]) idx[cnt++] = static_cast<std::int32_t>(x);
      const T* row = pp + t * e;
      std::sort(idx, idx + cnt, [&](std::int32_t a, std::int32_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
      });
      for (index_t j = 0; j < m; ++j) {
        const bool kept = j < cnt;
        if (!kept) idx[j] = -1;
        const T v = kept ? row[idx[j]] : T(0);
        sel.values.data()[t * m + j] = v;
        sel.gates.data()[t * m + j] = v;
        sel.keep.data()[t * m + j] = kept ? 1 : 0;
      }
    });
  }

  // dp assigned (N, E): dgates at the kept slots, zero elsewhere.
  void backward(const Tensor<T, B>& p, const Selection<T, B>& sel, const Tensor<T, B>& dgates,
                Tensor<T, B>& dp) const {
    constexpr const char* op = "ExpertChoice::backward";
    check_shape(op, "dgates", dgates, sel.gates.shape());
    check_shape(op, "keep", sel.keep, sel.gates.shape());
    check_shape(op, "indices", sel.indices, sel.gates.shape());
    GRAPHMOE_CHECK(p.rank() == 2 && p.rows() == sel.gates.rows(), op, "p ", p.shape(),
                   " does not match the selection ", sel.gates.shape());
    const index_t n = p.rows(), e = p.cols(), m = sel.gates.cols();
    prepare_output(op, "dp", dp, Shape{n, e});
    dp.zero();
    for (index_t a = 0; a < n * m; ++a) {
      if (!sel.keep.data()[a]) continue;
      const std::int32_t x = sel.indices.data()[a];
      GRAPHMOE_CHECK(x >= 0 && x < e, op, "kept slot ", a, " names expert ", x, " outside [0, ",
                     e, ")");
      dp.data()[(a / m) * e + x] += dgates.data()[a];
    }
  }

 private:
  RouterConfig cfg_;
};

}  // namespace graphmoe
