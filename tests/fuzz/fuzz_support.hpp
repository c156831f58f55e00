// tests/fuzz/fuzz_support.hpp: what every fuzz target of tests/fuzz shares.
//
// graphmoe's readers take paths, so each input is written to a file in a private folder under
// $TMPDIR (/tmp when unset) and the reader is called on that path. The expected outcome for
// malformed input is a graphmoe::Error; any other exception escapes LLVMFuzzerTestOneInput and
// ends the process (std::terminate -> abort), and a broken invariant calls finding(), which also
// aborts: libFuzzer, and the replay driver (replay_main.cpp), report both as a crash.
//
//   FuzzFiles files;              one per process (a function-local static)
//   files.write(name, data, n)    (re)writes <folder>/<name>, returns its path
//   expect_clean([&] { ... })     runs the reader; a graphmoe::Error is a clean refusal (false),
//                                 a return is an accepted input (true)
//   FUZZ_REQUIRE(cond, what)      an invariant of an accepted input; aborts naming it
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "graphmoe/config.hpp"

namespace graphmoe_fuzz {

[[noreturn]] inline void finding(const char* file, int line, const char* what) {
  std::fprintf(stderr, "graphmoe fuzz finding at %s:%d: %s\n", file, line, what);
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_REQUIRE(cond, what) \
  do {                                                                    \
    if (!(cond)) ::graphmoe_fuzz::finding(__FILE__, __LINE__, what);      \
  } while (0)

// A private folder under $TMPDIR holding the files the readers are given; removed with its
// files at normal exit (a crash leaves it behind, with the input that crashed in it).
class FuzzFiles {
 public:
  FuzzFiles() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = (tmp != nullptr && tmp[0] != '\0' ? std::string(tmp) : std::string("/tmp")) +
                          "/graphmoe-fuzz-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {
      std::fprintf(stderr, "graphmoe fuzz: mkdtemp(%s) failed: %s\n", pattern.c_str(),
                   std::strerror(errno));
      std::abort();
    }
    dir_ = buf.data();
  }
  ~FuzzFiles() {
    for (const std::string& p : written_) ::unlink(p.c_str());
    ::rmdir(dir_.c_str());
  }
  FuzzFiles(const FuzzFiles&) = delete;
  FuzzFiles& operator=(const FuzzFiles&) = delete;

  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) {
    const std::string p = dir_ + "/" + name;
    for (const std::string& w : written_)
      if (w == p) return p;
    written_.push_back(p);
    return p;
  }
  // Writes exactly n bytes of data to <dir>/<name> (truncating it) and returns the path.
  std::string write(const std::string& name, const std::uint8_t* data, std::size_t n) {
    const std::string p = path(name);
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) fail("open", p);
    std::size_t done = 0;
    while (done < n) {
      const ssize_t w = ::write(fd, data + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("write", p);
      done += static_cast<std::size_t>(w);
    }
    if (::close(fd) != 0) fail("close", p);
    return p;
  }
  std::string write(const std::string& name, const std::string& bytes) {
    return write(name, reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  }

 private:
  [[noreturn]] static void fail(const char* what, const std::string& p) {
    // Not a finding in graphmoe: the harness itself cannot work (full disk, no $TMPDIR).
    std::fprintf(stderr, "graphmoe fuzz: %s '%s' failed: %s\n", what, p.c_str(),
                 std::strerror(errno));
    std::abort();
  }
  std::string dir_;
  std::vector<std::string> written_;
};

inline FuzzFiles& files() {
  static FuzzFiles f;
  return f;
}

// Runs f(); true when it returns, false when it throws graphmoe::Error (the clean refusal of
// malformed input). Every other exception propagates: a finding.
template <class F>
bool expect_clean(F&& f) {
  try {
    f();
    return true;
  } catch (const graphmoe::Error&) {
    return false;
  }
}

}  // namespace graphmoe_fuzz
