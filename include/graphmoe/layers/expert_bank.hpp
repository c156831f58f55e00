// graphmoe/layers/expert_bank.hpp: E expert FFNs (D -> d_ff -> D, GELU) applied to tokens grouped
// by expert.
//
// Parameters (E experts stacked, PyTorch nn.Linear layout per expert):
//   w1 (E, F, D), b1 (E, F), w2 (E, D, F), b2 (E, D)
// For expert e and its block of rows X_e of the dispatched tokens xs (see DispatchPlan):
//   H_e = X_e w1_e^T + b1_e,  A_e = gelu(H_e),  Y_e = A_e w2_e^T + b2_e
// One GEMM pair per expert on its rows only: never a dense all-experts pass. Experts with id >= E
// in the plan (the capacity-drop bucket) are skipped and their rows of ys set to zero.
#pragma once

#include <string>

#include "graphmoe/backend/cpu/dispatch.hpp"
#include "graphmoe/backend/cpu/gelu.hpp"
#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/rng.hpp"

namespace graphmoe {

// How the expert GEMMs use the threads (see docs/benchmarks.md for the measurement):
enum class ExpertParallelism {
  WithinGemm,    // experts one after another, each GEMM multi-threaded
  AcrossExperts  // experts spread over the threads, each GEMM single-threaded
};

template <class T, class B = cpu>
class ExpertBank;

template <class T>
class ExpertBank<T, cpu> {
 public:
  void declare(ParameterArena<T, cpu>& arena, const std::string& prefix, index_t num_experts,
               index_t d_model, index_t d_ff) {
    GRAPHMOE_CHECK(num_experts >= 1 && d_model >= 1 && d_ff >= 1, "ExpertBank",
                   "num_experts, d_model and d_ff must be >= 1, got ", num_experts, ", ", d_model,
                   ", ", d_ff);
    e_ = num_experts;
    d_ = d_model;
    f_ = d_ff;
    id_w1_ = arena.add(prefix + "w1", Shape{e_, f_, d_});
    id_b1_ = arena.add(prefix + "b1", Shape{e_, f_});
    id_w2_ = arena.add(prefix + "w2", Shape{e_, d_, f_});
    id_b2_ = arena.add(prefix + "b2", Shape{e_, d_});
  }
  void bind(const ParameterArena<T, cpu>& arena) {
    w1_ = arena.value(id_w1_); dw1_ = arena.grad(id_w1_);
    b1_ = arena.value(id_b1_); db1_ = arena.grad(id_b1_);
    w2_ = arena.value(id_w2_); dw2_ = arena.grad(id_w2_);
    b2_ = arena.value(id_b2_); db2_ = arena.grad(id_b2_);
  }
  // w ~ N(0, init_std^2), biases 0.
  void init(Rng& rng, double init_std) {
    for (auto* w : {&w1_, &w2_})
      for (index_t i = 0; i < w->numel(); ++i)
        w->data()[i] = static_cast<T>(rng.normal(0.0, init_std));
    b1_.zero();
    b2_.zero();
  }
  void set_gelu(GeluForm form) { gelu_ = form; }
  void set_parallelism(ExpertParallelism p) { par_ = p; }
  index_t num_experts() const { return e_; }

  // xs (S, D) grouped by the plan -> ys (S, D). Caches H and A for backward.
  void forward(const DispatchPlan& plan, const Tensor<T, cpu>& xs, Tensor<T, cpu>& ys) {
    const index_t s = xs.rows();
    GRAPHMOE_CHECK(xs.rank() == 2 && xs.cols() == d_ && s == plan.num_slots(), "ExpertBank",
                   "xs has shape ", xs.shape(), ", expected (", plan.num_slots(), ", ", d_, ")");
    prepare_output("ExpertBank", "ys", ys, xs.shape());
    if (h_.empty() || h_.rows() != s) {
      h_ = Tensor<T, cpu>(Shape{s, f_});
      a_ = Tensor<T, cpu>(Shape{s, f_});
    }
    for_each_expert(plan, [&](index_t e, index_t r0, index_t r1) {
      Tensor<T, cpu> x = xs.slice(r0, r1), h = h_.slice(r0, r1), a = a_.slice(r0, r1);
      Tensor<T, cpu> y = ys.slice(r0, r1);
      gemm(Trans::N, Trans::T, T(1), x, w1_[e], T(0), h);
      as_matrix(h).rowwise() += as_vector(b1_[e]).transpose();
      gelu_forward(gelu_, h, a);
      gemm(Trans::N, Trans::T, T(1), a, w2_[e], T(0), y);
      as_matrix(y).rowwise() += as_vector(b2_[e]).transpose();
    });
    if (plan.num_experts > e_) {  // drop bucket
      const index_t r0 = plan.offset(e_), r1 = plan.offset(plan.num_experts);
      if (r1 > r0) ys.slice(r0, r1).zero();
    }
  }

  // dys (S, D) -> dxs (S, D) assigned; parameter gradients accumulated.
  void backward(const DispatchPlan& plan, const Tensor<T, cpu>& xs, const Tensor<T, cpu>& dys,
                Tensor<T, cpu>& dxs) {
    check_shape("ExpertBank::backward", "dys", dys, xs.shape());
    prepare_output("ExpertBank::backward", "dxs", dxs, xs.shape());
    if (plan.num_experts > e_) {
      const index_t r0 = plan.offset(e_), r1 = plan.offset(plan.num_experts);
      if (r1 > r0) dxs.slice(r0, r1).zero();
    }
    Tensor<T, cpu> dh_all(Shape{xs.rows(), f_});
    for_each_expert(plan, [&](index_t e, index_t r0, index_t r1) {
      Tensor<T, cpu> x = xs.slice(r0, r1), h = h_.slice(r0, r1), a = a_.slice(r0, r1);
      Tensor<T, cpu> dy = dys.slice(r0, r1), dx = dxs.slice(r0, r1), dh = dh_all.slice(r0, r1);
      Tensor<T, cpu> dw1 = dw1_[e], dw2 = dw2_[e];
      // y = a w2^T + b2
      as_vector(db2_[e]) += as_matrix(dy).colwise().sum().transpose();
      gemm(Trans::T, Trans::N, T(1), dy, a, T(1), dw2);   // dw2 += dy^T a
      gemm(Trans::N, Trans::N, T(1), dy, w2_[e], T(0), dh);  // da = dy w2 (into dh)
      gelu_backward(gelu_, h, dh, dh);                     // dh = gelu'(h) da
      as_vector(db1_[e]) += as_matrix(dh).colwise().sum().transpose();
      gemm(Trans::T, Trans::N, T(1), dh, x, T(1), dw1);    // dw1 += dh^T x
      gemm(Trans::N, Trans::N, T(1), dh, w1_[e], T(0), dx);  // dx = dh w1
    });
  }

  const Tensor<T, cpu>& w1() const { return w1_; }
  const Tensor<T, cpu>& w2() const { return w2_; }

 private:
  template <class Fn>
  void for_each_expert(const DispatchPlan& plan, Fn&& fn) {
    auto run = [&](index_t e) {
      const index_t r0 = plan.offset(e), r1 = plan.offset(e + 1);
      if (r1 > r0) fn(e, r0, r1);
    };
    if (par_ == ExpertParallelism::AcrossExperts) {
      parallel_items(e_, run);
    } else {
      for (index_t e = 0; e < e_; ++e) run(e);
    }
  }

  index_t e_ = 0, d_ = 0, f_ = 0;
  index_t id_w1_ = -1, id_b1_ = -1, id_w2_ = -1, id_b2_ = -1;
  Tensor<T, cpu> w1_, dw1_, b1_, db1_, w2_, dw2_, b2_, db2_;
  Tensor<T, cpu> h_, a_;  // forward cache (S, F)
  GeluForm gelu_ = GeluForm::Tanh;
  ExpertParallelism par_ = ExpertParallelism::WithinGemm;
};

}  // namespace graphmoe
