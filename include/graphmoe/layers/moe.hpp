// graphmoe/layers/moe.hpp: the sparse MoE layer, a router and an expert bank.
//
//   route:    (indices, gates) = Router(u)                    (N, k)
//   dispatch: xs = rows of u grouped by expert                 (N k, D)
//   experts:  ys = ExpertBank(xs)                              (N k, D)
//   combine:  y_i = sum_j gates_ij ys[slot of (i, j)]          (N, D)
//
// forward caches what backward needs; backward assigns du. routing() exposes the router's
// output (selected experts, r and p) for metrics; losses() the auxiliary losses of the last
// forward, coefficient times value, whose gradients backward includes (layers/loss.hpp).
#pragma once

#include <string>

#include "graphmoe/core/capacity.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/dist/expert_parallel.hpp"
#include "graphmoe/layers/expert_bank.hpp"
#include "graphmoe/layers/loss.hpp"
#include "graphmoe/ops/dispatch.hpp"
#include "graphmoe/ops/gates.hpp"
#include "graphmoe/routing/router.hpp"

namespace graphmoe {

// How the dispatched rows are laid out for the experts (core/dispatch_plan.hpp):
//   Compact: the kept assignments sorted by expert, N k rows (dropped ones in a skipped bucket);
//            the expert sizes are data, so a GPU reads them back once per layer (the expert GEMMs
//            are launched from the host).
//   Padded:  E blocks of C = ceil(capacity_factor N k / E) rows, each expert's kept assignments
//            first, the rest zero rows. Shapes and offsets depend on N, k, E and C only: nothing
//            is read back (the layout a CUDA graph can capture), at the price of E C - kept rows
//            of expert work. Needs RouterConfig::capacity_factor > 0 and a token-choice selector;
//            training-time routing only (incremental decoding routes dropless, Compact).
// The same model either way: outputs and gradients agree to rounding.
enum class ExpertLayout { Compact, Padded };

inline constexpr EnumName<ExpertLayout> kExpertLayoutNames[] = {{ExpertLayout::Compact, "compact"},
                                                                {ExpertLayout::Padded, "padded"}};
inline const char* expert_layout_name(ExpertLayout l) { return name_of(kExpertLayoutNames, l); }
inline ExpertLayout expert_layout_from_name(std::string_view s) {
  return value_of("expert_layout_from_name", "expert layout", kExpertLayoutNames, s);
}

struct MoEConfig {
  index_t d_model = 352;
  index_t d_ff = 352;
  RouterConfig router;
  GeluForm gelu = GeluForm::Tanh;  // GELU's form (activation Gelu)
  // The experts' activation: GELU (w1 (E, F, D)) or SwiGLU (w1 (E, 2F, D), gate rows then up
  // rows; core/ffn_activation.hpp). A TransformerBlock's dense FFN takes both fields too.
  FfnActivation activation = FfnActivation::Gelu;
  bool bias = true;  // the experts' (and a dense block FFN's) biases b1, b2; false: none
  double init_std = 0.02;  // expert weights ~ N(0, init_std^2)
  ExpertParallelism parallelism = ExpertParallelism::AcrossExperts;  // measured: docs/benchmarks.md
  ExpertLayout layout = ExpertLayout::Compact;
};

// One implementation for every backend (the ops resolve by the tensors' backend). C is the
// experts' GEMM compute type (layers/expert_bank.hpp): T by default; __nv_bfloat16 or __half with
// T = float on graphmoe::cuda for mixed precision (the router always runs in T).
template <class RouterPolicy, class T, class B = cpu, class C = T>
class MoELayer {
 public:
  using router_policy = RouterPolicy;

  void declare(ParameterArena<T, B>& arena, const std::string& prefix, const MoEConfig& cfg) {
    check_layout(cfg);
    cfg_ = cfg;
    router_.declare(arena, prefix + "router.", cfg.d_model, cfg.router);
    experts_.declare(arena, prefix + "experts.", cfg.router.num_experts, cfg.d_model, cfg.d_ff,
                     cfg.activation, cfg.bias);
    experts_.set_gelu(cfg.gelu);
    experts_.set_parallelism(cfg.parallelism);
  }
  // Expert parallel (docs/distributed.md): this rank holds experts dist::expert_shard(E, rank,
  // world) of the layer (cfg.router.num_experts a multiple of comm.size()) and a whole copy of the
  // router; forward and backward move token rows to their experts' ranks and back through comm
  // (dist/expert_parallel.hpp), so they are collective: every rank calls them in the same order.
  // The expert parameters are declared as shards (ParameterInfo::sharded) under the names the
  // whole layer uses. comm must outlive the layer. Backends whose tensors are host memory only
  // (B::host_memory: the CPU), for now.
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, const MoEConfig& cfg,
               dist::Communicator& comm) {
    GRAPHMOE_CHECK(B::host_memory, "MoELayer", "expert parallelism is not built for the ",
                   B::name, " backend (the expert exchange moves host tensors; "
                   "dist::NcclCommunicator exists but no device exchange uses it yet)");
    GRAPHMOE_CHECK(comm.memory_space() == dist::MemorySpace::Host, "MoELayer",
                   "an expert-parallel CPU layer needs a host-memory communicator");
    GRAPHMOE_CHECK(cfg.layout == ExpertLayout::Compact, "MoELayer",
                   "expert parallelism exchanges the compact layout's rows; the padded layout is "
                   "not built for it (MoEConfig::layout = ExpertLayout::Compact)");
    check_layout(cfg);
    const dist::ExpertShard shard =
        dist::expert_shard(cfg.router.num_experts, comm.rank(), comm.size());
    cfg_ = cfg;
    router_.declare(arena, prefix + "router.", cfg.d_model, cfg.router);
    experts_.declare_shard(arena, prefix + "experts.", cfg.router.num_experts, shard.first,
                           shard.count, cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias);
    experts_.set_gelu(cfg.gelu);
    experts_.set_parallelism(cfg.parallelism);
    ep_ = &comm;
  }
  // The communicator of an expert-parallel layer (nullptr: all experts are local).
  dist::Communicator* expert_communicator() const { return ep_; }
  // The last forward's exchange (rows sent and received; expert-parallel layers only).
  const dist::ExpertExchange<T, B>& expert_exchange() const { return exchange_; }

  void bind(const ParameterArena<T, B>& arena) {
    router_.bind(arena);
    experts_.bind(arena);
    bound_ = true;
  }
  // The experts read w1, w2 in C from mirror (ExpertBank::attach_mirror); the router runs in T.
  // C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) { experts_.attach_mirror(mirror); }
  void init(Rng& rng) {
    router_.init(rng);
    experts_.init(rng, cfg_.init_std);
  }

  // u: (N, D), N a multiple of ctx.seq_len -> y: (N, D).
  void forward(const Tensor<T, B>& u, const GraphContext<T, B>& ctx, Tensor<T, B>& y) {
    check_bound("forward");
    GRAPHMOE_CHECK(u.rank() == 2 && u.cols() == cfg_.d_model, "MoELayer", "u has shape ",
                   u.shape(), ", expected (N, ", cfg_.d_model, ")");
    u_ = u;
    ctx_ = ctx;
    // The router's content checks are read with the plan's expert offsets (one synchronisation
    // on the GPU instead of five; core/deferred_check.hpp).
    with_deferred_checks(B{}, [&] {
      router_.forward(u, ctx, route_);
      make_plan(cfg_.layout);
    });
    run_experts(u, y);
  }

  // Incremental decoding (inference/decoder.hpp): u (n, D), one new token per row of ctx.rows;
  // the router decodes it from `cache` (the graph's routing cache, RouterImpl::decode, dropless)
  // and the experts run as in forward. routing() holds the step's routing afterwards. The forward
  // cache is overwritten: run forward again before a backward.
  template <class Cache>
  void decode(const Tensor<T, B>& u, const GraphDecodeContext<T, B>& ctx, Cache& cache,
              Tensor<T, B>& y) {
    check_bound("decode");
    GRAPHMOE_CHECK(ep_ == nullptr, "MoELayer",
                   "incremental decoding of an expert-parallel layer is not built (its exchange "
                   "is collective over a training step's tokens)");
    GRAPHMOE_CHECK(u.rank() == 2 && u.cols() == cfg_.d_model, "MoELayer", "u has shape ",
                   u.shape(), ", expected (n, ", cfg_.d_model, ")");
    u_ = u;
    ctx_ = GraphContext<T, B>{};
    with_deferred_checks(B{}, [&] {
      router_.decode(u, ctx, cache, route_);
      make_plan(ExpertLayout::Compact);  // dropless: no capacity to pad to
    });
    run_experts(u, y);
  }

 private:
  static void check_layout(const MoEConfig& cfg) {
    if (cfg.layout != ExpertLayout::Padded) return;
    GRAPHMOE_CHECK(cfg.router.capacity_factor > 0, "MoELayer",
                   "the padded expert layout needs a capacity (RouterConfig::capacity_factor > 0, "
                   "got ", cfg.router.capacity_factor,
                   "): without one an expert can receive all N k assignments");
    GRAPHMOE_CHECK(!selector_chooses_across_tokens<typename RouterPolicy::selector>(), "MoELayer",
                   "the padded expert layout needs a token-choice selector (its capacity is "
                   "ceil(capacity_factor N k / E) per expert)");
  }

  // The dispatch plan of the routing in route_. Compact: capacity-dropped assignments go to a
  // bucket expert E that the bank skips. Padded: C slots per expert (core/dispatch_plan.hpp).
  void make_plan(ExpertLayout layout) {
    const Selection<T, B>& sel = route_.selection;
    const index_t e = cfg_.router.num_experts;
    if (layout == ExpertLayout::Padded) {
      const index_t c = token_capacity(cfg_.router.capacity_factor, sel.indices.rows(),
                                       sel.indices.cols(), e);
      make_padded_dispatch_plan(sel.indices, sel.keep, e, c, plan_);
      return;
    }
    Tensor<std::int32_t, B> ids = sel.indices;
    if (sel.may_drop) {
      ids = Tensor<std::int32_t, B>();
      route_dropped_to(sel.indices, sel.keep, static_cast<std::int32_t>(e), ids);
    }
    make_dispatch_plan(ids, sel.may_drop ? e + 1 : e, plan_);
  }

  // dispatch -> experts -> combine for the routing in route_ and plan_
  void run_experts(const Tensor<T, B>& u, Tensor<T, B>& y) {
    const Selection<T, B>& sel = route_.selection;
    const index_t e = cfg_.router.num_experts;
    if (xs_.empty() || xs_.rows() != plan_.num_slots()) {
      xs_ = Tensor<T, B>(Shape{plan_.num_slots(), cfg_.d_model});
      ys_ = Tensor<T, B>(Shape{plan_.num_slots(), cfg_.d_model});
    }
    dispatch_forward(plan_, u, xs_);
    if (ep_ != nullptr) {
      exchange_.dispatch(*ep_, plan_, e, xs_, lxs_);
      if (exchange_.received_rows() > 0) {
        if (!lys_.empty() && lys_.shape() != lxs_.shape()) lys_ = Tensor<T, B>();
        experts_.forward(exchange_.local_plan(), lxs_, lys_);
      }
      exchange_.combine(*ep_, lys_, ys_);
    } else {
      experts_.forward(plan_, xs_, ys_);
    }
    prepare_output("MoELayer", "y", y, u.shape());
    combine_forward(plan_, ys_, sel.gates, y);
  }

 public:

  // dy: (N, D) -> du: (N, D) assigned. Parameter gradients accumulated. With the Attention graph,
  // gradients for the attention layer are accumulated into ctx.attention's d* tensors.
  void backward(const Tensor<T, B>& dy, Tensor<T, B>& du) {
    check_bound("backward");
    check_shape("MoELayer::backward", "dy", dy, u_.shape());
    prepare_output("MoELayer::backward", "du", du, u_.shape());
    Tensor<T, B> dys, dgates, dxs;
    combine_backward(plan_, ys_, route_.selection.gates, dy, dys, dgates);
    if (ep_ != nullptr) {
      Tensor<T, B> ldys, ldxs;
      exchange_.dispatch_again(*ep_, dys, ldys);
      if (exchange_.received_rows() > 0) experts_.backward(exchange_.local_plan(), lxs_, ldys, ldxs);
      exchange_.combine(*ep_, ldxs, dxs);
    } else {
      experts_.backward(plan_, xs_, dys, dxs);
    }
    dispatch_backward(plan_, dxs, du);
    router_.backward(u_, ctx_, route_, dgates, du);
  }

  const RouterOutput<T, B>& routing() const { return route_; }
  // coef x (load-balancing, z, sequence-wise) losses of the last forward (task = 0): the terms this layer's
  // backward adds the gradients of.
  Loss losses() const {
    Loss l;
    l.load_balance = cfg_.router.load_balance_coef * route_.load_balance_loss;
    l.z_loss = cfg_.router.z_loss_coef * route_.z_loss;
    l.seq_aux = cfg_.router.seq_aux_loss_coef * route_.seq_aux_loss;
    return l;
  }
  RouterImpl<RouterPolicy, T, B>& router() { return router_; }
  const RouterImpl<RouterPolicy, T, B>& router() const { return router_; }
  ExpertBank<T, B, C>& experts() { return experts_; }
  const DispatchPlan<B>& plan() const { return plan_; }
  const MoEConfig& config() const { return cfg_; }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "MoELayer", op); }
  MoEConfig cfg_;
  RouterImpl<RouterPolicy, T, B> router_;
  ExpertBank<T, B, C> experts_;
  // forward cache
  Tensor<T, B> u_;
  GraphContext<T, B> ctx_;
  RouterOutput<T, B> route_;
  DispatchPlan<B> plan_;
  Tensor<T, B> xs_, ys_;
  // expert parallel: the communicator, the exchange, and this rank's experts' rows (grouped)
  dist::Communicator* ep_ = nullptr;
  dist::ExpertExchange<T, B> exchange_;
  Tensor<T, B> lxs_, lys_;
};

}  // namespace graphmoe
