// The Hugging Face writer (graphmoe/hf/writer.hpp): the golden fixtures under tests/hf/fixtures
// loaded, saved (F32 in one file, BF16 in shards) and read back bit for bit; random models of each
// family; the config.json written against the one transformers wrote; what is refused; atomicity.
//
// With GRAPHMOE_HF_WRITER_OUT=<dir> set, the case "hf writer: models for transformers" also writes
// each family's random model and graphmoe's float logits and expert choices into <dir>, which
// scripts/hf-writer-check.py loads with transformers (docs/reference/hugging-face.md).
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/hf/reader.hpp"
#include "graphmoe/hf/writer.hpp"
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

using LM = TransformerLM<SoftmaxRouter, float>;

const std::vector<std::string> kFamilies = {"llama",     "mixtral",   "olmoe",
                                            "qwen2_moe", "qwen3_moe", "deepseek_v3"};

// f.template operator()<Router>(family) for every family, with the router its checkpoints load
// into: SigmoidBiasRouter for DeepSeek-V3, SoftmaxRouter for the others.
template <class F>
void for_each_family(F&& f) {
  for (const std::string& family : kFamilies) {
    CAPTURE(family);
    if (family == "deepseek_v3")
      f.template operator()<SigmoidBiasRouter>(family);
    else
      f.template operator()<SoftmaxRouter>(family);
  }
}

std::string fixture(const std::string& family) {
  return (fs::path(GRAPHMOE_HF_FIXTURES) / family).string();
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot open ", path);
  return nlohmann::json::parse(in);
}

// A fresh folder under the system temp dir, removed with it.
struct TempDir {
  fs::path dir;
  TempDir() {
    static int counter = 0;
    dir = fs::temp_directory_path() /
          ("graphmoe_hfw_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(dir, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir, ec);
  }
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

void check_error(const std::string& msg, const std::vector<std::string>& parts) {
  for (const auto& p : parts) CHECK_MESSAGE(test::contains(msg, p), "'", p, "' not in: ", msg);
}

std::vector<float> parameters(const ParameterArena<float>& a) {
  std::vector<float> out;
  for (index_t i = 0; i < a.size(); ++i) {
    const Tensor<float> v = a.value(i);
    out.insert(out.end(), v.data(), v.data() + v.numel());
  }
  return out;
}
// Bit equality (NaN-free weights: == on floats is bit equality but for -0.0 vs 0.0).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class R, class T>
std::vector<T> logits_of(TransformerLM<R, T>& lm, const std::vector<std::int32_t>& prompt) {
  const auto t = static_cast<index_t>(prompt.size());
  Tensor<std::int32_t> ids(Shape{1, t});
  std::copy(prompt.begin(), prompt.end(), ids.data());
  lm.set_mode(Mode::Eval);
  lm.forward(ids, Tensor<std::int32_t>());
  const Tensor<T>& l = lm.logits();
  return std::vector<T>(l.data(), l.data() + l.numel());
}

// token ids below 96, the smallest fixture vocabulary (deepseek_v3's)
const std::vector<std::vector<std::int32_t>> kPrompts = {
    {5, 17, 93, 3, 64}, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {95, 0, 42, 42, 11, 90, 33, 8, 71, 64, 12, 5, 88, 2, 77, 19}};

// Every parameter drawn as scripts/hf-fixtures.py draws them (norms near 1, biases near 0,
// matrices N(0, 1 / fan_in)): far from ties between experts, unlike a fresh model's small router.
template <class R, class T>
void draw_weights(TransformerLM<R, T>& lm, std::uint64_t seed) {
  Rng rng(seed);
  ParameterArena<T>& a = lm.arena();
  for (index_t i = 0; i < a.size(); ++i) {
    const ParameterInfo& p = a.params()[static_cast<std::size_t>(i)];
    Tensor<T> v = a.value(i);
    const bool norm = p.name.find("ln") != std::string::npos || p.name.find("norm") != std::string::npos;
    const double fan_in = static_cast<double>(p.shape[p.shape.rank() - 1]);
    for (index_t j = 0; j < v.numel(); ++j) {
      const double n = rng.normal();
      v.data()[j] = static_cast<T>(p.shape.rank() == 1 ? (norm ? 1.0 + 0.2 * n : 0.2 * n)
                                                       : n / std::sqrt(fan_in));
    }
  }
  a.mark_values_written();
}

// All the tensors of a saved directory, by name (every shard).
std::map<std::string, LoadedTensor> tensors_of(const std::string& dir) {
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  std::map<std::string, LoadedTensor> out;
  for (const auto& f : ck.files())
    for (auto& [name, t] : load_safetensors(f).tensors) out.emplace(name, t);
  return out;
}

std::set<std::string> slot_names(const hf::ModelConfig& mc) {
  std::set<std::string> out;
  hf::for_each_tensor(mc, [&](const hf::TensorSlot& s) { out.insert(s.name); });
  return out;
}

// The keys of config.json transformers wrote that the writer leaves out or writes otherwise, and
// the keys it adds: every other key must be equal.
const std::set<std::string> kAbsentAllowed = {"transformers_version"};
const std::set<std::string> kDifferentAllowed = {
    "head_dim",           // Mixtral: null (= hidden / heads) there, the number here
    "max_window_layers",  // Qwen2-MoE: unused without sliding windows (28 there, the layers here)
    "num_nextn_predict_layers",  // DeepSeek-V3: 1 there (the default, with no MTP tensors), 0 here
    "dtype"};             // the dtype saved (checked separately)
const std::set<std::string> kExtraAllowed = {"rope_theta", "torch_dtype", "num_experts"};

void compare_config(const nlohmann::json& ours, const nlohmann::json& theirs, const std::string& dtype) {
  for (auto it = theirs.begin(); it != theirs.end(); ++it) {
    const std::string& key = it.key();
    CAPTURE(key);
    if (!ours.contains(key)) {
      CHECK_MESSAGE(kAbsentAllowed.count(key) == 1, "key '", key, "' not written");
      continue;
    }
    if (kDifferentAllowed.count(key) == 0)
      CHECK_MESSAGE(ours[key] == *it, "key '", key, "': ", ours[key].dump(), " vs ", it->dump());
  }
  for (auto it = ours.begin(); it != ours.end(); ++it)
    CHECK_MESSAGE((theirs.contains(it.key()) || kExtraAllowed.count(it.key()) == 1),
                  "key '", it.key(), "' written but not in transformers' config.json");
  CHECK(ours["dtype"] == dtype);
  CHECK(ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"]);
}

// A save hook: the second file's first write fails.
struct Fail {
  static inline int done = 0;
  static void hook(std::uint64_t written, std::uint64_t total) {
    if (written == total)
      ++done;
    else if (done >= 1)
      throw Error("injected write failure");
  }
};

}  // namespace

TEST_CASE("hf writer: every fixture loaded, saved in F32 and read back is the same model") {
  for_each_family([&]<class R>(const std::string& family) {
    const hf::Checkpoint ck = hf::Checkpoint::open(fixture(family));
    auto lm = hf::load_lm<R, float>(fixture(family));
    TempDir t;
    const std::string out = t / "model";
    hf::save_lm(*lm, ck.config(), out);
    CHECK(t.entries() == std::vector<std::string>{"model"});  // no temporary left
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(out)) files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    CHECK(files == std::vector<std::string>{"config.json", "model.safetensors"});
    auto back = hf::load_lm<R, float>(out);
    CHECK(same_bits(parameters(back->arena()), parameters(lm->arena())));
    for (const auto& p : kPrompts) CHECK(logits_of(*back, p) == logits_of(*lm, p));
    // config.json: transformers' keys and values, the token ids kept
    compare_config(read_json(out + "/config.json"), read_json(fixture(family) + "/config.json"),
                   "float32");
    const hf::ModelConfig re = hf::Checkpoint::open(out).config();
    CHECK(re.bos_token_ids == ck.config().bos_token_ids);
    CHECK(re.eos_token_ids == ck.config().eos_token_ids);
    CHECK(re.pad_token_id == ck.config().pad_token_id);
    CHECK(re.dtype == "float32");
    CHECK(hf::detail::computation_difference(re.lm, ck.config().lm).empty());
    CHECK(re.lm.router.load_balance_coef == ck.config().lm.router.load_balance_coef);
    CHECK(re.lm.max_seq_len == ck.config().lm.max_seq_len);
  });
}

TEST_CASE("hf writer: BF16 in shards with an index, a BF16 fixture is written byte for byte") {
  for_each_family([&]<class R>(const std::string& family) {
    const hf::Checkpoint ck = hf::Checkpoint::open(fixture(family));
    auto lm = hf::load_lm<R, float>(fixture(family));
    TempDir t;
    const std::string out = t / "model";
    hf::SaveOptions o;
    o.dtype = DType::BF16;
    o.max_shard_size = 40000;  // 3 to 7 shards of these tiny models
    hf::save_lm(*lm, ck.config(), out, o);
    const hf::Checkpoint re = hf::Checkpoint::open(out);
    REQUIRE(re.files().size() >= 2);
    CHECK(re.index_path() == out + "/model.safetensors.index.json");
    // the index: every tensor of the model, in the shard that holds it; the sizes
    const nlohmann::json index = read_json(re.index_path());
    std::set<std::string> mapped;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) mapped.insert(it.key());
    CHECK(mapped == slot_names(re.config()));
    CHECK(index["metadata"]["total_size"].get<std::uint64_t>() == 2 * re.element_count());
    CHECK(index["metadata"]["total_parameters"].get<std::uint64_t>() == re.element_count());
    for (const auto& f : re.files()) {
      CHECK(fs::file_size(f) <= o.max_shard_size + 8192);  // data plus its header
      CHECK(read_safetensors_header(f).metadata == std::map<std::string, std::string>{{"format", "pt"}});
    }
    // every value is the BF16 rounding of the model's
    auto back = hf::load_lm<R, float>(out);
    const std::vector<float> a = parameters(lm->arena()), b = parameters(back->arena());
    REQUIRE(a.size() == b.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
      wrong += hf::detail::bf16_to_float(hf::detail::float_to_bf16(a[i])) != b[i] ? 1 : 0;
    CHECK(wrong == 0);
    const nlohmann::json ex = read_json(fixture(family) + "/expected.json");
    if (ex["storage_dtype"] == "bfloat16") {
      CHECK(same_bits(a, b));
      for (const auto& p : kPrompts) CHECK(logits_of(*back, p) == logits_of(*lm, p));
      const auto mine = tensors_of(out), theirs = tensors_of(fixture(family));
      REQUIRE(mine.size() == theirs.size());
      for (const auto& [name, x] : theirs) {
        CAPTURE(name);
        REQUIRE(mine.count(name) == 1);
        CHECK(mine.at(name).dtype == DType::BF16);
        CHECK(mine.at(name).shape == x.shape);
        CHECK(mine.at(name).bytes == x.bytes);
      }
    }
    CHECK(read_json(out + "/config.json")["dtype"] == "bfloat16");
  });
}

TEST_CASE("hf writer: random models of every family round-trip, F32 and F16") {
  for_each_family([&]<class R>(const std::string& family) {
    const hf::ModelConfig mc = hf::Checkpoint::open(fixture(family)).config();
    TransformerLM<R, float> lm(mc.lm, 1234);  // graphmoe's own init
    TempDir t;
    hf::save_lm(lm, mc.family, t / "f32");
    auto back = hf::load_lm<R, float>(t / "f32");
    CHECK(same_bits(parameters(back->arena()), parameters(lm.arena())));
    CHECK(logits_of(*back, kPrompts[2]) == logits_of(lm, kPrompts[2]));
    const nlohmann::json cj = read_json(t / "f32/config.json");
    CHECK(cj["bos_token_id"].is_null());
    CHECK(cj["pad_token_id"].is_null());

    hf::SaveOptions o;
    o.dtype = DType::F16;
    hf::save_lm(lm, mc.family, t / "f16", o);
    auto half = hf::load_lm<R, float>(t / "f16");
    const std::vector<float> a = parameters(lm.arena()), b = parameters(half->arena());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
      wrong += hf::detail::f16_to_float(hf::detail::float_to_f16(a[i])) != b[i] ? 1 : 0;
    CHECK(wrong == 0);
  });
}

TEST_CASE("hf writer: a double model is written with one rounding") {
  const hf::ModelConfig mc = hf::Checkpoint::open(fixture("qwen2_moe")).config();
  auto ref = hf::load_lm<SoftmaxRouter, float>(fixture("qwen2_moe"));
  auto lmd = hf::load_lm<SoftmaxRouter, double>(fixture("qwen2_moe"));
  for (const DType dt : {DType::F32, DType::F16, DType::BF16}) {
    CAPTURE(dt);
    TempDir t;
    hf::SaveOptions o;
    o.dtype = dt;
    hf::save_lm(*lmd, mc, t / "m", o);
    auto back = hf::load_lm<SoftmaxRouter, float>(t / "m");
    const std::vector<float> a = parameters(ref->arena()), b = parameters(back->arena());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const float want = dt == DType::F32  ? a[i]
                         : dt == DType::F16 ? hf::detail::f16_to_float(hf::detail::float_to_f16(a[i]))
                                            : hf::detail::bf16_to_float(hf::detail::float_to_bf16(a[i]));
      wrong += want != b[i] ? 1 : 0;
    }
    CHECK(wrong == 0);  // the fixture is F16: exact in F16 and F32
  }
}

TEST_CASE("hf writer: rounding to BF16 and F16 is to nearest, ties to even") {
  using hf::detail::bf16_to_float;
  using hf::detail::f16_to_float;
  using hf::detail::float_to_bf16;
  using hf::detail::float_to_f16;
  // every finite half and bfloat16 value round-trips, and every midpoint rounds to the even side
  std::size_t bad = 0;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    if ((b & 0x7c00u) != 0x7c00u) {
      bad += float_to_f16(f16_to_float(b)) != b ? 1 : 0;
      const std::uint16_t next = static_cast<std::uint16_t>(b + 1);
      if ((next & 0x7fffu) < 0x7c00u && (b & 0x7fffu) != 0x7fffu) {
        const float mid = 0.5f * (f16_to_float(b) + f16_to_float(next));  // exact in float
        bad += float_to_f16(mid) != ((b & 1u) == 0 ? b : next) ? 1 : 0;
        bad += float_to_f16(std::nextafter(mid, 1e9f * (mid < 0 ? -1 : 1))) != next ? 1 : 0;
      }
    }
    if ((b & 0x7f80u) != 0x7f80u) {
      bad += float_to_bf16(bf16_to_float(b)) != b ? 1 : 0;
      const std::uint16_t next = static_cast<std::uint16_t>(b + 1);
      if ((next & 0x7f80u) != 0x7f80u && (b & 0x7fffu) != 0x7fffu) {
        std::uint32_t u;
        const float lo = bf16_to_float(b);
        std::memcpy(&u, &lo, 4);
        u += 0x8000u;  // the midpoint's bits
        float mid;
        std::memcpy(&mid, &u, 4);
        bad += float_to_bf16(mid) != ((b & 1u) == 0 ? b : next) ? 1 : 0;
      }
    }
  }
  CHECK(bad == 0);
  CHECK(float_to_f16(65504.0f) == 0x7bffu);
  CHECK(float_to_f16(65519.0f) == 0x7bffu);
  CHECK(float_to_f16(65520.0f) == 0x7c00u);  // ties to even: infinity
  CHECK(float_to_f16(std::ldexp(1.0f, -25)) == 0u);
  CHECK(float_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 1u);
  CHECK(float_to_f16(-0.0f) == 0x8000u);
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80u);  // tie, to even
  CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82u);
  // double: one rounding (1 + 2^-8 + 2^-40 is above the tie: rounding through float would tie)
  CHECK(float_to_bf16(hf::detail::double_to_float_odd(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40))) == 0x3f81u);
  CHECK(float_to_f16(hf::detail::double_to_float_odd(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -50))) == 0x3c01u);
  CHECK(hf::detail::double_to_float_odd(0.5) == 0.5f);
}

TEST_CASE("hf writer: models a family cannot express are refused naming the field") {
  const hf::ModelConfig mixtral = hf::Checkpoint::open(fixture("mixtral")).config();
  const hf::ModelConfig qwen2 = hf::Checkpoint::open(fixture("qwen2_moe")).config();
  const hf::ModelConfig qwen3 = hf::Checkpoint::open(fixture("qwen3_moe")).config();
  const hf::ModelConfig llama = hf::Checkpoint::open(fixture("llama")).config();
  auto refused = [](TransformerLMConfig c, hf::Family f, const std::function<void(TransformerLMConfig&)>& edit,
                    const std::vector<std::string>& parts) {
    edit(c);
    std::vector<std::string> all = parts;
    all.push_back("graphmoe::hf::save");
    all.push_back(hf::architecture_name(f));
    check_error(error_of([&] { (void)hf::to_model_config(c, f); }), all);
  };
  using C = TransformerLMConfig;
  using hf::Family;
  refused(TransformerLMConfig::gpt(128), Family::Llama, [](C& c) { c.layout = MoELayout::Dense; },
          {"norm", "LayerNorm"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.attention.rope_theta = 0; },
          {"attention.rope_theta", "learned position embeddings"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.activation = FfnActivation::Gelu; },
          {"activation", "GELU"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.router.options<LinearScorer>().bias = true; },
          {"router bias"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.router.options<TopK>().routed_scaling_factor = 2.5; },
          {"routed_scaling_factor", "2.5"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.router.options<TopK>().norm_topk_prob = false; },
          {"norm_topk_prob"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.router.capacity_factor = 1.25; },
          {"router.capacity_factor"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.first_k_dense = 1; }, {"layout", "dense blocks"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.shared_d_ff = 16; }, {"shared_d_ff"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.ffn_bias = true; }, {"ffn_bias"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.attention.out_bias = true; }, {"attention.out_bias"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.num_classes = 3; }, {"num_classes"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.attention.rope_layout = RopeLayout::Interleaved; },
          {"attention.rope_layout"});
  refused(qwen3.lm, Family::Olmoe, [](C& c) { c.attention.qk_norm = QKNorm::Full; },  // head_dim 32
          {"attention.head_dim = 32", "OLMoE's q_norm and k_norm"});
  refused(qwen3.lm, Family::Mixtral, [](C&) {}, {"attention.qk_norm", "PerHead"});
  refused(qwen3.lm, Family::Olmoe, [](C&) {}, {"attention.qk_norm", "PerHead", "has Full"});
  refused(qwen3.lm, Family::Qwen3Moe, [](C& c) { c.attention.qk_norm_eps = 1e-3; }, {"attention.qk_norm_eps"});
  refused(qwen2.lm, Family::Qwen3Moe, [](C&) {}, {"attention.qkv_bias"});
  refused(qwen2.lm, Family::Mixtral, [](C&) {}, {"attention.qkv_bias"});
  refused(qwen2.lm, Family::Qwen2Moe, [](C& c) { c.shared_expert_gate = false; }, {"shared_expert_gate"});
  refused(mixtral.lm, Family::Llama, [](C&) {}, {"layout", "MoE blocks"});
  refused(llama.lm, Family::Mixtral, [](C&) {}, {"layout", "no MoE block"});
  refused(mixtral.lm, Family::Mixtral, [](C& c) { c.router.options<TopK>().n_group = 2; c.router.options<TopK>().topk_group = 2; },
          {"n_group"});
  // and what each family can: dense first blocks and a sparse step in Qwen
  TransformerLMConfig q = qwen3.lm;
  q.first_k_dense = 1;
  hf::ModelConfig qm = hf::to_model_config(q, Family::Qwen3Moe);
  const nlohmann::json j = hf::config_json(qm);
  CHECK(j["mlp_only_layers"] == nlohmann::json::array({0}));
  CHECK(hf::parse_config(j, "config.json").lm.first_k_dense == 1);

  // save_lm refuses before it creates anything; so it does for a dtype it does not write
  TempDir t;
  TransformerLMConfig bad = mixtral.lm;
  bad.router.options<TopK>().routed_scaling_factor = 2.5;
  LM lm(bad, 1);
  check_error(error_of([&] { hf::save_lm(lm, Family::Mixtral, t / "m"); }), {"routed_scaling_factor"});
  LM ok(mixtral.lm, 1);
  hf::SaveOptions o;
  o.dtype = DType::F64;
  check_error(error_of([&] { hf::save_lm(ok, Family::Mixtral, t / "m", o); }), {"F64", "only F32, BF16 and F16"});
  // a weight that is not finite, or beyond F16's range
  ok.arena().value("blocks.1.moe.experts.w2").data()[5] = std::numeric_limits<float>::infinity();
  check_error(error_of([&] { hf::save_lm(ok, Family::Mixtral, t / "m"); }),
              {"'blocks.1.moe.experts.w2'", "model.layers.1.block_sparse_moe.experts.0.w2.weight",
               "at element 5", "not finite"});
  ok.arena().value("blocks.1.moe.experts.w2").data()[5] = 70000.0f;
  o.dtype = DType::F16;
  check_error(error_of([&] { hf::save_lm(ok, Family::Mixtral, t / "m", o); }),
              {"holds 70000", "beyond the range of F16"});
  CHECK(t.entries().empty());
}

TEST_CASE("hf writer: a router of the other kind than the family's is refused, both ways") {
  TempDir t;
  const hf::ModelConfig mixtral = hf::Checkpoint::open(fixture("mixtral")).config();
  TransformerLMConfig sc = mixtral.lm;
  sc.router.allow_unused_options = true;
  TransformerLM<SigmoidBiasRouter, float> sigmoid(sc, 2);
  check_error(error_of([&] { hf::save_lm(sigmoid, mixtral, t / "m"); }),
              {"MixtralForCausalLM's router is a softmax top-k", "SoftmaxRouter",
               "not sigmoid/independent/bias-balanced-topk"});
  const hf::ModelConfig ds = hf::Checkpoint::open(fixture("deepseek_v3")).config();
  TransformerLMConfig dc = ds.lm;
  dc.router.allow_unused_options = true;
  TransformerLM<SoftmaxRouter, float> softmax(dc, 2);
  check_error(error_of([&] { hf::save_lm(softmax, ds, t / "m"); }),
              {"DeepseekV3ForCausalLM's router scores with sigmoids and a selection bias",
               "SigmoidBiasRouter", "not linear/independent/topk"});
  CHECK(t.entries().empty());
}

TEST_CASE("hf writer: a graph router is refused unless its graph is dropped") {
  const hf::ModelConfig mc = hf::Checkpoint::open(fixture("mixtral")).config();
  TransformerLMConfig cfg = mc.lm;
  cfg.router.options<Similarity>().tau_mode = TauMode::Learned;
  TransformerLM<SimilarityRouter, float> sim(cfg, 3);
  REQUIRE(sim.arena().contains("blocks.0.moe.router.graph.log_tau"));
  TempDir t;
  check_error(error_of([&] { hf::save_lm(sim, mc, t / "m"); }),
              {"token graph 'similarity'", "SaveOptions::drop_graph", "MixtralForCausalLM"});
  CHECK(t.entries().empty());
  hf::SaveOptions o;
  o.drop_graph = true;
  hf::save_lm(sim, mc, t / "m", o);
  auto plain = hf::load_lm<SoftmaxRouter, float>(t / "m");
  // every parameter but the graph's, bit for bit
  for (index_t i = 0; i < sim.arena().size(); ++i) {
    const ParameterInfo& p = sim.arena().params()[static_cast<std::size_t>(i)];
    if (p.name.find(".graph.") != std::string::npos) {
      CHECK_FALSE(plain->arena().contains(p.name));
      continue;
    }
    const Tensor<float> a = sim.arena().value(i), b = plain->arena().value(p.name);
    CHECK(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * 4) == 0);
  }
}

TEST_CASE("hf writer: an existing directory is refused or replaced whole, a failed save leaves nothing") {
  const hf::ModelConfig mc = hf::Checkpoint::open(fixture("olmoe")).config();
  LM a(mc.lm, 1), b(mc.lm, 2);
  TempDir t;
  const std::string out = t / "model";
  // an empty directory is taken
  fs::create_directories(out);
  hf::save_lm(a, mc, out);
  CHECK(t.entries() == std::vector<std::string>{"model"});
  // a directory holding files is refused, then replaced as a whole with overwrite
  std::ofstream(out + "/tokenizer.json") << "{}";
  check_error(error_of([&] { hf::save_lm(b, mc, out); }), {out, "exists and holds files", "overwrite"});
  CHECK(same_bits(parameters(hf::load_lm<SoftmaxRouter, float>(out)->arena()), parameters(a.arena())));
  hf::SaveOptions o;
  o.overwrite = true;
  hf::save_lm(b, mc, out, o);
  CHECK(same_bits(parameters(hf::load_lm<SoftmaxRouter, float>(out)->arena()), parameters(b.arena())));
  CHECK_FALSE(fs::exists(out + "/tokenizer.json"));
  CHECK(t.entries() == std::vector<std::string>{"model"});
  // a file in the way, a parent that does not exist
  std::ofstream(t / "file") << "x";
  check_error(error_of([&] { hf::save_lm(a, mc, t / "file"); }), {"exists and is not a directory"});
  check_error(error_of([&] { hf::save_lm(a, mc, t / "no/such/model"); }), {"is not a directory"});

  // a save that fails midway (the shard's write), with and without a directory to replace
  graphmoe::detail::safetensors_save_hook = &Fail::hook;
  hf::SaveOptions big = o;
  big.max_shard_size = 30000;  // several shards: the failure comes after a first one
  check_error(error_of([&] { hf::save_lm(a, mc, t / "fresh", big); }), {"injected write failure"});
  Fail::done = 0;
  check_error(error_of([&] { hf::save_lm(a, mc, out, big); }), {"injected write failure"});
  graphmoe::detail::safetensors_save_hook = nullptr;
  CHECK(t.entries() == std::vector<std::string>{"file", "model"});  // no temporary, no "fresh"
  CHECK(same_bits(parameters(hf::load_lm<SoftmaxRouter, float>(out)->arena()), parameters(b.arena())));

  // an unwritable parent (not for root, whom permissions do not stop)
  if (::geteuid() != 0) {
    const std::string ro = t / "ro";
    fs::create_directories(ro);
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    check_error(error_of([&] { hf::save_lm(a, mc, ro + "/model"); }), {"cannot create the temporary directory"});
    fs::permissions(ro, fs::perms::owner_all);
    CHECK(fs::is_empty(ro));
  }
  // a stale temporary directory of a killed save (its process gone) is removed by the next save
  const std::string stale = t / ".model2.tmp.999999999";
  fs::create_directories(stale);
  std::ofstream(stale + "/config.json") << "{";
  hf::save_lm(a, mc, t / "model2/");  // a trailing '/' names the same directory
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(t / "model2/config.json"));
}

TEST_CASE("hf writer: models for transformers (GRAPHMOE_HF_WRITER_OUT)") {
  const char* env = std::getenv("GRAPHMOE_HF_WRITER_OUT");
  if (env == nullptr || env[0] == '\0') {
    MESSAGE("GRAPHMOE_HF_WRITER_OUT unset: nothing written (scripts/hf-writer-check.py sets it)");
    return;
  }
  const fs::path out(env);
  fs::create_directories(out);
  nlohmann::json manifest = nlohmann::json::array();
  auto write_expected = [&](const std::string& name, auto& lm, const std::string& note) {
    nlohmann::json ex;
    ex["name"] = name;
    ex["note"] = note;
    ex["prompts"] = kPrompts;
    ex["logits"] = nlohmann::json::array();
    ex["experts"] = nlohmann::json::array();
    for (const auto& p : kPrompts) {
      const std::vector<float> l = logits_of(lm, p);
      ex["logits"].push_back(l);
      nlohmann::json chosen = nlohmann::json::object();
      for (index_t layer = 0; layer < lm.num_layers(); ++layer) {
        if (!lm.block(layer).is_moe()) continue;
        const Tensor<std::int32_t>& idx = lm.block(layer).moe().routing().selection.indices;
        const index_t k = idx.numel() / idx.rows();
        nlohmann::json rows = nlohmann::json::array();
        for (index_t r = 0; r < idx.rows(); ++r) {
          std::vector<std::int32_t> got(idx.data() + r * k, idx.data() + (r + 1) * k);
          std::sort(got.begin(), got.end());
          rows.push_back(got);
        }
        chosen[std::to_string(layer)] = rows;
      }
      ex["experts"].push_back(chosen);
    }
    std::ofstream(out / (name + ".expected.json")) << ex.dump() << "\n";
    manifest.push_back(name);
  };
  std::uint64_t seed = 100;
  for_each_family([&]<class R>(const std::string& family) {
    const hf::ModelConfig mc = hf::Checkpoint::open(fixture(family)).config();
    TransformerLM<R, float> lm(mc.lm, seed);
    draw_weights(lm, seed++);
    hf::SaveOptions o;
    o.overwrite = true;
    if (family == "mixtral") {  // sharded, in BF16: graphmoe's logits are then of the BF16 model
      o.dtype = DType::BF16;
      o.max_shard_size = 50000;
    }
    hf::save_lm(lm, mc, (out / family).string(), o);
    auto back = hf::load_lm<R, float>((out / family).string());
    write_expected(family, *back, std::string(R::name()) + ", random weights, " + hf::torch_dtype_name(o.dtype));
  });
  {  // a Similarity router with a learned tau, saved with its graph dropped: the graph-free model
    const hf::ModelConfig mc = hf::Checkpoint::open(fixture("qwen3_moe")).config();
    TransformerLMConfig cfg = mc.lm;
    cfg.router.options<Similarity>().tau_mode = TauMode::Learned;
    TransformerLM<SimilarityRouter, float> sim(cfg, seed);
    draw_weights(sim, seed++);
    hf::SaveOptions o;
    o.overwrite = true;
    o.drop_graph = true;
    const std::string name = "qwen3_moe_similarity_dropped";
    hf::save_lm(sim, mc, (out / name).string(), o);
    auto plain = hf::load_lm<SoftmaxRouter, float>((out / name).string());
    write_expected(name, *plain, "SimilarityRouter (learned tau) saved with drop_graph; graphmoe's logits of the graph-free SoftmaxRouter model");
  }
  std::ofstream(out / "manifest.json") << manifest.dump() << "\n";
  MESSAGE("wrote ", manifest.size(), " models under ", out.string());
}
