// graphmoe/train/distributed_checkpoint.hpp: checkpoints of a model spread over ranks (expert
// parallel), in the one-file safetensors format of docs/checkpoints.md.
//
// The file holds every parameter WHOLE, under its usual name, whatever the world size that wrote
// it: an expert shard's rows are gathered to the root, which writes. Loading needs nothing
// distributed: load_arena and load_training_state give an expert shard its own rows of the whole
// tensor, so a file written at world size 4 loads at world size 1 (a one-process model), 2 or 4,
// and a one-process checkpoint loads into an expert-parallel model (docs/distributed.md,
// "Checkpoints").
#pragma once

#include <map>
#include <string>
#include <vector>

#include "graphmoe/core/communicator.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/optim.hpp"

namespace graphmoe::dist {

// The whole tensor of a sharded parameter p (ParameterInfo::sharded) on `root`, from each rank's
// rows `local` (p.shape): an empty tensor on the other ranks. The shards must be the equal
// contiguous blocks of expert_shard, rank r holding block r. Collective.
template <class T>
Tensor<T, cpu> gather_parameter(Communicator& comm, const ParameterInfo& p,
                                const Tensor<T, cpu>& local, int root = 0) {
  constexpr const char* op = "dist::gather_parameter";
  GRAPHMOE_CHECK(root >= 0 && root < comm.size(), op, "root ", root, " out of range for a world of ",
                 comm.size());
  GRAPHMOE_CHECK(p.sharded() && p.shape[0] * comm.size() == p.shard_rows &&
                     p.shard_begin == comm.rank() * p.shape[0],
                 op, "'", p.name, "' is not this rank's block of ", comm.size(),
                 " equal shards (rows ", p.shard_begin, " of ", p.shard_rows, ", shape ", p.shape,
                 ")");
  check_shape(op, "local", local, p.shape);
  const index_t n = p.shape.numel();
  const bool me = comm.rank() == root;
  std::vector<index_t> send(static_cast<std::size_t>(comm.size()), 0), recv(send.size(), 0);
  send[static_cast<std::size_t>(root)] = n;
  if (me) recv.assign(recv.size(), n);
  Tensor<T, cpu> full = me ? Tensor<T, cpu>(p.full_shape()) : Tensor<T, cpu>();
  comm.all_to_all_v(local.data(), n, send, full.data(), me ? full.numel() : 0, recv,
                    element_type_of<T>);
  return full;
}

// save_training_state (train/training_state.hpp) for an arena that may hold expert shards: the
// model and the AdamW state with every shard gathered whole to root, which writes the file
// (atomically, as save_training_state). Collective; the other ranks write nothing. Without shards
// it writes what save_training_state writes on root.
template <class T>
void save_training_state(Communicator& comm, const std::string& path,
                         const ParameterArena<T, cpu>& arena, const AdamW<T, cpu>& adam,
                         std::map<std::string, std::string> metadata, int root = 0) {
  GRAPHMOE_CHECK(arena.allocated(), "dist::save_training_state", "the arena is not allocated");
  const bool me = comm.rank() == root;
  std::vector<Tensor<T, cpu>> keep;  // the gathered tensors, alive until the file is written
  std::vector<TensorRef> refs;
  const auto add = [&](const std::string& name, const ParameterInfo& p, const Tensor<T, cpu>& view) {
    if (p.sharded()) {
      Tensor<T, cpu> full = gather_parameter(comm, p, view, root);
      if (me) {
        keep.push_back(full);
        refs.push_back({name, dtype_of<T>(), full.shape(), full.data()});
      }
    } else if (me) {
      refs.push_back({name, dtype_of<T>(), view.shape(), view.data()});
    }
  };
  for (index_t i = 0; i < arena.size(); ++i) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    add("model." + p.name, p, arena.value(i));
  }
  for (const auto& [name, view] : adam.state(arena)) {
    // "adamw.m.<param>" / "adamw.v.<param>"
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(arena.find(name.substr(8)))];
    add(name, p, view);
  }
  metadata["optimizer_steps"] = std::to_string(adam.steps());
  // the root's save can fail (disk full): every rank learns it, none is left waiting
  std::string bad;
  if (me) {
    try {
      save_safetensors(path, refs, metadata);
    } catch (const Error& e) {
      bad = e.what();
    }
  }
  double failed = bad.empty() ? 0.0 : 1.0;
  comm.all_reduce_sum(&failed, 1, ElementType::F64);
  GRAPHMOE_CHECK(bad.empty(), "dist::save_training_state", bad);
  GRAPHMOE_CHECK(failed == 0.0, "dist::save_training_state", "rank ", root, " could not write '",
                 path, "' (its own error says why)");
}

}  // namespace graphmoe::dist
