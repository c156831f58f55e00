// Fuzz target: a Hugging Face model directory's JSON files (graphmoe/hf/config.hpp,
// graphmoe/hf/reader.hpp).
//
// Input: the bytes of config.json, optionally followed by the separator "\n#index#\n" and the
// bytes of model.safetensors.index.json (the first separator splits them).
//   without it  config.json is written to the private folder and read with hf::read_config; an
//               accepted config names its file and its architecture's class, and its model
//               (cfg.lm) passes TransformerLMConfig::validate
//   with it     both files are written to the folder (there is no model.safetensors) and
//               hf::Checkpoint::open reads the folder: config.json, then the index, then the
//               shards it names; a refusal is a graphmoe::Error
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_support.hpp"
#include "graphmoe/hf/config.hpp"
#include "graphmoe/hf/reader.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

constexpr std::string_view kSeparator = "\n#index#\n";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t sep = input.find(kSeparator);
  graphmoe_fuzz::FuzzFiles& files = graphmoe_fuzz::files();
  if (sep == std::string_view::npos) {
    const std::string path = files.write("config.json", data, size);
    hf::ModelConfig cfg;
    if (!expect_clean([&] { cfg = hf::read_config(path); })) return 0;
    FUZZ_REQUIRE(cfg.path == path, "an accepted config names its file");
    FUZZ_REQUIRE(cfg.architecture == hf::architecture_name(cfg.family),
                 "an accepted config's architecture is its family's class");
    FUZZ_REQUIRE(expect_clean([&] { cfg.lm.validate(); }),
                 "an accepted config describes a valid TransformerLMConfig");
    return 0;
  }
  files.write("config.json", data, sep);
  const std::size_t index_at = sep + kSeparator.size();
  files.write("model.safetensors.index.json", data + index_at, size - index_at);
  ::unlink(files.path("model.safetensors").c_str());  // the index is the model
  expect_clean([&] { (void)hf::Checkpoint::open(files.dir()); });
  return 0;
}
