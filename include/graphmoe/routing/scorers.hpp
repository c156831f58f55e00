// graphmoe/routing/scorers.hpp: scorer implementations, u (N, D) -> affinity logits gamma (N, E).
//
// The router turns gamma into the expert scores r (in router.hpp): r = softmax(gamma) unless the
// scorer has its own map (routing/concepts.hpp, ScorerMapsScores: SigmoidScorer's sigmoid). Every
// scorer has the same members:
//   declare(arena, prefix, d_model, cfg)   register parameters (options: cfg.options<Policy>())
//   bind(arena)                             take views of values and gradients
//   init(rng)                               initial values
//   forward(u, gamma)                       gamma assigned
//   backward(u, dgamma, du)                 du accumulated (+=), parameter gradients accumulated
// and a scorer with its own map also
//   scores(gamma, r)                        r assigned (N, E)
//   scores_backward(gamma, r, dr, dgamma)   dgamma assigned (N, E)
#pragma once

#include <cmath>
#include <string>
#include <type_traits>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gemm.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

// gamma = u W^T + b (W: (E, D), b: (E)); for FrozenRandomScorer, W is a fixed buffer without bias
// and without gradient (SMoE-Dropout). Policy: LinearScorer, FrozenRandomScorer or SigmoidScorer
// (whose options have the same fields).
template <class T, class B, class Policy>
class LinearScorerBase {
  static constexpr bool kFrozen = std::is_same_v<Policy, FrozenRandomScorer>;

 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    const auto& opts = cfg.options<Policy>();
    init_std_ = opts.init_std;
    if constexpr (kFrozen)
      bias_ = false;
    else
      bias_ = opts.bias;
    id_w_ = arena.add(prefix + "weight", Shape{cfg.num_experts, d_model}, !kFrozen);
    if (bias_) id_b_ = arena.add(prefix + "bias", Shape{cfg.num_experts});
  }
  void bind(const ParameterArena<T, B>& arena) {
    w_ = arena.value(id_w_);
    dw_ = arena.grad(id_w_);
    if (bias_) {
      b_ = arena.value(id_b_);
      db_ = arena.grad(id_b_);
    }
  }
  void init(Rng& rng) {
    fill_normal(w_, rng, init_std_);
    if (bias_) b_.zero();
  }
  // (N, D) -> (N, E)
  void forward(const Tensor<T, B>& u, Tensor<T, B>& gamma) const {
    gemm(Trans::N, Trans::T, T(1), u, w_, T(0), gamma);
    if (bias_) add_row_vector(b_, gamma);
  }
  void backward(const Tensor<T, B>& u, const Tensor<T, B>& dgamma, Tensor<T, B>& du) {
    Tensor<T, B> none;
    Tensor<T, B>& dw = kFrozen ? none : dw_;
    gemm_backward(Trans::N, Trans::T, T(1), u, w_, dgamma, T(1), du, T(1), dw);
    if (bias_) accumulate_column_sums(dgamma, db_);
  }
  const Tensor<T, B>& weight() const { return w_; }

 private:
  double init_std_ = 0.02;
  bool bias_ = true;
  index_t id_w_ = -1, id_b_ = -1;
  Tensor<T, B> w_, dw_, b_, db_;
};

template <class T, class B>
class ScorerImpl<LinearScorer, T, B> : public LinearScorerBase<T, B, LinearScorer> {};
template <class T, class B>
class ScorerImpl<FrozenRandomScorer, T, B> : public LinearScorerBase<T, B, FrozenRandomScorer> {};

// r = sigmoid(gamma), gamma = u W^T (+ b): the scores map of DeepSeek-V3's gate.
template <class T, class B>
class ScorerImpl<SigmoidScorer, T, B> : public LinearScorerBase<T, B, SigmoidScorer> {
 public:
  void scores(const Tensor<T, B>& gamma, Tensor<T, B>& r) const { sigmoid_forward(gamma, r); }
  void scores_backward(const Tensor<T, B>& /*gamma*/, const Tensor<T, B>& r,
                       const Tensor<T, B>& dr, Tensor<T, B>& dgamma) const {
    sigmoid_backward(r, dr, dgamma);
  }
};

// X-MoE: h = u P^T (P: (d, D)), gamma_e = s * <h / |h|, e_e / |e_e|> (expert embeddings e: (E, d)),
// s = 1 / temperature, or with a learnable temperature s = exp(min(t, ln 100)), t a parameter
// initialised to ln(1 / temperature) (Tutel's CosineTopKGate parametrisation).
template <class T, class B>
class ScorerImpl<CosineScorer, T, B> {
 public:
  static constexpr double kNormEps = 1e-6;  // |x| is clamped below at this value

  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    opts_ = cfg.options<CosineScorer>();
    num_experts_ = cfg.num_experts;
    d_model_ = d_model;
    id_p_ = arena.add(prefix + "proj.weight", Shape{opts_.dim, d_model});
    id_e_ = arena.add(prefix + "expert_embeddings", Shape{cfg.num_experts, opts_.dim});
    if (opts_.learnable_temperature) id_t_ = arena.add(prefix + "log_scale", Shape{1});
  }
  void bind(const ParameterArena<T, B>& arena) {
    p_ = arena.value(id_p_);
    dp_ = arena.grad(id_p_);
    e_ = arena.value(id_e_);
    de_ = arena.grad(id_e_);
    if (id_t_ >= 0) {
      t_ = arena.value(id_t_);
      dt_ = arena.grad(id_t_);
    }
  }
  void init(Rng& rng) {
    fill_normal(p_, rng, 1.0 / std::sqrt(static_cast<double>(d_model_)));
    fill_normal(e_, rng, 1.0);
    if (id_t_ >= 0) fill(t_, static_cast<T>(std::log(1.0 / opts_.temperature)));
  }
  T scale() const {
    if (id_t_ < 0) return static_cast<T>(1.0 / opts_.temperature);
    return std::exp(std::min(read_scalar(t_), static_cast<T>(std::log(100.0))));
  }
  void forward(const Tensor<T, B>& u, Tensor<T, B>& gamma) {
    const index_t n = u.rows();
    prepare_output("CosineScorer", "gamma", gamma, Shape{n, num_experts_});
    h_ = Tensor<T, B>();
    gemm(Trans::N, Trans::T, T(1), u, p_, T(0), h_);  // (N, d)
    hn_ = h_.clone();
    hnorm_ = Tensor<T, B>();
    normalize_rows(hn_, hnorm_, static_cast<T>(kNormEps));
    en_ = e_.clone();
    enorm_ = Tensor<T, B>();
    normalize_rows(en_, enorm_, static_cast<T>(kNormEps));
    gemm(Trans::N, Trans::T, scale(), hn_, en_, T(0), gamma);
  }
  // Uses the cache of the last forward (which must have been called with the same u).
  void backward(const Tensor<T, B>& u, const Tensor<T, B>& dgamma, Tensor<T, B>& du) {
    const T s = scale();
    if (id_t_ >= 0 && read_scalar(t_) < static_cast<T>(std::log(100.0))) {
      // d gamma / d t = gamma (s = exp(t)), so dt = sum(dgamma * s * cos)
      Tensor<T, B> cosv;
      gemm(Trans::N, Trans::T, T(1), hn_, en_, T(0), cosv);
      accumulate_dot(dgamma, cosv, s, dt_);
    }
    Tensor<T, B> dhn, den;
    gemm(Trans::N, Trans::N, s, dgamma, en_, T(0), dhn);  // (N, d)
    gemm(Trans::T, Trans::N, s, dgamma, hn_, T(0), den);  // (E, d)
    normalize_rows_backward(hn_, hnorm_, static_cast<T>(kNormEps), dhn);  // dhn becomes dh
    normalize_rows_backward(en_, enorm_, static_cast<T>(kNormEps), den);  // den becomes de
    axpy(T(1), den, de_);
    gemm_backward(Trans::N, Trans::T, T(1), u, p_, dhn, T(1), du, T(1), dp_);
  }

 private:
  CosineScorer::Options opts_;
  index_t num_experts_ = 0;
  index_t d_model_ = 0;
  index_t id_p_ = -1, id_e_ = -1, id_t_ = -1;
  Tensor<T, B> p_, dp_, e_, de_, t_, dt_;
  Tensor<T, B> h_, hn_, hnorm_, en_, enorm_;  // forward cache
};

}  // namespace graphmoe
