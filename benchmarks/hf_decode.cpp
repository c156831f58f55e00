// hf_decode: decode tokens/s of a Hugging Face model directory loaded by graphmoe
// (hf::load_lm<SoftmaxRouter, float>, include/graphmoe/hf/reader.hpp) at batch 1, timed the way
// llama.cpp's llama-bench times its `-n N -d P` case, for benchmarks/compare/llamacpp_decode.sh
// (graphmoe beside llama.cpp on the same model).
//
//   hf_decode DIR [--prompts 64,512] [--gen 64] [--reps 3] [--threads 2] [--seed 7]
//   hf_decode DIR --ids prompt.bin [--logits-out last.f32] [--greedy 32] [--threads 2]
//
// Timing (the first form): for each prompt length P, a Decoder of one slot (inference/decoder.hpp,
// the KV cache; the model's max_position_embeddings bounds P + gen) is prefilled with P random
// ids (untimed; Decoder::prefill, chunks of 256), then one untimed warm-up repetition and `reps`
// timed ones: each is `gen` single-token steps (Decoder::step) at positions P .. P + gen - 1, fed
// random ids (nothing is sampled; each step computes the LM head's logits of its token), after
// which the slot is rewound to P (Decoder::rewind). Tokens/s of a repetition = gen / its wall time;
// the line per P gives their mean and standard deviation (llama-bench's avg_ts and stddev_ts)
// and each repetition's value:
//
//   decode prompt=64 gen=64 threads=2 reps=3 tok/s=1061.2 sd=12.3 samples=1050.1,1072.3,1061.2
//
// Agreement (the second form): the prompt is a file of int32 token ids (llama.cpp's llama-debug
// --save-logits writes one, llamacpp-<model>-tokens.bin); the last position's logits after
// prefill are written as float32 to --logits-out (vocab_size values, the layout of llama-debug's
// llamacpp-<model>.bin), and --greedy N continues greedily N tokens (argmax of each step's
// logits, ties to the lowest id), printed as "greedy: id id ...".
//
// float only: graphmoe's CPU path computes in float (a BF16 checkpoint is converted exactly to
// float on load), so there is no bf16 compute path to time beside llama.cpp's bf16 GGUF.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "graphmoe/hf/reader.hpp"
#include "graphmoe/inference/decoder.hpp"
#include "graphmoe/models/transformer_lm.hpp"

using namespace graphmoe;

namespace {

using LM = TransformerLM<SoftmaxRouter, float, cpu>;
using Clock = std::chrono::steady_clock;

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "hf_decode: " << why << "\n"
            << "usage: hf_decode DIR [--prompts 64,512] [--gen 64] [--reps 3] [--threads 2] [--seed 7]\n"
            << "       hf_decode DIR --ids prompt.bin [--logits-out last.f32] [--greedy N] [--threads 2]\n";
  std::exit(2);
}

std::vector<index_t> parse_list(const std::string& s) {
  std::vector<index_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(static_cast<index_t>(std::stol(item)));
  return out;
}

std::vector<std::int32_t> random_ids(index_t n, index_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> d(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = d(rng);
  return ids;
}

std::int32_t argmax(const Tensor<float, cpu>& logits, index_t vocab) {
  const float* p = logits.data();
  return static_cast<std::int32_t>(std::max_element(p, p + vocab) - p);
}

void time_decode(LM& lm, index_t vocab, index_t prompt, index_t gen, int reps, int threads,
                 std::uint32_t seed) {
  std::mt19937 rng(seed);
  Decoder<SoftmaxRouter, float> dec(lm, 1);
  if (prompt + gen > dec.max_len())
    usage("prompt " + std::to_string(prompt) + " + gen " + std::to_string(gen) +
          " exceeds the model's max_position_embeddings " + std::to_string(dec.max_len()));
  const std::vector<std::int32_t> prompt_ids = random_ids(prompt, vocab, rng);
  (void)dec.prefill(0, prompt_ids);
  const std::vector<index_t> slot = {0};
  std::vector<double> tps;
  for (int r = -1; r < reps; ++r) {  // r = -1: the warm-up repetition
    const std::vector<std::int32_t> gen_ids = random_ids(gen, vocab, rng);
    const auto t0 = Clock::now();
    for (index_t i = 0; i < gen; ++i) {
      const std::vector<std::int32_t> id = {gen_ids[static_cast<std::size_t>(i)]};
      const Tensor<float, cpu>& logits = dec.step(slot, id);
      volatile float sink = logits.data()[0];
      (void)sink;
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    dec.rewind(0, prompt);
    if (r >= 0) tps.push_back(static_cast<double>(gen) / s);
  }
  double mean = 0, sd = 0;
  for (double v : tps) mean += v;
  mean /= static_cast<double>(tps.size());
  for (double v : tps) sd += (v - mean) * (v - mean);
  sd = tps.size() > 1 ? std::sqrt(sd / static_cast<double>(tps.size() - 1)) : 0.0;
  std::printf("decode prompt=%ld gen=%ld threads=%d reps=%d tok/s=%.2f sd=%.2f samples=",
              static_cast<long>(prompt), static_cast<long>(gen), threads, reps, mean, sd);
  for (std::size_t i = 0; i < tps.size(); ++i) std::printf("%s%.2f", i ? "," : "", tps[i]);
  std::printf("\n");
  std::fflush(stdout);
}

void check(LM& lm, index_t vocab, const std::string& ids_path, const std::string& logits_out,
           index_t greedy) {
  std::ifstream in(ids_path, std::ios::binary);
  if (!in) usage("cannot read " + ids_path);
  std::vector<std::int32_t> ids;
  std::int32_t v;
  while (in.read(reinterpret_cast<char*>(&v), sizeof v)) ids.push_back(v);
  if (ids.empty()) usage(ids_path + " holds no token ids");
  Decoder<SoftmaxRouter, float> dec(lm, 1);
  const Tensor<float, cpu>& last = dec.prefill(0, ids);
  std::printf("prompt: %zu ids, last-position argmax %d\n", ids.size(), argmax(last, vocab));
  if (!logits_out.empty()) {
    std::ofstream out(logits_out, std::ios::binary);
    out.write(reinterpret_cast<const char*>(last.data()),
              static_cast<std::streamsize>(vocab * sizeof(float)));
    if (!out) usage("cannot write " + logits_out);
  }
  if (greedy > 0) {
    std::vector<std::int32_t> out;
    std::int32_t next = argmax(last, vocab);
    const std::vector<index_t> slot = {0};
    for (index_t i = 0; i < greedy; ++i) {
      out.push_back(next);
      if (i + 1 == greedy || dec.length(0) >= dec.max_len()) break;
      const std::vector<std::int32_t> id = {next};
      next = argmax(dec.step(slot, id), vocab);
    }
    std::printf("greedy:");
    for (std::int32_t id : out) std::printf(" %d", id);
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage("no model directory");
  const std::string dir = argv[1];
  std::vector<index_t> prompts = {64, 512};
  index_t gen = 64, greedy = 0;
  int reps = 3, threads = 2;
  std::uint32_t seed = 7;
  std::string ids_path, logits_out;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--prompts") prompts = parse_list(value());
    else if (a == "--gen") gen = std::stol(value());
    else if (a == "--reps") reps = std::stoi(value());
    else if (a == "--threads") threads = std::stoi(value());
    else if (a == "--seed") seed = static_cast<std::uint32_t>(std::stoul(value()));
    else if (a == "--ids") ids_path = value();
    else if (a == "--logits-out") logits_out = value();
    else if (a == "--greedy") greedy = std::stol(value());
    else usage("unknown option " + a);
  }
  if (gen < 1 || reps < 1 || threads < 1) usage("--gen, --reps and --threads must be >= 1");
  try {
    const auto t0 = Clock::now();
    std::unique_ptr<LM> lm = hf::load_lm<SoftmaxRouter, float>(dir);
    lm->set_mode(Mode::Eval);
    const index_t vocab = lm->config().vocab_size;
    std::printf("model %s: %ld parameters, vocab %ld, max_seq_len %ld, loaded in %.2f s\n",
                dir.c_str(), static_cast<long>(lm->arena().numel()), static_cast<long>(vocab),
                static_cast<long>(lm->config().max_seq_len),
                std::chrono::duration<double>(Clock::now() - t0).count());
    set_num_threads(threads);
    if (!ids_path.empty()) {
      check(*lm, vocab, ids_path, logits_out, greedy);
    } else {
      for (index_t p : prompts) time_decode(*lm, vocab, p, gen, reps, threads, seed);
    }
    set_num_threads(1);
  } catch (const std::exception& e) {
    std::cerr << "hf_decode: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
