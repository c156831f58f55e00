// graphmoe/routing/router.hpp: Router<Scorer, TokenGraph, Selector> and the named routers.
//
//   gamma = Scorer(u)            (N, E)  affinity logits
//   r     = softmax(gamma)       (N, E)  expert scores (or the scorer's own map, e.g. sigmoid)
//   p     = TokenGraph(r; u)     (N, E)  graph-aware scores
//   (indices, gates) = Selector(p)       (N, m) slots: each token's experts and gates
//
// RouterImpl<Router<...>, T, B> holds the parts; forward fills a RouterOutput (which the MoE layer
// returns for metrics) and backward takes dgates and accumulates du (+=). It drives every policy
// through the same optional lifecycle (routing/concepts.hpp: declare or configure, bind, init,
// set_mode, after_step) and checks the shape of every policy's output, naming the policy that got it wrong:
// a user's scorer that returns too many columns, or a graph that leaves p unfilled, is reported
// as that policy's error, not as an error of the op that reads its output next.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/communicator.hpp"
#include "graphmoe/core/mode.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/softmax.hpp"
#include "graphmoe/routing/aux_losses.hpp"
#include "graphmoe/routing/concepts.hpp"
#include "graphmoe/routing/graphs/blended.hpp"
#include "graphmoe/routing/scorers.hpp"
#include "graphmoe/routing/selectors.hpp"
#include "graphmoe/routing/token_graphs.hpp"

namespace graphmoe {

// The router policy: three tags (built-in or a user's: routing/concepts.hpp). RouterImpl checks
// each against its concept for the scalar type and backend it is instantiated with.
template <class Scorer, class Graph, class Selector>
struct Router {
  static_assert(NamedPolicy<Scorer> && NamedPolicy<Graph> && NamedPolicy<Selector>,
                "graphmoe::Router<Scorer, Graph, Selector>: every policy needs `static constexpr "
                "const char* name` (see routing/concepts.hpp)");
  using scorer = Scorer;
  using graph = Graph;
  using selector = Selector;
  // True when the router needs the attention layer's cache (the graph policy says so).
  static constexpr bool needs_attention = graph_needs_attention_cache<Graph>();
  static std::string name() {
    return std::string(Scorer::name) + "/" + Graph::name + "/" + Selector::name;
  }
};

// The paper's rows (Table 1 and its plug-in variants).
using SoftmaxRouter = Router<LinearScorer, Independent, TopK>;            // SMoE (Switch)
using SimilarityRouter = Router<LinearScorer, Similarity, TopK>;          // Similarity-Aware SMoE
using AttentionRouter = Router<LinearScorer, Attention, TopK>;            // Attention-Aware SMoE
using XMoERouter = Router<CosineScorer, Independent, TopK>;               // X-MoE
using SimilarityXMoERouter = Router<CosineScorer, Similarity, TopK>;      // Similarity-Aware X-MoE
using AttentionXMoERouter = Router<CosineScorer, Attention, TopK>;        // Attention-Aware X-MoE
using SMoEDropoutRouter = Router<FrozenRandomScorer, Independent, ScheduledTopK>;
using SimilaritySMoEDropoutRouter = Router<FrozenRandomScorer, Similarity, ScheduledTopK>;
using AttentionSMoEDropoutRouter = Router<FrozenRandomScorer, Attention, ScheduledTopK>;
// Expert choice (Zhou et al. 2022) on the softmax scores, and with either token graph: not in the
// paper; non-causal models only (policies.hpp).
using ExpertChoiceRouter = Router<LinearScorer, Independent, ExpertChoice>;
// DeepSeek-V3's routing: sigmoid scores, auxiliary-loss-free bias balancing (the token choice,
// e.g. routed_scaling_factor, n_group, in cfg.options<TopK>(), as for TopK; the bias's rate in
// cfg.options<BiasBalancedTopK>()),
// alone and with either token graph mixing the sigmoid scores before selection. Not in the paper.
using SigmoidBiasRouter = Router<SigmoidScorer, Independent, BiasBalancedTopK>;
using SimilaritySigmoidBiasRouter = Router<SigmoidScorer, Similarity, BiasBalancedTopK>;
using AttentionSigmoidBiasRouter = Router<SigmoidScorer, Attention, BiasBalancedTopK>;
using SimilarityExpertChoiceRouter = Router<LinearScorer, Similarity, ExpertChoice>;
using AttentionExpertChoiceRouter = Router<LinearScorer, Attention, ExpertChoice>;
// Graph upcycling (routing/graphs/blended.hpp): a softmax top-k router whose scores are mixed
// through the token graph by a learned weight, p = (1 - w) r + w G r with w = clamp(a, 0, 1),
// from a = 0 (the router without a graph, bit for bit). Not in the paper.
using BlendedSimilarityRouter = Router<LinearScorer, Blended<Similarity>, TopK>;
using BlendedAttentionRouter = Router<LinearScorer, Blended<Attention>, TopK>;

template <class T, class B = cpu>
struct RouterOutput {
  Tensor<T, B> gamma;        // (N, E) scorer logits
  Tensor<T, B> r;            // (N, E) softmax(gamma), or the scorer's own map of gamma
  Tensor<T, B> p;            // (N, E) after the token graph (with Independent: r itself)
  Selection<T, B> selection;  // indices, values, gates, keep (N, m)
  // unscaled values (computed when their coefficient is > 0). On a GPU inside a deferred scope
  // (TransformerLM::forward) load_balance_loss is known once the scope has read its batch: after
  // the forward returns.
  double load_balance_loss = 0;
  double z_loss = 0;
  // The sequence-wise balance loss L_seq (seq_aux_loss_coef > 0): over the sequences of
  // GraphContext::seq_len rows (a model with no sequences passes seq_len = N: one). Computed at
  // once (on a GPU from host copies: a synchronisation).
  double seq_aux_loss = 0;
  // The token graph's mean row entropy is not here: it costs a reduction and a read back on the
  // GPU, so RouterImpl::graph_entropy() computes it on request.
};

template <class Policy, class T, class B = cpu>
class RouterImpl;

// The same implementation for every backend: the parts and the ops they call resolve by the
// tensors' backend (a .cu file instantiating it with graphmoe::cuda includes graphmoe/cuda.cuh).
template <class Scorer, class Graph, class Selector, class T, class B>
class RouterImpl<Router<Scorer, Graph, Selector>, T, B> {
  // One message naming the first missing member of an incomplete policy.
  static_assert(check_scorer_policy<Scorer, T, B>());
  static_assert(check_graph_policy<Graph, T, B>());
  static_assert(check_selector_policy<Selector, T, B>());

 public:
  using policy = Router<Scorer, Graph, Selector>;
  using scorer_impl = policy_impl_t<Scorer, T, B>;
  using graph_impl = policy_impl_t<Graph, T, B>;
  using selector_impl = policy_impl_t<Selector, T, B>;

  // Validates the config for these three policies (RouterConfig::validate_for: options set for a
  // policy this router does not use are an error unless cfg.allow_unused_options), marks cfg as
  // declared (changing its options afterwards throws: the router keeps a copy) and declares or
  // configures each policy.
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    cfg.validate_for<Scorer, Graph, Selector>();
    cfg.mark_declared();
    cfg_ = cfg;
    d_model_ = d_model;
    policy_detail::declare(scorer_, arena, prefix, d_model, cfg_);
    policy_detail::declare(graph_, arena, prefix + "graph.", d_model, cfg_);
    policy_detail::declare(selector_, arena, prefix + "selector.", d_model, cfg_);
  }
  void bind(const ParameterArena<T, B>& arena) {
    policy_detail::bind(scorer_, arena);
    policy_detail::bind(graph_, arena);
    policy_detail::bind(selector_, arena);
  }
  void init(Rng& rng) {
    policy_detail::init(scorer_, rng);
    policy_detail::init(graph_, rng);
    policy_detail::init(selector_, rng);
  }
  // Passes the mode to every policy that takes one (core/mode.hpp).
  void set_mode(Mode mode) {
    mode_ = mode;
    policy_detail::set_mode(scorer_, mode);
    policy_detail::set_mode(graph_, mode);
    policy_detail::set_mode(selector_, mode);
  }
  Mode mode() const { return mode_; }

  const RouterConfig& config() const { return cfg_; }
  scorer_impl& scorer() { return scorer_; }
  graph_impl& graph() { return graph_; }
  selector_impl& selector() { return selector_; }
  index_t current_k() const { return selector_.current_k(); }
  // The mean row entropy of the token graph in the last forward (the graph's mean_entropy(); 0
  // for Independent, before any forward and after a decode step, which builds no graph over the
  // tokens). Computed when asked, not at every forward: on the GPU it is a reduction and a read
  // back, i.e. a synchronisation.
  double graph_entropy() const { return graph_forwarded_ ? graph_.mean_entropy() : 0.0; }
  void set_step(std::int64_t step) { selector_.set_step(step); }

  // Whether a policy has the after_step hook (then training forwards count the expert loads).
  static constexpr bool kCountsLoads = PolicyAfterStep<Scorer, T, B> ||
                                       PolicyAfterStep<Graph, T, B> ||
                                       PolicyAfterStep<Selector, T, B>;
  // After every optimizer step (the models' after_optimizer_step): the loads counted since the
  // last call (training forwards only), summed over comm's ranks when comm is given (a collective:
  // every rank calls it), go to each policy's after_step, as host doubles (RouterStep::loads) and
  // as int32 counts on the backend (RouterStep::load_counts); the count restarts first. A device
  // communicator sums the counts in place on the device, a host one (CPU backend) sums the host
  // vector, which is then written into the counts. Nothing for a router without the hook.
  void after_step(ParameterArena<T, B>& arena, dist::Communicator* comm = nullptr) {
    if constexpr (kCountsLoads) {
      const index_t e = cfg_.num_experts;
      if (step_loads_.empty()) {  // no training forward yet: zero loads (every rank sums them)
        step_loads_ = Tensor<std::int32_t, B>(Shape{e});
        fill(step_loads_, std::int32_t{0});
      }
      // The step's counts move to step_counts_ and the count restarts; step_loads_ keeps its
      // buffer (a captured CUDA graph accumulates into that address).
      if (step_counts_.empty()) step_counts_ = Tensor<std::int32_t, B>(Shape{e});
      step_counts_.copy_from(step_loads_);
      fill(step_loads_, std::int32_t{0});
      std::vector<double> loads(static_cast<std::size_t>(e), 0.0);
      if (comm != nullptr && comm->memory_space() == dist::MemorySpace::Device) {
        GRAPHMOE_CHECK(!B::host_memory, "Router::after_step",
                       "the communicator moves device memory but the router's tensors are on the "
                       "host");
        comm->all_reduce_sum(step_counts_.data(), e, dist::ElementType::I32);
      }
      const Tensor<std::int32_t, cpu> host = detail::host_values(step_counts_);
      for (index_t i = 0; i < e; ++i) loads[static_cast<std::size_t>(i)] = host.data()[i];
      if (comm != nullptr && comm->memory_space() == dist::MemorySpace::Host) {
        GRAPHMOE_CHECK(B::host_memory, "Router::after_step",
                       "the communicator moves host memory but the router's tensors are on a "
                       "device");
        comm->all_reduce_sum(loads);
        if constexpr (B::host_memory) {  // the summed counts into the tensor the policies get
          for (index_t i = 0; i < e; ++i) {
            const double l = loads[static_cast<std::size_t>(i)];
            GRAPHMOE_CHECK(l >= std::numeric_limits<std::int32_t>::min() &&
                               l <= std::numeric_limits<std::int32_t>::max(),
                           "Router::after_step", "expert ", i, "'s load summed over the ranks is ",
                           l, ", outside the int32 counts");
            step_counts_.data()[i] = static_cast<std::int32_t>(l);
          }
        }
      }
      const RouterStep<T, B> step{loads, step_counts_, comm, arena};
      policy_detail::after_step(scorer_, step);
      policy_detail::after_step(graph_, step);
      policy_detail::after_step(selector_, step);
    } else {
      (void)arena;
      (void)comm;
    }
  }
  // The loads counted since the last after_step (empty before the first training forward of a
  // router that counts).
  const Tensor<std::int32_t, B>& step_loads() const { return step_loads_; }

  // u: (N, D) tokens, N a multiple of ctx.seq_len.
  void forward(const Tensor<T, B>& u, const GraphContext<T, B>& ctx, RouterOutput<T, B>& out) {
    score(u, out);
    const index_t n = u.rows(), e = cfg_.num_experts;
    graph_.forward(u, out.r, ctx, out.p);
    check_policy_output("token graph", Graph::name, "p", out.p, n, e);
    if constexpr (SelectorSelectsInGroups<Selector, T, B>)
      selector_.select(out.p, selector_.current_k(), ctx.seq_len, out.selection);
    else
      selector_.select(out.p, selector_.current_k(), out.selection);
    check_selection(out.selection, n);
    graph_forwarded_ = true;
    if constexpr (kCountsLoads) {
      if (mode_ == Mode::Train) {
        if (step_loads_.empty()) {
          step_loads_ = Tensor<std::int32_t, B>(Shape{e});
          fill(step_loads_, std::int32_t{0});
        }
        accumulate_expert_counts(out.selection.indices, out.selection.keep, step_loads_);
      }
    }
    // (inside a deferred scope on a GPU, the value arrives with the scope's next read)
    out.load_balance_loss = 0.0;
    if (cfg_.load_balance_coef > 0)
      load_balance_loss_into(out.p, out.selection.indices, out.load_balance_loss);
    out.z_loss = 0.0;
    if (cfg_.z_loss_coef > 0) z_loss_into(out.gamma, out.z_loss);
    out.seq_aux_loss = 0.0;
    if (cfg_.seq_aux_loss_coef > 0)
      out.seq_aux_loss =
          seq_aux_loss(out.p, out.selection.indices, ctx.seq_len, 0.0, nullptr);
  }

  // Incremental decoding (inference/decoder.hpp): u (n, D) holds one new token per row of
  // ctx.rows; the graph decodes it from its routing cache (GraphDecodes, routing/concepts.hpp)
  // and the selector routes dropless (the capacity limit is a training device: a selector with
  // select_dropless is asked for that, one without must drop nothing). No auxiliary loss.
  template <class Cache>
  void decode(const Tensor<T, B>& u, const GraphDecodeContext<T, B>& ctx, Cache& cache,
              RouterOutput<T, B>& out) {
    static_assert(check_graph_decodes<Graph, T, B>());
    static_assert(!selector_chooses_across_tokens<Selector>(),
                  "graphmoe: incremental decoding needs a token-choice selector (this one chooses "
                  "across a sequence's tokens, later ones included)");
    score(u, out);
    const index_t n = u.rows(), e = cfg_.num_experts;
    graph_.decode(u, out.r, ctx, cache, out.p);
    check_policy_output("token graph", Graph::name, "p (decode)", out.p, n, e);
    if constexpr (requires { selector_.select_dropless(out.p, index_t{1}, out.selection); }) {
      selector_.select_dropless(out.p, selector_.current_k(), out.selection);
    } else {
      selector_.select(out.p, selector_.current_k(), out.selection);
      const index_t dropped = out.selection.may_drop ? dropped_count(out.selection) : 0;
      GRAPHMOE_CHECK(dropped == 0, "Router", "the selector '", Selector::name, "' dropped ",
                     dropped,
                     " assignments in a decode step; decoding routes dropless (give the selector "
                     "select_dropless(p, k, selection))");
    }
    check_selection(out.selection, n);
    graph_forwarded_ = false;
    out.load_balance_loss = 0;
    out.z_loss = 0;
    out.seq_aux_loss = 0;
  }

  // dgates: (N, m), the selection's shape. du accumulated (+=). The auxiliary losses' gradients (coefficient times
  // gradient) are added here.
  void backward(const Tensor<T, B>& u, const GraphContext<T, B>& ctx,
                const RouterOutput<T, B>& out, const Tensor<T, B>& dgates, Tensor<T, B>& du) {
    check_shape("Router::backward", "du", du, u.shape());
    const index_t n = u.rows(), e = cfg_.num_experts;
    Tensor<T, B> dp, dr, dgamma;
    selector_.backward(out.p, out.selection, dgates, dp);
    check_policy_output("selector", Selector::name, "dp (backward)", dp, n, e);
    if (cfg_.load_balance_coef > 0)
      load_balance_loss_backward(out.p, out.selection.indices, cfg_.load_balance_coef, dp);
    if (cfg_.seq_aux_loss_coef > 0)
      (void)seq_aux_loss(out.p, out.selection.indices, ctx.seq_len, cfg_.seq_aux_loss_coef,
                         &dp);
    graph_.backward(u, out.r, out.p, dp, ctx, dr, du);
    check_policy_output("token graph", Graph::name, "dr (backward)", dr, n, e);
    if constexpr (ScorerMapsScores<Scorer, T, B>)
      scorer_.scores_backward(out.gamma, out.r, dr, dgamma);
    else
      softmax_backward(out.r, dr, dgamma);
    check_policy_output("scorer", Scorer::name, "dgamma (scores_backward)", dgamma, n, e);
    if (cfg_.z_loss_coef > 0) z_loss_backward(out.gamma, cfg_.z_loss_coef, dgamma);
    scorer_.backward(u, dgamma, du);
  }

 private:
  // What forward and decode share before the graph: u checked, out's tensors cleared, gamma =
  // Scorer(u) (shape checked) and r = softmax(gamma).
  void score(const Tensor<T, B>& u, RouterOutput<T, B>& out) {
    GRAPHMOE_CHECK(u.rank() == 2 && u.cols() == d_model_, "Router", "u has shape ", u.shape(),
                   ", expected (N, ", d_model_, ")");
    check_finite("Router", "u", u);
    out.gamma = Tensor<T, B>();
    out.r = Tensor<T, B>();
    out.p = Tensor<T, B>();
    scorer_.forward(u, out.gamma);
    check_policy_output("scorer", Scorer::name, "gamma", out.gamma, u.rows(), cfg_.num_experts);
    if constexpr (ScorerMapsScores<Scorer, T, B>) {
      scorer_.scores(out.gamma, out.r);
      check_policy_output("scorer", Scorer::name, "r (scores)", out.r, u.rows(), cfg_.num_experts);
    } else {
      softmax_forward(out.gamma, out.r);
    }
  }

  // A policy's output must be (n, e): the router names the policy when it is not.
  template <class U>
  static void check_policy_output(const char* kind, const char* name, const char* what,
                                  const Tensor<U, B>& t, index_t n, index_t e) {
    GRAPHMOE_CHECK(!t.empty(), "Router", "the ", kind, " '", name, "' left ", what,
                   " empty; expected (", n, ", ", e, ")");
    GRAPHMOE_CHECK(t.rank() == 2 && t.dim(0) == n && t.dim(1) == e, "Router", "the ", kind, " '",
                   name, "' returned ", what, " of shape ", t.shape(), "; expected (", n, ", ", e,
                   ")");
  }
  // The selection: indices, values, gates and keep of one shape (n, m), m >= 1.
  static void check_selection(const Selection<T, B>& sel, index_t n) {
    const auto& idx = sel.indices;
    GRAPHMOE_CHECK(!idx.empty() && idx.rank() == 2 && idx.dim(0) == n && idx.dim(1) >= 1,
                   "Router", "the selector '", Selector::name, "' returned indices of shape ",
                   (idx.empty() ? std::string("(empty)") : idx.shape().str()), "; expected (", n,
                   ", m), m >= 1");
    const auto check = [&](const char* what, const Shape& s, bool empty) {
      GRAPHMOE_CHECK(!empty && s == idx.shape(), "Router", "the selector '", Selector::name,
                     "' returned ", what, " of shape ", (empty ? std::string("(empty)") : s.str()),
                     "; expected the indices' ", idx.shape());
    };
    check("values", sel.values.shape(), sel.values.empty());
    check("gates", sel.gates.shape(), sel.gates.empty());
    check("keep", sel.keep.shape(), sel.keep.empty());
    if constexpr (B::host_memory) {  // free where keep is host memory
      GRAPHMOE_CHECK(sel.may_drop || dropped_count(sel) == 0, "Router", "the selector '",
                     Selector::name, "' set may_drop = false but dropped ", dropped_count(sel),
                     " slots (keep = 0); set may_drop = true");
    }
  }

  RouterConfig cfg_;
  Tensor<std::int32_t, B> step_loads_;  // (E) kept assignments since the last after_step
  Tensor<std::int32_t, B> step_counts_;  // (E) the last step's, summed over ranks (RouterStep)
  bool graph_forwarded_ = false;  // the graph's state is a forward's (not a decode's)
  Mode mode_ = Mode::Train;
  index_t d_model_ = 0;
  scorer_impl scorer_;
  graph_impl graph_;
  selector_impl selector_;
};

}  // namespace graphmoe
