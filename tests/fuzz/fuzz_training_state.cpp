// Fuzz target: the training-state loader (graphmoe/train/training_state.hpp) on top of the
// safetensors reader.
//
// Input: the bytes of a .safetensors file. It is read with load_safetensors, every metadata field
// goes through metadata_int and metadata_json, and the file is loaded with load_training_state
// into a small arena ("w" (2, 3), "b" (3), non-trainable "frozen" (2)) and its AdamW. Invariants:
// a refused load (graphmoe::Error) changes neither the parameters nor the optimizer; an accepted
// one sets the parameters and both moments to exactly the file's tensors and the step count to
// the metadata's optimizer_steps.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/training_state.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

constexpr float kBefore = 5.0f;

void small_arena(ParameterArena<float>& a) {
  a.add("w", Shape{2, 3});
  a.add("b", Shape{3});
  a.add("frozen", Shape{2}, false);
  a.allocate();
  for (index_t i = 0; i < a.values().numel(); ++i) a.values().data()[i] = kBefore;
}

bool same_bytes(const Tensor<float>& v, const LoadedTensor& t) {
  return t.bytes.size() == static_cast<std::size_t>(v.numel()) * sizeof(float) &&
         (t.bytes.empty() || std::memcmp(v.data(), t.bytes.data(), t.bytes.size()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = graphmoe_fuzz::files().write("state.safetensors", data, size);
  SafetensorsFile f;
  if (!expect_clean([&] { f = load_safetensors(path); })) return 0;

  for (const auto& entry : f.metadata) {
    const std::string& key = entry.first;  // (clang 14 cannot capture a structured binding)
    std::int64_t v = 0;
    if (expect_clean([&] { v = metadata_int(f, key, -1000, 1000); }))
      FUZZ_REQUIRE(v >= -1000 && v <= 1000, "metadata_int stays in its range");
    expect_clean([&] { (void)metadata_json(f, key); });
  }
  FUZZ_REQUIRE(!expect_clean([&] { (void)metadata_field(f, std::string("\x01no such key")); }),
               "metadata_field refuses a missing key");

  ParameterArena<float> a;
  small_arena(a);
  AdamW<float> adam(a, AdamWConfig{});
  const bool ok = expect_clean([&] { load_training_state(f, a, adam); });
  if (!ok) {
    for (index_t i = 0; i < a.values().numel(); ++i)
      FUZZ_REQUIRE(a.values().data()[i] == kBefore, "a refused load leaves the parameters unchanged");
    FUZZ_REQUIRE(adam.steps() == 0, "a refused load leaves the step count unchanged");
    for (const auto& [name, view] : adam.state(a))
      for (index_t i = 0; i < view.numel(); ++i)
        FUZZ_REQUIRE(view.data()[i] == 0.0f, "a refused load leaves the moments unchanged");
    return 0;
  }
  FUZZ_REQUIRE(std::to_string(adam.steps()) == f.metadata.at("optimizer_steps") ||
                   adam.steps() == metadata_int(f, "optimizer_steps", 0,
                                                std::numeric_limits<std::int64_t>::max()),
               "the step count is the metadata's optimizer_steps");
  for (index_t p = 0; p < a.size(); ++p) {
    const std::string name = "model." + a.params()[static_cast<std::size_t>(p)].name;
    FUZZ_REQUIRE(f.contains(name), "an accepted file holds every parameter");
    FUZZ_REQUIRE(same_bytes(a.value(p), f.at(name)), "the parameters are the file's tensors");
  }
  for (const auto& [name, view] : adam.state(a)) {
    FUZZ_REQUIRE(f.contains(name), "an accepted file holds every moment");
    FUZZ_REQUIRE(same_bytes(view, f.at(name)), "the moments are the file's tensors");
  }
  return 0;
}
