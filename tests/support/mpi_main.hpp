// tests/support/mpi_main.hpp: main() of a doctest program run under mpiexec (ctest starts it with
// 2 and 4 ranks). Include it once, in place of <doctest/doctest.h>, from the program's one source
// file; test cases reach MPI_COMM_WORLD's communicator through test::world().
//
// Every rank runs every test case in the same order, and the cases use CHECK, not REQUIRE, so
// that a failed assertion on one rank does not make it skip a collective the others enter. The
// program fails on every rank if any rank failed.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>
#include <unistd.h>

#include "graphmoe/dist/mpi.hpp"

namespace graphmoe::test {
inline dist::MpiCommunicator*& world_pointer() {
  static dist::MpiCommunicator* comm = nullptr;
  return comm;
}
// MPI_COMM_WORLD's communicator (valid while main() runs the test cases).
inline dist::MpiCommunicator& world() { return *world_pointer(); }
}  // namespace graphmoe::test

int main(int argc, char** argv) {
  alarm(240);  // no rank outlives a stuck test by much (ctest's TIMEOUT kills mpiexec only)
  graphmoe::dist::MpiEnvironment mpi(argc, argv);
  graphmoe::dist::MpiCommunicator comm;
  graphmoe::test::world_pointer() = &comm;
  doctest::Context context(argc, argv);
  const int failed = context.run();
  int any_failed = failed != 0;
  MPI_Allreduce(MPI_IN_PLACE, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  graphmoe::test::world_pointer() = nullptr;
  if (context.shouldExit()) return failed;
  return any_failed;
}
