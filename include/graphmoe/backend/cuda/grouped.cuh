// graphmoe/backend/cuda/grouped.cuh: the expert bank's ops for all experts at once, on rows
// grouped by expert (a CudaDispatchPlan's slots), so that an MoE layer's launches do not grow
// with the number of experts.
//
//   grouped_gemm(ta, tb, alpha, A[], B[], beta, C[])   C_g = alpha op(A_g) op(B_g) + beta C_g for
//                          every problem g: one cublas<S|D>gemmGroupedBatched / GemmGroupedBatchedEx
//                          call (cuBLAS >= 12.5), else (older cuBLAS, or a type combination it
//                          reports CUBLAS_STATUS_NOT_SUPPORTED for) one gemm per problem
//   add_expert_rows(b, plan, y)            y[s] += b[expert of slot s] for the first y.rows() slots
//   accumulate_expert_column_sums(dy, plan, db)
//                                          db[e] += the column sums of expert e's rows of dy
//                                          (one thread per (e, column), rows in order: the same
//                                          sums on every run)
//
// Slots of the capacity-drop bucket (expert id >= db.rows() / b.rows()) are left alone.
//
// With them, the GPU's expert FFNs over the dispatched rows (contract and argument checks:
// ops/experts.hpp, which calls expert_ffn_forward / expert_ffn_backward through the backend tag):
// the same math as the CPU's per-expert loop (backend/cpu/experts.hpp) with every step for all
// experts at once: grouped GEMMs over the experts' row blocks, one fused bias + activation (+
// conversion) launch over all their rows, so that the launches per layer do not grow with E.
// The activation is GELU, or SwiGLU on the (rows, 2F) gate | up output of the first GEMM (the
// bias of both halves, silu(gate) * up and its conversion in the same one pass; its backward
// reads da = dy w2 from f.da and writes both halves of dh). Without biases (f.b1, f.b2 empty)
// the bias adds and bias gradients are skipped.
// ExpertParallelism (a CPU schedule) is ignored. Compute type C: T, or __nv_bfloat16 / __half
// with T = float (mixed precision): the GEMMs read C, accumulate in fp32 and write fp32, so bias,
// the activation and every reduction stay fp32; the activations A are written in C only (into
// ac: the fp32 a is not written), dh in both (dh for the bias gradient, dhc for the GEMMs).
#pragma once

#include <cublas_v2.h>

#include <climits>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/backend/cuda/dispatch.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/swiglu.cuh"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/expert_ffn.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {
namespace detail {

template <class T>
__global__ void add_expert_rows_kernel(const T* b, const std::int32_t* slot_expert, T* y,
                                       index_t rows, index_t cols, index_t num_experts) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, rows * cols) {
    const index_t e = slot_expert[i / cols];
    if (e < num_experts) y[i] = from_acc<T>(to_acc(y[i]) + to_acc(b[e * cols + i % cols]));
  }
}

template <class T>
__global__ void expert_column_sums_kernel(const T* dy, const std::int32_t* offsets, T* db,
                                          index_t num_experts, index_t cols) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, num_experts * cols) {
    const index_t e = i / cols, c = i % cols;
    acc_t<T> s = 0;
    for (index_t r = offsets[e]; r < offsets[e + 1]; ++r) s += to_acc(dy[r * cols + c]);
    db[i] = from_acc<T>(to_acc(db[i]) + s);
  }
}

inline void check_expert_rows(const char* op, const char* what, const CudaDispatchPlan& plan,
                              index_t rows, index_t experts) {
  GRAPHMOE_CHECK(rows <= plan.num_slots() && experts <= plan.num_experts, op, what, " covers ",
                 rows, " rows and ", experts, " experts; the plan has ", plan.num_slots(),
                 " slots and ", plan.num_experts, " experts");
}

#if CUBLAS_VERSION >= 120500
#define GRAPHMOE_CUBLAS_GROUPED_GEMM 1
#else
#define GRAPHMOE_CUBLAS_GROUPED_GEMM 0
#endif

// Whether cuBLAS answered CUBLAS_STATUS_NOT_SUPPORTED for grouped GEMMs of these types once (then
// the loop of single GEMMs runs without asking again).
template <class TA, class TC>
bool& grouped_gemm_unsupported() {
  static bool unsupported = false;
  return unsupported;
}

#if GRAPHMOE_CUBLAS_GROUPED_GEMM
// The grouped call for problems already in cuBLAS's column-major terms (see gemm: C^T = op(B)^T
// op(A)^T); `pointers` holds the device arrays of A, B and C pointers, problem by problem.
template <class TA, class TC>
cublasStatus_t cublas_grouped_gemm(cublasHandle_t h, const std::vector<cublasOperation_t>& ta,
                                   const std::vector<cublasOperation_t>& tb,
                                   const std::vector<int>& m, const std::vector<int>& n,
                                   const std::vector<int>& k, const std::vector<int>& lda,
                                   const std::vector<int>& ldb, const std::vector<int>& ldc,
                                   const void* const* a, const void* const* b, void* const* c,
                                   decltype(cublas_scalar(TC{})) alpha,
                                   decltype(cublas_scalar(TC{})) beta) {
  using S = decltype(cublas_scalar(TC{}));
  const int groups = static_cast<int>(m.size());
  const std::vector<S> alphas(m.size(), alpha), betas(m.size(), beta);
  const std::vector<int> sizes(m.size(), 1);
  if constexpr (std::is_same_v<TA, float> && std::is_same_v<TC, float>) {
    return cublasSgemmGroupedBatched(h, ta.data(), tb.data(), m.data(), n.data(), k.data(),
                                     alphas.data(), reinterpret_cast<const float* const*>(a),
                                     lda.data(), reinterpret_cast<const float* const*>(b),
                                     ldb.data(), betas.data(), reinterpret_cast<float* const*>(c),
                                     ldc.data(), groups, sizes.data());
  } else if constexpr (std::is_same_v<TA, double> && std::is_same_v<TC, double>) {
    return cublasDgemmGroupedBatched(h, ta.data(), tb.data(), m.data(), n.data(), k.data(),
                                     alphas.data(), reinterpret_cast<const double* const*>(a),
                                     lda.data(), reinterpret_cast<const double* const*>(b),
                                     ldb.data(), betas.data(), reinterpret_cast<double* const*>(c),
                                     ldc.data(), groups, sizes.data());
  } else {
    return cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m.data(), n.data(), k.data(),
                                      alphas.data(), a, cuda_data_type_v<TA>, lda.data(), b,
                                      cuda_data_type_v<TA>, ldb.data(), betas.data(), c,
                                      std::is_same_v<TC, float> ? CUDA_R_32F : cuda_data_type_v<TC>,
                                      ldc.data(), groups, sizes.data(),
                                      CUBLAS_COMPUTE_32F);
  }
}
#endif

}  // namespace detail

// C_g = alpha op(A_g) op(B_g) + beta C_g for g = 0, 1, ...: the same transposes and scalars for
// every problem, shapes per problem (each checked as gemm checks it; every C_g must already have
// its shape). TA = TC (float, double, bf16, half), or 16-bit TA with float TC (mixed precision).
template <class TA, class TC>
void grouped_gemm(Trans ta, Trans tb, TC alpha, const std::vector<Tensor<TA, cuda>>& a,
                  const std::vector<Tensor<TA, cuda>>& b, TC beta,
                  const std::vector<Tensor<TC, cuda>>& c) {
  GRAPHMOE_CHECK(a.size() == b.size() && a.size() == c.size(), "grouped_gemm", "got ", a.size(),
                 " A, ", b.size(), " B and ", c.size(), " C matrices");
  std::vector<cublasOperation_t> opa, opb;
  std::vector<int> m, n, k, lda, ldb, ldc;
  std::vector<std::size_t> live;      // the problems with a non-empty C
  for (std::size_t g = 0; g < a.size(); ++g) {
    GRAPHMOE_CHECK(!c[g].empty(), "grouped_gemm", "C of problem ", g, " is empty");
    Tensor<TC, cuda> cg = c[g];
    TC unused_beta = beta;
    index_t mg = 0, ng = 0, kg = 0;
    detail::cublas_gemm_prepare(ta, tb, a[g], b[g], cg, unused_beta, mg, ng, kg);
    if (mg == 0 || ng == 0) continue;
    live.push_back(g);
    opa.push_back(detail::cublas_op(tb));
    opb.push_back(detail::cublas_op(ta));
    m.push_back(static_cast<int>(ng));
    n.push_back(static_cast<int>(mg));
    k.push_back(static_cast<int>(kg));
    lda.push_back(detail::cublas_ld(b[g].cols()));
    ldb.push_back(detail::cublas_ld(a[g].cols()));
    ldc.push_back(static_cast<int>(ng));
  }
  if (live.empty()) return;
  auto one_by_one = [&] {
    for (std::size_t g : live) {
      Tensor<TC, cuda> cg = c[g];
      gemm(cuda{}, ta, tb, alpha, a[g], b[g], beta, cg);  // checked above
    }
  };
#if GRAPHMOE_CUBLAS_GROUPED_GEMM
  bool& unsupported = detail::grouped_gemm_unsupported<TA, TC>();
  if (live.size() == 1 || unsupported) return one_by_one();
  const std::size_t p = live.size();
  std::vector<const void*> pointers(3 * p);  // cuBLAS's A (our B) pointers, then B, then C
  for (std::size_t i = 0; i < p; ++i) {
    pointers[i] = b[live[i]].data();
    pointers[p + i] = a[live[i]].data();
    pointers[2 * p + i] = c[live[i]].data();
  }
  auto device_pointers =
      Tensor<std::uint64_t, cuda>::uninitialized(Shape{static_cast<index_t>(3 * p)});  // copied in full
  static_assert(sizeof(const void*) == sizeof(std::uint64_t));
  GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(device_pointers.data(), pointers.data(),
                                      3 * p * sizeof(const void*), cudaMemcpyHostToDevice,
                                      cuda_stream()));
  const auto* dp = reinterpret_cast<const void* const*>(device_pointers.data());
  const cublasStatus_t status = detail::cublas_grouped_gemm<TA, TC>(
      detail::cublas_handle(), opa, opb, m, n, k, lda, ldb, ldc, dp, dp + p,
      const_cast<void* const*>(dp + 2 * p), detail::cublas_scalar(alpha),
      detail::cublas_scalar(beta));
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    unsupported = true;
    return one_by_one();
  }
  GRAPHMOE_CUBLAS_CHECK(status);
#else
  one_by_one();
#endif
}

// y[s] += b[e] for every slot s < y.rows() of an expert e < b.rows() (the plan's slot_expert).
template <class T>
void add_expert_rows(const Tensor<T, cuda>& b, const CudaDispatchPlan& plan,
                     const Tensor<T, cuda>& y) {
  GRAPHMOE_CHECK(b.rank() == 2 && y.rank() == 2 && b.cols() == y.cols(), "add_expert_rows",
                 "b has shape ", b.shape(), " and y ", y.shape(), ", expected (E, D) and (S, D)");
  detail::check_expert_rows("add_expert_rows", "y", plan, y.rows(), b.rows());
  const index_t n = y.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::add_expert_rows_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                           b.data(), plan.backend.slot_expert.data(),
                                                           y.data(), y.rows(), y.cols(), b.rows());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// db[e] += sum of dy's rows of expert e, for e < db.rows() (the plan's expert offsets).
template <class T>
void accumulate_expert_column_sums(const Tensor<T, cuda>& dy, const CudaDispatchPlan& plan,
                                   const Tensor<T, cuda>& db) {
  GRAPHMOE_CHECK(db.rank() == 2 && dy.rank() == 2 && db.cols() == dy.cols(),
                 "accumulate_expert_column_sums", "dy has shape ", dy.shape(), " and db ",
                 db.shape(), ", expected (S, D) and (E, D)");
  detail::check_expert_rows("accumulate_expert_column_sums", "dy", plan, dy.rows(), db.rows());
  GRAPHMOE_CHECK(dy.rows() >= plan.offset(db.rows()), "accumulate_expert_column_sums",
                 "dy has ", dy.rows(), " rows; experts 0..", db.rows() - 1, " need ",
                 plan.offset(db.rows()));
  const index_t n = db.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::expert_column_sums_kernel<T>>(
      detail::grid_for(n), detail::kThreads, dy.data(), plan.expert_offsets.data(), db.data(),
      db.rows(), db.cols());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// ---- the expert FFNs -------------------------------------------------------------------------
namespace detail {

// The first layer's epilogue over the experts' rows, one pass: h += b1[expert of the row] (when
// b1 is given; kept for backward), then gelu(h) into a (T, when given) and into ac (the compute
// type C, when given): the same values as add_expert_rows, gelu_forward and convert one after the
// other.
template <class T, class C>
struct ExpertBiasGeluOp {
  GeluForm form;
  const T* b1;
  const std::int32_t* slot_expert;
  T* h;
  T* a;
  C* ac;
  index_t cols, num_experts;
  __device__ void operator()(index_t i) const {
    const index_t e = slot_expert[i / cols];
    T x = h[i];
    if (b1 != nullptr && e < num_experts)
      x = from_acc<T>(to_acc(x) + to_acc(b1[e * cols + i % cols]));
    h[i] = x;
    const T v = gelu_value_of(form, x);
    if (a != nullptr) a[i] = v;
    if (ac != nullptr) ac[i] = value_cast<C>(v);
  }
};

// The backward's GELU step, one pass: dh = da gelu'(h) in place, and dh in the compute type into
// dhc (when given): gelu_backward, then convert.
template <class T, class C>
struct ExpertGeluBackwardOp {
  GeluForm form;
  const T* h;
  T* dh;
  C* dhc;
  __device__ void operator()(index_t i) const {
    const T v = dh[i] * gelu_derivative_of(form, h[i]);
    dh[i] = v;
    if (dhc != nullptr) dhc[i] = value_cast<C>(v);
  }
};

// SwiGLU's epilogue of the first layer, one pass over (rows, F): for row r and unit j, gate g =
// h[r, j] and up u = h[r, F + j] get their b1 entries (when b1 is given; h keeps the sums for
// backward), then silu(g) * u into a (T, when given) and into ac (C, when given): the same
// formula as swiglu_forward (backend/cuda/swiglu.cuh, whose sigmoid it calls).
template <class T, class C>
struct ExpertBiasSwigluOp {
  const T* b1;  // (E, 2F) or nullptr
  const std::int32_t* slot_expert;
  T* h;         // (rows, 2F)
  T* a;         // (rows, F)
  C* ac;        // (rows, F)
  index_t f, num_experts;
  __device__ void operator()(index_t i) const {
    const index_t r = i / f, j = i % f;
    T* hr = h + r * 2 * f;
    T g = hr[j], u = hr[f + j];
    if (b1 != nullptr) {
      const index_t e = slot_expert[r];
      if (e < num_experts) {
        const T* br = b1 + e * 2 * f;
        g = from_acc<T>(to_acc(g) + to_acc(br[j]));
        u = from_acc<T>(to_acc(u) + to_acc(br[f + j]));
        hr[j] = g;
        hr[f + j] = u;
      }
    }
    const acc_t<T> x = to_acc(g);
    const T v = from_acc<T>(x * swiglu_sigmoid_of(x) * to_acc(u));
    if (a != nullptr) a[i] = v;
    if (ac != nullptr) ac[i] = value_cast<C>(v);
  }
};

// SwiGLU's backward step, one pass over (rows, F): from h = [g | u] and da (rows, F),
// dh[r, j] = da u silu'(g) and dh[r, F + j] = da silu(g), and both in the compute type into dhc
// (when given).
template <class T, class C>
struct ExpertSwigluBackwardOp {
  const T* h;   // (rows, 2F)
  const T* da;  // (rows, F)
  T* dh;        // (rows, 2F)
  C* dhc;       // (rows, 2F)
  index_t f;
  __device__ void operator()(index_t i) const {
    const index_t r = i / f, j = i % f, o = r * 2 * f + j;
    const acc_t<T> g = to_acc(h[o]), u = to_acc(h[o + f]), d = to_acc(da[i]);
    const acc_t<T> s = swiglu_sigmoid_of(g);
    const T dg = from_acc<T>(d * u * (s * (acc_t<T>(1) + g * (acc_t<T>(1) - s))));
    const T du = from_acc<T>(d * (g * s));
    dh[o] = dg;
    dh[o + f] = du;
    if (dhc != nullptr) {
      dhc[o] = value_cast<C>(dg);
      dhc[o + f] = value_cast<C>(du);
    }
  }
};

// C_g = op(A_g) op(B_g) + beta C_g for g < batch, where X_g is the matrix X0 (its shape, row-major
// as gemm reads it) moved by g * sx elements: one batched_gemm (gemm.cuh). TA = TC, or 16-bit TA
// with float TC; fp32 accumulation (fp64 for double), as gemm.
template <class TA, class TC>
void strided_gemm(Trans ta, Trans tb, TC beta, const Tensor<TA, cuda>& a0, index_t sa,
                  const Tensor<TA, cuda>& b0, index_t sb, const Tensor<TC, cuda>& c0, index_t sc,
                  index_t batch) {
  Tensor<TC, cuda> c = c0;
  TC unused_beta = beta;
  index_t m = 0, n = 0, k = 0;
  cublas_gemm_prepare(ta, tb, a0, b0, c, unused_beta, m, n, k);
  batched_gemm(m, n, k, gemm_scalar_t<TC>(1), MatrixBatch{a0.data(), a0.cols(), sa, ta},
               MatrixBatch{b0.data(), b0.cols(), sb, tb}, cublas_scalar(beta),
               MatrixBatch{c.data(), n, sc}, batch, GemmMath::Default, "strided_gemm");
}

// One GEMM call over the experts with rows: C_e = op(A_e) op(B_e) + beta C_e, where
// operands(e, r0, r1) returns (A_e, B_e, C_e) for expert e's rows [r0, r1). In the padded layout
// (every expert C rows, core/dispatch_plan.hpp) the problems are equal and evenly spaced: one
// strided-batched GEMM, its strides read off experts 0 and 1, with no pointer arrays to upload;
// otherwise one grouped GEMM over the experts with rows.
template <class T, class C, class Operands>
void expert_gemm(const DispatchPlan<cuda>& plan, index_t num_experts, Trans ta, Trans tb, T beta,
                 Operands&& operands) {
  if (plan.capacity > 0 && plan.num_experts == num_experts) {
    const index_t cap = plan.capacity;
    auto [a0, b0, c0] = operands(0, 0, cap);
    index_t sa = 0, sb = 0, sc = 0;
    if (num_experts > 1) {
      auto [a1, b1, c1] = operands(1, cap, 2 * cap);
      sa = a1.data() - a0.data();
      sb = b1.data() - b0.data();
      sc = c1.data() - c0.data();
    }
    strided_gemm(ta, tb, beta, a0, sa, b0, sb, c0, sc, num_experts);
    return;
  }
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

}  // namespace detail

// The forward for all experts at once (rows of the drop bucket untouched).
template <class T, class C>
void expert_ffn_forward(cuda, const DispatchPlan<cuda>& plan, const ExpertFfn<T, C, cuda>& f,
                        FfnActivationForm act, ExpertParallelism, Tensor<T, cuda>& ys) {
  const index_t e_ = f.num_experts;
  const index_t rows = plan.offset(e_);  // the experts' slots; the drop bucket follows
  if (rows == 0) return;
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::T, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{f.xc.slice(r0, r1), f.w1[e], f.h.slice(r0, r1)};  // H_e = X_e w1_e^T
  });
  // h += b1, a = act(h) (or its compute-type copy only, which is all backward reads: mixed
  // precision writes no fp32 a), in one pass
  Tensor<C, cuda> ac;
  if constexpr (std::is_same_v<C, T>)
    ac = f.a.slice(0, rows);
  else
    ac = f.ac.slice(0, rows);
  const bool bias = !f.b1.empty();
  const index_t bias_experts = bias ? f.b1.rows() : e_;
  detail::check_expert_rows("expert_ffn_forward", "h", plan, rows, bias_experts);
  T* const a_out = std::is_same_v<C, T> ? reinterpret_cast<T*>(ac.data()) : nullptr;
  C* const ac_out = std::is_same_v<C, T> ? nullptr : ac.data();
  if (act.swiglu()) {
    const index_t hidden = f.h.cols() / 2;
    detail::for_each_index(rows * hidden, detail::ExpertBiasSwigluOp<T, C>{
                                              bias ? f.b1.data() : nullptr,
                                              plan.backend.slot_expert.data(), f.h.data(), a_out, ac_out,
                                              hidden, bias_experts});
  } else {
    detail::for_each_index(
        rows * f.h.cols(),
        detail::ExpertBiasGeluOp<T, C>{act.gelu, bias ? f.b1.data() : nullptr,
                                       plan.backend.slot_expert.data(), f.h.data(), a_out, ac_out,
                                       f.h.cols(), bias_experts});
  }
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::T, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{ac.slice(r0, r1), f.w2[e], ys.slice(r0, r1)};  // Y_e = A_e w2_e^T
  });
  if (bias) add_expert_rows(f.b2, plan, ys.slice(0, rows));
}

// The backward for all experts at once, grouped like the forward.
template <class T, class C>
void expert_ffn_backward(cuda, const DispatchPlan<cuda>& plan, const ExpertFfn<T, C, cuda>& f,
                         FfnActivationForm act, ExpertParallelism, const Tensor<T, cuda>& dys,
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
  const bool bias = !f.b1.empty();
  // y = a w2^T + b2
  if (bias) accumulate_expert_column_sums(dys.slice(0, rows), plan, f.db2);
  detail::expert_gemm<T, C>(plan, e_, Trans::T, Trans::N, T(1), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dyc_all.slice(r0, r1), ac_all.slice(r0, r1), f.dw2[e]};  // dw2 += dy^T a
  });
  // da = dy w2: into dh (GELU, in place there next) or into f.da (SwiGLU: dh is twice as wide)
  const Tensor<T, cuda> da_all = act.swiglu() ? f.da : dh_all;
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::N, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dyc_all.slice(r0, r1), f.w2[e], da_all.slice(r0, r1)};  // da = dy w2
  });
  Tensor<T, cuda> dh = dh_all.slice(0, rows);
  Tensor<C, cuda> dhc;
  if constexpr (std::is_same_v<C, T>)
    dhc = dh_all;
  else
    dhc = dhc_all;
  C* const dhc_out = std::is_same_v<C, T> ? nullptr : dhc.data();
  if (act.swiglu()) {
    // dh = [da up silu'(gate) | da silu(gate)], and its compute-type copy, in one pass
    const index_t hidden = dh.cols() / 2;
    detail::for_each_index(rows * hidden, detail::ExpertSwigluBackwardOp<T, C>{
                                              f.h.data(), da_all.data(), dh.data(), dhc_out,
                                              hidden});
  } else {
    // dh = gelu'(h) da, and its compute-type copy, in one pass
    detail::for_each_index(rows * dh.cols(), detail::ExpertGeluBackwardOp<T, C>{
                                                 act.gelu, f.h.data(), dh.data(), dhc_out});
  }
  if (bias) accumulate_expert_column_sums(dh, plan, f.db1);
  detail::expert_gemm<T, C>(plan, e_, Trans::T, Trans::N, T(1), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dhc.slice(r0, r1), f.xc.slice(r0, r1), f.dw1[e]};  // dw1 += dh^T x
  });
  detail::expert_gemm<T, C>(plan, e_, Trans::N, Trans::N, T(0), [&](index_t e, index_t r0, index_t r1) {
    return std::tuple{dhc.slice(r0, r1), f.w1[e], dxs.slice(r0, r1)};  // dx = dh w1
  });
}

}  // namespace graphmoe
