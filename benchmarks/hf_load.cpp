// hf_load: how long hf::load_lm takes to load a Hugging Face model directory, beside the time to
// read the directory's files, for benchmarks/compare/hf_load.sh.
//
//   hf_load --make DIR [--hidden 1024] [--layers 8] [--experts 8] [--ffn 2304] [--vocab 32000]
//           [--dtype bf16|f16|f32] [--shard-gb 0.5] [--seed 1]
//   hf_load DIR [--reps 3] [--cold] [--threads 2]
//
// --make writes a random Mixtral-shaped model with graphmoe's writer (hf::save_lm: config.json,
// *.safetensors with an index when it shards); the defaults are a 1.07 GB model in bf16 (8 blocks,
// hidden 1024, 8 experts of 2304, 16 heads of which 4 key/value heads, vocab 32,000).
//
// The timing form runs `reps` rounds, each of two timed steps in this order:
//   read   every file of the directory that a load reads (config.json, the index, the shards)
//          read() through to its end into one 64 MiB buffer, nothing kept;
//   load   hf::load_lm<SoftmaxRouter, float>(DIR): config and headers parsed and checked, the
//          model declared and its arena allocated (values and gradients), every tensor checked
//          finite and converted into float, a file's tensors spread over --threads threads
//          (set_num_threads).
// Warm (the default): the files are read once before the first round, so both steps read them
// from the page cache. --cold: before each step every file's cached pages are dropped
// (posix_fadvise POSIX_FADV_DONTNEED; no privileges needed), so both read from the disk.
// Each round prints both times and load / read; the last line their means:
//
//   round 1: read 0.084 s (12.92 GB/s), load 0.523 s, load / read 6.26
//   mean over 3 rounds: read 0.082 s, load 0.510 s, load / read 6.19  (1.08 GB in 5 files, warm, 2 threads)
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "graphmoe/core/threads.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/hf/writer.hpp"
#include "graphmoe/models/transformer_lm.hpp"

using namespace graphmoe;

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "hf_load: " << why << "\n"
            << "usage: hf_load --make DIR [--hidden 1024] [--layers 8] [--experts 8] [--ffn 2304]\n"
            << "                  [--vocab 32000] [--dtype bf16|f16|f32] [--shard-gb 0.5] [--seed 1]\n"
            << "       hf_load DIR [--reps 3] [--cold] [--threads 2]\n";
  std::exit(2);
}

long long integer_arg(const std::string& flag, const std::string& v, long long lo, long long hi) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < lo || x > hi)
    usage(flag + " takes an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
          "], got '" + v + "'");
  return x;
}

// The files a load of `dir` reads: config.json, the index if any, every *.safetensors.
std::vector<std::string> model_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "config.json" || name == "model.safetensors.index.json" ||
        (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors"))
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

int open_or_die(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    std::perror(path.c_str());
    std::exit(1);
  }
  return fd;
}

// Reads every file through to its end; returns the bytes read.
std::uint64_t read_all(const std::vector<std::string>& files, std::vector<char>& buf) {
  std::uint64_t total = 0;
  for (const auto& f : files) {
    const int fd = open_or_die(f);
    for (;;) {
      const ssize_t n = ::read(fd, buf.data(), buf.size());
      if (n < 0) {
        std::perror(f.c_str());
        std::exit(1);
      }
      if (n == 0) break;
      total += static_cast<std::uint64_t>(n);
    }
    ::close(fd);
  }
  return total;
}

void drop_cache(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    const int fd = open_or_die(f);
    if (::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) {
      std::cerr << "hf_load: posix_fadvise(DONTNEED) failed on " << f << "\n";
      std::exit(1);
    }
    ::close(fd);
  }
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int make(const std::string& dir, int argc, char** argv, int i) {
  long long hidden = 1024, layers = 8, experts = 8, ffn = 2304, vocab = 32000, seed = 1;
  double shard_gb = 0.5;
  std::string dtype = "bf16";
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--hidden") hidden = integer_arg(a, v, 64, 16384);
    else if (a == "--layers") layers = integer_arg(a, v, 1, 256);
    else if (a == "--experts") experts = integer_arg(a, v, 2, 256);
    else if (a == "--ffn") ffn = integer_arg(a, v, 1, 65536);
    else if (a == "--vocab") vocab = integer_arg(a, v, 2, 1 << 20);
    else if (a == "--seed") seed = integer_arg(a, v, 0, 1LL << 40);
    else if (a == "--dtype") dtype = v;
    else if (a == "--shard-gb") shard_gb = std::atof(v.c_str());
    else usage("unknown option " + a);
  }
  if (hidden % 16 != 0) usage("--hidden must be a multiple of 16 (16 heads)");
  if (!(shard_gb > 0 && shard_gb < 1000)) usage("--shard-gb must be in (0, 1000)");
  hf::SaveOptions opts;
  if (dtype == "bf16") opts.dtype = DType::BF16;
  else if (dtype == "f16") opts.dtype = DType::F16;
  else if (dtype == "f32") opts.dtype = DType::F32;
  else usage("--dtype is bf16, f16 or f32, got '" + dtype + "'");
  opts.max_shard_size = static_cast<std::uint64_t>(shard_gb * 1e9);
  // Mixtral's blocks (TransformerLMConfig::mixtral) at the given sizes
  TransformerLMConfig c = TransformerLMConfig::preset("mixtral", static_cast<index_t>(vocab));
  c.d_model = hidden;
  c.num_layers = layers;
  c.num_heads = 16;
  c.attention.num_kv_heads = 4;
  c.d_ff = ffn;
  c.expert_d_ff = 0;
  c.router.num_experts = experts;
  c.max_seq_len = 4096;
  c.init_std = 0.02;
  TransformerLM<SoftmaxRouter, float, cpu> lm(c, static_cast<std::uint64_t>(seed));
  const auto t0 = Clock::now();
  hf::save_lm(lm, hf::Family::Mixtral, dir, opts);
  std::uint64_t bytes = 0;
  for (const auto& f : model_files(dir)) bytes += std::filesystem::file_size(f);
  std::cout << "wrote " << dir << ": " << lm.arena().numel() << " parameters, "
            << static_cast<double>(bytes) / 1e9 << " GB in " << model_files(dir).size()
            << " files (" << seconds_since(t0) << " s)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) usage("a model directory (or --make DIR) is needed");
    if (std::string(argv[1]) == "--make") {
      if (argc < 3) usage("--make needs a directory");
      return make(argv[2], argc, argv, 3);
    }
    const std::string dir = argv[1];
    int reps = 3, threads = 2;
    bool cold = false;
    for (int i = 2; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--cold") cold = true;
      else if (a == "--reps" && i + 1 < argc) reps = static_cast<int>(integer_arg(a, argv[++i], 1, 100));
      else if (a == "--threads" && i + 1 < argc)
        threads = static_cast<int>(integer_arg(a, argv[++i], 1, max_num_threads()));
      else usage("unknown option " + a);
    }
    set_num_threads(threads);
    const std::vector<std::string> files = model_files(dir);
    if (files.empty()) usage("'" + dir + "' holds no config.json or *.safetensors");
    std::vector<char> buf(std::size_t{64} << 20);
    std::uint64_t bytes = read_all(files, buf);  // warms the cache (and sizes the directory)
    double sum_read = 0, sum_load = 0;
    for (int r = 1; r <= reps; ++r) {
      if (cold) drop_cache(files);
      auto t0 = Clock::now();
      bytes = read_all(files, buf);
      const double t_read = seconds_since(t0);
      if (cold) drop_cache(files);
      t0 = Clock::now();
      double t_load = 0;
      {
        auto lm = hf::load_lm<SoftmaxRouter, float>(dir);
        t_load = seconds_since(t0);
        if (lm->arena().numel() <= 0) return 1;
      }  // the model's release is not timed
      std::printf("round %d: read %.3f s (%.2f GB/s), load %.3f s, load / read %.2f\n", r, t_read,
                  static_cast<double>(bytes) / 1e9 / t_read, t_load, t_load / t_read);
      sum_read += t_read;
      sum_load += t_load;
    }
    std::printf("mean over %d rounds: read %.3f s, load %.3f s, load / read %.2f  (%.2f GB in %zu "
                "files, %s, %d threads)\n",
                reps, sum_read / reps, sum_load / reps, sum_load / sum_read,
                static_cast<double>(bytes) / 1e9, files.size(), cold ? "cold" : "warm", threads);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "hf_load: " << e.what() << "\n";
    return 1;
  }
}
