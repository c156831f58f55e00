// graphmoe/dist/mpi.hpp: MpiEnvironment (MPI_Init_thread / MPI_Finalize as an object) and
// MpiCommunicator (graphmoe::dist::Communicator over an MPI communicator, host memory).
//
// Needs MPI: link graphmoe::mpi (built when CMake finds MPI; GRAPHMOE_ENABLE_MPI), which brings
// MPI::MPI_CXX. Only the MPI C API is used. docs/distributed.md has the whole story.
//
//   int main(int argc, char** argv) {
//     graphmoe::dist::MpiEnvironment mpi(argc, argv);   // MPI_Init_thread(FUNNELED)
//     graphmoe::dist::MpiCommunicator comm;             // a dup of MPI_COMM_WORLD
//     comm.all_reduce_sum(arena.grads());
//   }                                                   // MPI_Comm_free, MPI_Finalize
//
// Errors: every MPI call's return code is checked (the communicator's error handler is
// MPI_ERRORS_RETURN), and a failing call throws graphmoe::Error naming the call and MPI's error
// string, on the rank where it failed. Bad arguments are caught before any MPI data call, on
// every rank alike (core/communicator.hpp). A rank that dies (a signal, exit without
// MPI_Finalize) is handled by the launcher: Open MPI's mpirun kills the other ranks and exits
// non-zero, naming the rank that died.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <vector>

#include "graphmoe/core/communicator.hpp"

namespace graphmoe::dist {

namespace detail {

// Throws graphmoe::Error("graphmoe::<op>: <call> failed: <MPI's error string> ...") unless
// rc == MPI_SUCCESS.
inline void mpi_check(int rc, const char* op, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof text, "(no error string for code %d)", rc);
  }
  int error_class = rc;
  MPI_Error_class(rc, &error_class);
  ::graphmoe::detail::throw_error(op, call, " failed: ", text, " (MPI error code ", rc, ", class ",
                                  error_class, ")");
}

inline MPI_Datatype mpi_type(ElementType type) {
  switch (type) {
    case ElementType::F32:
      return MPI_FLOAT;
    case ElementType::F64:
      return MPI_DOUBLE;
    case ElementType::I32:
      return MPI_INT32_T;
    case ElementType::I64:
      return MPI_INT64_T;
  }
  ::graphmoe::detail::throw_error("dist::MpiCommunicator", "unknown element type ",
                                  static_cast<int>(type));
}

inline bool mpi_initialized() {
  int flag = 0;
  mpi_check(MPI_Initialized(&flag), "dist::MpiEnvironment", "MPI_Initialized");
  return flag != 0;
}

inline bool mpi_finalized() {
  int flag = 0;
  mpi_check(MPI_Finalized(&flag), "dist::MpiEnvironment", "MPI_Finalized");
  return flag != 0;
}

}  // namespace detail

// The thread levels of MPI_Init_thread. Funneled (the default): only the thread that initialised
// MPI calls it, which is how graphmoe uses it (OpenMP threads never call MPI).
enum class MpiThreadLevel : int {
  Single = MPI_THREAD_SINGLE,
  Funneled = MPI_THREAD_FUNNELED,
  Serialized = MPI_THREAD_SERIALIZED,
  Multiple = MPI_THREAD_MULTIPLE,
};

// MPI for the lifetime of this object: the constructor calls MPI_Init_thread unless MPI is
// already initialised (by the application or another library; then this object neither
// initialises nor finalises it), and throws graphmoe::Error if MPI was already finalised or
// provides a lower thread level than required. The destructor calls MPI_Finalize if this object
// initialised MPI, except while an exception propagates through it: then it calls
// MPI_Abort(MPI_COMM_WORLD, 1) (saying so on stderr), because the other ranks may be waiting in a
// collective that this rank will never enter, and MPI_Finalize would wait for them forever. (An
// exception that no handler catches never unwinds: std::terminate aborts the process, and the
// launcher ends the job as for any rank that dies.) Create one, in main,
// before any MpiCommunicator, and destroy the communicators first (declare them after it).
class MpiEnvironment {
 public:
  MpiEnvironment(int& argc, char**& argv, MpiThreadLevel required = MpiThreadLevel::Funneled)
      : MpiEnvironment(&argc, &argv, required) {}
  explicit MpiEnvironment(MpiThreadLevel required = MpiThreadLevel::Funneled)
      : MpiEnvironment(nullptr, nullptr, required) {}

  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  ~MpiEnvironment() {
    if (!owner_) return;
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (std::uncaught_exceptions() > uncaught_at_start_) {
      int rank = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      std::fprintf(stderr,
                   "graphmoe::dist::MpiEnvironment: an exception leaves the MPI scope on rank %d; "
                   "calling MPI_Abort so that the other ranks do not wait for it forever\n",
                   rank);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Finalize();
  }

  // Whether this object called MPI_Init_thread (and will call MPI_Finalize).
  bool owner() const { return owner_; }
  MpiThreadLevel provided() const { return provided_; }

  // Ends every process of the job (MPI_Abort on MPI_COMM_WORLD) with the given exit code.
  [[noreturn]] static void abort(int code = 1) {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::abort();  // MPI_Abort does not return; in case an implementation does
  }

 private:
  MpiEnvironment(int* argc, char*** argv, MpiThreadLevel required)
      : uncaught_at_start_(std::uncaught_exceptions()) {
    const char* op = "dist::MpiEnvironment";
    GRAPHMOE_CHECK(!detail::mpi_finalized(), op,
                   "MPI was already finalised; it cannot be initialised again in this process");
    int provided = 0;
    if (detail::mpi_initialized()) {
      detail::mpi_check(MPI_Query_thread(&provided), op, "MPI_Query_thread");
    } else {
      detail::mpi_check(MPI_Init_thread(argc, argv, static_cast<int>(required), &provided), op,
                        "MPI_Init_thread");
      owner_ = true;
    }
    provided_ = static_cast<MpiThreadLevel>(provided);
    if (provided < static_cast<int>(required)) {
      if (owner_) MPI_Finalize();
      owner_ = false;
      ::graphmoe::detail::throw_error(op, "MPI provides thread level ", provided, " but level ",
                                      static_cast<int>(required),
                                      " is required (MPI_THREAD_SINGLE = 0, FUNNELED = 1, "
                                      "SERIALIZED = 2, MULTIPLE = 3)");
    }
  }

  int uncaught_at_start_ = 0;
  bool owner_ = false;
  MpiThreadLevel provided_ = MpiThreadLevel::Single;
};

// A Communicator over its own duplicate of an MPI communicator (MPI_COMM_WORLD by default), so
// that graphmoe's messages never mix with the application's. Host memory. Collective: every rank
// of `comm` constructs it (MPI_Comm_dup) and destroys it (MPI_Comm_free, skipped once MPI is
// finalised). MPI takes int counts: all_reduce_sum and broadcast are sent in pieces of at most
// max_count() elements; an all_to_all_v block or displacement above it is refused with an Error.
struct MpiCommunicatorOptions {
  // The most elements in one MPI call (1 ... INT_MAX). Smaller values exist for tests, which
  // check the splitting with small buffers. Must be the same on every rank (checked).
  index_t max_count = INT_MAX;
};

class MpiCommunicator final : public Communicator {
 public:
  using Options = MpiCommunicatorOptions;

  MpiCommunicator() : MpiCommunicator(MPI_COMM_WORLD, Options{}) {}
  explicit MpiCommunicator(MPI_Comm comm, Options options = {}) : options_(options) {
    const char* op = "dist::MpiCommunicator";
    GRAPHMOE_CHECK(detail::mpi_initialized() && !detail::mpi_finalized(), op,
                   "MPI is not initialised (or already finalised): create a "
                   "graphmoe::dist::MpiEnvironment first");
    GRAPHMOE_CHECK(comm != MPI_COMM_NULL, op, "the communicator is MPI_COMM_NULL");
    GRAPHMOE_CHECK(1 <= options_.max_count && options_.max_count <= INT_MAX, op,
                   "Options::max_count = ", options_.max_count, " is outside [1, ", INT_MAX,
                   "] (MPI counts are int)");
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), op, "MPI_Comm_dup");
    try {
      detail::mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), op,
                        "MPI_Comm_set_errhandler");
      detail::mpi_check(MPI_Comm_rank(comm_, &rank_), op, "MPI_Comm_rank");
      detail::mpi_check(MPI_Comm_size(comm_, &size_), op, "MPI_Comm_size");
    } catch (...) {
      free_comm();
      throw;
    }
  }

  ~MpiCommunicator() override { free_comm(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MemorySpace memory_space() const override { return MemorySpace::Host; }
  index_t max_count() const override { return options_.max_count; }
  // The duplicated communicator (owned by this object).
  MPI_Comm comm() const { return comm_; }

  void barrier() override { detail::mpi_check(MPI_Barrier(comm_), "dist::barrier", "MPI_Barrier"); }

 protected:
  void all_reduce_sum_impl(void* data, index_t count, ElementType type) override {
    auto* bytes = static_cast<char*>(data);
    const std::size_t es = element_size(type);
    for (index_t done = 0; done < count;) {
      const index_t n = std::min(count - done, options_.max_count);
      detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, bytes + static_cast<std::size_t>(done) * es,
                                      static_cast<int>(n), detail::mpi_type(type), MPI_SUM, comm_),
                        "dist::all_reduce_sum", "MPI_Allreduce");
      done += n;
    }
  }

  void broadcast_impl(void* data, index_t count, ElementType type, int root) override {
    auto* bytes = static_cast<char*>(data);
    const std::size_t es = element_size(type);
    for (index_t done = 0; done < count;) {
      const index_t n = std::min(count - done, options_.max_count);
      detail::mpi_check(MPI_Bcast(bytes + static_cast<std::size_t>(done) * es, static_cast<int>(n),
                                  detail::mpi_type(type), root, comm_),
                        "dist::broadcast", "MPI_Bcast");
      done += n;
    }
  }

  void all_to_all_v_impl(const void* send, const index_t* send_counts, const index_t* send_displs,
                         void* recv, const index_t* recv_counts, const index_t* recv_displs,
                         ElementType type) override {
    // Checked against max_count() <= INT_MAX by Communicator before this is called.
    const std::size_t p = static_cast<std::size_t>(size_);
    std::vector<int> sc(p), sd(p), rc(p), rd(p);
    for (std::size_t j = 0; j < p; ++j) {
      sc[j] = static_cast<int>(send_counts[j]);
      sd[j] = static_cast<int>(send_displs[j]);
      rc[j] = static_cast<int>(recv_counts[j]);
      rd[j] = static_cast<int>(recv_displs[j]);
    }
    const MPI_Datatype t = detail::mpi_type(type);
    detail::mpi_check(
        MPI_Alltoallv(send, sc.data(), sd.data(), t, recv, rc.data(), rd.data(), t, comm_),
        "dist::all_to_all_v", "MPI_Alltoallv");
  }

  void min_over_ranks(std::span<std::int64_t> values) override {
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                                    MPI_INT64_T, MPI_MIN, comm_),
                      "dist::MpiCommunicator", "MPI_Allreduce (argument agreement)");
  }

 private:
  void free_comm() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  Options options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace graphmoe::dist
