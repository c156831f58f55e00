// graphmoe/core/expert_ffn.hpp: the tensors of a bank of expert FFNs as the expert FFN op reads and
// writes them (ops/experts.hpp), and how the CPU spreads the experts over its threads.
//
// F below is the hidden width d_ff and F1 the first projection's rows per expert: F with GELU,
// 2F with SwiGLU (gate rows, then up rows; core/ffn_activation.hpp). The biases are optional:
// empty b1, b2 (and db1, db2) mean an FFN without them.
#pragma once

#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/ffn_activation.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// How the expert GEMMs use the threads (see docs/benchmarks.md for the measurement). The CPU
// backend's schedule; other backends ignore it.
enum class ExpertParallelism {
  WithinGemm,    // experts one after another, each GEMM multi-threaded
  AcrossExperts  // experts spread over the threads, each GEMM single-threaded
};

// Handles of the tensors of E experts (layers/expert_bank.hpp owns them), T the parameter and
// activation type and C the GEMM compute type (T, or a 16-bit type on the GPU):
template <class T, class C, class B>
struct ExpertFfn {
  index_t num_experts = 0;    // E; plan experts >= E (the capacity-drop bucket) are skipped
  Tensor<C, B> w1, w2;        // (E, F1, D), (E, D, F): the weights in the compute type
  Tensor<T, B> b1, b2;        // (E, F1), (E, D), or both empty (no biases)
  Tensor<T, B> dw1, dw2;      // the weights' gradients (accumulated)
  Tensor<T, B> db1, db2;      // the biases' gradients (accumulated; empty without biases)
  Tensor<T, B> h;             // (S, F1): forward cache, the first projection (+ b1)
  Tensor<T, B> a;             // (S, F): forward cache, the activation gelu(h) or swiglu(h)
  Tensor<C, B> xc;            // (S, D): xs in the compute type (xs itself when C = T)
  Tensor<C, B> ac;            // (S, F): a in the compute type (empty when C = T)
  Tensor<T, B> da;            // (S, F): SwiGLU's backward scratch dy w2 (empty with GELU)
};

namespace detail {
// fn(e, r0, r1) for every expert e < num_experts whose rows [r0, r1) of the plan are not empty,
// in expert order.
template <class B, class Fn>
void for_each_expert_rows(const DispatchPlan<B>& plan, index_t num_experts, Fn&& fn) {
  for (index_t e = 0; e < num_experts; ++e) {
    const index_t r0 = plan.offset(e), r1 = plan.offset(e + 1);
    if (r1 > r0) fn(e, r0, r1);
  }
}
}  // namespace detail

}  // namespace graphmoe
