// graphmoe/backend/cpu/dispatch.hpp: the CPU system's dispatch plan, dispatch and combine
// (contract and argument checks: ops/dispatch.hpp, which calls these through the backend tag).
//
// make_dispatch_plan sorts the N * k assignments by expert id with a STABLE counting sort;
// make_padded_dispatch_plan places them in one pass in token order. Every loop is a gather or a
// scatter to distinct rows, so each parallelises without races. Slot -1 (the padded layout's
// empty slots and dropped assignments) reads as a zero row and is never written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {
inline index_t row_grain(index_t d) { return std::max<index_t>(1, 8192 / std::max<index_t>(d, 1)); }
}  // namespace detail

// The plan of indices (N, k), checked by ops/dispatch.hpp; returns the first expert id outside
// [0, num_experts) (the plan untouched then).
inline Offender make_dispatch_plan(cpu, const Tensor<std::int32_t, cpu>& indices,
                                   index_t num_experts, DispatchPlan<cpu>& plan) {
  const index_t n = indices.dim(0), k = indices.dim(1), slots = n * k;
  const std::int32_t* ids = indices.data();
  std::vector<std::int32_t> cursor(static_cast<std::size_t>(num_experts) + 1, 0);
  for (index_t a = 0; a < slots; ++a) {
    if (ids[a] < 0 || ids[a] >= num_experts) return {a, static_cast<double>(ids[a])};
    ++cursor[static_cast<std::size_t>(ids[a]) + 1];
  }
  detail::size_dispatch_plan(plan, n, k, num_experts, 0);
  plan.k = k;
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
  return {};
}

// The padded plan of indices and keep (checked by ops/dispatch.hpp); returns the first kept
// assignment with an id outside [0, num_experts) or beyond its expert's capacity, with its id.
inline Offender make_padded_dispatch_plan(cpu, const Tensor<std::int32_t, cpu>& indices,
                                          const Tensor<std::uint8_t, cpu>& keep,
                                          index_t num_experts, index_t capacity,
                                          DispatchPlan<cpu>& plan) {
  const index_t n = indices.dim(0), k = indices.dim(1), slots = num_experts * capacity;
  detail::size_dispatch_plan(plan, n, k, num_experts, capacity);
  for (index_t e = 0; e <= num_experts; ++e)
    plan.expert_offsets.data()[e] = static_cast<std::int32_t>(e * capacity);
  std::fill_n(plan.slot_token.data(), slots, std::int32_t{-1});
  std::fill_n(plan.slot_source.data(), slots, std::int32_t{-1});
  std::vector<index_t> count(static_cast<std::size_t>(num_experts), 0);
  const std::int32_t* ids = indices.data();
  Offender bad;
  for (index_t a = 0; a < n * k; ++a) {
    plan.source_slot.data()[a] = -1;
    if (keep.data()[a] == 0) continue;
    const std::int32_t e = ids[a];
    if (e < 0 || e >= num_experts || count[static_cast<std::size_t>(e)] >= capacity) {
      if (!bad.found()) bad = {a, static_cast<double>(e)};
      continue;
    }
    const index_t s = e * capacity + count[static_cast<std::size_t>(e)]++;
    plan.slot_token.data()[s] = static_cast<std::int32_t>(a / k);
    plan.slot_source.data()[s] = static_cast<std::int32_t>(a);
    plan.source_slot.data()[a] = static_cast<std::int32_t>(s);
  }
  return bad;
}

// xs[s] = x[slot_token[s]], zero for an empty slot (xs prepared by ops/dispatch.hpp).
template <class T>
void dispatch_forward(cpu, const DispatchPlan<cpu>& plan, const Tensor<T, cpu>& x,
                      Tensor<T, cpu>& xs) {
  const index_t d = x.cols();
  const std::int32_t* tok = plan.slot_token.data();
  const T* src = x.data();
  T* dst = xs.data();
  parallel_for(
      0, plan.num_slots(),
      [&](index_t s) {
        if (tok[s] < 0)
          std::fill_n(dst + s * d, d, T(0));
        else
          std::copy_n(src + static_cast<index_t>(tok[s]) * d, d, dst + s * d);
      },
      detail::row_grain(d));
}

// dx[t] = sum_j dxs[source_slot[t k + j]]: dxs (N k, D) -> dx (N, D), assigned.
template <class T>
void dispatch_backward(cpu, const DispatchPlan<cpu>& plan, const Tensor<T, cpu>& dxs,
                       Tensor<T, cpu>& dx) {
  const index_t d = dxs.cols(), k = plan.k;
  const std::int32_t* slot = plan.source_slot.data();
  const T* src = dxs.data();
  T* dst = dx.data();
  parallel_for(
      0, plan.num_tokens,
      [&](index_t t) {
        T* out = dst + t * d;
        bool first = true;
        for (index_t j = 0; j < k; ++j) {
          if (slot[t * k + j] < 0) continue;
          const T* in = src + static_cast<index_t>(slot[t * k + j]) * d;
          if (first) {
            std::copy_n(in, d, out);
            first = false;
          } else {
            for (index_t c = 0; c < d; ++c) out[c] += in[c];
          }
        }
        if (first) std::fill_n(out, d, T(0));
      },
      detail::row_grain(d * k));
}

// y[t] = sum_j gates[t, j] * ys[source_slot[t k + j]]: ys (N k, D), gates (N, k) -> y (N, D).
template <class T>
void combine_forward(cpu, const DispatchPlan<cpu>& plan, const Tensor<T, cpu>& ys,
                     const Tensor<T, cpu>& gates, Tensor<T, cpu>& y) {
  const index_t d = ys.cols(), k = plan.k;
  const std::int32_t* slot = plan.source_slot.data();
  const T* src = ys.data();
  const T* g = gates.data();
  T* dst = y.data();
  parallel_for(
      0, plan.num_tokens,
      [&](index_t t) {
        T* out = dst + t * d;
        bool first = true;
        for (index_t j = 0; j < k; ++j) {
          if (slot[t * k + j] < 0) continue;
          const T gj = g[t * k + j];
          const T* in = src + static_cast<index_t>(slot[t * k + j]) * d;
          if (first) {
            for (index_t c = 0; c < d; ++c) out[c] = gj * in[c];
            first = false;
          } else {
            for (index_t c = 0; c < d; ++c) out[c] += gj * in[c];
          }
        }
        if (first) std::fill_n(out, d, T(0));
      },
      detail::row_grain(d * k));
}

// Backward of combine_forward: dys (N k, D) and dgates (N, k), both assigned.
template <class T>
void combine_backward(cpu, const DispatchPlan<cpu>& plan, const Tensor<T, cpu>& ys,
                      const Tensor<T, cpu>& gates, const Tensor<T, cpu>& dy, Tensor<T, cpu>& dys,
                      Tensor<T, cpu>& dgates) {
  const index_t d = ys.cols(), k = plan.k;
  const std::int32_t* slot = plan.source_slot.data();
  const T* yp = ys.data();
  const T* g = gates.data();
  const T* dyp = dy.data();
  T* dysp = dys.data();
  T* dg = dgates.data();
  if (plan.capacity > 0) {  // the padded layout's empty slots
    const std::int32_t* source = plan.slot_source.data();
    parallel_for(
        0, plan.num_slots(),
        [&](index_t s) {
          if (source[s] < 0) std::fill_n(dysp + s * d, d, T(0));
        },
        detail::row_grain(d));
  }
  parallel_for(
      0, plan.num_tokens,
      [&](index_t t) {
        const T* grad = dyp + t * d;
        for (index_t j = 0; j < k; ++j) {
          const index_t s = slot[t * k + j];
          if (s < 0) {
            dg[t * k + j] = T(0);
            continue;
          }
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
