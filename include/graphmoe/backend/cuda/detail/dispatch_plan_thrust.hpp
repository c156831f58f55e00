// graphmoe/backend/cuda/detail/dispatch_plan_thrust.hpp: the dispatch plan built from Thrust
// algorithms, templated on the Thrust execution policy (internal).
//
// The same header compiles in two ways, as Thrust's own sources do:
//   - by nvcc, called from backend/cuda/dispatch.cuh with thrust::cuda::par_nosync(alloc): the
//     plan of a Tensor<std::int32_t, cuda>, on the GPU;
//   - by g++ alone, with -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP (or _OMP) and the CCCL
//     headers on the include path, called with thrust::cpp::par, thrust::host or
//     thrust::omp::par: tests/cuda/test_thrust_host.cpp checks it against the CPU backend's
//     make_dispatch_plan on machines without a GPU.
// It therefore includes nothing of CUDA itself and marks its functors GRAPHMOE_HOST_DEVICE.
//
// For ids (N k) of expert ids in [0, E) (assignment a = t k + j):
//   1. keys = ids as unsigned 32-bit integers, slot_source = 0, 1, ..., N k - 1
//   2. stable_sort_by_key(keys, slot_source)   (a radix sort on the GPU): slot_source[s] is the
//      assignment held by slot s, ordered by expert and, within an expert, by a, as the CPU's
//      stable counting sort orders them; keys[s] is then the expert of slot s
//   3. slot_token[s] = slot_source[s] / k
//   4. source_slot[slot_source[s]] = s        (scatter: the inverse permutation)
//   5. offsets[e] = lower_bound(keys, e) for e = 0..E   (the sorted keys' histogram, scanned)
// Steps 1 to 5 never read or write out of bounds whatever the ids are. As unsigned keys, a
// negative id is as large as an id >= E, so every bad id sorts after the good ones and the ids
// are all in range exactly when offsets[E] == N k: the caller checks that on the offsets it reads
// back anyway, and only then looks for the first bad id with first_invalid_expert_id (for the
// error message). (Unsigned keys also sidestep Thrust 3.0's sequential radix sort, which orders
// negative int keys after the positive ones.)
#pragma once

#include <cstdint>

#include <thrust/binary_search.h>
#include <thrust/copy.h>
#include <thrust/find.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/scatter.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/transform.h>

#include "graphmoe/config.hpp"

namespace graphmoe::detail {

struct DivideBy {
  std::int32_t k;
  GRAPHMOE_HOST_DEVICE std::int32_t operator()(std::int32_t a) const { return a / k; }
};

struct OutsideRange {
  std::int32_t num_experts;
  GRAPHMOE_HOST_DEVICE bool operator()(std::int32_t e) const { return e < 0 || e >= num_experts; }
};

// The plan of ids[0, slots) into caller-provided arrays in the policy's memory space:
// keys, slot_token, slot_source, source_slot (slots each) and offsets (num_experts + 1).
template <class Policy>
void build_dispatch_plan(const Policy& policy, const std::int32_t* ids, std::int64_t slots,
                         std::int32_t k, std::int32_t num_experts, std::uint32_t* keys,
                         std::int32_t* offsets, std::int32_t* slot_token,
                         std::int32_t* slot_source, std::int32_t* source_slot) {
  const std::int32_t n = static_cast<std::int32_t>(slots);
  thrust::copy(policy, ids, ids + n, keys);
  thrust::sequence(policy, slot_source, slot_source + n);
  thrust::stable_sort_by_key(policy, keys, keys + n, slot_source);
  thrust::transform(policy, slot_source, slot_source + n, slot_token, DivideBy{k});
  thrust::scatter(policy, thrust::counting_iterator<std::int32_t>(0),
                  thrust::counting_iterator<std::int32_t>(n), slot_source, source_slot);
  thrust::lower_bound(policy, keys, keys + n, thrust::counting_iterator<std::uint32_t>(0),
                      thrust::counting_iterator<std::uint32_t>(
                          static_cast<std::uint32_t>(num_experts) + 1),
                      offsets);
}

// The first assignment a whose id is outside [0, num_experts), or -1 when all are inside.
template <class Policy>
std::int64_t first_invalid_expert_id(const Policy& policy, const std::int32_t* ids,
                                     std::int64_t slots, std::int32_t num_experts) {
  const std::int32_t* it = thrust::find_if(policy, ids, ids + slots, OutsideRange{num_experts});
  const std::int64_t a = it - ids;
  return a == slots ? -1 : a;
}

}  // namespace graphmoe::detail
