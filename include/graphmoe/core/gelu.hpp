// graphmoe/core/gelu.hpp: the form of the GELU activation and the constants of its formulas.
//
// Every backend's gelu takes a GeluForm and evaluates the same formulas with the same constants
// (backend/cpu/gelu.hpp, backend/cuda/detail/nn_functors.hpp); the contract and the argument
// checks are ops/gelu.hpp's.
#pragma once

namespace graphmoe {

// The two usual forms of the GELU activation (ops/gelu.hpp gives both formulas).
enum class GeluForm { Tanh, Erf };

namespace detail {

// The constants of the GELU formulas, shared so that every backend evaluates the same formula.
inline constexpr double kGeluSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
inline constexpr double kGeluInvSqrt2 = 0.70710678118654752440;     // 1 / sqrt(2)
inline constexpr double kGeluInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)
inline constexpr double kGeluCubic = 0.044715;

}  // namespace detail

}  // namespace graphmoe
