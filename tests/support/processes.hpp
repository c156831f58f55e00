// tests/support/processes.hpp: running the example programs from a test (a shell command with
// its output captured), in a scratch folder that is removed afterwards. Shared by the example CLI
// tests (test_example_cli, test_train_lm_dp, test_train_vision_dp).
#pragma once

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace graphmoe::test {

// s in single quotes for sh, its own single quotes escaped.
inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'')
      q.append("'\\''");
    else
      q.push_back(c);
  }
  q.push_back('\'');
  return q;
}

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A scratch folder under the system temp dir, "graphmoe_<tag>_<pid>", removed with everything in
// it.
struct Scratch {
  std::filesystem::path dir;
  explicit Scratch(const std::string& tag) {
    dir = std::filesystem::temp_directory_path() /
          ("graphmoe_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
};

struct Result {
  std::string command;
  int status = -1;  // exit status; -1: killed by a signal
  std::string out, err;
  std::string text() const {
    std::string t = "$ ";
    t.append(command).append("\n[exit ").append(std::to_string(status)).append("]\n[stdout]\n");
    t.append(out).append("[stderr]\n").append(err);
    return t;
  }
};

// Runs `prefix exe args...` (prefix: e.g. "mpiexec -n 2", already quoted; may be empty) under
// `timeout -k 5 <seconds>`, stdin from /dev/null, stdout and stderr captured through files in s.
inline Result run_program(const Scratch& s, const std::string& prefix, const std::string& exe,
                          const std::vector<std::string>& args, int seconds) {
  // (appends, not operator+ on temporaries: GCC 12 warns falsely about those, -Wrestrict)
  std::string cmd = "timeout -k 5 ";
  cmd.append(std::to_string(seconds));
  if (!prefix.empty()) cmd.append(" ").append(prefix);
  cmd.append(" ").append(quote(exe));
  for (const auto& a : args) cmd.append(" ").append(quote(a));
  Result r;
  r.command = cmd;
  const std::filesystem::path out = s.dir / "stdout.txt", err = s.dir / "stderr.txt";
  cmd.append(" >").append(quote(out.string())).append(" 2>").append(quote(err.string()));
  cmd.append(" </dev/null");
  const int raw = std::system(cmd.c_str());
  r.status = raw != -1 && WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

#if defined(GRAPHMOE_MPIEXEC)
// The command prefix that starts a program on `ranks` MPI processes (GRAPHMOE_MPIEXEC and
// GRAPHMOE_MPIEXEC_NUMPROC_FLAG from CMake), "" for ranks = 0 (the program alone). With Open MPI:
// more ranks than cores are allowed (CI has 2) and no binding (each rank runs --threads 1).
inline std::string mpiexec_prefix(int ranks) {
  if (ranks <= 0) return "";
  std::string prefix = quote(GRAPHMOE_MPIEXEC);
  prefix.append(" ").append(GRAPHMOE_MPIEXEC_NUMPROC_FLAG).append(" ").append(std::to_string(ranks));
#if GRAPHMOE_MPIEXEC_OPEN_MPI
  prefix.append(" --oversubscribe --bind-to none");
#endif
  return prefix;
}
#endif

// The word corpus of the examples' command-line tests: 300 lines of 10 words drawn from
// kCorpusWords by a fixed linear congruential stream (about 3,000 tokens, the same every run).
inline const std::vector<std::string> kCorpusWords = {"the", "cat",  "sat", "on",   "a",
                                                      "mat", "dog",  "ran", "far",  "good",
                                                      "bad", "film", "was", "very", "not"};
inline void write_word_corpus(const std::string& path) {
  std::ofstream out(path);
  unsigned x = 7;
  for (int line = 0; line < 300; ++line) {
    for (int w = 0; w < 10; ++w) {
      x = x * 1103515245u + 12345u;
      out << (w ? " " : "") << kCorpusWords[(x >> 16) % kCorpusWords.size()];
    }
    out << "\n";
  }
}

// A refusal: a non-zero exit (not a crash) whose stderr holds every one of `parts`.
inline void check_refused(const Result& r, const std::vector<std::string>& parts) {
  INFO(r.text());
  CHECK(r.status > 0);
  for (const auto& p : parts) {
    CAPTURE(p);
    CHECK(r.err.find(p) != std::string::npos);
  }
}

}  // namespace graphmoe::test
