// graphmoe/layers/norm.hpp: the normalisation layers (layer contract in linear.hpp):
//   LayerNorm  y = (x - mean) / sqrt(var + eps) * weight + bias      (GPT-2)
//   RMSNorm    y = x / sqrt(mean(x^2) + eps) * weight                (Llama, Mixtral, Qwen, OLMoE,
//                                                                     DeepSeek; ops/rmsnorm.hpp)
//   Norm       either, chosen by NormKind at declare (a model's config field)
#pragma once

#include <string>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/layernorm.hpp"
#include "graphmoe/ops/rmsnorm.hpp"

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

// weight only ("<prefix>weight", initialised to 1), no bias.
template <class T, class B = cpu>
class RMSNorm {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t dim,
               double eps = 1e-6) {
    GRAPHMOE_CHECK(eps > 0 && eps < 1, "RMSNorm", "eps must be in (0, 1), got ", eps);
    eps_ = eps;
    id_w_ = arena.add(prefix + "weight", Shape{dim});
  }
  void bind(const ParameterArena<T, B>& arena) {
    w_ = arena.value(id_w_);
    dw_ = arena.grad(id_w_);
    bound_ = true;
  }
  void init() { fill(w_, T(1)); }
  // x (..., dim) -> y of x's shape
  void forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
    check_bound("forward");
    x_ = x;
    inv_rms_ = Tensor<T, B>();
    rmsnorm_forward(x, w_, eps_, y, inv_rms_);
  }
  // dx assigned (may be dy); the weight's gradient accumulated.
  void backward(const Tensor<T, B>& dy, Tensor<T, B>& dx) {
    check_bound("backward");
    rmsnorm_backward(x_, w_, inv_rms_, dy, dx, dw_);
  }
  const Tensor<T, B>& weight() const { return w_; }

 private:
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "RMSNorm", op); }
  double eps_ = 1e-6;
  index_t id_w_ = -1;
  Tensor<T, B> w_, dw_;
  Tensor<T, B> x_, inv_rms_;
};

enum class NormKind { LayerNorm, RMSNorm };

inline constexpr EnumName<NormKind> kNormKindNames[] = {{NormKind::LayerNorm, "layernorm"},
                                                        {NormKind::RMSNorm, "rmsnorm"}};
inline const char* norm_kind_name(NormKind k) { return name_of(kNormKindNames, k); }
inline NormKind norm_kind_from_name(std::string_view s) {
  return value_of("norm_kind_from_name", "norm", kNormKindNames, s);
}

// LayerNorm or RMSNorm, chosen at declare; the same calls either way.
template <class T, class B = cpu>
class Norm {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t dim, NormKind kind,
               double eps) {
    GRAPHMOE_CHECK(kind == NormKind::LayerNorm || kind == NormKind::RMSNorm, "Norm",
                   static_cast<int>(kind), " is not a NormKind");
    kind_ = kind;
    if (kind_ == NormKind::RMSNorm)
      rms_.declare(arena, prefix, dim, eps);
    else
      ln_.declare(arena, prefix, dim, eps);
  }
  void bind(const ParameterArena<T, B>& arena) {
    if (kind_ == NormKind::RMSNorm) rms_.bind(arena); else ln_.bind(arena);
  }
  void init() {
    if (kind_ == NormKind::RMSNorm) rms_.init(); else ln_.init();
  }
  void forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
    if (kind_ == NormKind::RMSNorm) rms_.forward(x, y); else ln_.forward(x, y);
  }
  void backward(const Tensor<T, B>& dy, Tensor<T, B>& dx) {
    if (kind_ == NormKind::RMSNorm) rms_.backward(dy, dx); else ln_.backward(dy, dx);
  }
  NormKind kind() const { return kind_; }

 private:
  NormKind kind_ = NormKind::LayerNorm;
  LayerNorm<T, B> ln_;
  RMSNorm<T, B> rms_;
};

}  // namespace graphmoe
