// graphmoe/routing/policies.hpp: the router's policy tags and their options.
//
// A router is Scorer x TokenGraph x Selector, chosen at compile time:
//
//   Scorer      u (N, D)  -> affinity logits gamma (N, E), expert scores r = softmax(gamma) (or
//                            the scorer's own map: SigmoidScorer's r = sigmoid(gamma))
//   TokenGraph  r (N, E)  -> p = G r, per sequence (G depends on the tokens)
//   Selector    p (N, E)  -> each token's experts and their gates: a (N, m) table of
//                            (expert, gate, keep) slots, m = k for token choice (TopK); expert
//                            choice (ExpertChoice) fills a varying number of slots per token
//
// The tags below name the parts, their implementation (`impl<T, B>`) and their options (`Options`,
// a plain struct with defaults and an optional validate()). RouterConfig holds what every router
// has (experts, k, causality, capacity, auxiliary-loss coefficients) and one Options value per
// policy, reached by the policy's type: cfg.options<Similarity>().tau = 0.5. The implementations
// are in scorers.hpp, token_graphs.hpp and selectors.hpp. A user's policy is any tag of the same
// form, its Options included (routing/concepts.hpp states what its implementation must provide).
#pragma once

#include <any>
#include <cmath>
#include <concepts>
#include <string>
#include <cstdint>
#include <list>
#include <optional>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

namespace dist {
class Communicator;  // core/communicator.hpp
}  // namespace dist

// What a policy's optional after_step hook receives, once after every optimizer step
// (RouterImpl::after_step, called by the models' after_optimizer_step; routing/concepts.hpp).
template <class T, class B = cpu>
struct RouterStep {
  // (E) the kept assignments per expert over the step's training forwards (every micro-batch),
  // summed over the data-parallel ranks of `comm`, on the host
  const std::vector<double>& loads;
  // (E) the same summed counts as an int32 tensor on the router's backend (on a GPU in device
  // memory: a policy can update device state from it without a copy, as BiasBalancedTopK does
  // with expert_bias_update, ops/gates.hpp). Valid during the call; the router overwrites it at
  // the next step.
  const Tensor<std::int32_t, B>& load_counts;
  // the data-parallel communicator the loads were summed over (nullptr: one process)
  dist::Communicator* comm;
  // the model's arena: a policy that writes a value (a buffer of its own) calls
  // arena.mark_values_written() afterwards, so that copies of the values (bf16 mirrors) refresh
  ParameterArena<T, B>& arena;
};

// The built-in implementations, one specialisation per policy (and backend where it differs).
template <class Policy, class T, class B = cpu>
class ScorerImpl;
template <class Policy, class T, class B = cpu>
class GraphImpl;
template <class Policy, class T, class B = cpu>
class SelectorImpl;

// ---- scorers --------------------------------------------------------------------------------
// r = softmax(W u + b)                                        (Switch / GShard / the paper's SMoE)
struct LinearScorer {
  static constexpr const char* name = "linear";
  struct Options {
    bool bias = true;       // b in W u + b
    double init_std = 0.02; // W ~ N(0, init_std^2), b = 0
    void validate() const {
      GRAPHMOE_CHECK(init_std >= 0, "LinearScorer::Options", "init_std must be >= 0, got ", init_std);
    }
  };
  template <class T, class B>
  using impl = ScorerImpl<LinearScorer, T, B>;
};
// X-MoE (Chi et al. 2022): gamma_e = <normalize(P u), normalize(e_e)> / temperature
struct CosineScorer {
  static constexpr const char* name = "cosine";
  // Defaults: projection 16 and expert-side + token-side L2 normalisation as in the X-MoE paper and
  // torchscale's projection size; temperature 0.3 as LibMoE's fixed value (the X-MoE paper's
  // learnable temperature has no published initial value); learnable off.
  struct Options {
    index_t dim = 16;                    // d, the projection's size
    double temperature = 0.3;            // gamma is divided by it
    bool learnable_temperature = false;  // "log_scale" parameter initialised to ln(1 / temperature)
    void validate() const {
      GRAPHMOE_CHECK(dim >= 1, "CosineScorer::Options", "dim must be >= 1, got ", dim);
      GRAPHMOE_CHECK(temperature > 0, "CosineScorer::Options", "temperature must be > 0, got ",
                     temperature);
    }
  };
  template <class T, class B>
  using impl = ScorerImpl<CosineScorer, T, B>;
};
// SMoE-Dropout (Chen et al. 2023): r = softmax(W u), W ~ N(0, 0.02^2), never updated
struct FrozenRandomScorer {
  static constexpr const char* name = "frozen-random";
  struct Options {
    double init_std = 0.02;  // W ~ N(0, init_std^2) (SMoE-Dropout: 0.02); no bias
    void validate() const {
      GRAPHMOE_CHECK(init_std >= 0, "FrozenRandomScorer::Options", "init_std must be >= 0, got ",
                     init_std);
    }
  };
  template <class T, class B>
  using impl = ScorerImpl<FrozenRandomScorer, T, B>;
};

// DeepSeek-V3 (and Megatron-Core's moe_router_score_function = "sigmoid"): r = sigmoid(W u + b),
// each expert's score on its own (no competition in the map; the selector's gates normalise over
// the chosen k or not, TopK::Options). No bias by default (DeepSeek-V3's gate has none).
struct SigmoidScorer {
  static constexpr const char* name = "sigmoid";
  struct Options {
    bool bias = false;       // b in W u + b
    double init_std = 0.02;  // W ~ N(0, init_std^2), b = 0
    void validate() const {
      GRAPHMOE_CHECK(init_std >= 0, "SigmoidScorer::Options", "init_std must be >= 0, got ",
                     init_std);
    }
  };
  template <class T, class B>
  using impl = ScorerImpl<SigmoidScorer, T, B>;
};

// ---- token graphs -----------------------------------------------------------------------------
// How tau of the Similarity graph is set.
enum class TauMode {
  Fixed,        // tau = Similarity::Options::tau (the paper: 1)
  ScaledSqrtD,  // tau = Similarity::Options::tau * sqrt(D), as attention scales its logits
  Learned,      // tau = exp(log_tau), one trained parameter per router ("graph.log_tau"),
                // initialised to Similarity::Options::tau (CPU backend)
};
inline constexpr EnumName<TauMode> kTauModeNames[] = {
    {TauMode::Fixed, "fixed"}, {TauMode::ScaledSqrtD, "scaled"}, {TauMode::Learned, "learned"}};
inline const char* tau_mode_name(TauMode m) { return name_of(kTauModeNames, m); }
inline TauMode tau_mode_from_name(std::string_view s) {
  return value_of("tau_mode_from_name", "tau mode", kTauModeNames, s);
}

// How h* of the Attention graph is chosen (the paper: lowest mean attention entropy over tokens).
enum class HeadChoice {
  PerSequence,        // h* = argmin_h mean_i H(A_h[i,:]) over the whole sequence
  PerSequenceCausal,  // h*_i = argmin_h mean_{i' <= i} H(A_h[i',:]): no dependence on later tokens
};

// Whether a token graph keeps its (N, T) matrix from forward for backward (N tokens, sequences of
// T): Similarity's S, Attention's posterior A^p. Both graphs work in blocks of 64 rows either way,
// so neither ever holds a (T, T) temporary of its own.
enum class GraphMemory {
  Auto,       // Store while T <= kGraphStoreMaxLen, Recompute above (graph_stores)
  Store,      // keep the N x T values: backward reads them (fastest for short sequences)
  Recompute,  // keep O(N) (each row's log-sum-exp); backward recomputes the rows block by block,
              // one more (T, T, D) product: O(T x (D + E)) memory per sequence
};

// Auto's rule: store up to this sequence length. Both the stored bytes per token (4 T in float)
// and recomputing's relative cost depend on T alone; the crossover measured on the CPU is in
// docs/benchmarks.md ("Token graphs at long sequences").
inline constexpr index_t kGraphStoreMaxLen = 512;

// Whether a graph with option `memory` keeps its N x seq_len matrix for sequences of seq_len.
inline bool graph_stores(GraphMemory memory, index_t seq_len) {
  GRAPHMOE_CHECK(memory == GraphMemory::Auto || memory == GraphMemory::Store ||
                     memory == GraphMemory::Recompute,
                 "GraphMemory", static_cast<int>(memory), " is not a GraphMemory");
  GRAPHMOE_CHECK(seq_len >= 1, "GraphMemory", "sequence length must be >= 1, got ", seq_len);
  if (memory == GraphMemory::Auto) return seq_len <= kGraphStoreMaxLen;
  return memory == GraphMemory::Store;
}

// p = r
struct Independent {
  static constexpr const char* name = "independent";
  template <class T, class B>
  using impl = GraphImpl<Independent, T, B>;
};

// p_i = sum_j S[i,j] r_j, S = softmax(U U^T / tau) row-wise within each sequence (masked to j <= i
// when RouterConfig::causal).
struct Similarity {
  static constexpr const char* name = "similarity";
  struct Options {
    double tau = 1.0;  // the paper's tau = 1
    TauMode tau_mode = TauMode::Fixed;
    // Leave S[i,i] out of row i: p_i = sum_{j != i} S[i,j] r_j, the token's own scores dropped
    // (u_i still weighs its neighbours); a causal sequence's first token, which has no neighbour,
    // keeps S[0,0] = 1.
    bool exclude_self = false;
    // The graph on a learned bilinear form: S = softmax(U W_s U^T / tau), W_s (D, D) a parameter
    // ("<router>.graph.w_s") initialised to the identity, so training starts from the paper's
    // graph (the paper's Definition 2 has W_s, "in practice W_s = I").
    bool projection = false;
    // Keep S (N x seq_len values) for backward, or recompute it block by block (one more U U^T
    // product); Auto chooses by the sequence length (graph_stores). The CUDA backend's fused
    // kernel (Exact precision, none of the options above) always recomputes.
    GraphMemory memory = GraphMemory::Auto;
    // No gradient through S (r still gets its gradient through p = S r).
    bool detach = false;
    // The arithmetic of the (T, T) products: Exact (T throughout, the default and the CPU's only
    // one), or on the CUDA backend with a float router TF32 / BF16 tensor-core products with fp32
    // accumulation (core/token_graph.hpp; errors in docs/routers.md, "Precision").
    GraphPrecision precision = GraphPrecision::Exact;
    void validate() const {
      GRAPHMOE_CHECK(tau > 0 && tau < 1e300, "Similarity::Options", "tau must be > 0 and finite, got ",
                     tau);
      GRAPHMOE_CHECK(precision == GraphPrecision::Exact || precision == GraphPrecision::TF32 ||
                         precision == GraphPrecision::BF16,
                     "Similarity::Options", "precision ", static_cast<int>(precision),
                     " is not a GraphPrecision");
      GRAPHMOE_CHECK(tau_mode == TauMode::Fixed || tau_mode == TauMode::ScaledSqrtD ||
                         tau_mode == TauMode::Learned,
                     "Similarity::Options", "tau_mode ", static_cast<int>(tau_mode),
                     " is not a TauMode");
      graph_stores(memory, 1);  // refuses a value that is not a GraphMemory
    }
  };
  template <class T, class B>
  using impl = GraphImpl<Similarity, T, B>;
};

// p_i = sum_j A^p_{h*}[i,j] r_j, A^p the attention posterior of Lemma 1
struct Attention {
  static constexpr const char* name = "attention";
  struct Options {
    double sigma = 1.0;  // the paper's sigma = 1
    // Unset (the default): PerSequenceCausal in a causal router (RouterConfig::causal), PerSequence
    // otherwise. PerSequence in a causal router is refused: h* would depend on later tokens.
    std::optional<HeadChoice> head_choice;
    // Keep A^p (N x seq_len values) for backward, or recompute it block by block (one more
    // (T, T, D) product); Auto chooses by the sequence length (graph_stores). CPU backend.
    GraphMemory memory = GraphMemory::Auto;
    // No gradient through A^p (r still gets its gradient through p = A^p r).
    bool detach = false;
    // The arithmetic of the (T, T) products (in the head's dimensions): Exact, or on the CUDA
    // backend with a float router TF32 / BF16 tensor-core products with fp32 accumulation (BF16:
    // the (T, T) products' inputs in bf16, the (N, D, d_model) ones on TF32; errors in
    // docs/routers.md, "Precision").
    GraphPrecision precision = GraphPrecision::Exact;
    void validate() const {
      GRAPHMOE_CHECK(sigma > 0 && sigma < 1e300, "Attention::Options",
                     "sigma must be > 0 and finite, got ", sigma);
      GRAPHMOE_CHECK(precision == GraphPrecision::Exact || precision == GraphPrecision::TF32 ||
                         precision == GraphPrecision::BF16,
                     "Attention::Options", "precision ", static_cast<int>(precision),
                     " is not a GraphPrecision");
      graph_stores(memory, 1);  // refuses a value that is not a GraphMemory
    }
    // The head choice in a router that is (or is not) causal; refuses PerSequence in a causal one.
    HeadChoice head_choice_for(bool causal) const {
      const HeadChoice h =
          head_choice.value_or(causal ? HeadChoice::PerSequenceCausal : HeadChoice::PerSequence);
      GRAPHMOE_CHECK(!(causal && h == HeadChoice::PerSequence), "Attention::Options",
                     "head_choice is PerSequence, which chooses h* from the whole sequence, later "
                     "tokens included, but the router is causal: use HeadChoice::PerSequenceCausal "
                     "(or leave head_choice unset)");
      return h;
    }
  };
  template <class T, class B>
  using impl = GraphImpl<Attention, T, B>;
  static constexpr bool needs_attention_cache = true;  // reads GraphContext::attention
};

// ---- selectors --------------------------------------------------------------------------------
// How a token-choice selector picks its k experts and weighs them (TopK, BiasBalancedTopK), with
// Hugging Face's names for the fields (Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V2/V3 configs).
struct TokenChoiceOptions {
  // gates = p_sel / sum(p_sel) over the chosen k (true: the paper's Renormalize(TopK^0(p)),
  // Mixtral, Qwen3-MoE, DeepSeek-V3), or gates = p_sel (false: OLMoE, Qwen2-MoE)
  bool norm_topk_prob = true;
  // every gate multiplied by this (DeepSeek-V3: 2.5)
  double routed_scaling_factor = 1.0;
  // Group-limited routing (DeepSeek-V2/V3): the E experts form n_group contiguous groups, a
  // token's group score is the sum of its two largest scores in the group, and its k experts come
  // from its topk_group best groups only. n_group = 1: every expert is eligible.
  index_t n_group = 1;
  index_t topk_group = 1;
  void validate() const {
    GRAPHMOE_CHECK(routed_scaling_factor > 0 && routed_scaling_factor < 1e300, "TopK options",
                   "routed_scaling_factor must be > 0 and finite, got ", routed_scaling_factor);
    GRAPHMOE_CHECK(n_group >= 1 && topk_group >= 1 && topk_group <= n_group, "TopK options",
                   "need n_group >= 1 and 1 <= topk_group <= n_group, got n_group = ", n_group,
                   ", topk_group = ", topk_group);
  }
  // The checks that need the router's E and k.
  void validate_for(index_t num_experts, index_t k) const {
    validate();
    GRAPHMOE_CHECK(num_experts % n_group == 0, "TopK options", "n_group = ", n_group,
                   " does not divide num_experts = ", num_experts);
    GRAPHMOE_CHECK(k <= topk_group * (num_experts / n_group), "TopK options", "k = ", k,
                   " experts cannot come from topk_group = ", topk_group, " groups of ",
                   num_experts / n_group, " experts");
  }
};

// top-k of p, renormalised (Appendix C.3); RouterConfig::k experts per token. Options: whether the
// gates are renormalised, a scale, group-limited routing (TokenChoiceOptions; the defaults are the
// paper's selector).
struct TopK {
  static constexpr const char* name = "topk";
  using Options = TokenChoiceOptions;
  template <class T, class B>
  using impl = SelectorImpl<TopK, T, B>;
};

// Auxiliary-loss-free load balancing (Wang et al. 2024, DeepSeek-V3): the k experts are the top-k
// of p + b, b a per-expert bias that only selects (the gates are p at those experts, as TopK's);
// after every optimizer step b_e += bias_update_rate * sign(mean load - load_e), the loads counted
// over the step's training forwards and summed over the data-parallel ranks. b is not trained: it is
// a buffer of the arena ("<router>.selector.expert_bias", trainable = false), saved in checkpoints.
// Megatron-Core: moe_router_enable_expert_bias, moe_router_bias_update_rate (1e-3).
// How the k experts are picked and weighed is TopK's: this selector reads cfg.options<TopK>()
// (norm_topk_prob, routed_scaling_factor, groups) as TopK does, so one config serves both.
struct BiasBalancedTopK {
  static constexpr const char* name = "bias-balanced-topk";
  using shares_options_of = TopK;  // RouterConfig::validate_for counts TopK's options as used
  struct Options {
    double bias_update_rate = 1e-3;  // gamma
    void validate() const {
      GRAPHMOE_CHECK(bias_update_rate >= 0 && bias_update_rate < 1e300, "BiasBalancedTopK::Options",
                     "bias_update_rate must be >= 0 and finite, got ", bias_update_rate);
    }
  };
  template <class T, class B>
  using impl = SelectorImpl<BiasBalancedTopK, T, B>;
};
// SMoE-Dropout: k rises linearly from k_min to k_max over `schedule_steps` steps:
// k(t) = clamp(round((k_max - k_min) t / T) + k_min) (RouterConfig::k is not used)
struct ScheduledTopK {
  static constexpr const char* name = "scheduled-topk";
  struct Options {
    index_t k_min = 1;
    index_t k_max = 2;
    std::int64_t schedule_steps = 1000;  // T
    void validate() const {
      GRAPHMOE_CHECK(k_min >= 1 && k_min <= k_max, "ScheduledTopK::Options",
                     "need 1 <= k_min <= k_max, got k_min = ", k_min, ", k_max = ", k_max);
      GRAPHMOE_CHECK(schedule_steps >= 1, "ScheduledTopK::Options",
                     "schedule_steps must be >= 1, got ", schedule_steps);
    }
  };
  template <class T, class B>
  using impl = SelectorImpl<ScheduledTopK, T, B>;
};

// Expert choice (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing"): within each
// sequence of L tokens, every expert takes the c tokens with the largest p[:, e], c = min(L,
// ceil(f L k / E)) with f = capacity_factor (1 when <= 0), so that tokens get k experts on average;
// gate = p[t, e] (not renormalised, as in the paper). A token may get 0..E experts. Because a token's
// experts depend on the other tokens of its sequence, later ones included, a causal model refuses
// it (TransformerLM fails to compile with it). CPU backend.
struct ExpertChoice {
  static constexpr const char* name = "expert-choice";
  template <class T, class B>
  using impl = SelectorImpl<ExpertChoice, T, B>;
  // A token's selection depends on the other tokens of its sequence (models/transformer_lm.hpp).
  static constexpr bool chooses_across_tokens = true;
};

// ---- options ----------------------------------------------------------------------------------
// A policy without options has none to set: its options type is NoOptions.
struct NoOptions {
  void validate() const {}
};

namespace policy_detail {
template <class P>
struct options_of {
  using type = NoOptions;
};
template <class P>
  requires requires { typename P::Options; }
struct options_of<P> {
  using type = typename P::Options;
};
}  // namespace policy_detail

// P::Options, or NoOptions for a policy without them.
template <class P>
using policy_options_t = typename policy_detail::options_of<P>::type;

namespace policy_detail {
// The policy whose options P also reads (`using shares_options_of = Q;`, as BiasBalancedTopK
// reads TopK's), or P itself.
template <class P>
struct shared_options_of {
  using type = P;
};
template <class P>
  requires requires { typename P::shares_options_of; }
struct shared_options_of<P> {
  using type = typename P::shares_options_of;
};
}  // namespace policy_detail

// Calls opts.validate() when the options type has one (a user's Options need not).
template <class Opts>
void validate_options(const Opts& opts) {
  if constexpr (requires { opts.validate(); }) opts.validate();
}

namespace policy_detail {
// The name of policy P for messages: P::name, or the type's name for a tag without one.
template <class P>
const char* policy_name() {
  if constexpr (requires { { P::name } -> std::convertible_to<const char*>; })
    return P::name;
  else
    return typeid(P).name();
}
}  // namespace policy_detail

// What every router has, and each policy's options by the policy's type.
//
// Options are checked against the router that declares with this config: options set for a policy
// the router does not use are an error (a typo'd policy, or a router other than the one meant),
// unless allow_unused_options is set, which a command line shared by every router sets explicitly.
// Once a router has declared with a config (RouterImpl::declare), changing that config's options
// throws: the router keeps a copy, so the change would have no effect. A copy of the config is
// a new, unmarked config.
struct RouterConfig {
  RouterConfig() = default;

 private:
  // Whether a router declared with this config (mark_declared). A copy of the config is a new,
  // unmarked config; assigning to a marked one throws. Declared first, so that the defaulted
  // assignment checks it before any field is overwritten.
  struct DeclaredMark {
    mutable bool on = false;
    DeclaredMark() = default;
    DeclaredMark(const DeclaredMark&) noexcept {}
    DeclaredMark& operator=(const DeclaredMark&) {
      check_unmarked(on, "operator=");
      return *this;
    }
  };
  static void check_unmarked(bool marked, const char* what) {
    GRAPHMOE_CHECK(!marked, "RouterConfig", "a router was already declared with this config, ",
                   "so changing it (", what, ") would have no effect on that router (it keeps a "
                   "copy); set options before declaring, or change a copy");
  }
  DeclaredMark declared_;

 public:
  index_t num_experts = 16;  // E
  index_t k = 2;             // experts per token (TopK; ExpertChoice: on average); ScheduledTopK
                             // uses its own k_min..k_max

  // No token's routing may depend on a later token of its sequence: the Similarity graph masks
  // j > i, the Attention graph chooses h* from the prefix (Attention::Options). On by default in
  // the LM (which requires it), off in ViT / classifiers. A user's graph reads it too.
  bool causal = false;

  // Capacity: each expert takes at most ceil(capacity_factor * N * k / E) token slots, in token
  // order; overflowing assignments are dropped (their gate is zero and the token's other experts
  // keep their gates). capacity_factor <= 0 means dropless (the default). ExpertChoice: each
  // expert takes exactly ceil(f L k / E) tokens of a sequence of L, f = capacity_factor (1 if <= 0).
  double capacity_factor = 0.0;

  // Auxiliary losses (0 = off): Switch load balancing over the batch, ST-MoE router z-loss, and
  // DeepSeek-V3's sequence-wise balance loss (ops/aux_losses.hpp seq_aux_loss; DeepSeek-V3 uses
  // 1e-4 beside its bias balancing).
  double load_balance_coef = 0.0;
  double z_loss_coef = 0.0;
  double seq_aux_loss_coef = 0.0;

  // Options set for a policy that the declaring router does not use are ignored instead of an
  // error (for one command line that configures every router, as the examples' do).
  bool allow_unused_options = false;

  // The options of policy P, default-constructed and kept on first use:
  //   cfg.options<Similarity>().tau = 0.5;
  // The reference stays valid for the life of this RouterConfig (later calls do not move it).
  template <class P>
  policy_options_t<P>& options() {
    using O = policy_options_t<P>;
    static_assert(std::is_copy_constructible_v<O> && std::is_default_constructible_v<O>,
                  "graphmoe::RouterConfig::options<P>(): P::Options must be default- and "
                  "copy-constructible");
    check_not_declared(policy_detail::policy_name<P>());
    for (auto& e : options_)
      if (e.policy == std::type_index(typeid(P))) return *std::any_cast<O>(&e.value);
    options_.push_back({std::type_index(typeid(P)), policy_detail::policy_name<P>(), O{}});
    return *std::any_cast<O>(&options_.back().value);
  }
  // The options of policy P as set, or P's defaults when none were set.
  template <class P>
  const policy_options_t<P>& options() const {
    using O = policy_options_t<P>;
    for (const auto& e : options_)
      if (e.policy == std::type_index(typeid(P))) return *std::any_cast<O>(&e.value);
    static const O defaults{};
    return defaults;
  }
  // Replaces P's options; returns *this, so that calls chain.
  template <class P>
  RouterConfig& set_options(policy_options_t<P> opts) {
    options<P>() = std::move(opts);
    return *this;
  }
  // Whether options<P>() was set (or reached through the non-const options<P>()).
  template <class P>
  bool has_options() const {
    for (const auto& e : options_)
      if (e.policy == std::type_index(typeid(P))) return true;
    return false;
  }

  // The common fields; RouterImpl also validates its three policies' options (validate_for).
  void validate() const {
    GRAPHMOE_CHECK(num_experts >= 1, "RouterConfig", "num_experts must be >= 1, got ", num_experts);
    GRAPHMOE_CHECK(k >= 1 && k <= num_experts, "RouterConfig", "k = ", k,
                   " must be in [1, num_experts = ", num_experts, "]");
    GRAPHMOE_CHECK(load_balance_coef >= 0 && z_loss_coef >= 0, "RouterConfig",
                   "auxiliary loss coefficients must be >= 0");
    GRAPHMOE_CHECK(seq_aux_loss_coef >= 0 && std::isfinite(seq_aux_loss_coef), "RouterConfig",
                   "seq_aux_loss_coef must be finite and >= 0, got ", seq_aux_loss_coef);
  }
  // validate(), the options of the given policies (and of the policies whose options they share:
  // `using shares_options_of = Q;`), and (unless allow_unused_options) that no options were set
  // for any other policy.
  template <class... Policies>
  void validate_for() const {
    validate();
    (validate_options(options<Policies>()), ...);
    (validate_options(options<typename policy_detail::shared_options_of<Policies>::type>()), ...);
    if (allow_unused_options) return;
    for (const auto& e : options_) {
      const bool used =
          ((e.policy == std::type_index(typeid(Policies)) ||
            e.policy ==
                std::type_index(typeid(typename policy_detail::shared_options_of<Policies>::type))) ||
           ...);
      if (used) continue;
      std::string names;
      ((names += (names.empty() ? "" : "/") + std::string(policy_detail::policy_name<Policies>())),
       ...);
      GRAPHMOE_CHECK(false, "RouterConfig", "options were set for the policy '", e.name,
                     "', which this router (", names, ") does not use; remove them, or set "
                     "allow_unused_options when one command line configures every router");
    }
  }

  // Called by RouterImpl::declare: from now on, changing this config's options throws.
  void mark_declared() const { declared_.on = true; }
  bool declared() const { return declared_.on; }

 private:
  void check_not_declared(const char* what) const { check_unmarked(declared_.on, what); }
  struct StoredOptions {
    std::type_index policy;
    const char* name;  // for messages
    std::any value;    // policy_options_t<policy>
  };
  std::list<StoredOptions> options_;  // a list: references stay valid as entries are added
};

}  // namespace graphmoe
