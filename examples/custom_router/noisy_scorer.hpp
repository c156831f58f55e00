// custom_router/noisy_scorer.hpp: noisy top-k gating (Shazeer et al. 2017, "Outrageously Large
// Neural Networks"), written as a graphmoe scorer policy outside namespace graphmoe.
//
//   h_g   = u W_g^T                      (N, E)   W_g: (E, D), "<prefix>w_gate"
//   h_n   = u W_n^T                      (N, E)   W_n: (E, D), "<prefix>w_noise"
//   gamma = h_g + eps o softplus(h_n)    (N, E)   eps ~ N(0, 1) per entry
//
// The router then applies r = softmax(gamma). eps is drawn from a graphmoe::Rng the scorer owns,
// seeded from the model's Rng in init(). Two public switches:
//
//   resample = true   draw a fresh eps at every forward (training). false: reuse the eps of the
//                     previous forward, so that gamma is a deterministic function of u, W_g and W_n
//                     (a finite-difference gradient check needs that). If there is no previous eps
//                     of the right shape (first forward, or N changed), one is drawn anyway.
//   noisy = true      false: gamma = h_g, no noise (evaluation, as in the paper). The model sets
//                     it through the policy's set_mode hook: model.set_mode(graphmoe::Mode::Eval)
//                     turns the noise off in every layer, Mode::Train back on.
//
// Backward, with dgamma given:
//   dW_g += dgamma^T u
//   dh_n  = dgamma o eps o sigmoid(h_n)          (softplus' = sigmoid)
//   dW_n += dh_n^T u
//   du   += dgamma W_g + dh_n W_n
// It uses the eps and h_n of the last forward (which must have been called with the same u).
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>

#include <graphmoe/graphmoe.hpp>

namespace custom_router {

// The policy's options (NoisyScorer::Options), defined before the implementation that reads them.
struct NoisyScorerOptions {
  double init_std = 0.02;  // W_g, W_n ~ N(0, init_std^2)
  void validate() const {
    GRAPHMOE_USER_CHECK(init_std >= 0, "NoisyScorer::Options", "init_std must be >= 0, got ", init_std);
  }
};
// CPU only (the loops below read tensors on the host).
template <class T, class B>
  requires std::same_as<B, graphmoe::cpu>
class NoisyScorerImpl {
 public:
  using Tensor = graphmoe::Tensor<T, B>;
  using index_t = graphmoe::index_t;

  bool resample = true;  // see the header comment
  bool noisy = true;

  // defined below NoisyScorer, whose options it reads
  void declare(graphmoe::ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               const graphmoe::RouterConfig& cfg);
  void bind(const graphmoe::ParameterArena<T, B>& arena) {
    w_gate_ = arena.value(id_gate_);
    dw_gate_ = arena.grad(id_gate_);
    w_noise_ = arena.value(id_noise_);
    dw_noise_ = arena.grad(id_noise_);
  }
  void init(graphmoe::Rng& rng) {
    graphmoe::fill_normal(w_gate_, rng, init_std_);
    graphmoe::fill_normal(w_noise_, rng, init_std_);
    // the noise stream: its own Rng, seeded from two words of the model's
    const std::uint64_t hi = rng.next_u32(), lo = rng.next_u32();
    noise_rng_ = graphmoe::Rng((hi << 32) | lo);
    eps_ = Tensor();
  }

  // The model's train / eval mode (graphmoe/core/mode.hpp): noise in training only.
  void set_mode(graphmoe::Mode mode) { noisy = mode == graphmoe::Mode::Train; }

  void forward(const Tensor& u, Tensor& gamma) {
    using graphmoe::Trans;
    gamma = Tensor();
    graphmoe::gemm(Trans::N, Trans::T, T(1), u, w_gate_, T(0), gamma);  // h_g (N, E)
    if (!noisy) {
      h_noise_ = Tensor();
      return;
    }
    h_noise_ = Tensor();
    graphmoe::gemm(Trans::N, Trans::T, T(1), u, w_noise_, T(0), h_noise_);  // h_n (N, E)
    if (resample || eps_.shape() != gamma.shape()) {
      eps_ = Tensor(gamma.shape());
      graphmoe::fill_normal(eps_, noise_rng_, 1.0);
    }
    for (index_t i = 0; i < gamma.numel(); ++i)
      gamma.data()[i] += eps_.data()[i] * softplus(h_noise_.data()[i]);
  }

  void backward(const Tensor& u, const Tensor& dgamma, Tensor& du) {
    using graphmoe::Trans;
    // gamma = u W_g^T: du += dgamma W_g, dW_g += dgamma^T u
    graphmoe::gemm_backward(Trans::N, Trans::T, T(1), u, w_gate_, dgamma, T(1), du, T(1),
                            dw_gate_);
    if (!noisy) return;
    Tensor dh(dgamma.shape());
    for (index_t i = 0; i < dh.numel(); ++i)
      dh.data()[i] = dgamma.data()[i] * eps_.data()[i] * sigmoid(h_noise_.data()[i]);
    graphmoe::gemm_backward(Trans::N, Trans::T, T(1), u, w_noise_, dh, T(1), du, T(1), dw_noise_);
  }

  // The noise of the last forward (N, E) (empty when noisy is false).
  const Tensor& noise() const { return eps_; }
  const Tensor& w_gate() const { return w_gate_; }
  const Tensor& w_noise() const { return w_noise_; }

  // log(1 + e^x) without overflow, and its derivative.
  static T softplus(T x) { return x > T(0) ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }
  static T sigmoid(T x) {
    if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
    const T e = std::exp(x);
    return e / (T(1) + e);
  }

 private:
  double init_std_ = 0.02;
  index_t id_gate_ = -1, id_noise_ = -1;
  Tensor w_gate_, dw_gate_, w_noise_, dw_noise_;
  graphmoe::Rng noise_rng_;
  Tensor eps_, h_noise_;  // forward cache
};

struct NoisyScorer {
  static constexpr const char* name = "noisy";
  using Options = NoisyScorerOptions;  // cfg.options<NoisyScorer>().init_std = 0.05
  template <class T, class B>
  using impl = NoisyScorerImpl<T, B>;
};

template <class T, class B>
  requires std::same_as<B, graphmoe::cpu>
void NoisyScorerImpl<T, B>::declare(graphmoe::ParameterArena<T, B>& arena,
                                    const std::string& prefix, index_t d_model,
                                    const graphmoe::RouterConfig& cfg) {
  const NoisyScorer::Options& opts = cfg.options<NoisyScorer>();
  opts.validate();
  init_std_ = opts.init_std;
  id_gate_ = arena.add(prefix + "w_gate", graphmoe::Shape{cfg.num_experts, d_model});
  id_noise_ = arena.add(prefix + "w_noise", graphmoe::Shape{cfg.num_experts, d_model});
}

}  // namespace custom_router
