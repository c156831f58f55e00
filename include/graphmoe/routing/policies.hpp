// graphmoe/routing/policies.hpp: the router's policy tags and their options.
//
// A router is Scorer x TokenGraph x Selector, chosen at compile time:
//
//   Scorer      u (N, D)  -> affinity logits gamma (N, E), expert scores r = softmax(gamma)
//   TokenGraph  r (N, E)  -> p = G r, per sequence (G depends on the tokens)
//   Selector    p (N, E)  -> each token's experts and their gates: a (N, m) table of
//                            (expert, gate, keep) slots, m = k for token choice (TopK); expert
//                            choice (ExpertChoice) fills a varying number of slots per token
//
// The tags below name the parts and their implementation (`impl<T, B>`); their numerical options
// live in RouterConfig (one struct, so that a command line or a checkpoint maps onto it directly).
// The implementations are in scorers.hpp, token_graphs.hpp and selectors.hpp. A user's policy is
// any tag of the same form (routing/concepts.hpp states what its implementation must provide).
#pragma once

#include <cstdint>
#include <type_traits>

#include "graphmoe/config.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe {

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
  template <class T, class B>
  using impl = ScorerImpl<LinearScorer, T, B>;
};
// X-MoE (Chi et al. 2022): gamma_e = <normalize(P u), normalize(e_e)> / temperature
struct CosineScorer {
  static constexpr const char* name = "cosine";
  template <class T, class B>
  using impl = ScorerImpl<CosineScorer, T, B>;
};
// SMoE-Dropout (Chen et al. 2023): r = softmax(W u), W ~ N(0, 0.02^2), never updated
struct FrozenRandomScorer {
  static constexpr const char* name = "frozen-random";
  template <class T, class B>
  using impl = ScorerImpl<FrozenRandomScorer, T, B>;
};

// ---- token graphs -----------------------------------------------------------------------------
// p = r
struct Independent {
  static constexpr const char* name = "independent";
  template <class T, class B>
  using impl = GraphImpl<Independent, T, B>;
};
// p_i = sum_j S[i,j] r_j, S = softmax(U U^T / tau) row-wise within each sequence
struct Similarity {
  static constexpr const char* name = "similarity";
  template <class T, class B>
  using impl = GraphImpl<Similarity, T, B>;
};
// p_i = sum_j A^p_{h*}[i,j] r_j, A^p the attention posterior of Lemma 1
struct Attention {
  static constexpr const char* name = "attention";
  template <class T, class B>
  using impl = GraphImpl<Attention, T, B>;
  static constexpr bool needs_attention_cache = true;  // reads GraphContext::attention
};

// ---- selectors --------------------------------------------------------------------------------
// top-k of p, renormalised (Appendix C.3)
struct TopK {
  static constexpr const char* name = "topk";
  template <class T, class B>
  using impl = SelectorImpl<TopK, T, B>;
};
// SMoE-Dropout: k rises linearly from k_min to k_max over `schedule_steps` steps
struct ScheduledTopK {
  static constexpr const char* name = "scheduled-topk";
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

// How tau of the Similarity graph is set.
enum class TauMode {
  Fixed,        // tau = similarity_tau (the paper: 1)
  ScaledSqrtD,  // tau = similarity_tau * sqrt(D), as attention scales its logits
  Learned,      // tau = exp(log_tau), one trained parameter per router ("graph.log_tau"),
                // initialised to similarity_tau (CPU backend)
};

// How h* of the Attention graph is chosen (the paper: lowest mean attention entropy over tokens).
enum class HeadChoice {
  PerSequence,        // h* = argmin_h mean_i H(A_h[i,:]) over the whole sequence
  PerSequenceCausal,  // h*_i = argmin_h mean_{i' <= i} H(A_h[i',:]): no dependence on later tokens
};

struct RouterConfig {
  index_t num_experts = 16;  // E
  index_t k = 2;             // experts per token (TopK); ScheduledTopK uses k_min..k_max

  // LinearScorer / FrozenRandomScorer
  bool scorer_bias = true;     // LinearScorer only; FrozenRandomScorer has none (as SMoE-Dropout)
  double init_std = 0.02;      // N(0, init_std^2) for W (SMoE-Dropout: 0.02)

  // CosineScorer (X-MoE). Defaults: projection 16 and expert-side + token-side L2 normalisation as
  // in the X-MoE paper and torchscale's projection size; temperature 0.3 as LibMoE's fixed value
  // (the X-MoE paper's learnable temperature has no published initial value); learnable off.
  index_t cosine_dim = 16;
  double cosine_temperature = 0.3;
  bool cosine_learnable_temperature = false;

  // Similarity graph
  double similarity_tau = 1.0;  // the paper's tau = 1
  TauMode tau_mode = TauMode::Fixed;
  bool causal = false;          // mask j > i (on by default in the LM, off in ViT / classifiers)
  // Leave S[i,i] out of row i: p_i = sum_{j != i} S[i,j] r_j, the token's own scores dropped (u_i
  // still weighs its neighbours); a causal sequence's first token, which has no neighbour, keeps
  // S[0,0] = 1. CPU backend.
  bool similarity_exclude_self = false;
  // The graph on a learned bilinear form: S = softmax(U W_s U^T / tau), W_s (D, D) a parameter
  // ("<router>.graph.w_s") initialised to the identity, so training starts from the paper's
  // graph (the paper's Definition 2 has W_s, "in practice W_s = I"). CPU backend.
  bool similarity_projection = false;
  // false: keep S (N x seq_len values) from forward for backward; true: keep O(N) and recompute
  // S block by block in backward (one more U U^T GEMM).
  bool similarity_recompute = false;

  // Attention graph
  double attention_sigma = 1.0;  // the paper's sigma = 1
  HeadChoice head_choice = HeadChoice::PerSequence;

  // Either graph: no gradient through S or A^p (r still gets its gradient through p = G r).
  bool detach_graph = false;

  // ScheduledTopK (SMoE-Dropout): k(t) = clamp(round((k_max - k_min) t / T) + k_min)
  index_t k_min = 1;
  index_t k_max = 2;
  std::int64_t schedule_steps = 1000;

  // Capacity: each expert takes at most ceil(capacity_factor * N * k / E) token slots, in token
  // order; overflowing assignments are dropped (their gate is zero and the token's other experts
  // keep their gates). capacity_factor <= 0 means dropless (the default). ExpertChoice: each
  // expert takes exactly ceil(f L k / E) tokens of a sequence of L, f = capacity_factor (1 if <= 0).
  double capacity_factor = 0.0;

  // Auxiliary losses (0 = off): Switch load balancing and ST-MoE router z-loss.
  double load_balance_coef = 0.0;
  double z_loss_coef = 0.0;

  void validate() const {
    GRAPHMOE_CHECK(num_experts >= 1, "RouterConfig", "num_experts must be >= 1, got ", num_experts);
    GRAPHMOE_CHECK(k >= 1 && k <= num_experts, "RouterConfig", "k = ", k,
                   " must be in [1, num_experts = ", num_experts, "]");
    GRAPHMOE_CHECK(similarity_tau > 0, "RouterConfig", "tau must be > 0, got ", similarity_tau);
    GRAPHMOE_CHECK(attention_sigma > 0, "RouterConfig", "sigma must be > 0, got ", attention_sigma);
    GRAPHMOE_CHECK(cosine_dim >= 1, "RouterConfig", "cosine_dim must be >= 1, got ", cosine_dim);
    GRAPHMOE_CHECK(cosine_temperature > 0, "RouterConfig", "cosine temperature must be > 0, got ",
                   cosine_temperature);
    GRAPHMOE_CHECK(init_std >= 0, "RouterConfig", "init_std must be >= 0, got ", init_std);
    GRAPHMOE_CHECK(k_min >= 1 && k_min <= k_max && k_max <= num_experts, "RouterConfig",
                   "need 1 <= k_min <= k_max <= num_experts, got k_min = ", k_min, ", k_max = ",
                   k_max, ", num_experts = ", num_experts);
    GRAPHMOE_CHECK(schedule_steps >= 1, "RouterConfig", "schedule_steps must be >= 1, got ",
                   schedule_steps);
    GRAPHMOE_CHECK(load_balance_coef >= 0 && z_loss_coef >= 0, "RouterConfig",
                   "auxiliary loss coefficients must be >= 0");
  }
};

}  // namespace graphmoe
