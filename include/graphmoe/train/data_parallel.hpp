// graphmoe/train/data_parallel.hpp: data-parallel training over any Communicator.
//
// Every rank holds the whole model in its own ParameterArena; a global batch of W x b sequences
// is cut into W equal contiguous shards of b (rank r takes rows [r b, (r + 1) b)); each rank runs
// forward and backward on its shard, then
//   average_gradients(comm, arena)      grads := (1 / W) sum over ranks of grads
// (one all-reduce of the arena's single gradient buffer: the arena is already one bucket), and
// every rank takes the same optimizer step on the same gradients, so the parameters stay
// identical without being sent again. broadcast_parameters makes them identical at the start
// (after init or after a checkpoint loaded on the root only).
//
// What equals one process with the whole batch (docs/distributed.md "Data parallel"):
// - the task loss and its gradients: the models' losses are means over the shard's tokens, and
//   the mean of W equal-sized shard means is the mean over the batch (the same for the z-loss);
//   with an ignore_index, only when every shard has the same number of counted targets;
// - NOT the load-balancing loss, which is E sum_e f_e P_e over the shard: a product of two means,
//   so its average over shards differs from its value over the whole batch (as in DeepSpeed,
//   Megatron and fairseq, whose balancing losses are per rank too); nor routing with a capacity
//   (capacity_factor > 0), which is computed from the shard's tokens. Token graphs are within a
//   sequence and a sequence lives on one rank, so they need nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/communicator.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/train/lm_batcher.hpp"

namespace graphmoe::dist {

namespace detail {
// The element ranges [begin, end) of an arena's buffers that hold replicated (not sharded)
// parameters, padding included, adjacent ones merged: the whole buffer when nothing is sharded
// (one collective), else one range per run of replicated parameters between expert shards.
template <class T, class B>
std::vector<std::pair<index_t, index_t>> replicated_ranges(const ParameterArena<T, B>& arena) {
  std::vector<std::pair<index_t, index_t>> out;
  const index_t total = arena.values().numel();
  const auto& ps = arena.params();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (ps[i].sharded()) continue;
    const index_t begin = ps[i].offset;
    const index_t end = i + 1 < ps.size() ? ps[i + 1].offset : total;
    if (!out.empty() && out.back().second == begin) {
      out.back().second = end;
    } else {
      out.emplace_back(begin, end);
    }
  }
  return out;
}

template <class B>
void require_memory_space(const Communicator& comm, const char* op) {
  constexpr MemorySpace want = B::host_memory ? MemorySpace::Host : MemorySpace::Device;
  GRAPHMOE_CHECK(comm.memory_space() == want, op, "the arena's tensors live in ",
                 want == MemorySpace::Host ? "host" : "device", " memory, the communicator's in ",
                 comm.memory_space() == MemorySpace::Host ? "host" : "device", " memory");
}
}  // namespace detail

// Every rank's parameter values := root's (all of them, trainable or not). Collective.
template <class T, class B>
void broadcast_parameters(Communicator& comm, ParameterArena<T, B>& arena, int root = 0) {
  detail::require_memory_space<B>(comm, "dist::broadcast_parameters");
  GRAPHMOE_CHECK(arena.allocated(), "dist::broadcast_parameters",
                 "the arena is not allocated (declare, allocate, bind, init, then broadcast)");
  const Tensor<T, B>& v = arena.values();
  // expert shards differ by rank by design: only the replicated parameters are the root's
  for (const auto& [begin, end] : detail::replicated_ranges(arena)) {
    comm.broadcast(v.data() + begin, end - begin, element_type_of<T>, root);
  }
  arena.mark_values_written();
}

// grads := the mean over ranks of grads (sum, then times 1 / W). Collective: call it on every
// rank after backward and before clipping and the optimizer step, so that clipping sees the
// gradient of the whole batch.
template <class T, class B>
void average_gradients(Communicator& comm, ParameterArena<T, B>& arena) {
  detail::require_memory_space<B>(comm, "dist::average_gradients");
  GRAPHMOE_CHECK(arena.allocated(), "dist::average_gradients", "the arena is not allocated");
  const Tensor<T, B>& g = arena.grads();
  // An expert shard's gradient already sums every rank's tokens (they came to it): it is only
  // scaled. Replicated parameters are all-reduced (one call when nothing is sharded).
  for (const auto& [begin, end] : detail::replicated_ranges(arena)) {
    comm.all_reduce_sum(g.data() + begin, end - begin, element_type_of<T>);
  }
  if (comm.size() > 1) scale(g, static_cast<T>(1.0 / static_cast<double>(comm.size())));
}

// clip_grad_norm (train/optim.hpp) over the whole model when it is spread over the ranks: the
// norm of every trainable gradient, each replicated parameter counted once and every rank's
// expert shards included, then the same clipping on every rank. Call it after average_gradients.
// Equal to clip_grad_norm when nothing is sharded (up to the order of the double sums). Returns
// the norm before clipping; throws on every rank when any gradient is NaN or Inf. Collective.
template <class T>
double clip_grad_norm(Communicator& comm, ParameterArena<T, cpu>& arena, double max_norm) {
  detail::require_memory_space<cpu>(comm, "dist::clip_grad_norm");
  GRAPHMOE_CHECK(arena.allocated(), "dist::clip_grad_norm", "the parameter arena is not allocated");
  GRAPHMOE_CHECK(!std::isnan(max_norm), "dist::clip_grad_norm", "max_norm is nan");
  double sums[2] = {0.0, 0.0};  // replicated (the same on every rank), this rank's shards
  const T* g = arena.grads().data();
  for (const auto& p : arena.params()) {
    if (!p.trainable) continue;
    double s = 0;
    for (index_t j = p.offset; j < p.offset + p.shape.numel(); ++j) {
      s += static_cast<double>(g[j]) * static_cast<double>(g[j]);
    }
    sums[p.sharded() ? 1 : 0] += s;
  }
  comm.all_reduce_sum(&sums[1], 1, ElementType::F64);
  const double norm = std::sqrt(sums[0] + sums[1]);
  GRAPHMOE_CHECK(std::isfinite(norm), "dist::clip_grad_norm", "gradient norm is ",
                 std::isnan(norm) ? "nan" : "inf",
                 " (a trainable gradient holds NaN or Inf on some rank: check the loss and the "
                 "learning rate)");
  if (max_norm > 0 && norm > max_norm) {
    const T factor = static_cast<T>(max_norm / norm);
    T* gm = arena.grads().data();
    for (const auto& p : arena.params()) {
      if (!p.trainable) continue;
      for (index_t j = p.offset; j < p.offset + p.shape.numel(); ++j) gm[j] *= factor;
    }
  }
  return norm;
}

// The mean over ranks of one number (a loss to print or log). Collective.
inline double mean_over_ranks(Communicator& comm, double value) {
  double v = value;
  comm.all_reduce_sum(&v, 1, ElementType::F64);
  return v / static_cast<double>(comm.size());
}

// The largest |value - root's value| over every replicated parameter (expert shards differ by
// design) and every rank (0 when the ranks are in sync, as they must be after each step). Collective; host memory only; costs a
// broadcast of the whole arena, so it is a check, not something to call every step.
template <class T>
double max_parameter_divergence(Communicator& comm, const ParameterArena<T, cpu>& arena, int root = 0) {
  detail::require_memory_space<cpu>(comm, "dist::max_parameter_divergence");
  const Tensor<T, cpu>& v = arena.values();
  Tensor<T, cpu> ref = v.clone();
  comm.broadcast(ref.data(), ref.numel(), element_type_of<T>, root);
  // NaN counts as infinitely divergent
  const auto worse = [](double d, double m) { return std::isnan(d) ? HUGE_VAL : std::max(d, m); };
  double m = 0;
  for (const auto& [begin, end] : graphmoe::dist::detail::replicated_ranges(arena)) {
    for (index_t i = begin; i < end; ++i)
      m = worse(std::abs(static_cast<double>(v.data()[i]) - static_cast<double>(ref.data()[i])), m);
  }
  // the max over ranks: every rank's value in its own slot, summed (a gather)
  std::vector<double> each(static_cast<std::size_t>(comm.size()), 0.0);
  each[static_cast<std::size_t>(comm.rank())] = m;
  comm.all_reduce_sum(each.data(), static_cast<index_t>(each.size()), ElementType::F64);
  double out = 0;
  for (double d : each) out = worse(d, out);
  return out;
}

// The rows [begin, end) of a global batch of `rows` rows that `rank` of `world` takes: W equal
// contiguous blocks. A batch that does not split evenly is refused (unequal shards would weight
// the shards' mean losses wrongly).
struct RowRange {
  index_t begin = 0, end = 0;
};
inline RowRange shard_rows(index_t rows, int rank, int world) {
  GRAPHMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "dist::shard_rows", "rank ", rank,
                 " out of range for a world of ", world);
  GRAPHMOE_CHECK(rows >= world && rows % world == 0, "dist::shard_rows", "a global batch of ",
                 rows, " sequences does not split into ", world,
                 " equal shards: make it a multiple of the world size");
  const index_t b = rows / world;
  return {rank * b, (rank + 1) * b};
}

// This rank's shard of a global LM batch (inputs and targets, rows shard_rows(...)), copied.
inline LMBatch shard(const LMBatch& global, int rank, int world) {
  GRAPHMOE_CHECK(global.inputs.rank() == 2 && global.targets.shape() == global.inputs.shape(),
                 "dist::shard", "inputs ", global.inputs.shape(), " and targets ",
                 global.targets.shape(), " must be the same (B, T)");
  const RowRange r = shard_rows(global.inputs.dim(0), rank, world);
  return LMBatch{global.inputs.slice(r.begin, r.end).clone(),
                 global.targets.slice(r.begin, r.end).clone()};
}
inline LMBatch shard(const LMBatch& global, const Communicator& comm) {
  return shard(global, comm.rank(), comm.size());
}

}  // namespace graphmoe::dist
