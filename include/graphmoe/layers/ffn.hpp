// graphmoe/layers/ffn.hpp: the dense feed-forward block, D -> d_ff -> D with GELU or SwiGLU (layer
// contract in linear.hpp). C (default T): the two Linear layers' GEMM compute type (linear.hpp).
//
//   GELU:    y = fc2(gelu(fc1(x)))                 fc1 (F, D)
//   SwiGLU:  y = fc2(silu(g) * u), [g | u] = fc1(x)  fc1 (2F, D): its first F rows the gate
//            projection, its last F rows the up projection (core/ffn_activation.hpp); fc2 (D, F)
// bias (declare): fc1 and fc2 with or without their bias vectors (Llama-family MLPs have none).
#pragma once

#include <string>

#include "graphmoe/core/ffn_activation.hpp"
#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/ops/swiglu.hpp"
#include "graphmoe/layers/linear.hpp"

namespace graphmoe {

template <class T, class B = cpu, class C = T>
class FeedForward {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               index_t d_ff, GeluForm gelu = GeluForm::Tanh,
               FfnActivation activation = FfnActivation::Gelu, bool bias = true) {
    GRAPHMOE_CHECK(activation == FfnActivation::Gelu || activation == FfnActivation::SwiGLU,
                   "FeedForward", "unknown FfnActivation ", static_cast<int>(activation));
    gelu_ = gelu;
    activation_ = activation;
    fc1_.declare(arena, prefix + "fc1.", d_model, ffn_first_width(activation) * d_ff, bias);
    fc2_.declare(arena, prefix + "fc2.", d_ff, d_model, bias);
  }
  void bind(const ParameterArena<T, B>& arena) {
    fc1_.bind(arena);
    fc2_.bind(arena);
    bound_ = true;
  }
  // fc1 and fc2 read their C weights from mirror (Linear::attach_mirror). C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    fc1_.attach_mirror(mirror);
    fc2_.attach_mirror(mirror);
  }
  void init(Rng& rng, double stddev, double out_scale = 1.0) {
    fc1_.init(rng, stddev);
    fc2_.init(rng, stddev * out_scale);
  }
  FfnActivation activation() const { return activation_; }
  // x (N, D) -> y (N, D)
  void forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
    check_bound("forward");
    h_ = Tensor<T, B>();
    a_ = Tensor<T, B>();
    fc1_.forward(x, h_);
    if (activation_ == FfnActivation::SwiGLU)
      swiglu_forward(h_, a_);
    else
      gelu_forward(gelu_, h_, a_);
    fc2_.forward(a_, y);
  }
  void backward(const Tensor<T, B>& dy, Tensor<T, B>& dx) {
    check_bound("backward");
    Tensor<T, B> da(a_.shape());
    fc2_.backward(dy, &da);
    Tensor<T, B> dh;
    if (activation_ == FfnActivation::SwiGLU) {
      dh = Tensor<T, B>(h_.shape());
      swiglu_backward(h_, da, dh);
    } else {
      gelu_backward(gelu_, h_, da, da);
      dh = da;
    }
    prepare_output("FeedForward::backward", "dx", dx, Shape{h_.rows(), fc1_.in()});
    fc1_.backward(dh, &dx);
  }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "FeedForward", op); }
  GeluForm gelu_ = GeluForm::Tanh;
  FfnActivation activation_ = FfnActivation::Gelu;
  Linear<T, B, C> fc1_, fc2_;
  Tensor<T, B> h_, a_;  // forward cache: fc1's output (N, F or 2F) and the activation (N, F)
};

}  // namespace graphmoe
