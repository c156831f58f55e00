// Downstream consumer of graphmoe::mpi (built when the package has MPI): one process, no mpiexec
// (an MPI singleton). Two translation units include graphmoe/dist/mpi.hpp (this one and
// mpi_second.cpp), so a non-inline definition in it fails to link. Exit status 0 when the
// collectives of a world of size 1 give the expected results.
#include <graphmoe/dist/mpi.hpp>

#include <cstdio>
#include <vector>

// Defined in mpi_second.cpp.
int world_size_of(graphmoe::dist::Communicator& comm);

int main(int argc, char** argv) {
  graphmoe::dist::MpiEnvironment mpi(argc, argv);
  graphmoe::dist::MpiCommunicator comm;
  std::vector<double> v{1.5, 2.5};
  comm.all_reduce_sum(v);
  std::vector<graphmoe::index_t> counts;
  const std::vector<double> got = comm.all_to_all_v(v, std::vector<graphmoe::index_t>{2}, counts);
  const bool ok = world_size_of(comm) == 1 && v == std::vector<double>{1.5, 2.5} && got == v &&
                  counts == std::vector<graphmoe::index_t>{2};
  std::printf("graphmoe consumer_mpi: size=%d %s\n", comm.size(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
