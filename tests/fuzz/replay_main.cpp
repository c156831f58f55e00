// tests/fuzz/replay_main.cpp: runs a fuzz target's LLVMFuzzerTestOneInput on files, without
// libFuzzer, so that the targets build with any compiler (the GRAPHMOE_SANITIZE build links them
// as replay_<target>) and a crash can be reproduced without the fuzzer:
//
//   replay_<target> PATH...   each PATH a file, or a folder whose regular files are run in name
//                             order (not recursively); exits 0 after all of them, prints how many
//                             ran, and fails when none did (an empty corpus tests nothing)
//
// A finding aborts the process (see fuzz_support.hpp), as it does under libFuzzer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const fs::path p(argv[i]);
    if (fs::is_directory(p)) {
      std::vector<fs::path> dir;
      for (const auto& e : fs::directory_iterator(p))
        if (e.is_regular_file()) dir.push_back(e.path());
      std::sort(dir.begin(), dir.end());
      inputs.insert(inputs.end(), dir.begin(), dir.end());
    } else if (fs::is_regular_file(p)) {
      inputs.push_back(p);
    } else {
      std::fprintf(stderr, "replay: '%s' is neither a file nor a folder\n", argv[i]);
      return 2;
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "replay: no input files (usage: %s FILE_OR_FOLDER...)\n", argv[0]);
    return 2;
  }
  for (const fs::path& p : inputs) {
    std::ifstream in(p, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "replay: cannot read '%s'\n", p.c_str());
      return 2;
    }
    std::fprintf(stderr, "replay: %s (%zu bytes)\n", p.c_str(), bytes.size());
    // A copy of exactly the input's size, so that ASan catches a read one byte past the end.
    std::vector<std::uint8_t> data(bytes.begin(), bytes.end());
    LLVMFuzzerTestOneInput(data.empty() ? nullptr : data.data(), data.size());
  }
  std::printf("replay: %zu inputs, no finding\n", inputs.size());
  return 0;
}
