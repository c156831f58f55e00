// graphmoe/backend/cuda/experts.cuh: the expert FFNs over the dispatched rows on the GPU (contract
// and argument checks: ops/experts.hpp, which calls these through the backend tag).
//
// The same math as the CPU's per-expert loop with every step for all experts at once: grouped
// GEMMs over the experts' row blocks, one bias / GELU / conversion launch over all their rows
// (backend/cuda/grouped.cuh), so that the launches per layer do not grow with E. ExpertParallelism
// (a CPU schedule) is ignored.
//
// Compute type C: T, or __nv_bfloat16 / __half with T = float (mixed precision): the GEMMs read
// C, accumulate in fp32 and write fp32, so bias, GELU and every reduction stay fp32; the
// activations A are converted to C once per forward (into ac), dh once per backward (into dhc).
#pragma once

#include <tuple>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/grouped.cuh"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/expert_ffn.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {
namespace detail {

// One grouped GEMM over the experts with rows: C_e = op(A_e) op(B_e) + beta C_e, where
// operands(e, r0, r1) returns (A_e, B_e, C_e) for expert e's rows [r0, r1).
template <class T, class C, class Operands>
void expert_gemm(const DispatchPlan<cuda>& plan, index_t num_experts, Trans ta, Trans tb, T beta,
                 Operands&& operands) {
  std::vector<Tensor<C, cuda>> lhs, rhs;
  std::vector<Tensor<T, cuda>> out;
  for_each_expert_rows(plan, num_experts, [&](index_t e, index_t r0, index_t r1) {
    auto [a, b, c] = operands(e, r0, r1);
    lhs.push_back(a);
    rhs.push_back(b);
    out.push_back(c);
  });
  grouped_gemm(ta, tb, T(1), lhs, rhs, beta, out);
}

// A's rows [r0, r1) as the compute type (converted into f.ac when C != T).
template <class T, class C>
Tensor<C, cuda> expert_compute_rows(const ExpertFfn<T, C, cuda>& f, const Tensor<T, cuda>& a,
                                    index_t r0, index_t r1) {
  if constexpr (std::is_same_v<C, T>) {
    return a;
  } else {
    Tensor<C, cuda> dst = f.ac.slice(r0, r1);
    convert(a, dst);
    return dst;
  }
}

}  // namespace detail

// The forward for all experts at once (rows of the drop bucket untouched).
template <class T, class C>
void expert_ffn_forward(cuda, const DispatchPlan<cuda>& plan, const ExpertFfn<T, C, cuda>& f,
                        GeluForm gelu, ExpertParallelism, Tensor<T, cuda>& ys) {
  const index_t e_ = f.num_experts;
  const index_t rows = plan.offset(e_);  // the experts' slots; the drop bucket follows
  if (rows == 0) return;
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::T, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{f.xc.slice(r0, r1), f.w1[e], f.h.slice(r0, r1)};  // H_e = X_e w1_e^T
  });
  Tensor<T, cuda> h = f.h.slice(0, rows), a = f.a.slice(0, rows);
  add_expert_rows(f.b1, plan, h);
  gelu_forward(gelu, h, a);
  const Tensor<C, cuda> ac = detail::expert_compute_rows(f, a, 0, rows);
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::T, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{ac.slice(r0, r1), f.w2[e], ys.slice(r0, r1)};  // Y_e = A_e w2_e^T
  });
  add_expert_rows(f.b2, plan, ys.slice(0, rows));
}

// The backward for all experts at once, grouped like the forward.
template <class T, class C>
void expert_ffn_backward(cuda, const DispatchPlan<cuda>& plan, const ExpertFfn<T, C, cuda>& f,
                         GeluForm gelu, ExpertParallelism, const Tensor<T, cuda>& dys,
                         const Tensor<C, cuda>& dyc_all, Tensor<T, cuda>& dxs,
                         Tensor<T, cuda>& dh_all, Tensor<C, cuda>& dhc_all) {
  const index_t e_ = f.num_experts;
  const index_t rows = plan.offset(e_);
  if (rows == 0) return;
  Tensor<C, cuda> ac_all;
  if constexpr (std::is_same_v<C, T>) {
    ac_all = f.a;
  } else {
    ac_all = f.ac;
  }
  // y = a w2^T + b2
  accumulate_expert_column_sums(dys.slice(0, rows), plan, f.db2);
  detail::expert_gemm<T, C>(plan, e_, Trans::T, Trans::N, T(1), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dyc_all.slice(r0, r1), ac_all.slice(r0, r1), f.dw2[e]};  // dw2 += dy^T a
  });
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::N, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dyc_all.slice(r0, r1), f.w2[e], dh_all.slice(r0, r1)};  // da = dy w2
  });
  Tensor<T, cuda> dh = dh_all.slice(0, rows);
  gelu_backward(gelu, f.h.slice(0, rows), dh, dh);  // dh = gelu'(h) da
  accumulate_expert_column_sums(dh, plan, f.db1);
  Tensor<C, cuda> dhc;
  if constexpr (std::is_same_v<C, T>) {
    dhc = dh_all;
  } else {
    dhc = dhc_all;
    Tensor<C, cuda> dst = dhc_all.slice(0, rows);
    convert(dh, dst);
  }
  detail::expert_gemm<T, C>(plan, e_, Trans::T, Trans::N, T(1), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dhc.slice(r0, r1), f.xc.slice(r0, r1), f.dw1[e]};  // dw1 += dh^T x
  });
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::N, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dhc.slice(r0, r1), f.w1[e], dxs.slice(r0, r1)};  // dx = dh w1
  });
}

}  // namespace graphmoe
