// graphmoe/backend/cpu/experts.hpp: the CPU system's expert FFNs over the dispatched rows
// (contract and argument checks: ops/experts.hpp, which calls these through the backend tag).
// The GEMMs, bias adds and activations are the CPU system's own (tag-first) functions on the
// plan's slices, whose shapes the expert bank fixed: nothing is checked again per expert.
//
// One GEMM pair per expert on its rows only. The experts run one after another (each GEMM
// multi-threaded) or across the threads (each GEMM single-threaded), as ExpertParallelism says.
// The compute type is T (ExpertBank refuses another one on the CPU). GELU: gelu between the
// GEMMs; SwiGLU: swiglu of the first GEMM's (rows, 2F) output (backend/cpu/swiglu.hpp), its
// backward through the (rows, F) scratch f.da. Empty biases: no bias add, no bias gradient.
#pragma once

#include "graphmoe/backend/cpu/detail/extern_instances.hpp"
#include "graphmoe/backend/cpu/elementwise.hpp"
#include "graphmoe/backend/cpu/gelu.hpp"
#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/backend/cpu/swiglu.hpp"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/expert_ffn.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {
namespace detail {
template <class Fn>
void for_each_expert_cpu(const DispatchPlan<cpu>& plan, index_t num_experts,
                         ExpertParallelism par, Fn&& fn) {
  auto run = [&](index_t e) {
    const index_t r0 = plan.offset(e), r1 = plan.offset(e + 1);
    if (r1 > r0) fn(e, r0, r1);
  };
  if (par == ExpertParallelism::AcrossExperts) {
    parallel_items(num_experts, run);
  } else {
    for (index_t e = 0; e < num_experts; ++e) run(e);
  }
}
}  // namespace detail

// H_e = X_e w1_e^T + b1_e, A_e = act(H_e), Y_e = A_e w2_e^T + b2_e for each expert's rows.
template <class T>
void expert_ffn_forward(cpu, const DispatchPlan<cpu>& plan, const ExpertFfn<T, T, cpu>& f,
                        FfnActivationForm act, ExpertParallelism par, Tensor<T, cpu>& ys) {
  const bool bias = !f.b1.empty();
  detail::for_each_expert_cpu(plan, f.num_experts, par, [&](index_t e, index_t r0, index_t r1) {
    Tensor<T, cpu> h = f.h.slice(r0, r1), a = f.a.slice(r0, r1), y = ys.slice(r0, r1);
    gemm(cpu{}, Trans::N, Trans::T, T(1), f.xc.slice(r0, r1), f.w1[e], T(0), h);
    if (bias) add_row_vector(cpu{}, f.b1[e], h);
    if (act.swiglu())
      swiglu_forward(cpu{}, h, a);
    else
      gelu_forward(cpu{}, act.gelu, h, a);
    const Tensor<T, cpu> ac = a;
    gemm(cpu{}, Trans::N, Trans::T, T(1), ac, f.w2[e], T(0), y);
    if (bias) add_row_vector(cpu{}, f.b2[e], y);
  });
}

// Each expert's rows: dxs assigned, the parameter gradients accumulated; dh (S, F1) scratch, and
// f.da (S, F) with SwiGLU.
template <class T>
void expert_ffn_backward(cpu, const DispatchPlan<cpu>& plan, const ExpertFfn<T, T, cpu>& f,
                         FfnActivationForm act, ExpertParallelism par, const Tensor<T, cpu>& dys,
                         const Tensor<T, cpu>& dyc_all, Tensor<T, cpu>& dxs,
                         Tensor<T, cpu>& dh_all, Tensor<T, cpu>& /*dhc_all: C = T*/) {
  const bool bias = !f.b1.empty();
  detail::for_each_expert_cpu(plan, f.num_experts, par, [&](index_t e, index_t r0, index_t r1) {
    Tensor<T, cpu> h = f.h.slice(r0, r1), dy = dys.slice(r0, r1), dx = dxs.slice(r0, r1);
    Tensor<T, cpu> dh = dh_all.slice(r0, r1), dw1 = f.dw1[e], dw2 = f.dw2[e];
    const Tensor<T, cpu> dyc = dyc_all.slice(r0, r1), xc = f.xc.slice(r0, r1);
    Tensor<T, cpu> ac = f.a.slice(r0, r1);
    // y = a w2^T + b2
    if (bias) accumulate_column_sums(cpu{}, dy, f.db2[e]);
    gemm(cpu{}, Trans::T, Trans::N, T(1), dyc, ac, T(1), dw2);       // dw2 += dy^T a
    if (act.swiglu()) {
      Tensor<T, cpu> da = f.da.slice(r0, r1);
      gemm(cpu{}, Trans::N, Trans::N, T(1), dyc, f.w2[e], T(0), da);  // da = dy w2
      swiglu_backward(cpu{}, h, da, dh);                       // dh = [dgate | dup]
    } else {
      gemm(cpu{}, Trans::N, Trans::N, T(1), dyc, f.w2[e], T(0), dh);  // da = dy w2 (into dh)
      gelu_backward(cpu{}, act.gelu, h, dh, dh);               // dh = gelu'(h) da
    }
    if (bias) accumulate_column_sums(cpu{}, dh, f.db1[e]);
    Tensor<T, cpu> dhc = dh;
    gemm(cpu{}, Trans::T, Trans::N, T(1), dhc, xc, T(1), dw1);       // dw1 += dh^T x
    gemm(cpu{}, Trans::N, Trans::N, T(1), dhc, f.w1[e], T(0), dx);   // dx = dh w1
  });
}

// This header's float and double instances, for graphmoe/backend/cpu/instances.hpp (M(, T): their
// explicit instantiation; extern before them with GRAPHMOE_EXTERN_CPU_KERNELS).
#define GRAPHMOE_CPU_EXPERTS_INSTANCES(EXTERN, T) \
  EXTERN template void expert_ffn_forward<T>(cpu, const DispatchPlan<cpu>&,                       \
                                             const ExpertFfn<T, T, cpu>&, FfnActivationForm,       \
                                             ExpertParallelism, Tensor<T, cpu>&);                  \
  EXTERN template void expert_ffn_backward<T>(                                                    \
      cpu, const DispatchPlan<cpu>&, const ExpertFfn<T, T, cpu>&, FfnActivationForm,              \
      ExpertParallelism, const Tensor<T, cpu>&, const Tensor<T, cpu>&, Tensor<T, cpu>&,           \
      Tensor<T, cpu>&, Tensor<T, cpu>&);
GRAPHMOE_CPU_EXTERN_INSTANCES(GRAPHMOE_CPU_EXPERTS_INSTANCES)

}  // namespace graphmoe
