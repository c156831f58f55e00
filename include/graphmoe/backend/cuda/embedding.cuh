// graphmoe/backend/cuda/embedding.cuh: table lookup by integer id, and its scatter-add backward,
// on the GPU.
//
// The same functions and contract as backend/cpu/embedding.hpp, on Tensor<T, cuda>:
//
//   forward:   out[i, :] = table[ids[i], :]          ids: any shape, n ids; table (V, D)
//                                                    out: (ids.shape..., D)
//   backward:  dtable[ids[i], :] += dout[i, :]       accumulates (dtable is a parameter gradient)
//
// Every id must lie in [0, V); a bad id throws the CPU op's message naming the first bad position
// and its value, before anything is written. The check is a thrust::find_if read back on the
// host, so both functions synchronise the stream.
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

#include "graphmoe/backend/common/checks.hpp"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {
// Throws naming the first id of `ids` outside [0, vocab). Synchronises the stream.
inline void check_ids(const char* op, const Tensor<std::int32_t, cuda>& ids, index_t vocab) {
  index_t bad = -1;
  run_thrust(op, [&](const auto& policy) {
    bad = first_bad_id(policy, ids.data(), ids.numel(), vocab);
  });
  if (bad >= 0)
    embedding_throw_bad_id(op, ids.shape(), bad, read_device_value(ids.data() + bad), vocab);
}
}  // namespace detail

// out = table[ids]: (ids.shape..., D). An empty `out` is allocated.
template <class T>
void embedding_forward(const Tensor<std::int32_t, cuda>& ids, const Tensor<T, cuda>& table,
                       Tensor<T, cuda>& out) {
  constexpr const char* op = "embedding_forward";
  const detail::EmbeddingDims s = detail::embedding_check_table(op, ids, table);
  detail::check_ids(op, ids, s.vocab);
  prepare_output(op, "out", out, detail::embedding_output_shape(op, ids.shape(), s.d));
  detail::for_each_index(ids.numel() * s.d,
                         detail::EmbeddingGatherOp<T>{ids.data(), table.data(), s.d, out.data()});
}

// dtable[ids[i], :] += dout[i, :]. dtable (V, D) must be allocated (V cannot be inferred from the
// ids); dout must have the shape (ids.shape..., D).
template <class T>
void embedding_backward(const Tensor<std::int32_t, cuda>& ids, const Tensor<T, cuda>& dout,
                        Tensor<T, cuda>& dtable) {
  constexpr const char* op = "embedding_backward";
  const detail::EmbeddingDims s = detail::embedding_check_backward(op, ids, dout, dtable);
  detail::check_ids(op, ids, s.vocab);
  const index_t n = ids.numel();
  if (n == 0 || s.d == 0) return;
  Tensor<std::uint32_t, cuda> keys(Shape{n});
  Tensor<index_t, cuda> order(Shape{n});
  Tensor<index_t, cuda> starts(Shape{n});
  detail::run_thrust(op, [&](const auto& policy) {
    detail::embedding_backward_sorted(policy, ids.data(), n, dout.data(), s.d, dtable.data(),
                                      keys.data(), order.data(), starts.data());
  });
}

}  // namespace graphmoe
