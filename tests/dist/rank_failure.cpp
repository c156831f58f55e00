// A job in which one rank fails while the others wait for it in a collective; run by
// run_rank_failure.cmake under mpiexec, which checks that the whole job stops, non-zero, soon.
//
//   rank_failure kill    rank 1 kills itself with SIGKILL (a crash, the OOM killer): no
//                        exception, no MPI_Finalize; the launcher must notice and end the job
//   rank_failure throw   rank 1 throws graphmoe::Error out of the MpiEnvironment's scope: its
//                        destructor calls MPI_Abort instead of waiting in MPI_Finalize
//
// The other ranks loop on all_reduce_sum, which cannot complete without rank 1. Every rank arms
// alarm(60), so that no process outlives a launcher that fails to clean up.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <vector>

#include "graphmoe/dist/mpi.hpp"

int main(int argc, char** argv) {
  alarm(60);
  const bool kill = argc > 1 && std::strcmp(argv[1], "kill") == 0;
  const bool throw_error = argc > 1 && std::strcmp(argv[1], "throw") == 0;
  if (!kill && !throw_error) {
    std::fprintf(stderr, "usage: rank_failure kill|throw\n");
    return 2;
  }
  try {
    graphmoe::dist::MpiEnvironment mpi(argc, argv);
    graphmoe::dist::MpiCommunicator comm;
    comm.barrier();
    std::vector<float> grads(4096, 1.0f);
    if (comm.rank() == 1) {
      usleep(300 * 1000);  // the others are inside all_reduce_sum by now
      std::printf("rank_failure: rank 1 fails now (%s)\n", kill ? "SIGKILL" : "throw");
      std::fflush(stdout);
      if (kill) std::raise(SIGKILL);
      throw graphmoe::Error("graphmoe::rank_failure: rank 1 gives up");
    }
    std::printf("rank_failure: rank %d enters all_reduce_sum\n", comm.rank());
    std::fflush(stdout);
    for (;;) comm.all_reduce_sum(grads);
  } catch (const graphmoe::Error& e) {
    // Not reached from rank 1's throw: the MpiEnvironment's destructor runs while that exception
    // propagates and calls MPI_Abort, which ends the job. Reached when MPI setup itself fails.
    std::fprintf(stderr, "rank_failure: %s\n", e.what());
    return 1;
  }
}
