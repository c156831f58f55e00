// The Hugging Face reader (graphmoe/hf/reader.hpp) on the golden fixtures under tests/hf/fixtures
// (tiny random models that transformers wrote, with transformers' logits and expert choices:
// scripts/hf-fixtures.py remakes them), and on hostile directories built here from them.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/hf/reader.hpp"
#include "graphmoe/routing/router.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "support/errors.hpp"

using namespace graphmoe;
using graphmoe::test::error_of;
namespace fs = std::filesystem;

#ifndef GRAPHMOE_HF_FIXTURES
#error "GRAPHMOE_HF_FIXTURES (tests/hf/fixtures) must be defined by tests/CMakeLists.txt"
#endif

namespace {

const std::vector<std::string> kFamilies = {"llama", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"};

std::string fixture(const std::string& family) {
  return (fs::path(GRAPHMOE_HF_FIXTURES) / family).string();
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot open ", path);
  return nlohmann::json::parse(in);
}
void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2);
}

// A copy of a fixture in a fresh folder under the system temp dir, removed with it.
struct FixtureCopy {
  fs::path dir;
  explicit FixtureCopy(const std::string& family) {
    static int counter = 0;
    dir = fs::temp_directory_path() /
          ("graphmoe_hf_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(fixture(family)))
      fs::copy_file(e.path(), dir / e.path().filename());
  }
  ~FixtureCopy() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string path() const { return dir.string(); }
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
  // Edits config.json.
  void config(const std::function<void(nlohmann::json&)>& edit) const {
    nlohmann::json j = read_json(*this / "config.json");
    edit(j);
    write_json(*this / "config.json", j);
  }
  // Rewrites a safetensors file through edit(tensors), which may change any tensor (name, dtype,
  // shape, bytes), drop or add some.
  void tensors(const std::string& file,
               const std::function<void(std::vector<LoadedTensor>&)>& edit) const {
    SafetensorsFile f = load_safetensors(*this / file);
    std::vector<LoadedTensor> ts;
    for (auto& [name, t] : f.tensors) ts.push_back(t);
    edit(ts);
    std::vector<TensorRef> refs;
    for (const auto& t : ts) refs.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
    save_safetensors(*this / file, refs, f.metadata);
  }
};

LoadedTensor& named(std::vector<LoadedTensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  FAIL("no tensor ", name);
  return ts.front();
}

// The error of Checkpoint::open on dir, or of load_lm when open succeeds.
std::string open_error(const std::string& dir) {
  return error_of([&] { (void)hf::load_lm<SoftmaxRouter, float>(dir); });
}

// Every part must be in the message (printed when one is not).
void check_error(const std::string& msg, const std::vector<std::string>& parts) {
  for (const auto& p : parts) CHECK_MESSAGE(test::contains(msg, p), "'", p, "' not in: ", msg);
}

// The model's logits for one prompt, (T, V) flattened.
template <class R, class T>
std::vector<double> logits_of(TransformerLM<R, T>& lm, const std::vector<std::int32_t>& prompt) {
  const auto t = static_cast<index_t>(prompt.size());
  Tensor<std::int32_t> ids(Shape{1, t});
  std::copy(prompt.begin(), prompt.end(), ids.data());
  lm.set_mode(Mode::Eval);
  lm.forward(ids, Tensor<std::int32_t>());
  const Tensor<T>& l = lm.logits();
  return std::vector<double>(l.data(), l.data() + l.numel());
}

struct Comparison {
  double logits = 0;     // max |a - b| / max |b| over the stored columns, worst prompt
  double logsumexp = 0;  // max |a - b| / max |b| of the rows' logsumexp, worst prompt
  index_t expert_rows = 0, expert_mismatches = 0;
};

// The loaded model against expected.json: logits (the stored columns and every row's
// logsumexp) and every MoE layer's chosen experts, prompt by prompt.
template <class R, class T>
Comparison compare(TransformerLM<R, T>& lm, const nlohmann::json& ex) {
  Comparison out;
  const index_t v = lm.config().vocab_size;
  const index_t stride = ex["column_stride"].get<index_t>();
  for (std::size_t p = 0; p < ex["prompts"].size(); ++p) {
    const auto prompt = ex["prompts"][p].get<std::vector<std::int32_t>>();
    const std::vector<double> a = logits_of(lm, prompt);
    double diff = 0, scale = 0, ldiff = 0, lscale = 0;
    for (std::size_t t = 0; t < prompt.size(); ++t) {
      const auto& row = ex["logits"][p][t];
      for (std::size_t j = 0; j < row.size(); ++j) {
        const index_t col = static_cast<index_t>(t) % stride + stride * static_cast<index_t>(j);
        const double b = row[j].get<double>();
        diff = std::max(diff, std::abs(a[t * v + col] - b));
        scale = std::max(scale, std::abs(b));
      }
      double m = -std::numeric_limits<double>::infinity(), s = 0;
      for (index_t c = 0; c < v; ++c) m = std::max(m, a[t * v + c]);
      for (index_t c = 0; c < v; ++c) s += std::exp(a[t * v + c] - m);
      const double lse = m + std::log(s), b = ex["logsumexp"][p][t].get<double>();
      ldiff = std::max(ldiff, std::abs(lse - b));
      lscale = std::max(lscale, std::abs(b));
    }
    out.logits = std::max(out.logits, diff / scale);
    out.logsumexp = std::max(out.logsumexp, ldiff / lscale);
    for (auto it = ex["experts"][p].begin(); it != ex["experts"][p].end(); ++it) {
      const index_t layer = std::stoi(it.key());
      REQUIRE(lm.block(layer).is_moe());
      const Tensor<std::int32_t>& idx = lm.block(layer).moe().routing().selection.indices;
      REQUIRE(idx.rows() == static_cast<index_t>(prompt.size()));
      const index_t k = idx.numel() / idx.rows();
      for (index_t t = 0; t < idx.rows(); ++t) {
        std::vector<std::int32_t> got(idx.data() + t * k, idx.data() + (t + 1) * k);
        std::sort(got.begin(), got.end());
        const auto want = (*it)[static_cast<std::size_t>(t)].get<std::vector<std::int32_t>>();
        ++out.expert_rows;
        if (got != want) ++out.expert_mismatches;
      }
    }
    // the dense blocks are exactly those without expected experts
    for (index_t l = 0; l < lm.num_layers(); ++l)
      CHECK(lm.block(l).is_moe() == ex["experts"][p].contains(std::to_string(l)));
  }
  return out;
}

std::vector<double> parameters(const ParameterArena<float>& a) {
  std::vector<double> out;
  for (index_t i = 0; i < a.size(); ++i) {
    const Tensor<float> v = a.value(i);
    out.insert(out.end(), v.data(), v.data() + v.numel());
  }
  return out;
}

}  // namespace

TEST_CASE("hf: every fixture loads and computes transformers' logits and expert choices") {
  for (const std::string& family : kFamilies) {
    CAPTURE(family);
    const nlohmann::json ex = read_json(fixture(family) + "/expected.json");
    const hf::Checkpoint ck = hf::Checkpoint::open(fixture(family));
    CHECK(ck.config().architecture == ex["architecture"].get<std::string>());
    CHECK(ck.files().size() >= 1);
    auto lm = hf::load_lm<SoftmaxRouter, float>(fixture(family));
    const Comparison c = compare(*lm, ex);
    MESSAGE(family, " (", ex["storage_dtype"].get<std::string>(), ", ", ck.files().size(),
            " file(s), ", ck.tensor_count(), " tensors): float logits within ", c.logits,
            " relative, logsumexp ", c.logsumexp, ", experts ", c.expert_rows - c.expert_mismatches,
            " of ", c.expert_rows, " token-layers identical");
    CHECK(c.logits <= 1e-4);
    CHECK(c.logsumexp <= 1e-4);
    CHECK(c.expert_mismatches == 0);
    CHECK((family == "llama") == (c.expert_rows == 0));

    auto lmd = hf::load_lm<SoftmaxRouter, double>(fixture(family));
    const Comparison d = compare(*lmd, ex);
    MESSAGE(family, ": double logits within ", d.logits, " relative of transformers' float32");
    CHECK(d.logits <= 1e-4);
    CHECK(d.expert_mismatches == 0);
  }
}

TEST_CASE("hf: the configs map onto the families' blocks") {
  const hf::ModelConfig mixtral = hf::Checkpoint::open(fixture("mixtral")).config();
  CHECK(mixtral.family == hf::Family::Mixtral);
  CHECK(mixtral.lm.router.num_experts == 8);
  CHECK(mixtral.lm.router.k == 2);
  CHECK(mixtral.lm.router.options<TopK>().norm_topk_prob);
  CHECK_FALSE(mixtral.lm.router.options<LinearScorer>().bias);
  CHECK(mixtral.lm.attention.num_kv_heads == 2);
  CHECK(mixtral.lm.attention.rope_theta == 1e6);
  CHECK(mixtral.lm.norm == NormKind::RMSNorm);
  CHECK(mixtral.lm.activation == FfnActivation::SwiGLU);
  CHECK_FALSE(mixtral.lm.tie_embeddings);
  CHECK(mixtral.lm.router.load_balance_coef == doctest::Approx(0.02));
  const hf::ModelConfig olmoe = hf::Checkpoint::open(fixture("olmoe")).config();
  CHECK(olmoe.lm.attention.qk_norm == QKNorm::Full);
  CHECK(olmoe.lm.attention.num_kv_heads == 0);
  CHECK_FALSE(olmoe.lm.router.options<TopK>().norm_topk_prob);
  const hf::ModelConfig qwen2 = hf::Checkpoint::open(fixture("qwen2_moe")).config();
  CHECK(qwen2.lm.attention.qkv_bias);
  CHECK_FALSE(qwen2.lm.attention.out_bias);
  CHECK(qwen2.lm.shared_expert_gate);
  CHECK(qwen2.lm.moe_every == 2);
  CHECK_FALSE(qwen2.lm.is_moe_layer(0));
  CHECK(qwen2.lm.is_moe_layer(1));
  const hf::ModelConfig qwen3 = hf::Checkpoint::open(fixture("qwen3_moe")).config();
  CHECK(qwen3.lm.attention.qk_norm == QKNorm::PerHead);
  CHECK(qwen3.lm.attention.head_dim == 32);  // 4 heads x 32 = 2 hidden_size
  CHECK(qwen3.lm.router.options<TopK>().norm_topk_prob);
  const hf::ModelConfig llama = hf::Checkpoint::open(fixture("llama")).config();
  CHECK(llama.lm.layout == MoELayout::Dense);
  CHECK(llama.eos_token_ids == std::vector<std::int64_t>{2});
  // mlp_only_layers = [0] is graphmoe's first dense block
  nlohmann::json j = read_json(fixture("qwen3_moe") + "/config.json");
  j["mlp_only_layers"] = {0};
  CHECK(hf::parse_config(j, "config.json").lm.first_k_dense == 1);
}

TEST_CASE("hf: the two-step load into an arena of one's own, with a prefix, equals load_lm") {
  const std::string dir = fixture("qwen2_moe");
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  ParameterArena<float> arena;
  arena.add("something.else", Shape{3});
  TransformerLM<SoftmaxRouter, float> lm;
  TransformerLMConfig cfg = ck.config().lm;
  cfg.max_seq_len = 32;             // neither changes the computation
  cfg.router.load_balance_coef = 0;
  lm.declare(arena, "lm.", cfg);
  arena.allocate();
  lm.bind(arena);
  ck.load(lm);
  auto ref = hf::load_lm<SoftmaxRouter, float>(dir);
  const std::vector<std::int32_t> prompt = {5, 17, 99, 3, 64};
  CHECK(logits_of(lm, prompt) == logits_of(*ref, prompt));

  // a graph router loads the same weights (and routes through its graph)
  auto sim = hf::load_lm<SimilarityRouter, float>(fixture("mixtral"));
  auto plain = hf::load_lm<SoftmaxRouter, float>(fixture("mixtral"));
  CHECK(parameters(sim->arena()) == parameters(plain->arena()));

  // a model declared with another computation is refused by name
  TransformerLMConfig other = ck.config().lm;
  other.attention.rope_theta = 10000;
  TransformerLM<SoftmaxRouter, float> wrong(other, TransformerLM<SoftmaxRouter, float>::NoInit{});
  check_error(error_of([&] { ck.load(wrong); }), {"attention options", "config.json"});
}

TEST_CASE("hf: a graph router with parameters of its own (Blended) loads, its a = 0 computes SoftmaxRouter's logits") {
  // "blocks.i.moe.router.graph.blend" is no Hugging Face tensor: it keeps its initial value, 0
  const std::string dir = fixture("olmoe");
  auto blended = hf::load_lm<BlendedSimilarityRouter, float>(dir);
  auto plain = hf::load_lm<SoftmaxRouter, float>(dir);
  index_t blends = 0;
  const auto& arena = blended->arena();
  for (index_t id = 0; id < static_cast<index_t>(arena.params().size()); ++id) {
    const std::string& name = arena.params()[static_cast<std::size_t>(id)].name;
    if (!test::contains(name, ".router.graph.blend")) continue;
    ++blends;
    CHECK(arena.value(id).numel() == 1);
    CHECK(arena.value(id).data()[0] == 0.0f);
  }
  CHECK(blends == plain->config().num_layers);  // every OLMoE block is MoE
  const std::vector<std::int32_t> prompt = {5, 17, 99, 3, 64, 1, 120};
  CHECK(logits_of(*blended, prompt) == logits_of(*plain, prompt));  // bit for bit
  CHECK(hf::has_graph_parameters<BlendedSimilarityRouter>(plain->config()));
  CHECK_FALSE(hf::has_graph_parameters<SoftmaxRouter>(plain->config()));
}

TEST_CASE("hf: F32 and F64 files of the same weights load to the same model as BF16 and F16") {
  for (const std::string family : {"olmoe", "qwen2_moe"}) {  // BF16, F16
    CAPTURE(family);
    auto ref = hf::load_lm<SoftmaxRouter, float>(fixture(family));
    for (const DType to : {DType::F32, DType::F64}) {
      FixtureCopy c(family);
      c.tensors("model.safetensors", [&](std::vector<LoadedTensor>& ts) {
        for (auto& t : ts) {
          const std::size_t n = static_cast<std::size_t>(t.shape.numel());
          std::vector<std::uint8_t> bytes(n * dtype_size(to));
          for (std::size_t i = 0; i < n; ++i) {
            std::uint16_t b;
            std::memcpy(&b, t.bytes.data() + 2 * i, 2);
            const float x = t.dtype == DType::BF16 ? hf::detail::bf16_to_float(b)
                                                   : hf::detail::f16_to_float(b);
            if (to == DType::F32) {
              std::memcpy(bytes.data() + 4 * i, &x, 4);
            } else {
              const double y = x;
              std::memcpy(bytes.data() + 8 * i, &y, 8);
            }
          }
          t.dtype = to;
          t.bytes = std::move(bytes);
        }
      });
      auto lm = hf::load_lm<SoftmaxRouter, float>(c.path());
      CHECK(parameters(lm->arena()) == parameters(ref->arena()));
    }
  }
  // f16_to_float on the special values
  CHECK(hf::detail::f16_to_float(0x3c00) == 1.0f);
  CHECK(hf::detail::f16_to_float(0xc000) == -2.0f);
  CHECK(hf::detail::f16_to_float(0x0001) == std::ldexp(1.0f, -24));  // the smallest subnormal
  CHECK(hf::detail::f16_to_float(0x7bff) == 65504.0f);
  CHECK(std::isinf(hf::detail::f16_to_float(0x7c00)));
  CHECK(std::isnan(hf::detail::f16_to_float(0x7e00)));
  CHECK(hf::detail::bf16_to_float(0x3f80) == 1.0f);
}

TEST_CASE("hf: first_bad_element finds the first NaN or infinity of every dtype at any position") {
  // the scan tests blocks of 4096 elements without a branch and searches only a bad block: a bad
  // element at a block's first or last entry, in the last partial block, and two in one block
  const std::size_t n = 3 * 4096 + 17;
  for (const DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    const std::size_t w = dt == DType::F64 ? 8 : dt == DType::F32 ? 4 : 2;
    std::vector<std::uint8_t> bytes(n * w, 0);  // zeros: finite
    auto put_bad = [&](std::size_t i, bool inf) {
      switch (dt) {
        case DType::F32: {
          const float x = inf ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
          std::memcpy(bytes.data() + 4 * i, &x, 4);
          break;
        }
        case DType::F64: {
          const double x = inf ? 1e300 : std::numeric_limits<double>::quiet_NaN();  // 1e300: inf in float
          std::memcpy(bytes.data() + 8 * i, &x, 8);
          break;
        }
        default: {
          const std::uint16_t b = dt == DType::BF16 ? (inf ? 0x7f80 : 0x7fc1) : (inf ? 0xfc00 : 0x7e01);
          std::memcpy(bytes.data() + 2 * i, &b, 2);
        }
      }
    };
    CAPTURE(static_cast<int>(dt));
    CHECK(hf::detail::first_bad_element<float>(bytes.data(), dt, n) == n);
    for (const std::size_t at : {std::size_t{0}, std::size_t{4095}, std::size_t{4096}, n - 1}) {
      CAPTURE(at);
      std::vector<std::uint8_t> keep = bytes;
      put_bad(at, at % 2 == 1);
      if (at + 3 < n) put_bad(at + 3, false);  // a later one in the same block
      CHECK(hf::detail::first_bad_element<float>(bytes.data(), dt, n) == at);
      bytes = keep;
    }
  }
  // F64 beyond float's range is bad for float only
  std::vector<std::uint8_t> big(8);
  const double x = 1e300;
  std::memcpy(big.data(), &x, 8);
  CHECK(hf::detail::first_bad_element<float>(big.data(), DType::F64, 1) == 0);
  CHECK(hf::detail::first_bad_element<double>(big.data(), DType::F64, 1) == 1);
}

TEST_CASE("hf: hostile shards and indexes are refused naming the file and the tensor") {
  const std::string shard2 = "model-00002-of-00003.safetensors";
  SUBCASE("a missing shard") {
    FixtureCopy c("mixtral");
    fs::remove(c / shard2);
    check_error(open_error(c.path()),
                {c / "model.safetensors.index.json", shard2, "does not exist", "for tensor 'model."});
  }
  SUBCASE("a truncated shard") {
    FixtureCopy c("mixtral");
    fs::resize_file(c / shard2, fs::file_size(c / shard2) - 100);
    check_error(open_error(c.path()), {c / shard2, "beyond the data buffer", "truncated", "tensor '"});
  }
  SUBCASE("a shard cut inside its header") {
    FixtureCopy c("mixtral");
    fs::resize_file(c / shard2, 5);
    check_error(open_error(c.path()), {c / shard2, "shorter than the 8-byte header"});
  }
  SUBCASE("an index naming a file outside the directory") {
    for (const std::string outside : {"../model-00001-of-00003.safetensors", "/etc/passwd", ".."}) {
      FixtureCopy c("mixtral");
      nlohmann::json j = read_json(c / "model.safetensors.index.json");
      j["weight_map"]["model.norm.weight"] = outside;
      write_json(c / "model.safetensors.index.json", j);
      check_error(open_error(c.path()), {c / "model.safetensors.index.json", "'weight_map'",
                                         "model.norm.weight", outside, "not a file name inside"});
    }
  }
  SUBCASE("an index and its shards that disagree") {
    FixtureCopy c("mixtral");
    nlohmann::json j = read_json(c / "model.safetensors.index.json");
    const std::string file = j["weight_map"]["model.norm.weight"];
    j["weight_map"].erase("model.norm.weight");
    write_json(c / "model.safetensors.index.json", j);
    check_error(open_error(c.path()), {c / file, "model.norm.weight", "which the index", "does not name"});
    j["weight_map"]["model.norm.weight"] = file == shard2 ? "model-00001-of-00003.safetensors" : shard2;
    write_json(c / "model.safetensors.index.json", j);
    check_error(open_error(c.path()), {c / file, "model.norm.weight", "puts in"});
    j["weight_map"]["model.norm.weight"] = file;
    j["weight_map"]["model.extra.weight"] = file;
    write_json(c / "model.safetensors.index.json", j);
    check_error(open_error(c.path()), {"model.extra.weight", "which does not hold it"});
  }
  SUBCASE("no weights, both forms, not a directory") {
    FixtureCopy c("llama");
    fs::rename(c / "model.safetensors", c / "pytorch_model.bin");
    check_error(open_error(c.path()), {c.path(), "neither model.safetensors nor"});
    fs::rename(c / "pytorch_model.bin", c / "model.safetensors");
    write_json(c / "model.safetensors.index.json", {{"weight_map", {{"a", "model.safetensors"}}}});
    check_error(open_error(c.path()), {"both model.safetensors and", "ambiguous"});
    check_error(open_error(c / "config.json"), {"config.json", "is not a directory"});
    fs::remove(c / "model.safetensors.index.json");
    fs::remove(c / "config.json");
    check_error(open_error(c.path()), {c / "config.json", "cannot open"});
  }
  SUBCASE("a tensor of the wrong shape") {
    FixtureCopy c("llama");
    c.tensors("model.safetensors", [](std::vector<LoadedTensor>& ts) {
      named(ts, "model.norm.weight").shape = Shape{8, 8};
    });
    check_error(open_error(c.path()), {c / "model.safetensors", "'model.norm.weight'",
                                       "has shape (8, 8)", "config.json", "gives (64)"});
  }
  SUBCASE("a tensor of the wrong dtype") {
    FixtureCopy c("llama");
    c.tensors("model.safetensors", [](std::vector<LoadedTensor>& ts) {
      named(ts, "model.layers.1.mlp.up_proj.weight").dtype = DType::I32;
    });
    check_error(open_error(c.path()), {c / "model.safetensors", "'model.layers.1.mlp.up_proj.weight'",
                                       "has dtype I32", "must be F32, F16, BF16 or F64"});
  }
  SUBCASE("a missing tensor and a tensor left over") {
    FixtureCopy c("llama");
    c.tensors("model.safetensors", [](std::vector<LoadedTensor>& ts) {
      ts.erase(std::find_if(ts.begin(), ts.end(), [](const LoadedTensor& t) {
        return t.name == "model.layers.1.self_attn.k_proj.weight";
      }));
    });
    check_error(open_error(c.path()), {c / "model.safetensors", "no tensor 'model.layers.1.self_attn.k_proj.weight'",
                                       "shape (32, 64)", "LlamaForCausalLM"});
    FixtureCopy d("olmoe");
    d.tensors("model.safetensors", [](std::vector<LoadedTensor>& ts) {
      LoadedTensor t = named(ts, "model.norm.weight");
      t.name = "model.layers.0.self_attn.rotary_emb.inv_freq";
      ts.push_back(t);
    });
    check_error(open_error(d.path()), {d / "model.safetensors", "model.layers.0.self_attn.rotary_emb.inv_freq",
                                       "left over"});
  }
  SUBCASE("NaN and infinite weights, and nothing is written by a failed load") {
    for (const std::string family : {"llama", "qwen3_moe", "qwen2_moe"}) {  // F32, BF16, F16
      CAPTURE(family);
      FixtureCopy c(family);
      const std::string tensor = "lm_head.weight";
      c.tensors("model.safetensors", [&](std::vector<LoadedTensor>& ts) {
        LoadedTensor& t = named(ts, tensor);
        const std::size_t at = 77;
        if (t.dtype == DType::F32) {
          const float nan = std::numeric_limits<float>::quiet_NaN();
          std::memcpy(t.bytes.data() + 4 * at, &nan, 4);
        } else {
          const std::uint16_t inf = t.dtype == DType::BF16 ? 0x7f80 : 0x7c00;  // +inf
          std::memcpy(t.bytes.data() + 2 * at, &inf, 2);
        }
      });
      const hf::Checkpoint ck = hf::Checkpoint::open(c.path());  // the header is fine
      TransformerLM<SoftmaxRouter, float> lm(ck.config().lm, 7);
      const std::vector<double> before = parameters(lm.arena());
      check_error(error_of([&] { ck.load(lm); }),
                  {c / "model.safetensors", "'" + tensor + "'", "at element 77", "must be finite",
                   family == "llama" ? "holds nan" : "holds inf"});
      CHECK(parameters(lm.arena()) == before);
    }
  }
}

TEST_CASE("hf: config.json's absurd values, unknown architectures and keys are refused by name") {
  const std::string path = "dir/config.json";
  const nlohmann::json mixtral = read_json(fixture("mixtral") + "/config.json");
  const nlohmann::json qwen2 = read_json(fixture("qwen2_moe") + "/config.json");
  const nlohmann::json qwen3 = read_json(fixture("qwen3_moe") + "/config.json");
  const nlohmann::json olmoe = read_json(fixture("olmoe") + "/config.json");
  const nlohmann::json llama = read_json(fixture("llama") + "/config.json");
  auto refused = [&](nlohmann::json j, const std::function<void(nlohmann::json&)>& edit,
                     const std::vector<std::string>& parts) {
    edit(j);
    std::vector<std::string> all = parts;
    all.push_back("'dir/config.json'");
    check_error(error_of([&] { (void)hf::parse_config(j, path); }), all);
  };
  using J = nlohmann::json;
  // absurd sizes
  refused(mixtral, [](J& j) { j["hidden_size"] = 1000000000000LL; },
          {"key 'hidden_size' = 1000000000000 is outside [1, 65536]"});
  refused(mixtral, [](J& j) { j["hidden_size"] = 1e12; }, {"key 'hidden_size' = 1000000000000"});
  refused(mixtral, [](J& j) { j["num_local_experts"] = 0; }, {"key 'num_local_experts' = 0 is outside"});
  refused(olmoe, [](J& j) { j["num_experts"] = 0; }, {"key 'num_experts' = 0 is outside"});
  refused(mixtral, [](J& j) { j["num_experts_per_tok"] = 9; }, {"key 'num_experts_per_tok' = 9 is outside [1, 8]"});
  refused(mixtral, [](J& j) { j["num_attention_heads"] = 5; }, {"key 'num_attention_heads'", "does not divide hidden_size"});
  refused(mixtral, [](J& j) { j["num_key_value_heads"] = 3; }, {"key 'num_key_value_heads'", "does not divide"});
  refused(mixtral, [](J& j) { j["vocab_size"] = -1; }, {"key 'vocab_size' = -1 is outside"});
  refused(mixtral, [](J& j) { j["vocab_size"] = "128"; }, {"key 'vocab_size' is a string", "expected an integer"});
  refused(mixtral, [](J& j) { j["num_hidden_layers"] = 100000; }, {"key 'num_hidden_layers' = 100000"});
  refused(mixtral, [](J& j) { j["intermediate_size"] = 1LL << 40; }, {"key 'intermediate_size'"});
  refused(mixtral, [](J& j) { j["max_position_embeddings"] = 1LL << 40; }, {"key 'max_position_embeddings'"});
  refused(mixtral, [](J& j) { j["rms_norm_eps"] = 0; }, {"key 'rms_norm_eps' = 0 is outside (0, 1]"});
  refused(mixtral, [](J& j) { j.erase("hidden_size"); }, {"key 'hidden_size' is missing"});
  refused(qwen2, [](J& j) { j["moe_intermediate_size"] = 0; }, {"key 'moe_intermediate_size' = 0"});
  // unknown architectures
  refused(mixtral, [](J& j) { j["architectures"] = {"GPT2LMHeadModel"}; },
          {"key 'architectures'", "'GPT2LMHeadModel' is not an architecture the reader knows",
           "MixtralForCausalLM"});
  refused(mixtral, [](J& j) { j.erase("architectures"); }, {"key 'architectures' is missing"});
  refused(mixtral, [](J& j) { j["model_type"] = "llama"; }, {"key 'model_type'", "does not match"});
  // keys that change the computation
  refused(llama, [](J& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; },
          {"key 'rope_scaling'", "scaled RoPE"});
  refused(llama, [](J& j) { j["rope_parameters"]["rope_type"] = "yarn"; }, {"key 'rope_parameters'", "scaled RoPE"});
  refused(llama, [](J& j) { j["rope_parameters"]["partial_rotary_factor"] = 0.5; },
          {"key 'rope_parameters'", "'partial_rotary_factor'"});
  refused(llama, [](J& j) { j["rope_theta"] = 1234.0; }, {"key 'rope_parameters'", "but the key 'rope_theta' says"});
  refused(llama, [](J& j) { j.erase("rope_parameters"); }, {"key 'rope_theta' is missing"});
  refused(mixtral, [](J& j) { j["sliding_window"] = 16; }, {"key 'sliding_window' = 16", "sliding-window attention"});
  refused(qwen2, [](J& j) { j["use_sliding_window"] = true; }, {"key 'use_sliding_window'"});
  refused(qwen2, [](J& j) { j["layer_types"][1] = "sliding_attention"; }, {"key 'layer_types'", "sliding_attention"});
  refused(llama, [](J& j) { j["attention_bias"] = true; }, {"key 'attention_bias' is true"});
  refused(llama, [](J& j) { j["mlp_bias"] = true; }, {"key 'mlp_bias' is true"});
  refused(llama, [](J& j) { j["hidden_act"] = "gelu"; }, {"key 'hidden_act' = 'gelu'"});
  refused(olmoe, [](J& j) { j["head_dim"] = 32; },
          {"key 'head_dim' = 32", "OLMoE's q_norm and k_norm are sized for"});
  refused(llama, [](J& j) { j["head_dim"] = 0; }, {"key 'head_dim' = 0"});
  refused(llama, [](J& j) { j["head_dim"] = 1LL << 40; }, {"key 'head_dim'"});
  refused(llama, [](J& j) { j["head_dim"] = 60000; }, {"key 'head_dim' = 60000", "num_attention_heads x head_dim"});
  refused(llama, [](J& j) { j["num_attention_heads"] = 3; j.erase("head_dim"); j["num_key_value_heads"] = 3; },
          {"key 'num_attention_heads' = 3 does not divide hidden_size = 64", "head_dim is not set"});
  refused(llama, [](J& j) { j["attention_dropout"] = 0.1; }, {"key 'attention_dropout'"});
  refused(olmoe, [](J& j) { j["clip_qkv"] = 8.0; }, {"key 'clip_qkv' is set"});
  refused(mixtral, [](J& j) { j["router_jitter_noise"] = 0.1; }, {"key 'router_jitter_noise'"});
  refused(qwen3, [](J& j) { j["mlp_only_layers"] = {1}; }, {"key 'mlp_only_layers'", "only the first layers"});
  refused(llama, [](J& j) { j["quantization_config"] = {{"quant_method", "gptq"}}; },
          {"key 'quantization_config' is set"});
  refused(mixtral, [](J& j) { j["norm_topk_prob"] = false; },  // Mixtral always renormalises
          {"key 'norm_topk_prob'", "is not known to the reader for MixtralForCausalLM"});
  refused(llama, [](J& j) { j["logit_softcapping"] = 30.0; },
          {"key 'logit_softcapping' (30.0) is not known", "could change what the model computes"});
  // and what is understood
  nlohmann::json tied = llama;
  tied["tie_word_embeddings"] = true;
  tied["rope_scaling"] = nullptr;
  tied["eos_token_id"] = {2, 7};
  const hf::ModelConfig t = hf::parse_config(tied, path);
  CHECK(t.lm.tie_embeddings);
  CHECK(t.eos_token_ids == std::vector<std::int64_t>{2, 7});
  // head_dim: the default when it equals hidden_size / num_attention_heads, set otherwise
  CHECK(t.lm.attention.head_dim == 0);
  nlohmann::json wide = llama;
  wide["head_dim"] = 32;  // 4 heads x 32 = 2 hidden_size, as Qwen3-MoE's releases
  const hf::ModelConfig w = hf::parse_config(wide, path);
  CHECK(w.lm.attention.head_dim == 32);
  CHECK(w.lm.attention.head_dim_for(w.lm.d_model, w.lm.num_heads) == 32);
  nlohmann::json v4 = mixtral;  // transformers 4's keys
  v4.erase("rope_parameters");
  v4["rope_theta"] = 1e6;
  v4["rope_scaling"] = nullptr;
  v4["torch_dtype"] = "bfloat16";
  v4["sliding_window"] = 4096;  // longer than max_position_embeddings: no effect
  CHECK(hf::parse_config(v4, path).lm.attention.rope_theta == 1e6);
  nlohmann::json q3 = qwen3;  // num_experts (transformers 4) beside num_local_experts
  q3["num_experts"] = 8;
  CHECK(hf::parse_config(q3, path).lm.router.num_experts == 8);
  q3["num_experts"] = 16;
  check_error(error_of([&] { (void)hf::parse_config(q3, path); }),
              {"key 'num_experts' = 16 disagrees with num_local_experts = 8"});
}

TEST_CASE("hf: an absurd config.json on disk fails before the shards are read") {
  FixtureCopy c("mixtral");
  c.config([](nlohmann::json& j) { j["hidden_size"] = 1000000000000LL; });
  fs::remove(c / "model-00001-of-00003.safetensors");  // never reached
  check_error(open_error(c.path()), {c / "config.json", "key 'hidden_size'"});
  c.config([](nlohmann::json& j) { j = nlohmann::json::array(); });
  check_error(open_error(c.path()), {c / "config.json", "holds an array, not a JSON object"});
  std::ofstream(c / "config.json") << "{\"architectures\": [";
  check_error(open_error(c.path()), {c / "config.json", "is not valid JSON"});
  // nested 75,000 deep (150 kB): nlohmann_json's recursive copy of such a value overflowed the
  // stack; the nesting is refused before the value is built, in config.json and in the index
  const std::string deep = "{\"architectures\": " + std::string(75000, '[') +
                           std::string(75000, ']') + "}";
  std::ofstream(c / "config.json") << deep;
  check_error(open_error(c.path()), {c / "config.json", "nests JSON arrays and objects more than "
                                     "256 levels deep (at byte 273)"});
  FixtureCopy d("mixtral");
  std::ofstream(d / "model.safetensors.index.json") << deep;
  check_error(open_error(d.path()), {d / "model.safetensors.index.json", "more than 256 levels deep"});
  // 256 levels are read (and refused for what they hold, not for their depth)
  std::ofstream(c / "config.json") << "{\"architectures\": " + std::string(255, '[') +
                                          std::string(255, ']') + "}";
  const std::string e = open_error(c.path());
  CHECK_MESSAGE(e.find("levels deep") == std::string::npos, e);
  CHECK_MESSAGE(e.find("architectures") != std::string::npos, e);
}

TEST_CASE("hf: broken symbolic links and link loops are named as such") {
  FixtureCopy c("mixtral");
  const std::string shard2 = "model-00002-of-00003.safetensors";
  fs::remove(c / shard2);
  fs::create_symlink(c / "gone.safetensors", c / shard2);
  check_error(open_error(c.path()), {c / "model.safetensors.index.json", shard2,
                                     "is a broken symbolic link (to '" + (c / "gone.safetensors")});
  fs::remove(c / shard2);
  fs::create_symlink(shard2, c / shard2);  // itself
  check_error(open_error(c.path()), {shard2, "is a symbolic link loop"});
  fs::rename(c / "config.json", c / "config.real.json");
  fs::create_symlink(c / "config.missing.json", c / "config.json");
  check_error(open_error(c.path()), {c / "config.json", "is a broken symbolic link (to '"});
  // model.safetensors as a broken link: not "holds neither model.safetensors nor ..."
  FixtureCopy d("llama");
  fs::rename(d / "model.safetensors", d / "model.real.safetensors");
  fs::create_symlink(d / "elsewhere.safetensors", d / "model.safetensors");
  const std::string e = open_error(d.path());
  check_error(e, {d / "model.safetensors", "is a broken symbolic link"});
  CHECK_MESSAGE(e.find("holds neither") == std::string::npos, e);
  // the directory itself
  const std::string link = c / "dir-link";
  fs::create_symlink(c / "no-such-dir", link);
  check_error(open_error(link), {link, "is a broken symbolic link (to '"});
}

TEST_CASE("hf: DeepSeek-V3 (latent attention, sigmoid-bias group routing) loads and computes transformers' logits and expert choices") {
  const std::string dir = fixture("deepseek_v3");
  const nlohmann::json ex = read_json(dir + "/expected.json");
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  const hf::ModelConfig& mc = ck.config();
  CHECK(mc.family == hf::Family::DeepseekV3);
  CHECK(hf::sigmoid_routed(mc.family));
  const AttentionOptions& a = mc.lm.attention;
  CHECK(a.kv_lora_rank == 16);
  CHECK(a.q_lora_rank == 16);
  CHECK(a.qk_nope_head_dim == 8);
  CHECK(a.qk_rope_head_dim == 8);
  CHECK(a.v_head_dim == 8);
  CHECK(a.latent_norm_eps == 1e-6);
  CHECK(a.rope_layout == RopeLayout::Interleaved);
  CHECK(a.rope_theta == 10000.0);
  CHECK(a.num_kv_heads == 0);
  const auto& t = mc.lm.router.options<TopK>();
  CHECK(t.n_group == 4);
  CHECK(t.topk_group == 2);
  CHECK(t.routed_scaling_factor == 2.5);
  CHECK(t.norm_topk_prob);
  CHECK(mc.lm.router.k == 3);
  CHECK_FALSE(mc.lm.router.options<SigmoidScorer>().bias);
  CHECK(mc.lm.first_k_dense == 1);
  CHECK(mc.lm.shared_d_ff == 4);
  CHECK_FALSE(mc.lm.shared_expert_gate);
  CHECK(mc.mtp_layers == 1);

  auto lm = hf::load_lm<SigmoidBiasRouter, float>(dir);
  const Comparison c = compare(*lm, ex);
  MESSAGE("deepseek_v3 (", ck.tensor_count(), " tensors): float logits within ", c.logits,
          " relative, logsumexp ", c.logsumexp, ", experts ", c.expert_rows - c.expert_mismatches,
          " of ", c.expert_rows, " token-layers identical");
  CHECK(c.logits <= 1e-4);
  CHECK(c.logsumexp <= 1e-4);
  CHECK(c.expert_rows > 0);
  CHECK(c.expert_mismatches == 0);
  // the selection bias is loaded (e_score_correction_bias -> moe.router.selector.expert_bias)
  const Tensor<float> bias = lm->arena().value(lm->arena().find("blocks.1.moe.router.selector.expert_bias"));
  CHECK(std::any_of(bias.data(), bias.data() + bias.numel(), [](float x) { return x != 0; }));
  auto lmd = hf::load_lm<SigmoidBiasRouter, double>(dir);
  const Comparison d = compare(*lmd, ex);
  MESSAGE("deepseek_v3: double logits within ", d.logits, " relative of transformers' float32");
  CHECK(d.logits <= 1e-4);
  CHECK(d.expert_mismatches == 0);
  // a graph router over the same scores loads the same weights
  auto sim = hf::load_lm<SimilaritySigmoidBiasRouter, float>(dir);
  CHECK(parameters(sim->arena()) == parameters(lm->arena()));
  // graph upcycling: Blended<Similarity> over the sigmoid scores starts at a = 0, the model itself
  using BlendedSigmoid = Router<SigmoidScorer, Blended<Similarity>, BiasBalancedTopK>;
  auto blended = hf::load_lm<BlendedSigmoid, float>(dir);
  for (const auto& p : ex["prompts"]) {
    const auto prompt = p.get<std::vector<std::int32_t>>();
    CHECK(logits_of(*blended, prompt) == logits_of(*lm, prompt));
  }

  // the other kind of router is refused by name, both ways
  check_error(error_of([&] { (void)hf::load_lm<SoftmaxRouter, float>(dir); }),
              {"DeepseekV3ForCausalLM", "sigmoids and a selection bias", "SigmoidBiasRouter"});
  check_error(error_of([&] { (void)hf::load_lm<SigmoidBiasRouter, float>(fixture("qwen3_moe")); }),
              {"Qwen3MoeForCausalLM", "softmax top-k", "SoftmaxRouter"});
}

TEST_CASE("hf: DeepSeek-V3's multi-token-prediction layers are skipped, other extra layers are not") {
  FixtureCopy c("deepseek_v3");
  c.tensors("model.safetensors", [](std::vector<LoadedTensor>& ts) {
    LoadedTensor t = named(ts, "model.layers.1.mlp.gate.weight");
    t.name = "model.layers.2.mlp.gate.weight";  // layer num_hidden_layers: the MTP module
    ts.push_back(t);
  });
  auto ref = hf::load_lm<SigmoidBiasRouter, float>(fixture("deepseek_v3"));
  auto lm = hf::load_lm<SigmoidBiasRouter, float>(c.path());
  CHECK(parameters(lm->arena()) == parameters(ref->arena()));
  c.config([](nlohmann::json& j) { j["num_nextn_predict_layers"] = 0; });
  check_error(open_error(c.path()), {"'model.layers.2.mlp.gate.weight' is left over"});
  c.config([](nlohmann::json& j) { j["num_nextn_predict_layers"] = 1; });
  c.tensors("model.safetensors", [](std::vector<LoadedTensor>& ts) {
    LoadedTensor t = named(ts, "model.norm.weight");
    t.name = "model.layers.3.input_layernorm.weight";  // beyond the one MTP layer
    ts.push_back(t);
  });
  check_error(error_of([&] { (void)hf::load_lm<SigmoidBiasRouter, float>(c.path()); }),
              {"'model.layers.3.input_layernorm.weight' is left over"});
}

TEST_CASE("hf: DeepSeek-V3 config keys are read, and refused by name where graphmoe cannot compute them") {
  const std::string path = "dir/config.json";
  const nlohmann::json ds = read_json(fixture("deepseek_v3") + "/config.json");
  using J = nlohmann::json;
  auto refused = [&](const std::function<void(J&)>& edit, const std::vector<std::string>& parts) {
    J j = ds;
    edit(j);
    std::vector<std::string> all = parts;
    all.push_back("'dir/config.json'");
    check_error(error_of([&] { (void)hf::parse_config(j, path); }), all);
  };
  refused([](J& j) { j["n_group"] = 3; }, {"key 'n_group' = 3 does not divide n_routed_experts = 8"});
  refused([](J& j) { j["n_group"] = 8; }, {"key 'n_group' = 8 makes groups of one expert"});
  refused([](J& j) { j["topk_group"] = 5; }, {"key 'topk_group' = 5 is outside [1, 4]"});
  refused([](J& j) { j["topk_group"] = 1; }, {"key 'num_experts_per_tok' = 3", "topk_group = 1 groups of 2"});
  refused([](J& j) { j["num_key_value_heads"] = 2; }, {"key 'num_key_value_heads' = 2 differs"});
  refused([](J& j) { j["v_head_dim"] = 17; }, {"key 'v_head_dim' = 17 is above"});
  refused([](J& j) { j["qk_rope_head_dim"] = 7; }, {"key 'qk_rope_head_dim' = 7 is odd"});
  refused([](J& j) { j["head_dim"] = 16; }, {"key 'head_dim' differs from qk_rope_head_dim = 8"});
  refused([](J& j) { j["qk_head_dim"] = 12; }, {"key 'qk_head_dim' differs"});
  refused([](J& j) { j.erase("kv_lora_rank"); }, {"key 'kv_lora_rank' is missing"});
  refused([](J& j) { j["n_shared_experts"] = 0; }, {"key 'n_shared_experts' = 0 is outside"});
  refused([](J& j) { j["scoring_func"] = "softmax"; }, {"key 'scoring_func' is not 'sigmoid'"});
  refused([](J& j) { j["topk_method"] = "greedy"; }, {"key 'topk_method' = 'greedy'"});
  refused([](J& j) { j["moe_layer_freq"] = 2; }, {"key 'moe_layer_freq' is not 1"});
  refused([](J& j) { j["attention_bias"] = true; }, {"key 'attention_bias' is true"});
  refused([](J& j) { j["num_mtp_layers"] = 2; }, {"key 'num_mtp_layers' = 2 disagrees"});
  refused([](J& j) {
    j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}, {"mscale", 1.0}};
  }, {"key 'rope_scaling'", "scaled RoPE"});
  refused([](J& j) { j["router_aux_loss_coef"] = 0.01; }, {"key 'router_aux_loss_coef'", "is not known"});
  // understood: the original release's remote-code keys, q_proj without a query latent, half-split
  // RoPE, defaults of absent keys
  J orig = ds;
  orig["scoring_func"] = "sigmoid";
  orig["topk_method"] = "noaux_tc";
  orig["moe_layer_freq"] = 1;
  orig["ep_size"] = 1;
  orig["seq_aux"] = true;
  orig["aux_loss_alpha"] = 0.001;
  orig["auto_map"] = {{"AutoConfig", "configuration_deepseek.DeepseekV3Config"}};
  orig["q_lora_rank"] = nullptr;
  orig["rope_interleave"] = false;
  orig.erase("routed_scaling_factor");
  orig.erase("num_nextn_predict_layers");
  const hf::ModelConfig o = hf::parse_config(orig, path);
  CHECK(o.lm.attention.q_lora_rank == 0);
  CHECK(o.lm.attention.rope_layout == RopeLayout::HalfSplit);
  CHECK(o.lm.router.seq_aux_loss_coef == doctest::Approx(0.001));
  CHECK(o.lm.router.options<TopK>().routed_scaling_factor == 2.5);
  CHECK(o.mtp_layers == 1);
  J all_dense = ds;
  all_dense["first_k_dense_replace"] = 5;  // every layer dense, as transformers builds it
  CHECK(hf::parse_config(all_dense, path).lm.first_k_dense == 2);
}
