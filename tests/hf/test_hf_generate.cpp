// Greedy generation from the Hugging Face golden fixtures (tests/hf/fixtures, written by
// scripts/hf-fixtures.py): graphmoe's incremental decoder (KV and routing caches) continues each
// fixture's first prompt for 64 tokens, and the ids must be transformers' own greedy continuation
// (expected.json "greedy": argmax of each step's float32 logits). Every family; float, as the
// reader loads it (DeepSeek-V3 into SigmoidBiasRouter, the others into SoftmaxRouter). The fixtures record how far each of transformers' choices was from a tie
// ("greedy_margin", at least 2e-4 in logits), far above float's rounding of the logits here.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/hf/reader.hpp"
#include "graphmoe/inference/generate.hpp"
#include "graphmoe/routing/router.hpp"

using namespace graphmoe;
namespace fs = std::filesystem;

#ifndef GRAPHMOE_HF_FIXTURES
#error "GRAPHMOE_HF_FIXTURES (tests/hf/fixtures) must be defined by tests/CMakeLists.txt"
#endif

namespace {

template <class Router>
void check_greedy(const std::string& family) {
  CAPTURE(family);
  const fs::path dir = fs::path(GRAPHMOE_HF_FIXTURES) / family;
  std::ifstream in(dir / "expected.json");
  REQUIRE(in.good());
  const nlohmann::json expected = nlohmann::json::parse(in);
  const auto prompt = expected.at("prompts").at(0).get<std::vector<std::int32_t>>();
  const auto want = expected.at("greedy").get<std::vector<std::int32_t>>();
  REQUIRE(want.size() == 64);
  auto lm = hf::load_lm<Router, float>(dir.string());
  GenerateOptions opt;
  opt.max_new_tokens = 64;
  opt.sampling.greedy = true;
  const GenerateResult got = generate(*lm, prompt, opt);
  REQUIRE(got.tokens.size() == want.size());
  std::size_t first_diff = want.size();
  for (std::size_t i = 0; i < want.size() && first_diff == want.size(); ++i)
    if (got.tokens[i] != want[i]) first_diff = i;
  CHECK_MESSAGE(first_diff == want.size(), family, ": the continuation differs from token ",
                first_diff);
  // the full forward (no caches) gives the same tokens
  opt.decoding = Decoding::FullForward;
  CHECK(generate(*lm, prompt, opt).tokens == got.tokens);
}

}  // namespace

TEST_CASE("hf: greedy generation from every fixture is transformers' for 64 tokens") {
  for (const char* family : {"llama", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"})
    check_greedy<SoftmaxRouter>(family);
  check_greedy<SigmoidBiasRouter>("deepseek_v3");
}
