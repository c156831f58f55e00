// graphmoe/backend/cuda/embedding.cuh: table lookup by integer id, and its scatter-add backward,
// on the GPU.
//
// The CUDA system's embedding (contract and argument checks: ops/embedding.hpp, which calls these
// through the backend tag), on Tensor<T, cuda>:
//
//   forward:   out[i, :] = table[ids[i], :]          ids: any shape, n ids; table (V, D)
//                                                    out: (ids.shape..., D)
//   backward:  dtable[ids[i], :] += dout[i, :]       accumulates (dtable is a parameter gradient)
//
// The first id outside [0, V) is found before anything is written, by a thrust::find_if read back
// on the host (embedding_first_bad_id, and embedding_backward before it adds), so both synchronise
// the stream.
//
// The forward pass is one thread per output entry. The backward pass uses no atomics: the
// positions 0..n-1 are sorted by id (Thrust's stable radix sort), the runs of equal ids found, and
// one thread per (run, column) adds the run's rows of dout in position order, the order in which
// the CPU op adds them (detail::embedding_backward_sorted in detail/nn_functors.hpp, tested on the
// host by test_host_nn_ops). The result is deterministic and bit-identical to the CPU backend's.
// A very frequent id (a padding token) makes one long run: its threads loop over all its rows.
// Scratch: 20 bytes per id, from the caching allocator.
#pragma once

#include <cstdint>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {
// The first id of `ids` outside [0, vocab), if any; `op` names the op in a Thrust error.
// Synchronises the stream.
inline Offender first_bad_id_of(const char* op, const Tensor<std::int32_t, cuda>& ids,
                                index_t vocab) {
  index_t bad = -1;
  run_thrust(op, [&](const auto& policy) {
    bad = first_bad_id(policy, ids.data(), ids.numel(), vocab);
  });
  if (bad < 0) return {};
  return {bad, static_cast<double>(read_device_value(ids.data() + bad))};
}
}  // namespace detail

// The first id of `ids` outside [0, vocab), if any (flat position and value): embedding_forward's
// check, before out is prepared. Synchronises the stream.
inline Offender embedding_first_bad_id(cuda, const Tensor<std::int32_t, cuda>& ids,
                                       index_t vocab) {
  return detail::first_bad_id_of("embedding_forward", ids, vocab);
}

// out = table[ids]: (ids.shape..., D), prepared by ops/embedding.hpp; the ids are in range.
template <class T>
void embedding_forward(cuda, const Tensor<std::int32_t, cuda>& ids, const Tensor<T, cuda>& table,
                       Tensor<T, cuda>& out) {
  const index_t d = table.dim(1);
  detail::for_each_index(ids.numel() * d,
                         detail::EmbeddingGatherOp<T>{ids.data(), table.data(), d, out.data()});
}

// dtable[ids[i], :] += dout[i, :], shapes checked by ops/embedding.hpp; returns the first id out
// of [0, V) (dtable untouched then).
template <class T>
Offender embedding_backward(cuda, const Tensor<std::int32_t, cuda>& ids,
                            const Tensor<T, cuda>& dout, Tensor<T, cuda>& dtable) {
  constexpr const char* op = "embedding_backward";
  const index_t d = dtable.dim(1);
  const Offender bad = detail::first_bad_id_of(op, ids, dtable.dim(0));
  if (bad.found()) return bad;
  const index_t n = ids.numel();
  if (n == 0 || d == 0) return {};
  Tensor<std::uint32_t, cuda> keys(Shape{n});
  Tensor<index_t, cuda> order(Shape{n});
  Tensor<index_t, cuda> starts(Shape{n});
  detail::run_thrust(op, [&](const auto& policy) {
    detail::embedding_backward_sorted(policy, ids.data(), n, dout.data(), d, dtable.data(),
                                      keys.data(), order.data(), starts.data());
  });
  return {};
}

}  // namespace graphmoe
