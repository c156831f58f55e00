// graphmoe/layers/expert_bank.hpp: E expert FFNs (D -> d_ff -> D, GELU or SwiGLU) applied to
// tokens grouped by expert.
//
// Parameters (E experts stacked, PyTorch nn.Linear layout per expert):
//   GELU:    w1 (E, F, D), b1 (E, F), w2 (E, D, F), b2 (E, D)
//   SwiGLU:  w1 (E, 2F, D), b1 (E, 2F), w2 (E, D, F), b2 (E, D): w1_e's first F rows are the
//            gate projection, its last F rows the up projection (core/ffn_activation.hpp)
// declare(..., bias = false) declares no b1, b2 (the Llama-family experts have none).
// For expert e and its block of rows X_e of the dispatched tokens xs (see DispatchPlan):
//   H_e = X_e w1_e^T + b1_e,  A_e = gelu(H_e) or silu(H_e[:, :F]) * H_e[:, F:],
//   Y_e = A_e w2_e^T + b2_e
// One GEMM pair per expert on its rows only: never a dense all-experts pass. Experts with id >= E
// in the plan (the capacity-drop bucket) are skipped and their rows of ys set to zero. The
// schedule is the backend's (ops/experts.hpp): on the CPU the experts run one after another or
// across threads (ExpertParallelism); on the GPU each step runs for all experts at once (grouped
// GEMMs, one bias / GELU launch over all expert rows), so that a layer's launches do not grow
// with E.
//
// Compute type C (default T): the scalar type of the GEMM operands. With T = float and C =
// __nv_bfloat16 (or __half) on graphmoe::cuda, the parameters, biases, activations and gradients
// stay fp32 (master weights, as mixed-precision training keeps them) and each forward converts
// xs, w1, w2 and the activations A to C once; the GEMMs read C, accumulate in fp32 and write fp32
// (backend/cuda/gemm.cuh's mixed gemm), so bias, GELU and every reduction stay fp32. The router
// is not affected (it runs in T): the "fp32 router logits and softmax". With a compute
// mirror attached (attach_mirror, layers/compute_mirror.hpp) w1 and w2 in C are views of the
// mirror (refreshed first if stale) instead of per-forward conversions: the same values.
#pragma once

#include <string>
#include <type_traits>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/expert_ffn.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/layers/compute_mirror.hpp"
#include "graphmoe/ops/dispatch.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/experts.hpp"
#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/ops/gemm.hpp"

namespace graphmoe {

// ExpertParallelism (how the CPU's expert GEMMs use the threads): core/expert_ffn.hpp.

// One implementation for every backend. The plan is a DispatchPlan<B>, whose expert offsets are
// on the host; the per-expert schedule is the backend's (expert_ffn_forward / _backward,
// ops/experts.hpp; ExpertParallelism only applies to the CPU).
template <class T, class B = cpu, class C = T>
class ExpertBank {
  static_assert(std::is_same_v<C, T> || backend_mixed_precision<B>,
                "graphmoe::ExpertBank: a compute type other than T needs a backend with mixed_precision (graphmoe::cuda)");

 public:
  // activation: GELU (w1 has F rows per expert) or SwiGLU (2F: gate | up); bias: declare b1, b2.
  // The activation is fixed here (the parameters' shapes depend on it); GELU's form is set_gelu's.
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t num_experts,
               index_t d_model, index_t d_ff, FfnActivation activation = FfnActivation::Gelu,
               bool bias = true) {
    GRAPHMOE_CHECK(num_experts >= 1 && d_model >= 1 && d_ff >= 1, "ExpertBank",
                   "num_experts, d_model and d_ff must be >= 1, got ", num_experts, ", ", d_model,
                   ", ", d_ff);
    set_activation(activation, bias);
    e_ = num_experts;
    d_ = d_model;
    f_ = d_ff;
    total_ = num_experts;
    first_ = 0;
    id_w1_ = arena.add(prefix + "w1", Shape{e_, f1(), d_});
    if (bias_) id_b1_ = arena.add(prefix + "b1", Shape{e_, f1()});
    id_w2_ = arena.add(prefix + "w2", Shape{e_, d_, f_});
    if (bias_) id_b2_ = arena.add(prefix + "b2", Shape{e_, d_});
  }
  // Expert parallel: this bank holds experts [first, first + count) of a layer of total_experts
  // (its parameters are shards of the whole layer's, ParameterInfo::sharded, under the same
  // names); the plans it is given number its experts 0 .. count - 1.
  void declare_shard(ParameterArena<T, B>& arena, const std::string& prefix,
                     index_t total_experts, index_t first, index_t count, index_t d_model,
                     index_t d_ff, FfnActivation activation = FfnActivation::Gelu,
                     bool bias = true) {
    GRAPHMOE_CHECK(total_experts >= 1 && count >= 1 && first >= 0 &&
                       first + count <= total_experts && d_model >= 1 && d_ff >= 1,
                   "ExpertBank", "experts [", first, ", ", first + count, ") of ", total_experts,
                   " with d_model ", d_model, " and d_ff ", d_ff, " are not a valid shard");
    set_activation(activation, bias);
    e_ = count;
    d_ = d_model;
    f_ = d_ff;
    total_ = total_experts;
    first_ = first;
    id_w1_ = arena.add_shard(prefix + "w1", Shape{e_, f1(), d_}, total_, first_);
    if (bias_) id_b1_ = arena.add_shard(prefix + "b1", Shape{e_, f1()}, total_, first_);
    id_w2_ = arena.add_shard(prefix + "w2", Shape{e_, d_, f_}, total_, first_);
    if (bias_) id_b2_ = arena.add_shard(prefix + "b2", Shape{e_, d_}, total_, first_);
  }
  void bind(const ParameterArena<T, B>& arena) {
    w1_ = arena.value(id_w1_); dw1_ = arena.grad(id_w1_);
    if (bias_) {
      b1_ = arena.value(id_b1_); db1_ = arena.grad(id_b1_);
    }
    w2_ = arena.value(id_w2_); dw2_ = arena.grad(id_w2_);
    if (bias_) {
      b2_ = arena.value(id_b2_); db2_ = arena.grad(id_b2_);
    }
    bound_ = true;
  }
  // w ~ N(0, init_std^2), biases 0.
  // A shard draws the whole layer's weights and keeps its own experts, so that every world size
  // starts from the same model for the same seed.
  void init(Rng& rng, double init_std) {
    if (total_ == e_) {
      fill_normal(w1_, rng, init_std);
      fill_normal(w2_, rng, init_std);
    } else {
      init_rows(w1_, Shape{total_, f1(), d_}, rng, init_std);
      init_rows(w2_, Shape{total_, d_, f_}, rng, init_std);
    }
    if (bias_) {
      b1_.zero();
      b2_.zero();
    }
  }
  void set_gelu(GeluForm form) { gelu_ = form; }
  FfnActivation activation() const { return activation_; }
  bool has_bias() const { return bias_; }
  void set_parallelism(ExpertParallelism p) { par_ = p; }
  index_t num_experts() const { return e_; }

  // xs (S, D) grouped by the plan -> ys (S, D). Caches H and A for backward.
  void forward(const DispatchPlan<B>& plan, const Tensor<T, B>& xs, Tensor<T, B>& ys) {
    check_bound("forward");
    const index_t s = xs.rows();
    GRAPHMOE_CHECK(xs.rank() == 2 && xs.cols() == d_ && s == plan.num_slots(), "ExpertBank",
                   "xs has shape ", xs.shape(), ", expected (", plan.num_slots(), ", ", d_, ")");
    prepare_output("ExpertBank", "ys", ys, xs.shape());
    if (h_.empty() || h_.rows() != s) {
      h_ = Tensor<T, B>(Shape{s, f1()});
      a_ = Tensor<T, B>(Shape{s, f_});
    }
    xc_ = to_compute(xs, xc_);
    if constexpr (!std::is_same_v<C, T>) {
      if (mirror_ != nullptr) {
        mirror_->ensure_current();
        w1c_ = mirror_->value(id_w1_);
        w2c_ = mirror_->value(id_w2_);
      }
    }
    if (mirror_ == nullptr) {
      w1c_ = to_compute(w1_, w1c_);
      w2c_ = to_compute(w2_, w2c_);
    }
    if constexpr (!std::is_same_v<C, T>) {
      if (ac_.empty() || ac_.rows() != s) ac_ = Tensor<C, B>(Shape{s, f_});
    }
    expert_ffn_forward(plan, tensors(), form(), par_, ys);
    if (plan.num_experts > e_) {  // drop bucket
      const index_t r0 = plan.offset(e_), r1 = plan.offset(plan.num_experts);
      if (r1 > r0) ys.slice(r0, r1).zero();
    }
  }

  // dys (S, D) -> dxs (S, D) assigned; parameter gradients accumulated.
  void backward(const DispatchPlan<B>& plan, const Tensor<T, B>& xs, const Tensor<T, B>& dys,
                Tensor<T, B>& dxs) {
    check_bound("backward");
    check_shape("ExpertBank::backward", "dys", dys, xs.shape());
    prepare_output("ExpertBank::backward", "dxs", dxs, xs.shape());
    if (plan.num_experts > e_) {
      const index_t r0 = plan.offset(e_), r1 = plan.offset(plan.num_experts);
      if (r1 > r0) dxs.slice(r0, r1).zero();
    }
    // scratch kept between steps (allocated, and zero-filled, only when the slot count changes)
    if (dh_.empty() || dh_.rows() != xs.rows()) {
      dh_ = Tensor<T, B>(Shape{xs.rows(), f1()});
      if constexpr (!std::is_same_v<C, T>) dhc_ = Tensor<C, B>(Shape{xs.rows(), f1()});
      if (activation_ == FfnActivation::SwiGLU) da_ = Tensor<T, B>(Shape{xs.rows(), f_});
    }
    dyc_ = to_compute(dys, dyc_);
    expert_ffn_backward(plan, tensors(), form(), par_, dys, dyc_, dxs, dh_, dhc_);
  }

  // w1, w2 in C read from mirror (of the arena this bank is bound to) from the next forward on;
  // nullptr: converted per forward again. C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    static_assert(!std::is_same_v<C, T>,
                  "graphmoe::ExpertBank::attach_mirror: C = T has no mirror");
    mirror_ = mirror;
    w1c_ = Tensor<C, B>();  // never convert into the mirror's storage
    w2c_ = Tensor<C, B>();
  }

  index_t total_experts() const { return total_; }
  index_t first_expert() const { return first_; }
  const Tensor<T, B>& w1() const { return w1_; }
  const Tensor<T, B>& w2() const { return w2_; }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "ExpertBank", op); }
  void set_activation(FfnActivation activation, bool bias) {
    GRAPHMOE_CHECK(activation == FfnActivation::Gelu || activation == FfnActivation::SwiGLU,
                   "ExpertBank", "unknown FfnActivation ", static_cast<int>(activation));
    activation_ = activation;
    bias_ = bias;
  }
  // The first projection's rows per expert: F (GELU) or 2F (SwiGLU's gate | up).
  index_t f1() const { return ffn_first_width(activation_) * f_; }
  FfnActivationForm form() const { return FfnActivationForm(activation_, gelu_); }
  void init_rows(const Tensor<T, B>& local, const Shape& full, Rng& rng, double init_std) {
    Tensor<T, cpu> all(full);
    fill_normal(all, rng, init_std);
    const index_t per = full.numel() / total_;
    copy_from_host(local, Tensor<T, cpu>::borrow(all.data() + first_ * per, local.shape()));
  }
  // src as the compute type: src itself when C = T, else converted into cache (reallocated when
  // its shape differs) and the cache returned.
  static Tensor<C, B> to_compute(const Tensor<T, B>& src, Tensor<C, B> cache) {
    if constexpr (std::is_same_v<C, T>) {
      return src;
    } else {
      if (cache.empty() || cache.shape() != src.shape()) cache = Tensor<C, B>(src.shape());
      convert(src, cache);
      return cache;
    }
  }
  // Handles of the bank's tensors for the expert FFN op.
  ExpertFfn<T, C, B> tensors() const {
    ExpertFfn<T, C, B> f;
    f.num_experts = e_;
    f.w1 = w1c_;
    f.w2 = w2c_;
    f.b1 = b1_;
    f.b2 = b2_;
    f.dw1 = dw1_;
    f.dw2 = dw2_;
    f.db1 = db1_;
    f.db2 = db2_;
    f.h = h_;
    f.a = a_;
    f.xc = xc_;
    f.ac = ac_;
    f.da = da_;
    return f;
  }

  index_t total_ = 0, first_ = 0;  // the layer's experts, this bank's first (expert parallel)
  index_t e_ = 0, d_ = 0, f_ = 0;
  index_t id_w1_ = -1, id_b1_ = -1, id_w2_ = -1, id_b2_ = -1;
  Tensor<T, B> w1_, dw1_, b1_, db1_, w2_, dw2_, b2_, db2_;
  Tensor<T, B> h_, a_;  // forward cache (S, F1), (S, F); F1 = F (GELU) or 2F (SwiGLU)
  // The GEMM operands in the compute type C (with C = T, handles of the tensors themselves).
  Tensor<C, B> xc_, w1c_, w2c_, ac_;
  ComputeMirror<T, C, B>* mirror_ = nullptr;  // C != T: w1, w2 in C from here when set
  // Backward scratch (S, F1): dh, its compute-type copy and dy's (C = T: dhc_ stays empty); da_
  // (S, F): SwiGLU's dy w2 (empty with GELU)
  Tensor<T, B> dh_, da_;
  Tensor<C, B> dhc_, dyc_;
  GeluForm gelu_ = GeluForm::Tanh;
  FfnActivation activation_ = FfnActivation::Gelu;
  bool bias_ = true;  // b1, b2 declared
  ExpertParallelism par_ = ExpertParallelism::WithinGemm;
};

}  // namespace graphmoe
