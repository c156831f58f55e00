// graphmoe/layers/ffn.hpp: the dense feed-forward block, D -> d_ff -> D with GELU (layer contract
// in linear.hpp). C (default T): the two Linear layers' GEMM compute type (linear.hpp).
#pragma once

#include <string>

#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/layers/linear.hpp"

namespace graphmoe {

template <class T, class B = cpu, class C = T>
class FeedForward {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               index_t d_ff, GeluForm gelu = GeluForm::Tanh) {
    gelu_ = gelu;
    fc1_.declare(arena, prefix + "fc1.", d_model, d_ff);
    fc2_.declare(arena, prefix + "fc2.", d_ff, d_model);
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
  // x (N, D) -> y (N, D)
  void forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
    check_bound("forward");
    h_ = Tensor<T, B>();
    a_ = Tensor<T, B>();
    fc1_.forward(x, h_);
    gelu_forward(gelu_, h_, a_);
    fc2_.forward(a_, y);
  }
  void backward(const Tensor<T, B>& dy, Tensor<T, B>& dx) {
    check_bound("backward");
    Tensor<T, B> da(a_.shape());
    fc2_.backward(dy, &da);
    gelu_backward(gelu_, h_, da, da);
    prepare_output("FeedForward::backward", "dx", dx, Shape{h_.rows(), fc1_.in()});
    fc1_.backward(da, &dx);
  }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "FeedForward", op); }
  GeluForm gelu_ = GeluForm::Tanh;
  Linear<T, B, C> fc1_, fc2_;
  Tensor<T, B> h_, a_;
};

}  // namespace graphmoe
