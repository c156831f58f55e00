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

namespace detail {

// Flags the first position of ids whose id is outside [0, vocab).
template <class I>
__global__ void embedding_bad_id_kernel(const I* ids, index_t n, index_t vocab,
                                        unsigned long long* bad) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    if (IdOutsideRange{vocab}(ids[i])) flag_index(bad, i);
  }
}

// dtable[ids[i], :] += dout[i, :] without Thrust (so that a CUDA graph can hold it) and without
// atomics: one block per position i whose id occurs there first (the block checks the positions
// before it), its threads over the columns, each adding the rows of that id in position order to
// dtable's value: the CPU op's order, bit for bit. O(n^2) id comparisons (broadcast reads): meant
// for the n = B T of a training step (a few thousand); ids outside [0, vocab) are flagged and
// skipped.
template <class T>
__global__ void embedding_backward_direct_kernel(const std::int32_t* ids, index_t n,
                                                 const T* dout, index_t d, index_t vocab,
                                                 T* dtable, unsigned long long* bad) {
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    const std::int32_t v = ids[i];
    if (IdOutsideRange{vocab}(v)) {
      if (threadIdx.x == 0) flag_index(bad, i);
      continue;
    }
    int earlier = 0;
    for (index_t j = threadIdx.x; j < i; j += blockDim.x) earlier |= ids[j] == v ? 1 : 0;
    if (block_reduce(earlier, SumOp{}, 0) != 0) continue;  // not the id's first position
    for (index_t c = threadIdx.x; c < d; c += blockDim.x) {
      T acc = dtable[static_cast<index_t>(v) * d + c];
      for (index_t j = i; j < n; ++j)
        if (ids[j] == v) acc += dout[j * d + c];
      dtable[static_cast<index_t>(v) * d + c] = acc;
    }
  }
}

// Whether the ids' checks can wait (a deferred scope or a graph capture is open): then they are
// deferrable flags, and the backward takes the direct kernel.
inline bool embedding_defers() { return active_device_checks() != nullptr; }

}  // namespace detail

// The first id of `ids` outside [0, vocab), if any (flat position and value): embedding_forward's
// check, before out is prepared. Synchronises the stream, unless a deferred scope is open (then a
// deferrable flag: the gather gives a zero row for such an id until the scope reports it).
inline Offender embedding_first_bad_id(cuda, const Tensor<std::int32_t, cuda>& ids,
                                       index_t vocab) {
  if (!detail::embedding_defers())
    return detail::first_bad_id_of("embedding_forward", ids, vocab);
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  const index_t n = ids.numel();
  if (n > 0) {
    detail::launch_kernel<detail::embedding_bad_id_kernel<std::int32_t>>(detail::grid_for(n), detail::kThreads,
                                                           ids.data(), n, vocab, bad.get());
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  return bad.result<Offender>("embedding_forward",
                              [ids](index_t i) { return detail::offender_at(ids, i); });
}

// out = table[ids]: (ids.shape..., D), prepared by ops/embedding.hpp; the ids are in range.
template <class T>
void embedding_forward(cuda, const Tensor<std::int32_t, cuda>& ids, const Tensor<T, cuda>& table,
                       Tensor<T, cuda>& out) {
  const index_t d = table.dim(1);
  detail::for_each_index(ids.numel() * d, detail::EmbeddingGatherOp<T>{ids.data(), table.data(), d,
                                                                      table.dim(0), out.data()});
}

// dtable[ids[i], :] += dout[i, :], shapes checked by ops/embedding.hpp; returns the first id out
// of [0, V) (dtable untouched then).
template <class T>
Offender embedding_backward(cuda, const Tensor<std::int32_t, cuda>& ids,
                            const Tensor<T, cuda>& dout, Tensor<T, cuda>& dtable) {
  constexpr const char* op = "embedding_backward";
  const index_t d = dtable.dim(1);
  if (detail::embedding_defers()) {  // one kernel, a deferrable flag (dtable's other rows added)
    detail::FirstIndexFlag flag{detail::FirstIndexFlag::Deferrable{}};
    const index_t n = ids.numel();
    if (n > 0 && d > 0) {
      detail::launch_kernel<detail::embedding_backward_direct_kernel<T>>(
          detail::grid_for_rows(n), 128, ids.data(), n, dout.data(), d, dtable.dim(0),
          dtable.data(), flag.get());
      GRAPHMOE_CUDA_CHECK_LAUNCH();
    }
    return flag.result<Offender>(op, [ids](index_t i) { return detail::offender_at(ids, i); });
  }
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
