// graphmoe/core/trans.hpp: the transpose flag of gemm, op(X) = X (Trans::N) or X^T (Trans::T).
//
// Its own header so that every backend's gemm (and nvcc translation units, which must not see
// Eigen) can take it without including another backend.
#pragma once

namespace graphmoe {

enum class Trans { N, T };

}  // namespace graphmoe
