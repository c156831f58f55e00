// graphmoe/routing/concepts.hpp: what a scorer, token-graph or selector policy must provide.
//
// A policy is a tag type with a name and its implementation for a scalar type T and backend B:
//
//   struct MyGraph {
//     static constexpr const char* name = "my-graph";
//     template <class T, class B> using impl = MyGraphImpl<T, B>;   // any class template, any namespace
//     static constexpr bool needs_attention_cache = false;          // optional (default false)
//     struct Options { double width = 1; void validate() const; };  // optional (routing/policies.hpp)
//   };
//
// and the implementation has the members listed below (exactly the calls RouterImpl makes). The
// concepts ScorerPolicy / TokenGraphPolicy / SelectorPolicy state them; RouterImpl checks them
// with check_*_policy<P, T, B>(), which fails with one message naming the first missing member.
// No specialisation inside namespace graphmoe is needed. The built-in policies (policies.hpp)
// follow the same rule: their impl is ScorerImpl / GraphImpl / SelectorImpl<Policy, T, B>.
// The implementation reads its options in configure / declare with cfg.options<MyGraph>() (the
// defaults when none were set) and the common fields (num_experts, k, causal, ...) from cfg.
//
// The lifecycle is the same for every kind of policy, and every hook of it is optional:
//   declare(ParameterArena<T, B>&, const std::string& prefix, index_t d_model, const RouterConfig&)
//                      a policy with parameters adds them to the arena under `prefix` (the
//                      router's prefix; the graph's is "<prefix>graph.", the selector's
//                      "<prefix>selector.") and reads its options; or, without parameters,
//   configure(index_t d_model, const RouterConfig&)  or  configure(const RouterConfig&)
//                      reads its options (the router calls the first of the three it finds; a
//                      policy with none of them has nothing to configure)
//   bind(const ParameterArena<T, B>&)   takes views of its parameters once the arena is allocated
//   init(Rng&)                          initialises them, and seeds any random stream of its own
//                                       from the model's Rng (called in model order, so a model's
//                                       seed fixes every policy's draws)
//   set_mode(Mode)                      Mode::Train / Mode::Eval (core/mode.hpp), passed down by
//                                       model.set_mode(): e.g. a noisy scorer draws no noise in Eval
//   after_step(const RouterStep<T, B>&) once after every optimizer step (the models'
//                                       after_optimizer_step, which training loops call): the
//                                       step's expert loads summed over the data-parallel ranks,
//                                       the communicator and the arena (policies.hpp). A policy's
//                                       state that is not trained (BiasBalancedTopK's bias) is an
//                                       arena buffer declared with trainable = false: saved in
//                                       checkpoints, skipped by optimizers; the policy writes it
//                                       here and calls step.arena.mark_values_written(). The
//                                       router counts loads only when one of its policies has
//                                       this hook.
// forward / backward (and a selector's current_k / set_step) are required.
// docs/extending.md walks through an example.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/mode.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/routing/policies.hpp"
#include "graphmoe/routing/selectors.hpp"
#include "graphmoe/routing/token_graphs.hpp"

namespace graphmoe {

namespace policy_detail {
template <class>
inline constexpr bool always_false = false;
}  // namespace policy_detail

// ---- every policy -----------------------------------------------------------------------------
template <class P>
concept NamedPolicy = requires {
  { P::name } -> std::convertible_to<std::string_view>;
};
template <class P, class T, class B>
concept PolicyWithImpl = requires { typename P::template impl<T, B>; } &&
                         std::default_initializable<typename P::template impl<T, B>>;
template <class P, class T, class B>
using policy_impl_t = typename P::template impl<T, B>;

// ---- the lifecycle hooks, the same optional ones for every kind (see the top of this file) ----
template <class P, class T, class B>
concept PolicyDeclares = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, ParameterArena<T, B>& arena, const std::string& prefix,
             index_t d_model, const RouterConfig& cfg) { s.declare(arena, prefix, d_model, cfg); };
template <class P, class T, class B>
concept PolicyConfiguresWithWidth = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, index_t d_model, const RouterConfig& cfg) {
      s.configure(d_model, cfg);
    };
template <class P, class T, class B>
concept PolicyConfigures = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const RouterConfig& cfg) { s.configure(cfg); };
template <class P, class T, class B>
concept PolicyBinds = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const ParameterArena<T, B>& arena) { s.bind(arena); };
template <class P, class T, class B>
concept PolicyInits = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, Rng& rng) { s.init(rng); };
template <class P, class T, class B>
concept PolicyHasMode = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, Mode mode) { s.set_mode(mode); };

template <class P, class T, class B>
concept PolicyAfterStep = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const RouterStep<T, B>& step) { s.after_step(step); };

namespace policy_detail {
// The router's calls of the hooks: each one the policy has, nothing for one it lacks.
template <class Impl, class T, class B>
void declare(Impl& impl, ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
             const RouterConfig& cfg) {
  if constexpr (requires { impl.declare(arena, prefix, d_model, cfg); })
    impl.declare(arena, prefix, d_model, cfg);
  else if constexpr (requires { impl.configure(d_model, cfg); })
    impl.configure(d_model, cfg);
  else if constexpr (requires { impl.configure(cfg); })
    impl.configure(cfg);
}
template <class Impl, class T, class B>
void bind(Impl& impl, const ParameterArena<T, B>& arena) {
  if constexpr (requires { impl.bind(arena); }) impl.bind(arena);
}
template <class Impl>
void init(Impl& impl, Rng& rng) {
  if constexpr (requires { impl.init(rng); }) impl.init(rng);
}
template <class Impl>
void set_mode(Impl& impl, Mode mode) {
  if constexpr (requires { impl.set_mode(mode); }) impl.set_mode(mode);
}
template <class Impl, class T, class B>
void after_step(Impl& impl, const RouterStep<T, B>& step) {
  if constexpr (requires { impl.after_step(step); }) impl.after_step(step);
}
}  // namespace policy_detail

// ---- scorers: u (N, D) -> gamma (N, E) logits; parameters in the arena -------------------------
// (the lifecycle hooks are the optional ones above; the names below are kept for existing code)
template <class P, class T, class B>
concept ScorerDeclares = PolicyDeclares<P, T, B>;
template <class P, class T, class B>
concept ScorerBinds = PolicyBinds<P, T, B>;
template <class P, class T, class B>
concept ScorerInits = PolicyInits<P, T, B>;
template <class P, class T, class B>
concept ScorerForward = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const Tensor<T, B>& u, Tensor<T, B>& gamma) {
      s.forward(u, gamma);
    };
template <class P, class T, class B>
concept ScorerBackward = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const Tensor<T, B>& u, const Tensor<T, B>& dgamma,
             Tensor<T, B>& du) { s.backward(u, dgamma, du); };

// Optional: the scorer's own map from logits to scores (SigmoidScorer); without it r = softmax(gamma).
template <class P, class T, class B>
concept ScorerMapsScores = PolicyWithImpl<P, T, B> &&
    requires(const policy_impl_t<P, T, B>& s, const Tensor<T, B>& gamma, Tensor<T, B>& r,
             const Tensor<T, B>& dr, Tensor<T, B>& dgamma) {
      s.scores(gamma, r);
      s.scores_backward(gamma, r, dr, dgamma);
    };

template <class P, class T = float, class B = cpu>
concept ScorerPolicy = NamedPolicy<P> && PolicyWithImpl<P, T, B> && ScorerForward<P, T, B> &&
                       ScorerBackward<P, T, B>;

// ---- token graphs: p = G r within each sequence of ctx.seq_len tokens -------------------------
// A graph without parameters typically has configure(d_model, cfg); one with parameters has
// declare(arena, prefix, d_model, cfg), bind(arena) and init(rng) (the lifecycle above).
template <class P, class T, class B>
concept GraphConfigures = PolicyConfiguresWithWidth<P, T, B>;
template <class P, class T, class B>
concept GraphHasParameters = PolicyDeclares<P, T, B>;
template <class P, class T, class B>
concept GraphForward = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& g, const Tensor<T, B>& u, const Tensor<T, B>& r,
             const GraphContext<T, B>& ctx, Tensor<T, B>& p) { g.forward(u, r, ctx, p); };
template <class P, class T, class B>
concept GraphBackward = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& g, const Tensor<T, B>& u, const Tensor<T, B>& r,
             const Tensor<T, B>& p, const Tensor<T, B>& dp, const GraphContext<T, B>& ctx,
             Tensor<T, B>& dr, Tensor<T, B>& du) { g.backward(u, r, p, dp, ctx, dr, du); };
template <class P, class T, class B>
concept GraphEntropy = PolicyWithImpl<P, T, B> &&
    requires(const policy_impl_t<P, T, B>& g) {
      { g.mean_entropy() } -> std::convertible_to<double>;
    };

template <class P, class T = float, class B = cpu>
concept TokenGraphPolicy = NamedPolicy<P> && PolicyWithImpl<P, T, B> &&
                           GraphForward<P, T, B> && GraphBackward<P, T, B> &&
                           GraphEntropy<P, T, B>;

// ---- the incremental form of a token graph (optional; incremental decoding needs it) ---------
// A graph that can decode one token at a time, given what it kept of the sequence's earlier tokens
// (a routing cache, as the KV cache keeps keys and values), has
//   using decode_cache = C;   default-constructible; `index_t values_per_token() const` says how
//                             many values it keeps per cached token (reported beside the KV cache)
//   decode_init(C&, const GraphDecodeDims&)        allocates it for dims.slots sequences of
//                                                  dims.max_len tokens
//   decode(u, r, const GraphDecodeContext<T, B>&, C&, p)
//                             ctx.rows: one new token per row (its slot and position t, earlier
//                             positions cached or in the same step: a slot may have a chunk of
//                             rows at consecutive positions); writes what later tokens need at
//                             position t for every row before any row reads (reading only
//                             positions <= t, so that a slot can be rewound to any position,
//                             core/decode.hpp), assigns p (n, E)
//                             equal to the forward's p of that token in a causal sequence; fills
//                             *ctx.weights (n, max_len) with the row's graph weights if asked
// (routing/graphs/*.hpp: Independent keeps nothing, Similarity u and r, Attention r and one value
// per head). A decoder over a graph without it fails to compile with check_graph_decodes's message.
template <class P, class T, class B>
concept GraphDecodes =
    PolicyWithImpl<P, T, B> && requires { typename policy_impl_t<P, T, B>::decode_cache; } &&
    std::default_initializable<typename policy_impl_t<P, T, B>::decode_cache> &&
    requires(policy_impl_t<P, T, B>& g, typename policy_impl_t<P, T, B>::decode_cache& c,
             const GraphDecodeDims& dims, const Tensor<T, B>& u, const Tensor<T, B>& r,
             const GraphDecodeContext<T, B>& ctx, Tensor<T, B>& p) {
      g.decode_init(c, dims);
      g.decode(u, r, ctx, c, p);
      { static_cast<const typename policy_impl_t<P, T, B>::decode_cache&>(c).values_per_token() }
          -> std::convertible_to<index_t>;
    };

// The routing cache of a graph that decodes; NoDecodeCache for one that does not (its decode path
// is then refused at compile time, check_graph_decodes).
struct NoDecodeCache {
  index_t values_per_token() const { return 0; }
};
namespace policy_detail {
template <class P, class T, class B, bool = GraphDecodes<P, T, B>>
struct graph_decode_cache {
  using type = NoDecodeCache;
};
template <class P, class T, class B>
struct graph_decode_cache<P, T, B, true> {
  using type = typename policy_impl_t<P, T, B>::decode_cache;
};
}  // namespace policy_detail
template <class P, class T, class B>
using graph_decode_cache_t = typename policy_detail::graph_decode_cache<P, T, B>::type;

// Whether the graph reads the attention layer's cache (GraphContext::attention): the policy's
// optional `static constexpr bool needs_attention_cache`, false without it.
template <class P>
consteval bool graph_needs_attention_cache() {
  if constexpr (requires { { P::needs_attention_cache } -> std::convertible_to<bool>; })
    return P::needs_attention_cache;
  else
    return false;
}

// ---- selectors: p (N, E) -> k experts per token and their gates --------------------------------
template <class P, class T, class B>
concept SelectorConfigures = PolicyConfigures<P, T, B>;
template <class P, class T, class B>
concept SelectorSelects = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const Tensor<T, B>& p, index_t k, Selection<T, B>& sel) {
      s.select(p, k, sel);
    };
// The grouped form, for a selector whose choice spans the tokens of a sequence (ExpertChoice): the
// router passes GraphContext::seq_len. A selector provides either form (the grouped one wins).
template <class P, class T, class B>
concept SelectorSelectsInGroups = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const Tensor<T, B>& p, index_t k, index_t seq_len,
             Selection<T, B>& sel) { s.select(p, k, seq_len, sel); };
template <class P, class T, class B>
concept SelectorBackward = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const Tensor<T, B>& p, const Selection<T, B>& sel,
             const Tensor<T, B>& dgates, Tensor<T, B>& dp) { s.backward(p, sel, dgates, dp); };
template <class P, class T, class B>
concept SelectorK = PolicyWithImpl<P, T, B> &&
    requires(policy_impl_t<P, T, B>& s, const policy_impl_t<P, T, B>& cs, std::int64_t step) {
      { cs.current_k() } -> std::convertible_to<index_t>;
      s.set_step(step);
    };

template <class P, class T = float, class B = cpu>
concept SelectorPolicy = NamedPolicy<P> && PolicyWithImpl<P, T, B> &&
                         (SelectorSelects<P, T, B> || SelectorSelectsInGroups<P, T, B>) &&
                         SelectorBackward<P, T, B> && SelectorK<P, T, B>;

// Whether a token's selection depends on other tokens (ExpertChoice: on its whole sequence, later
// tokens included): the policy's optional `static constexpr bool chooses_across_tokens`, false
// without it. A causal model refuses such a selector.
template <class P>
consteval bool selector_chooses_across_tokens() {
  if constexpr (requires { { P::chooses_across_tokens } -> std::convertible_to<bool>; })
    return P::chooses_across_tokens;
  else
    return false;
}

// ---- the checks with one message each ---------------------------------------------------------
// Each fails to compile at the first missing member, with a static_assert naming it (and its
// signature); for a complete policy it is true. (To test a policy without a compile error, use the
// concepts above.)
// (The failing branch returns true: its static_assert is the one error; the caller's
// static_assert(check_...()) would only add a second one without a message.)
#define GRAPHMOE_POLICY_REQUIRE(cond, msg)                           \
  else if constexpr (!(cond)) {                                      \
    static_assert(policy_detail::always_false<P>, "graphmoe: " msg); \
    return true;                                                     \
  }

template <class P, class T, class B>
consteval bool check_scorer_policy() {
  if constexpr (false) {
  }
  GRAPHMOE_POLICY_REQUIRE(NamedPolicy<P>,
                          "a scorer policy needs `static constexpr const char* name`")
  GRAPHMOE_POLICY_REQUIRE((PolicyWithImpl<P, T, B>),
                          "a scorer policy needs `template <class T, class B> using impl = ...;` "
                          "naming a default-constructible implementation")
  GRAPHMOE_POLICY_REQUIRE((ScorerForward<P, T, B>),
                          "the scorer implementation lacks `forward(const Tensor<T, B>& u, "
                          "Tensor<T, B>& gamma)`")
  GRAPHMOE_POLICY_REQUIRE((ScorerBackward<P, T, B>),
                          "the scorer implementation lacks `backward(const Tensor<T, B>& u, const "
                          "Tensor<T, B>& dgamma, Tensor<T, B>& du)`")
  return true;
}

template <class P, class T, class B>
consteval bool check_graph_policy() {
  if constexpr (false) {
  }
  GRAPHMOE_POLICY_REQUIRE(NamedPolicy<P>,
                          "a token-graph policy needs `static constexpr const char* name`")
  GRAPHMOE_POLICY_REQUIRE((PolicyWithImpl<P, T, B>),
                          "a token-graph policy needs `template <class T, class B> using impl = "
                          "...;` naming a default-constructible implementation")
  GRAPHMOE_POLICY_REQUIRE((GraphForward<P, T, B>),
                          "the token-graph implementation lacks `forward(const Tensor<T, B>& u, "
                          "const Tensor<T, B>& r, const GraphContext<T, B>&, Tensor<T, B>& p)`")
  GRAPHMOE_POLICY_REQUIRE((GraphBackward<P, T, B>),
                          "the token-graph implementation lacks `backward(const Tensor<T, B>& u, "
                          "const Tensor<T, B>& r, const Tensor<T, B>& p, const Tensor<T, B>& dp, "
                          "const GraphContext<T, B>&, Tensor<T, B>& dr, Tensor<T, B>& du)`")
  GRAPHMOE_POLICY_REQUIRE((GraphEntropy<P, T, B>),
                          "the token-graph implementation lacks `double mean_entropy() const`")
  return true;
}

// For a decoder: the graph's incremental form (above), with one message naming what is missing.
template <class P, class T, class B>
consteval bool check_graph_decodes() {
  if constexpr (false) {
  }
  GRAPHMOE_POLICY_REQUIRE((GraphDecodes<P, T, B>),
                          "incremental decoding needs the token graph's incremental form: `using "
                          "decode_cache = ...;` (with `index_t values_per_token() const`), "
                          "`decode_init(decode_cache&, const GraphDecodeDims&)` and `decode(const "
                          "Tensor<T, B>& u, const Tensor<T, B>& r, const GraphDecodeContext<T, B>&, "
                          "decode_cache&, Tensor<T, B>& p)` (routing/concepts.hpp); use "
                          "generate_full_forward (inference/generate.hpp) for a graph without it")
  return true;
}

template <class P, class T, class B>
consteval bool check_selector_policy() {
  if constexpr (false) {
  }
  GRAPHMOE_POLICY_REQUIRE(NamedPolicy<P>,
                          "a selector policy needs `static constexpr const char* name`")
  GRAPHMOE_POLICY_REQUIRE((PolicyWithImpl<P, T, B>),
                          "a selector policy needs `template <class T, class B> using impl = ...;` "
                          "naming a default-constructible implementation")
  GRAPHMOE_POLICY_REQUIRE((SelectorSelects<P, T, B> || SelectorSelectsInGroups<P, T, B>),
                          "the selector implementation lacks `select(const Tensor<T, B>& p, "
                          "index_t k, Selection<T, B>&)` (or the grouped `select(const Tensor<T, "
                          "B>& p, index_t k, index_t seq_len, Selection<T, B>&)`)")
  GRAPHMOE_POLICY_REQUIRE((SelectorBackward<P, T, B>),
                          "the selector implementation lacks `backward(const Tensor<T, B>& p, const "
                          "Selection<T, B>&, const Tensor<T, B>& dgates, Tensor<T, B>& dp)`")
  GRAPHMOE_POLICY_REQUIRE((SelectorK<P, T, B>),
                          "the selector implementation lacks `index_t current_k() const` or "
                          "`set_step(std::int64_t)`")
  return true;
}

#undef GRAPHMOE_POLICY_REQUIRE

}  // namespace graphmoe
