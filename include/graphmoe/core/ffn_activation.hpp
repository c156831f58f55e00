// graphmoe/core/ffn_activation.hpp: the activation of a feed-forward network (the dense
// FeedForward, layers/ffn.hpp, and the experts, layers/expert_bank.hpp), and the form the expert
// FFN op takes it in (ops/experts.hpp).
//
//   Gelu:    y = gelu(x W1^T + b1) W2^T + b2                 W1 (F, D): one projection D -> F
//   SwiGLU:  y = (silu(x Wg^T) * (x Wu^T)) W2^T (+ biases)   the gate and up projections fused
//            into one weight W1 = [Wg; Wu] of 2F rows (the first F the gate Wg, the last F the up
//            projection Wu), so h = x W1^T is (rows, 2F) and a = swiglu(h) = silu(h[:, :F]) *
//            h[:, F:] is (rows, F) (ops/swiglu.hpp); W2 (D, F) as with GELU. The MLP of Llama,
//            Mixtral, Qwen, OLMoE and DeepSeek (which have no biases: the layers' bias flag).
#pragma once

#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/core/gelu.hpp"

namespace graphmoe {

enum class FfnActivation { Gelu, SwiGLU };

inline constexpr EnumName<FfnActivation> kFfnActivationNames[] = {{FfnActivation::Gelu, "gelu"},
                                                                  {FfnActivation::SwiGLU, "swiglu"}};
inline const char* ffn_activation_name(FfnActivation a) { return name_of(kFfnActivationNames, a); }
inline FfnActivation ffn_activation_from_name(std::string_view s) {
  return value_of("ffn_activation_from_name", "activation", kFfnActivationNames, s);
}

// How many rows the first projection has per hidden unit: 1 (GELU), 2 (SwiGLU: gate | up).
inline constexpr int ffn_first_width(FfnActivation a) { return a == FfnActivation::SwiGLU ? 2 : 1; }

// The expert FFN op's activation: the kind, and GELU's form (read with Gelu only). Converts from
// a GeluForm alone (the GELU activation of that form).
struct FfnActivationForm {
  FfnActivation activation = FfnActivation::Gelu;
  GeluForm gelu = GeluForm::Tanh;
  constexpr FfnActivationForm() = default;
  constexpr FfnActivationForm(GeluForm g) : gelu(g) {}  // NOLINT: implicit, GELU of form g
  constexpr FfnActivationForm(FfnActivation a, GeluForm g = GeluForm::Tanh)
      : activation(a), gelu(g) {}
  constexpr bool swiglu() const { return activation == FfnActivation::SwiGLU; }
};

}  // namespace graphmoe
