// --dp N for the training examples: data parallel over the ranks of an MPI job
// (docs/distributed.md, "Running data parallel from the command line").
//
//   mpirun -n 2 --bind-to none train_lm --dp 2 --batch 8 ...
//
// --batch stays the GLOBAL batch: every rank draws the same global batch from the same data
// stream (same seed) and trains on its contiguous shard of --batch / --dp sequences
// (dist::shard); the gradients are averaged over the ranks before clipping, so that a run with
// --dp N trains like one process with the same --batch (up to float rounding, and with
// --load-balance 0: the balancing loss is per shard, graphmoe/train/data_parallel.hpp).
//
// This header is MPI-free (the training loops include it): it sees the communicator through
// graphmoe::dist::Communicator. The MPI world itself is set up by main() with DataParallelWorld
// (common/data_parallel_world.hpp).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>

#include "graphmoe/core/communicator.hpp"
#include "graphmoe/train/distributed_checkpoint.hpp"
#include "graphmoe/train/data_parallel.hpp"
#include "graphmoe/train/training_state.hpp"

namespace examples {

inline constexpr std::int64_t kMaxRanks = 65'536;  // --dp

// The run's ranks: `comm` is the MPI world's communicator when --dp N > 1, null for one process.
struct DataParallel {
  int ranks = 1;                                 // --dp
  int experts = 1;                               // --ep: 1, or ranks (the experts split over them)
  graphmoe::dist::Communicator* comm = nullptr;  // set by main() when ranks > 1
  bool active() const { return comm != nullptr && comm->size() > 1; }
  // --ep N: every MoE layer's experts split over the ranks (TransformerLM's expert-parallel
  // constructor); the forward and backward passes, clipping and saving are then collective.
  bool expert_parallel() const { return active() && experts > 1; }
  int rank() const { return comm != nullptr ? comm->rank() : 0; }
  int size() const { return comm != nullptr ? comm->size() : 1; }
  // Rank 0 prints, writes metrics and checkpoints; the other ranks write nothing.
  bool root() const { return rank() == 0; }
};

// An error that every rank raises at the same point of the run, from the same values (a check
// of the command line against the world, a divergence decided on a value reduced over the
// ranks): the ranks can all stop cleanly, and rank 0 alone prints it. Any other error may be one
// rank's alone, while the others wait in a collective: that one ends the whole job (MPI_Abort).
struct SameOnEveryRank : graphmoe::Error {
  using graphmoe::Error::Error;
};
// Throws SameOnEveryRank("graphmoe::<op>: <parts>"), worded like GRAPHMOE_CHECK's errors.
template <class... Args>
[[noreturn]] void throw_same_on_every_rank(const char* op, const Args&... parts) {
  std::ostringstream os;
  os << "graphmoe::" << op << ": ";
  (os << ... << parts);
  throw SameOnEveryRank(os.str());
}

// --dp N's checks on the other flags, alike on every rank: --batch (the global batch, of `what`:
// "sequences", "images", "examples") a multiple of N, and --device cpu (the MPI communicator
// moves host memory).
inline void check_data_parallel(const char* program, const DataParallel& dp, long long batch,
                                const std::string& device, const char* what) {
  if (dp.ranks <= 1) return;
  if (batch % dp.ranks != 0)
    throw_same_on_every_rank(program, "--batch ", batch, " is not a multiple of --dp ", dp.ranks,
                             ": --batch is the global batch, split into ", dp.ranks,
                             " equal shards of --batch / --dp ", what);
  if (device != "cpu")
    throw_same_on_every_rank(program, "--dp ", dp.ranks,
                             " needs --device cpu (the MPI communicator moves host memory)");
}

// The number of processes the MPI launcher started, from its environment (Open MPI's mpirun,
// MPICH's Hydra); 0 when none says so. Read without initialising MPI.
inline long launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n > 0) return n;
    }
  }
  return 0;
}

// The whole batch's value of a per-shard mean (the mean over the ranks; equal shards). The
// value itself with one process.
inline double mean_over_ranks(const DataParallel& dp, double value) {
  return dp.active() ? graphmoe::dist::mean_over_ranks(*dp.comm, value) : value;
}

// This rank's shard of a global LM batch (the batch itself with one process).
inline graphmoe::LMBatch shard(const DataParallel& dp, const graphmoe::LMBatch& global) {
  return dp.active() ? graphmoe::dist::shard(global, *dp.comm) : global;
}

// The collectives on the whole parameter arena. They move host memory: main() refuses --dp N > 1
// with --device cuda, and on a backend whose tensors are not in host memory (B::host_memory) these
// do nothing (one process); those graphmoe::dist offers for ParameterArena<T, cpu> alone are
// called for the CPU alone.
template <class T, class B>
void broadcast_parameters(const DataParallel& dp, graphmoe::ParameterArena<T, B>& arena) {
  if constexpr (B::host_memory) {
    if (dp.active()) graphmoe::dist::broadcast_parameters(*dp.comm, arena);
  }
}
// grads := their mean over the ranks: after backward, before clipping.
template <class T, class B>
void average_gradients(const DataParallel& dp, graphmoe::ParameterArena<T, B>& arena) {
  if constexpr (B::host_memory) {
    if (dp.active()) graphmoe::dist::average_gradients(*dp.comm, arena);
  }
}
// The largest difference of any parameter from rank 0's, over the ranks (0 with one process).
template <class T, class B>
double max_parameter_divergence(const DataParallel& dp, const graphmoe::ParameterArena<T, B>& arena) {
  if constexpr (std::is_same_v<B, graphmoe::cpu>) {
    if (dp.active()) return graphmoe::dist::max_parameter_divergence(*dp.comm, arena);
  }
  return 0.0;
}

// The communicator over which the routers' after-step hooks sum the step's expert loads
// (TransformerLM::after_optimizer_step): the ranks' world on the CPU, none otherwise (as above).
template <class B>
graphmoe::dist::Communicator* routers_comm(const DataParallel& dp) {
  if constexpr (B::host_memory) return dp.active() ? dp.comm : nullptr;
  return nullptr;
}

// The global gradient norm, clipped: over every rank's expert shards with --ep (collective),
// else this arena's (the same on every rank after average_gradients).
template <class T, class B>
double clip_grad_norm(const DataParallel& dp, graphmoe::ParameterArena<T, B>& arena, double clip) {
  if constexpr (std::is_same_v<B, graphmoe::cpu>) {
    if (dp.expert_parallel()) return graphmoe::dist::clip_grad_norm(*dp.comm, arena, clip);
  }
  return graphmoe::clip_grad_norm(arena, clip);
}

// Writes a training checkpoint: rank 0 alone, or with --ep every rank (collective: rank 0 gathers
// the expert shards and writes, graphmoe/train/distributed_checkpoint.hpp). Call it on every rank.
template <class T, class B>
void save_training_state(const DataParallel& dp, const std::string& path,
                         const graphmoe::ParameterArena<T, B>& arena, const graphmoe::AdamW<T, B>& adam,
                         const std::map<std::string, std::string>& metadata) {
  if constexpr (std::is_same_v<B, graphmoe::cpu>) {
    if (dp.expert_parallel()) {
      graphmoe::dist::save_training_state(*dp.comm, path, arena, adam, metadata);
      return;
    }
  }
  if (dp.root()) graphmoe::save_training_state(path, arena, adam, metadata);
}

}  // namespace examples
