// graphmoe/backend/cpu/dispatch.hpp: grouping tokens by expert (dispatch) and gathering the
// experts' outputs back per token (combine), for a Mixture-of-Experts layer.
//
// Each of N tokens is routed to k experts: indices (N, k). Assignment a = t * k + j is "token t's
// j-th choice". make_dispatch_plan sorts the N * k assignments by expert id with a STABLE counting
// sort, so the rows for expert e are one contiguous block of slots [offsets[e], offsets[e + 1]),
// and within that block assignments keep (token, j) order. One GEMM per expert then reads its
// block of xs directly.
//
//   dispatch:  xs[s] = x[slot_token[s]]                                  x (N, D) -> xs (N k, D)
//   combine:   y[t]  = sum_j gates[t, j] * ys[source_slot[t k + j]]      ys (N k, D) -> y (N, D)
//
// Backwards (all gradients assigned):
//   dispatch:  dx[t] = sum_j dxs[source_slot[t k + j]]
//   combine:   dys[source_slot[t k + j]] = gates[t, j] * dy[t]
//              dgates[t, j] = <dy[t], ys[source_slot[t k + j]]>
//
// Every loop is a gather or a scatter to distinct rows, so each parallelises without races. This
// is the seam where expert parallelism (dist/expert_parallel.hpp) sends the rows to other ranks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

struct DispatchPlan {
  index_t num_tokens = 0, k = 0, num_experts = 0;
  Tensor<std::int32_t, cpu> expert_offsets;  // (E + 1): slots of expert e are [offsets[e], offsets[e + 1])
  Tensor<std::int32_t, cpu> slot_token;      // (N k): the token row held by sorted slot s
  Tensor<std::int32_t, cpu> slot_source;     // (N k): the assignment (t k + j) held by slot s
  Tensor<std::int32_t, cpu> source_slot;     // (N k): inverse of slot_source

  index_t num_slots() const { return num_tokens * k; }
  // Number of assignments routed to expert e.
  index_t count(index_t e) const {
    GRAPHMOE_CHECK(e >= 0 && e < num_experts, "DispatchPlan::count", "expert ", e,
                   " is out of range [0, ", num_experts, ")");
    return expert_offsets.data()[e + 1] - expert_offsets.data()[e];
  }
  // First slot of expert e (the row of xs where its block starts).
  index_t offset(index_t e) const {
    GRAPHMOE_CHECK(e >= 0 && e <= num_experts, "DispatchPlan::offset", "expert ", e,
                   " is out of range [0, ", num_experts, "]");
    return expert_offsets.data()[e];
  }
};

// The dispatch plan type of a backend: DispatchPlan here, CudaDispatchPlan in
// backend/cuda/dispatch.cuh. Backend-generic layers (layers/moe.hpp) hold a dispatch_plan_t<B>.
template <class B>
struct dispatch_plan_for;
template <>
struct dispatch_plan_for<cpu> {
  using type = DispatchPlan;
};
template <class B>
using dispatch_plan_t = typename dispatch_plan_for<B>::type;

namespace detail {
// Keeps t's storage when it already has the shape (plans are rebuilt every step).
inline void plan_tensor(Tensor<std::int32_t, cpu>& t, const Shape& shape) {
  if (t.empty() || t.shape() != shape) t = Tensor<std::int32_t, cpu>(shape);
}

inline void check_plan(const char* op, const DispatchPlan& plan) {
  const index_t slots = plan.num_slots();
  GRAPHMOE_CHECK(plan.k >= 1 && plan.num_experts >= 1 && !plan.expert_offsets.empty() &&
                     plan.expert_offsets.numel() == plan.num_experts + 1 &&
                     !plan.slot_token.empty() && plan.slot_token.numel() == slots &&
                     !plan.slot_source.empty() && plan.slot_source.numel() == slots &&
                     !plan.source_slot.empty() && plan.source_slot.numel() == slots,
                 op, "the plan was not built by make_dispatch_plan (N = ", plan.num_tokens,
                 ", k = ", plan.k, ", E = ", plan.num_experts, ")");
}

// Checks that `m` is read as an (rows, cols) matrix: rank >= 1 with those rows and columns.
template <class T>
void check_matrix(const char* op, const char* what, const Tensor<T, cpu>& m, index_t rows,
                  index_t cols) {
  GRAPHMOE_CHECK(!m.empty(), op, what, " is empty, expected (", rows, ", ", cols, ")");
  GRAPHMOE_CHECK(m.rank() >= 1 && m.rows() == rows && m.cols() == cols, op, what,
                 " has shape ", m.shape(), ", expected (", rows, ", ", cols, ")");
}

inline index_t row_grain(index_t d) { return std::max<index_t>(1, 8192 / std::max<index_t>(d, 1)); }
}  // namespace detail

// Builds the plan for indices (N, k) of expert ids in [0, num_experts).
inline void make_dispatch_plan(const Tensor<std::int32_t, cpu>& indices, index_t num_experts,
                               DispatchPlan& plan) {
  constexpr const char* op = "make_dispatch_plan";
  GRAPHMOE_CHECK(!indices.empty() && indices.rank() == 2, op,
                 "indices must be an (N, k) matrix of expert ids, got ",
                 (indices.empty() ? "an empty tensor" : indices.shape().str()));
  GRAPHMOE_CHECK(num_experts >= 1, op, "num_experts = ", num_experts, " must be >= 1");
  const index_t n = indices.dim(0), k = indices.dim(1), slots = n * k;
  GRAPHMOE_CHECK(k >= 1, op, "indices ", indices.shape(), " select no expert per token (k = 0)");
  GRAPHMOE_CHECK(slots <= std::numeric_limits<std::int32_t>::max() &&
                     num_experts < std::numeric_limits<std::int32_t>::max(),
                 op, "N * k = ", slots, " or E = ", num_experts, " exceeds the int32 range");
  const std::int32_t* ids = indices.data();
  std::vector<std::int32_t> cursor(static_cast<std::size_t>(num_experts) + 1, 0);
  for (index_t a = 0; a < slots; ++a) {
    GRAPHMOE_CHECK(ids[a] >= 0 && ids[a] < num_experts, op, "expert id ", ids[a], " of token ",
                   a / k, ", choice ", a % k, " is out of range [0, ", num_experts, ")");
    ++cursor[static_cast<std::size_t>(ids[a]) + 1];
  }
  plan.num_tokens = n;
  plan.k = k;
  plan.num_experts = num_experts;
  detail::plan_tensor(plan.expert_offsets, Shape{num_experts + 1});
  detail::plan_tensor(plan.slot_token, Shape{slots});
  detail::plan_tensor(plan.slot_source, Shape{slots});
  detail::plan_tensor(plan.source_slot, Shape{slots});
  std::int32_t* offsets = plan.expert_offsets.data();
  for (index_t e = 0; e < num_experts; ++e) {
    cursor[static_cast<std::size_t>(e) + 1] += cursor[static_cast<std::size_t>(e)];
  }
  std::copy(cursor.begin(), cursor.end(), offsets);
  std::int32_t* slot_token = plan.slot_token.data();
  std::int32_t* slot_source = plan.slot_source.data();
  std::int32_t* source_slot = plan.source_slot.data();
  for (index_t a = 0; a < slots; ++a) {  // ascending a: the sort is stable
    const std::int32_t s = cursor[static_cast<std::size_t>(ids[a])]++;
    slot_token[s] = static_cast<std::int32_t>(a / k);
    slot_source[s] = static_cast<std::int32_t>(a);
    source_slot[a] = s;
  }
}

// xs[s] = x[slot_token[s]]: x (N, D) -> xs (N k, D). An empty xs is allocated.
template <class T>
void dispatch_forward(const DispatchPlan& plan, const Tensor<T, cpu>& x, Tensor<T, cpu>& xs) {
  constexpr const char* op = "dispatch_forward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!x.empty() && x.rank() >= 1, op, "x is empty");
  const index_t d = x.cols();
  detail::check_matrix(op, "x", x, plan.num_tokens, d);
  prepare_output(op, "xs", xs, Shape{plan.num_slots(), d});
  const std::int32_t* tok = plan.slot_token.data();
  const T* src = x.data();
  T* dst = xs.data();
  parallel_for(
      0, plan.num_slots(),
      [&](index_t s) { std::copy_n(src + static_cast<index_t>(tok[s]) * d, d, dst + s * d); },
      detail::row_grain(d));
}

// dx[t] = sum_j dxs[source_slot[t k + j]]: dxs (N k, D) -> dx (N, D), assigned.
template <class T>
void dispatch_backward(const DispatchPlan& plan, const Tensor<T, cpu>& dxs, Tensor<T, cpu>& dx) {
  constexpr const char* op = "dispatch_backward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!dxs.empty() && dxs.rank() >= 1, op, "dxs is empty");
  const index_t d = dxs.cols(), k = plan.k;
  detail::check_matrix(op, "dxs", dxs, plan.num_slots(), d);
  prepare_output(op, "dx", dx, Shape{plan.num_tokens, d});
  const std::int32_t* slot = plan.source_slot.data();
  const T* src = dxs.data();
  T* dst = dx.data();
  parallel_for(
      0, plan.num_tokens,
      [&](index_t t) {
        T* out = dst + t * d;
        std::copy_n(src + static_cast<index_t>(slot[t * k]) * d, d, out);
        for (index_t j = 1; j < k; ++j) {
          const T* in = src + static_cast<index_t>(slot[t * k + j]) * d;
          for (index_t c = 0; c < d; ++c) out[c] += in[c];
        }
      },
      detail::row_grain(d * k));
}

// y[t] = sum_j gates[t, j] * ys[source_slot[t k + j]]: ys (N k, D), gates (N, k) -> y (N, D).
template <class T>
void combine_forward(const DispatchPlan& plan, const Tensor<T, cpu>& ys, const Tensor<T, cpu>& gates,
                     Tensor<T, cpu>& y) {
  constexpr const char* op = "combine_forward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!ys.empty() && ys.rank() >= 1, op, "ys is empty");
  const index_t d = ys.cols(), k = plan.k;
  detail::check_matrix(op, "ys", ys, plan.num_slots(), d);
  detail::check_matrix(op, "gates", gates, plan.num_tokens, k);
  prepare_output(op, "y", y, Shape{plan.num_tokens, d});
  const std::int32_t* slot = plan.source_slot.data();
  const T* src = ys.data();
  const T* g = gates.data();
  T* dst = y.data();
  parallel_for(
      0, plan.num_tokens,
      [&](index_t t) {
        T* out = dst + t * d;
        const T g0 = g[t * k];
        const T* in0 = src + static_cast<index_t>(slot[t * k]) * d;
        for (index_t c = 0; c < d; ++c) out[c] = g0 * in0[c];
        for (index_t j = 1; j < k; ++j) {
          const T gj = g[t * k + j];
          const T* in = src + static_cast<index_t>(slot[t * k + j]) * d;
          for (index_t c = 0; c < d; ++c) out[c] += gj * in[c];
        }
      },
      detail::row_grain(d * k));
}

// Backward of combine_forward: dys (N k, D) and dgates (N, k), both assigned.
template <class T>
void combine_backward(const DispatchPlan& plan, const Tensor<T, cpu>& ys, const Tensor<T, cpu>& gates,
                      const Tensor<T, cpu>& dy, Tensor<T, cpu>& dys, Tensor<T, cpu>& dgates) {
  constexpr const char* op = "combine_backward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!ys.empty() && ys.rank() >= 1, op, "ys is empty");
  const index_t d = ys.cols(), k = plan.k;
  detail::check_matrix(op, "ys", ys, plan.num_slots(), d);
  detail::check_matrix(op, "gates", gates, plan.num_tokens, k);
  detail::check_matrix(op, "dy", dy, plan.num_tokens, d);
  prepare_output(op, "dys", dys, Shape{plan.num_slots(), d});
  prepare_output(op, "dgates", dgates, Shape{plan.num_tokens, k});
  const std::int32_t* slot = plan.source_slot.data();
  const T* yp = ys.data();
  const T* g = gates.data();
  const T* dyp = dy.data();
  T* dysp = dys.data();
  T* dg = dgates.data();
  parallel_for(
      0, plan.num_tokens,
      [&](index_t t) {
        const T* grad = dyp + t * d;
        for (index_t j = 0; j < k; ++j) {
          const index_t s = slot[t * k + j];
          const T gj = g[t * k + j];
          const T* in = yp + s * d;
          T* out = dysp + s * d;
          T dot = T(0);
          for (index_t c = 0; c < d; ++c) {
            out[c] = gj * grad[c];
            dot += grad[c] * in[c];
          }
          dg[t * k + j] = dot;
        }
      },
      detail::row_grain(d * k));
}

}  // namespace graphmoe
