// graphmoe/layers/norm.hpp: layer normalisation with a learned gain and bias (layer contract in
// linear.hpp).
#pragma once

#include <string>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/layernorm.hpp"

namespace graphmoe {

template <class T, class B = cpu>
class LayerNorm {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t dim,
               double eps = 1e-5) {
    dim_ = dim;
    eps_ = eps;
    id_g_ = arena.add(prefix + "weight", Shape{dim});
    id_b_ = arena.add(prefix + "bias", Shape{dim});
  }
  void bind(const ParameterArena<T, B>& arena) {
    g_ = arena.value(id_g_);
    dg_ = arena.grad(id_g_);
    b_ = arena.value(id_b_);
    db_ = arena.grad(id_b_);
    bound_ = true;
  }
  void init() {
    fill(g_, T(1));
    b_.zero();
  }
  void forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
    check_bound("forward");
    x_ = x;
    mean_ = Tensor<T, B>();
    rstd_ = Tensor<T, B>();
    layernorm_forward(x, g_, b_, static_cast<T>(eps_), y, mean_, rstd_);
  }
  void backward(const Tensor<T, B>& dy, Tensor<T, B>& dx) {
    check_bound("backward");
    layernorm_backward(x_, g_, mean_, rstd_, dy, dx, dg_, db_);
  }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "LayerNorm", op); }
  index_t dim_ = 0;
  double eps_ = 1e-5;
  index_t id_g_ = -1, id_b_ = -1;
  Tensor<T, B> g_, dg_, b_, db_;
  Tensor<T, B> x_, mean_, rstd_;
};

}  // namespace graphmoe
