// --dp N in the examples' main(): the MPI world (when N > 1) and the handling of errors under it.
// Included by main.cpp only; the training loops see common/data_parallel.hpp.
//
// With GRAPHMOE_EXAMPLES_MPI (examples/CMakeLists.txt defines it when graphmoe::mpi exists):
//   --dp 1 (the default)  MPI is not initialised at all: the program runs as it always did. If an
//                         MPI launcher started several copies of it, it refuses (each copy would
//                         train alone and overwrite the others' files).
//   --dp N > 1            MPI_Init; the world must have exactly N ranks.
// Without MPI, --dp N > 1 is refused.
#pragma once

#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "common/data_parallel.hpp"
#include "graphmoe/config.hpp"
#include "graphmoe/train/divergence.hpp"

#if defined(GRAPHMOE_EXAMPLES_MPI)
#include "graphmoe/dist/mpi.hpp"
#endif

namespace examples {

class DataParallelWorld {
 public:
  // Sets dp.comm when dp.ranks > 1 (MPI_Init, then a duplicate of MPI_COMM_WORLD). Refuses
  // nothing itself: check() does, inside main()'s try, so that fail() can handle its errors.
  DataParallelWorld(int& argc, char**& argv, const char* program, DataParallel& dp)
      : program_(program), dp_(dp) {
#if defined(GRAPHMOE_EXAMPLES_MPI)
    if (dp.ranks > 1) {
      mpi_.emplace(argc, argv);
      world_.emplace();
      dp.comm = &*world_;
    }
#endif
    (void)argc;
    (void)argv;
  }

  // Throws SameOnEveryRank when the world has another size than --dp, graphmoe::Error when this
  // binary has no MPI and --dp > 1, or when several copies were launched with --dp 1.
  void check() const {
    const long launched = launcher_world_size();
    if (dp_.ranks == 1) {
      GRAPHMOE_CHECK(launched <= 1, program_, "this is one of ", launched,
                     " processes started by an MPI launcher, but --dp is 1: each would train the "
                     "same model alone and write the same files. Pass --dp ", launched,
                     " to train one model data parallel over them");
      return;
    }
#if defined(GRAPHMOE_EXAMPLES_MPI)
    if (world_->size() != dp_.ranks)
      throw_same_on_every_rank(program_, "--dp ", dp_.ranks,
                               " must equal the number of MPI processes, which is ",
                               world_->size(), ": launch with mpirun -n ", dp_.ranks,
                               " (or pass --dp ", world_->size(), ")");
#else
    GRAPHMOE_CHECK(false, program_, "--dp ", dp_.ranks,
                   ": this binary was built without MPI, so it trains in one process only (--dp "
                   "1). Install MPI (scripts/install-deps.sh: libopenmpi-dev openmpi-bin) and "
                   "re-run cmake (GRAPHMOE_ENABLE_MPI)");
#endif
  }
  DataParallelWorld(const DataParallelWorld&) = delete;
  DataParallelWorld& operator=(const DataParallelWorld&) = delete;

  // main()'s catch: prints the error and returns the exit status. With one process:
  // "<program>: error: <what>" and 1, as without --dp. With several ranks, an error every
  // rank raises alike (SameOnEveryRank, the divergence guard's decisions, which are taken on
  // values reduced over the ranks) is printed by rank 0 and every rank returns 1, so that MPI
  // finalises normally; any other error is printed by its rank and ends the whole job
  // (MPI_Abort), since the other ranks may be waiting for this one in a collective.
  int fail(const std::exception& e) {
    if (!dp_.active()) {
      std::fprintf(stderr, "%s: error: %s\n", program_, e.what());
      return 1;
    }
    const bool same_everywhere = dynamic_cast<const SameOnEveryRank*>(&e) != nullptr ||
                                 dynamic_cast<const graphmoe::DivergenceError*>(&e) != nullptr;
    if (same_everywhere) {
      if (dp_.root()) std::fprintf(stderr, "%s: error: %s\n", program_, e.what());
      return 1;
    }
    std::fprintf(stderr, "%s: error on rank %d of %d: %s\n", program_, dp_.rank(), dp_.size(),
                 e.what());
    std::fflush(stderr);
#if defined(GRAPHMOE_EXAMPLES_MPI)
    graphmoe::dist::MpiEnvironment::abort(1);
#endif
    return 1;
  }

 private:
  const char* program_;
  DataParallel& dp_;
#if defined(GRAPHMOE_EXAMPLES_MPI)
  // destroyed in reverse: the communicator is freed before MPI_Finalize
  std::optional<graphmoe::dist::MpiEnvironment> mpi_;
  std::optional<graphmoe::dist::MpiCommunicator> world_;
#endif
};

}  // namespace examples
