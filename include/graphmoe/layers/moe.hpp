// graphmoe/layers/moe.hpp: the sparse MoE layer, a router and an expert bank.
//
//   route:    (indices, gates) = Router(u)                    (N, k)
//   dispatch: xs = rows of u grouped by expert                 (N k, D)
//   experts:  ys = ExpertBank(xs)                              (N k, D)
//   combine:  y_i = sum_j gates_ij ys[slot of (i, j)]          (N, D)
//
// forward caches what backward needs; backward assigns du. routing() exposes the router's
// output (selected experts, r and p) for metrics.
#pragma once

#include <string>

#include "graphmoe/backend/cpu/dispatch.hpp"
#include "graphmoe/layers/expert_bank.hpp"
#include "graphmoe/routing/router.hpp"

namespace graphmoe {

struct MoEConfig {
  index_t d_model = 352;
  index_t d_ff = 352;
  RouterConfig router;
  GeluForm gelu = GeluForm::Tanh;
  double init_std = 0.02;  // expert weights ~ N(0, init_std^2)
  ExpertParallelism parallelism = ExpertParallelism::AcrossExperts;  // measured: docs/benchmarks.md
};

template <class RouterPolicy, class T, class B = cpu>
class MoELayer;

template <class RouterPolicy, class T>
class MoELayer<RouterPolicy, T, cpu> {
 public:
  using router_policy = RouterPolicy;

  void declare(ParameterArena<T, cpu>& arena, const std::string& prefix, const MoEConfig& cfg) {
    cfg_ = cfg;
    router_.declare(arena, prefix + "router.", cfg.d_model, cfg.router);
    experts_.declare(arena, prefix + "experts.", cfg.router.num_experts, cfg.d_model, cfg.d_ff);
    experts_.set_gelu(cfg.gelu);
    experts_.set_parallelism(cfg.parallelism);
  }
  void bind(const ParameterArena<T, cpu>& arena) {
    router_.bind(arena);
    experts_.bind(arena);
  }
  void init(Rng& rng) {
    router_.init(rng);
    experts_.init(rng, cfg_.init_std);
  }

  // u: (N, D), N a multiple of ctx.seq_len -> y: (N, D).
  void forward(const Tensor<T, cpu>& u, const GraphContext<T, cpu>& ctx, Tensor<T, cpu>& y) {
    GRAPHMOE_CHECK(u.rank() == 2 && u.cols() == cfg_.d_model, "MoELayer", "u has shape ",
                   u.shape(), ", expected (N, ", cfg_.d_model, ")");
    u_ = u;
    ctx_ = ctx;
    router_.forward(u, ctx, route_);
    const Selection<T, cpu>& sel = route_.selection;
    // Capacity-dropped assignments go to a bucket expert E that the bank skips.
    const index_t e = cfg_.router.num_experts;
    Tensor<std::int32_t, cpu> ids = sel.indices;
    if (sel.dropped > 0) {
      ids = sel.indices.clone();
      for (index_t i = 0; i < ids.numel(); ++i)
        if (!sel.keep.data()[i]) ids.data()[i] = static_cast<std::int32_t>(e);
    }
    make_dispatch_plan(ids, sel.dropped > 0 ? e + 1 : e, plan_);
    if (xs_.empty() || xs_.rows() != plan_.num_slots()) {
      xs_ = Tensor<T, cpu>(Shape{plan_.num_slots(), cfg_.d_model});
      ys_ = Tensor<T, cpu>(Shape{plan_.num_slots(), cfg_.d_model});
    }
    dispatch_forward(plan_, u, xs_);
    experts_.forward(plan_, xs_, ys_);
    prepare_output("MoELayer", "y", y, u.shape());
    combine_forward(plan_, ys_, sel.gates, y);
  }

  // dy: (N, D) -> du: (N, D) assigned. Parameter gradients accumulated. With the Attention graph,
  // gradients for the attention layer are accumulated into ctx.attention's d* tensors.
  void backward(const Tensor<T, cpu>& dy, Tensor<T, cpu>& du) {
    check_shape("MoELayer::backward", "dy", dy, u_.shape());
    prepare_output("MoELayer::backward", "du", du, u_.shape());
    Tensor<T, cpu> dys, dgates, dxs;
    combine_backward(plan_, ys_, route_.selection.gates, dy, dys, dgates);
    experts_.backward(plan_, xs_, dys, dxs);
    dispatch_backward(plan_, dxs, du);
    router_.backward(u_, ctx_, route_, dgates, du);
  }

  const RouterOutput<T, cpu>& routing() const { return route_; }
  RouterImpl<RouterPolicy, T, cpu>& router() { return router_; }
  ExpertBank<T, cpu>& experts() { return experts_; }
  const DispatchPlan& plan() const { return plan_; }
  const MoEConfig& config() const { return cfg_; }

 private:
  MoEConfig cfg_;
  RouterImpl<RouterPolicy, T, cpu> router_;
  ExpertBank<T, cpu> experts_;
  // forward cache
  Tensor<T, cpu> u_;
  GraphContext<T, cpu> ctx_;
  RouterOutput<T, cpu> route_;
  DispatchPlan plan_;
  Tensor<T, cpu> xs_, ys_;
};

}  // namespace graphmoe
