// graphmoe/core/gemm_shape.hpp: the checks of a product C = alpha op(A) op(B) + beta C and its
// (m, n, k), shared by the gemm op (ops/gemm.hpp) and the backends' batched products that check
// each problem as gemm does (backend/cuda/grouped.cuh): one set of messages, naming "gemm".
#pragma once

#include "graphmoe/config.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/trans.hpp"

namespace graphmoe::detail {

// A and B non-empty of rank >= 1 with matching inner dimensions; an empty C is allocated as
// (m, n) (new_output) and beta then set to +0; a given C must be (m, n).
template <class TA, class TC, class S, class Bk>
void gemm_prepare(Trans ta, Trans tb, const Tensor<TA, Bk>& A, const Tensor<TA, Bk>& B,
                  Tensor<TC, Bk>& C, S& beta, index_t& m, index_t& n, index_t& k) {
  GRAPHMOE_CHECK(!A.empty() && !B.empty(), "gemm", "A or B is empty");
  GRAPHMOE_CHECK(A.rank() >= 1 && B.rank() >= 1, "gemm", "A and B must have rank >= 1, got ",
                 A.shape(), " and ", B.shape());
  m = ta == Trans::N ? A.rows() : A.cols();
  k = ta == Trans::N ? A.cols() : A.rows();
  const index_t kb = tb == Trans::N ? B.rows() : B.cols();
  n = tb == Trans::N ? B.cols() : B.rows();
  GRAPHMOE_CHECK(k == kb, "gemm", "inner dimensions differ: op(A) is (", m, ", ", k,
                 ") from A ", A.shape(), (ta == Trans::T ? " transposed" : ""), ", op(B) is (", kb,
                 ", ", n, ") from B ", B.shape(), (tb == Trans::T ? " transposed" : ""));
  if (C.empty()) {
    C = new_output<TC, Bk>(Shape{m, n});  // beta = 0: C is not read
    beta = S{};  // +0 (value-initialised, for the 16-bit types too)
  }
  GRAPHMOE_CHECK(C.rows() == m && C.cols() == n, "gemm", "C has shape ", C.shape(),
                 ", expected ", m, " rows and ", n, " columns for A ", A.shape(), " and B ",
                 B.shape());
}

}  // namespace graphmoe::detail
