// graphmoe/ops/experts.hpp: E expert FFNs (D -> F -> D, GELU) over the rows that a dispatch plan
// grouped by expert (ops/dispatch.hpp), with the tensors of core/expert_ffn.hpp.
//
//   forward:   for each expert e < E and its rows [r0, r1) = [offset(e), offset(e + 1)) of xs:
//                H_e = X_e w1_e^T + b1_e,  A_e = gelu(H_e),  Y_e = A_e w2_e^T + b2_e
//              with X = f.xc (xs in the compute type); H and A are written to f.h and f.a (the
//              forward cache; f.ac too when C != T), Y to ys.
//   backward:  dxs's expert rows assigned (dX_e = dH_e w1_e), the parameter gradients f.dw1,
//              f.db1, f.dw2, f.db2 accumulated; dyc is dys in the compute type, dh (S, F) and
//              dhc (S, F when C != T) are scratch.
// Rows of experts >= E (the plan's capacity-drop bucket) are left untouched: the caller zeroes
// them. Never a dense all-experts pass: each expert's GEMMs read its rows only.
//
// Backends: the CPU runs the experts one after another or across the threads (ExpertParallelism,
// backend/cpu/experts.hpp); the GPU runs each step for all experts at once (grouped GEMMs,
// backend/cuda/grouped.cuh) and ignores ExpertParallelism. The op layer checks the plan here,
// then calls expert_ffn_forward(B{}, ...) / expert_ffn_backward(B{}, ...).
#pragma once

#include "graphmoe/backend/cpu/experts.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/expert_ffn.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/dispatch.hpp"

namespace graphmoe {

namespace detail {
template <class T, class C, class B>
void check_expert_ffn(const char* op, const DispatchPlan<B>& plan, const ExpertFfn<T, C, B>& f) {
  check_plan(op, plan);
  GRAPHMOE_CHECK(f.num_experts >= 1 && f.num_experts <= plan.num_experts, op, "the bank's ",
                 f.num_experts, " experts do not fit the plan's ", plan.num_experts);
}
}  // namespace detail

// ys (S, D) with S = plan.num_slots(), allocated by the caller; see the contract above.
template <class T, class C, Backend B>
void expert_ffn_forward(const DispatchPlan<B>& plan, const ExpertFfn<T, C, B>& f, GeluForm gelu,
                        ExpertParallelism par, Tensor<T, B>& ys) {
  constexpr const char* op = "expert_ffn_forward";
  detail::check_expert_ffn(op, plan, f);
  check_shape(op, "h", f.h, Shape{plan.num_slots(), f.h.cols()});
  check_shape(op, "ys", ys, Shape{plan.num_slots(), ys.cols()});
  expert_ffn_forward(B{}, plan, f, gelu, par, ys);
}

template <class T, class C, Backend B>
void expert_ffn_backward(const DispatchPlan<B>& plan, const ExpertFfn<T, C, B>& f, GeluForm gelu,
                         ExpertParallelism par, const Tensor<T, B>& dys, const Tensor<C, B>& dyc,
                         Tensor<T, B>& dxs, Tensor<T, B>& dh, Tensor<C, B>& dhc) {
  constexpr const char* op = "expert_ffn_backward";
  detail::check_expert_ffn(op, plan, f);
  check_shape(op, "dys", dys, Shape{plan.num_slots(), dys.cols()});
  check_shape(op, "dxs", dxs, dys.shape());
  check_shape(op, "dh", dh, f.h.shape());
  expert_ffn_backward(B{}, plan, f, gelu, par, dys, dyc, dxs, dh, dhc);
}

}  // namespace graphmoe
