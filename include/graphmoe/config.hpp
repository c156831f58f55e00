// graphmoe/config.hpp: version, host/device macros, the library's one error type and its checks.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#define GRAPHMOE_VERSION_MAJOR 0
#define GRAPHMOE_VERSION_MINOR 1
#define GRAPHMOE_VERSION_PATCH 0

// Functions callable from host and device code when compiled by nvcc; plain functions otherwise.
#if defined(__CUDACC__)
#define GRAPHMOE_HOST_DEVICE __host__ __device__
#define GRAPHMOE_DEVICE __device__
#else
#define GRAPHMOE_HOST_DEVICE
#define GRAPHMOE_DEVICE
#endif

// True during nvcc's device compilation pass only.
#if defined(__CUDA_ARCH__)
#define GRAPHMOE_DEVICE_PASS 1
#else
#define GRAPHMOE_DEVICE_PASS 0
#endif

namespace graphmoe {

// The one exception type the library throws for bad input, bad configuration and bad files.
// Messages start with the operation that failed ("graphmoe::gemm: ...") and name the offending
// shapes or values.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args>
[[noreturn]] inline void throw_error(const char* op, Args&&... parts) {
  std::ostringstream os;
  os << "graphmoe::" << op << ": ";
  (os << ... << std::forward<Args>(parts));
  throw Error(os.str());
}
// The same without the library's prefix: for code outside graphmoe (GRAPHMOE_USER_CHECK).
template <class... Args>
[[noreturn]] inline void throw_user_error(const char* where, Args&&... parts) {
  std::ostringstream os;
  os << where << ": ";
  (os << ... << std::forward<Args>(parts));
  throw Error(os.str());
}
}  // namespace detail

}  // namespace graphmoe

// GRAPHMOE_CHECK(cond, "op", parts...): throws graphmoe::Error("graphmoe::op: parts...") when
// cond is false. Parts are streamed with operator<<, so shapes and values can be passed directly.
#define GRAPHMOE_CHECK(cond, op, ...)                                  \
  do {                                                                 \
    if (!(cond)) ::graphmoe::detail::throw_error(op, __VA_ARGS__);     \
  } while (0)

// GRAPHMOE_USER_CHECK(cond, "where", parts...): the check for code outside the library (a user's
// policy, layer or options): throws graphmoe::Error("where: parts...") without the "graphmoe::"
// prefix, so that a message never blames the library for the user's own check.
#define GRAPHMOE_USER_CHECK(cond, where, ...)                               \
  do {                                                                      \
    if (!(cond)) ::graphmoe::detail::throw_user_error(where, __VA_ARGS__);  \
  } while (0)
