// The Thrust construction of the dispatch plan (backend/cuda/detail/dispatch_plan_thrust.hpp),
// compiled by g++ against Thrust's CPU backends (THRUST_DEVICE_SYSTEM_CPP, see
// tests/CMakeLists.txt), must equal the CPU backend's make_dispatch_plan entry for entry: offsets,
// slot_token, slot_source and source_slot. This is the same source that backend/cuda/dispatch.cuh
// runs on the GPU, so its logic is tested on every machine, with or without a GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include <thrust/execution_policy.h>
#include <thrust/system/cpp/execution_policy.h>
#if defined(_OPENMP)
#include <thrust/system/omp/execution_policy.h>
#endif

#include "graphmoe/ops/dispatch.hpp"
#include "graphmoe/backend/cuda/detail/dispatch_plan_thrust.hpp"
#include "graphmoe/core/rng.hpp"

#if THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CPP && THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_OMP
#error "test_thrust_host must be compiled with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP or _OMP"
#endif

using namespace graphmoe;

namespace {

struct HostPlan {
  std::vector<std::int32_t> offsets, slot_token, slot_source, source_slot;
  std::vector<std::uint32_t> keys;
};

template <class Policy>
HostPlan thrust_plan(const Policy& policy, const Tensor<std::int32_t>& idx, index_t e) {
  const index_t slots = idx.numel();
  HostPlan p;
  p.offsets.resize(static_cast<std::size_t>(e + 1));
  for (auto* v : {&p.slot_token, &p.slot_source, &p.source_slot})
    v->resize(static_cast<std::size_t>(slots));
  p.keys.resize(static_cast<std::size_t>(slots));
  detail::build_dispatch_plan(policy, idx.data(), slots, static_cast<std::int32_t>(idx.dim(1)),
                              static_cast<std::int32_t>(e), p.keys.data(), p.offsets.data(),
                              p.slot_token.data(), p.slot_source.data(), p.source_slot.data());
  return p;
}

// Expert ids drawn from the first `used` of e experts, so experts [used, e) stay empty; with
// `skip_even`, the even experts below `used` are empty too.
Tensor<std::int32_t> random_ids(index_t n, index_t k, index_t e, index_t used, bool skip_even,
                                Rng& rng) {
  Tensor<std::int32_t> idx({n, k});
  for (index_t i = 0; i < idx.numel(); ++i) {
    std::int32_t id = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(used)));
    if (skip_even && id % 2 == 0) id = id + 1 < e ? id + 1 : static_cast<std::int32_t>(e - 1);
    idx.data()[i] = id;
  }
  return idx;
}

template <class Policy>
void check_against_cpu(const char* policy_name, const Policy& policy, const Tensor<std::int32_t>& idx,
                       index_t e) {
  CAPTURE(policy_name);
  DispatchPlan ref;
  make_dispatch_plan(idx, e, ref);
  const HostPlan p = thrust_plan(policy, idx, e);
  CHECK(p.offsets == ref.expert_offsets.to_vector());
  CHECK(p.slot_token == ref.slot_token.to_vector());
  CHECK(p.slot_source == ref.slot_source.to_vector());
  CHECK(p.source_slot == ref.source_slot.to_vector());
  // keys end up as the expert of each slot
  for (std::size_t s = 0; s < p.keys.size(); ++s)
    CHECK(p.keys[s] == static_cast<std::uint32_t>(idx.data()[p.slot_source[s]]));
  CHECK(detail::first_invalid_expert_id(policy, idx.data(), idx.numel(),
                                        static_cast<std::int32_t>(e)) == -1);
}

template <class Policy>
void check_all_shapes(const char* policy_name, const Policy& policy) {
  Rng rng(2024);
  for (index_t k : {1, 2, 4}) {
    for (index_t n : {0, 1, 7, 64, 1000}) {
      for (index_t e : {1, 3, 8, 64}) {
        CAPTURE(k);
        CAPTURE(n);
        CAPTURE(e);
        check_against_cpu(policy_name, policy, random_ids(n, k, e, e, false, rng), e);
        // trailing experts empty, and every other expert empty
        check_against_cpu(policy_name, policy, random_ids(n, k, e, (e + 1) / 2, false, rng), e);
        check_against_cpu(policy_name, policy, random_ids(n, k, e, e, true, rng), e);
      }
    }
  }
}

}  // namespace

TEST_CASE("thrust plan: equals the CPU plan (thrust::cpp::par)") {
  check_all_shapes("thrust::cpp::par", thrust::cpp::par);
}

TEST_CASE("thrust plan: equals the CPU plan (thrust::host)") {
  check_all_shapes("thrust::host", thrust::host);
}

TEST_CASE("thrust plan: equals the CPU plan (thrust::device, a CPU backend here)") {
  // thrust::device is the system dispatch.cuh's policy belongs to; compiled by g++ it is
  // THRUST_DEVICE_SYSTEM, so the device code path runs on the CPU.
  check_all_shapes("thrust::device", thrust::device);
}

#if defined(_OPENMP)
TEST_CASE("thrust plan: equals the CPU plan (thrust::omp::par)") {
  check_all_shapes("thrust::omp::par", thrust::omp::par);
}
#endif

TEST_CASE("thrust plan: worked example, stable within an expert") {
  // token: 0      1      2      3
  auto idx = Tensor<std::int32_t>::from({4, 2}, {2, 0, 0, 2, 1, 2, 0, 3});
  const HostPlan p = thrust_plan(thrust::cpp::par, idx, 5);
  CHECK(p.offsets == std::vector<std::int32_t>{0, 3, 4, 7, 8, 8});
  CHECK(p.slot_source == std::vector<std::int32_t>{1, 2, 6, 4, 0, 3, 5, 7});
  CHECK(p.slot_token == std::vector<std::int32_t>{0, 1, 3, 2, 0, 1, 2, 3});
  CHECK(p.source_slot == std::vector<std::int32_t>{4, 0, 1, 5, 3, 6, 2, 7});
}

TEST_CASE("thrust plan: out-of-range ids show in the offsets and are found") {
  // dispatch.cuh detects bad ids from offsets[E] != N k (a negative id is a huge unsigned key),
  // then looks up the first one for the message.
  const index_t e = 4;
  auto negative = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, -1, 3, 0});
  HostPlan p = thrust_plan(thrust::cpp::par, negative, e);
  CHECK(p.offsets[e] != 6);
  CHECK(detail::first_invalid_expert_id(thrust::cpp::par, negative.data(), 6, 4) == 3);
  auto too_large = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, 3, 4, 7});
  p = thrust_plan(thrust::cpp::par, too_large, e);
  CHECK(p.offsets[e] != 6);
  CHECK(detail::first_invalid_expert_id(thrust::cpp::par, too_large.data(), 6, 4) == 4);
  // the permutation stays a permutation: nothing was written out of bounds
  std::vector<int> seen(6, 0);
  for (std::int32_t a : p.slot_source) ++seen[static_cast<std::size_t>(a)];
  CHECK(seen == std::vector<int>(6, 1));
}
