// graphmoe/ops/experts.hpp: E expert FFNs (D -> F -> D, GELU or SwiGLU) over the rows that a
// dispatch plan grouped by expert (ops/dispatch.hpp), with the tensors of core/expert_ffn.hpp.
//
//   forward:   for each expert e < E and its rows [r0, r1) = [offset(e), offset(e + 1)) of xs:
//                H_e = X_e w1_e^T + b1_e,  A_e = act(H_e),  Y_e = A_e w2_e^T + b2_e
//              with X = f.xc (xs in the compute type); H and A are written to f.h and f.a (the
//              forward cache; f.ac too when C != T), Y to ys. act (FfnActivationForm,
//              core/ffn_activation.hpp): gelu of its form, H (rows, F); or swiglu, H (rows, 2F)
//              = [gate | up] and A = silu(gate) * up (rows, F). Without biases (f.b1, f.b2
//              empty) the bias adds and their gradients are skipped.
//   backward:  dxs's expert rows assigned (dX_e = dH_e w1_e), the parameter gradients f.dw1,
//              f.db1, f.dw2, f.db2 accumulated; dyc is dys in the compute type, dh (S, F1) and
//              dhc (S, F1 when C != T) are scratch, and with SwiGLU f.da (S, F) too (dA = dY w2).
// Rows of experts >= E (the plan's capacity-drop bucket) are left untouched: the caller zeroes
// them. Never a dense all-experts pass: each expert's GEMMs read its rows only.
//
// Backends: the CPU runs the experts one after another or across the threads (ExpertParallelism,
// backend/cpu/experts.hpp); the GPU runs each step for all experts at once (grouped GEMMs,
// backend/cuda/grouped.cuh) and ignores ExpertParallelism. The op layer checks the plan and the
// activation's widths here, then calls expert_ffn_forward(B{}, ...) / expert_ffn_backward(B{}, ...).
#pragma once

#include "graphmoe/backend/cpu/experts.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/expert_ffn.hpp"
#include "graphmoe/core/ffn_activation.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/dispatch.hpp"

namespace graphmoe {

namespace detail {
template <class T, class C, class B>
void check_expert_ffn(const char* op, const DispatchPlan<B>& plan, const ExpertFfn<T, C, B>& f,
                      FfnActivationForm act) {
  check_plan(op, plan);
  GRAPHMOE_CHECK(f.num_experts >= 1 && f.num_experts <= plan.num_experts, op, "the bank's ",
                 f.num_experts, " experts do not fit the plan's ", plan.num_experts);
  GRAPHMOE_CHECK(act.activation == FfnActivation::Gelu || act.activation == FfnActivation::SwiGLU,
                 op, "unknown FfnActivation ", static_cast<int>(act.activation));
  GRAPHMOE_CHECK(f.b1.empty() == f.b2.empty(), op,
                 "b1 and b2 must both be given or both be empty (no biases)");
  const index_t width = ffn_first_width(act.activation);
  GRAPHMOE_CHECK(f.w2.rank() == 3 && f.h.rank() == 2 && f.h.cols() == width * f.w2.shape()[2],
                 op, "h has shape ", f.h.shape(), " and w2 ", f.w2.shape(), "; ",
                 ffn_activation_name(act.activation), " needs h's columns = ", width,
                 " x w2's last dimension");
}
}  // namespace detail

// ys (S, D) with S = plan.num_slots(), allocated by the caller; see the contract above.
template <class T, class C, Backend B>
void expert_ffn_forward(const DispatchPlan<B>& plan, const ExpertFfn<T, C, B>& f,
                        FfnActivationForm act, ExpertParallelism par, Tensor<T, B>& ys) {
  constexpr const char* op = "expert_ffn_forward";
  detail::check_expert_ffn(op, plan, f, act);
  check_shape(op, "h", f.h, Shape{plan.num_slots(), f.h.cols()});
  check_shape(op, "ys", ys, Shape{plan.num_slots(), ys.cols()});
  expert_ffn_forward(B{}, plan, f, act, par, ys);
}

template <class T, class C, Backend B>
void expert_ffn_backward(const DispatchPlan<B>& plan, const ExpertFfn<T, C, B>& f,
                         FfnActivationForm act, ExpertParallelism par, const Tensor<T, B>& dys,
                         const Tensor<C, B>& dyc, Tensor<T, B>& dxs, Tensor<T, B>& dh,
                         Tensor<C, B>& dhc) {
  constexpr const char* op = "expert_ffn_backward";
  detail::check_expert_ffn(op, plan, f, act);
  check_shape(op, "dys", dys, Shape{plan.num_slots(), dys.cols()});
  check_shape(op, "dxs", dxs, dys.shape());
  check_shape(op, "dh", dh, f.h.shape());
  if (act.swiglu()) check_shape(op, "da", f.da, Shape{f.h.rows(), f.h.cols() / 2});
  expert_ffn_backward(B{}, plan, f, act, par, dys, dyc, dxs, dh, dhc);
}

}  // namespace graphmoe
