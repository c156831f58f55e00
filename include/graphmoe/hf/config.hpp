// graphmoe/hf/config.hpp: a Hugging Face config.json mapped onto TransformerLMConfig.
//
//   ModelConfig c = hf::read_config("dir/config.json");   // or parse_config(json, path)
//   c.lm                                                   // the TransformerLMConfig to declare
//
// Architectures (config.json's "architectures"): LlamaForCausalLM, MixtralForCausalLM,
// OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM. Every key of
// the file is either understood (it sets a field, or is checked to hold the value the model computes with), known
// not to change the computation (token ids, generation and training-only settings), or refused
// by name: a key the reader does not know could change what the model computes, so it is never
// ignored. Refused values say why (scaled RoPE, sliding windows in use, biases graphmoe's blocks
// lack, an activation other than SiLU, ...).
// Sizes are checked against limits (hidden_size <= 65536, num_local_experts <= 4096, ...) before
// anything is declared or allocated. docs/reference/hugging-face.md lists every key.
//
// The router of every family but DeepSeek-V3 is a linear map without bias to softmax scores,
// top-k in float (LinearScorer with bias = false, TopK with norm_topk_prob as the family sets it,
// scale 1). DeepSeek-V3's is a linear map to sigmoid scores, a per-expert selection bias
// (e_score_correction_bias), group-limited top-k, gates normalised or not and scaled by
// routed_scaling_factor (SigmoidScorer with bias = false, BiasBalancedTopK reading TopK's
// norm_topk_prob, routed_scaling_factor, n_group and topk_group).
// Errors: graphmoe::Error "graphmoe::hf::read_config: '<path>': key '<key>' ...".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/hf/json.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/files.hpp"

namespace graphmoe::hf {

enum class Family { Llama, Mixtral, Olmoe, Qwen2Moe, Qwen3Moe, DeepseekV3 };

// "LlamaForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM",
// "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM".
inline const char* architecture_name(Family f) {
  switch (f) {
    case Family::Llama: return "LlamaForCausalLM";
    case Family::Mixtral: return "MixtralForCausalLM";
    case Family::Olmoe: return "OlmoeForCausalLM";
    case Family::Qwen2Moe: return "Qwen2MoeForCausalLM";
    case Family::Qwen3Moe: return "Qwen3MoeForCausalLM";
    case Family::DeepseekV3: return "DeepseekV3ForCausalLM";
  }
  return "?";
}
// config.json's model_type of each family.
inline const char* model_type_name(Family f) {
  switch (f) {
    case Family::Llama: return "llama";
    case Family::Mixtral: return "mixtral";
    case Family::Olmoe: return "olmoe";
    case Family::Qwen2Moe: return "qwen2_moe";
    case Family::Qwen3Moe: return "qwen3_moe";
    case Family::DeepseekV3: return "deepseek_v3";
  }
  return "?";
}
inline const std::vector<Family>& families() {
  static const std::vector<Family> all = {Family::Llama, Family::Mixtral, Family::Olmoe,
                                          Family::Qwen2Moe, Family::Qwen3Moe, Family::DeepseekV3};
  return all;
}

// The limits of the sizes config.json may ask for (refused above them, before any allocation).
struct ConfigLimits {
  static constexpr std::int64_t vocab_size = std::int64_t(1) << 22;          // 4,194,304
  static constexpr std::int64_t hidden_size = 65536;
  static constexpr std::int64_t layers = 1024;
  static constexpr std::int64_t heads = 1024;
  static constexpr std::int64_t intermediate_size = std::int64_t(1) << 20;  // 1,048,576
  static constexpr std::int64_t experts = 4096;
  static constexpr std::int64_t positions = std::int64_t(1) << 24;           // 16,777,216
};

// Whether the family's router is DeepSeek-V3's (sigmoid scores, a selection bias, groups): loaded
// into a Router<SigmoidScorer, Graph, BiasBalancedTopK> (SigmoidBiasRouter and its graph forms);
// the other families' into a Router<LinearScorer, Graph, TopK>.
inline bool sigmoid_routed(Family f) { return f == Family::DeepseekV3; }

// What config.json says, mapped onto graphmoe.
struct ModelConfig {
  std::string path;          // the config.json read
  Family family = Family::Llama;
  std::string architecture;  // architecture_name(family)
  TransformerLMConfig lm;    // the model to declare (validated)
  // Informational (no effect on the computation): the special tokens as config.json gives them
  // (eos may be a list), and its "torch_dtype" / "dtype" ("" when absent).
  std::vector<std::int64_t> bos_token_ids, eos_token_ids;
  std::optional<std::int64_t> pad_token_id;
  std::string dtype;
  // DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers): layers
  // num_hidden_layers .. num_hidden_layers + mtp_layers - 1 of the checkpoint, which the causal
  // LM does not run (transformers does not load them either); their tensors are skipped.
  std::int64_t mtp_layers = 0;
};

namespace detail {

// The keys of one config.json object: typed reads with limits, each read key marked understood;
// finish() refuses every key left unread. Errors name the file and the key.
class ConfigKeys {
 public:
  ConfigKeys(const nlohmann::json& j, std::string path, std::string arch)
      : j_(j), path_(std::move(path)), arch_(std::move(arch)) {}

  static constexpr const char* op = "hf::read_config";

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    graphmoe::detail::throw_error(op, "'", path_, "': key '", key, "' ", what);
  }
  // The value of key, or nullptr when absent (null counts as present: see is_null).
  const nlohmann::json* find(const std::string& key) {
    used_.insert(key);
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  bool present(const std::string& key) const { return j_.contains(key); }
  // Absent or null.
  bool absent_or_null(const std::string& key) {
    const nlohmann::json* v = find(key);
    return v == nullptr || v->is_null();
  }
  // An integer in [lo, hi]; required unless fallback is given (used when absent or null).
  std::int64_t integer(const std::string& key, std::int64_t lo, std::int64_t hi,
                       std::optional<std::int64_t> fallback = std::nullopt) {
    const nlohmann::json* v = find(key);
    if (v == nullptr || v->is_null()) {
      if (fallback) return *fallback;
      fail(key, v == nullptr ? std::string("is missing (") + arch_ + " needs it)"
                             : std::string("is null (") + arch_ + " needs an integer)");
    }
    std::int64_t x = 0;
    if (v->is_number_unsigned()) {
      const auto u = v->get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(INT64_MAX)) fail(key, "= " + v->dump() + " is too large");
      x = static_cast<std::int64_t>(u);
    } else if (v->is_number_integer()) {
      x = v->get<std::int64_t>();
    } else if (v->is_number_float() && std::isfinite(v->get<double>()) &&
               std::floor(v->get<double>()) == v->get<double>() &&
               std::fabs(v->get<double>()) < 9.0e18) {
      x = static_cast<std::int64_t>(v->get<double>());  // 1e12 written as a float
    } else {
      fail(key, std::string("is ") + json_kind(*v) + " (" + shorten(v->dump()) +
                    "), expected an integer");
    }
    if (x < lo || x > hi)
      fail(key, "= " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " +
                    std::to_string(hi) + "]");
    return x;
  }
  // A finite number in (lo, hi) (open: lo_open) or [lo, hi].
  double number(const std::string& key, double lo, double hi, std::optional<double> fallback,
                bool lo_open = false) {
    const nlohmann::json* v = find(key);
    if (v == nullptr || v->is_null()) {
      if (fallback) return *fallback;
      fail(key, v == nullptr ? std::string("is missing (") + arch_ + " needs it)"
                             : std::string("is null (") + arch_ + " needs a number)");
    }
    if (!v->is_number())
      fail(key, std::string("is ") + json_kind(*v) + " (" + shorten(v->dump()) +
                    "), expected a number");
    const double x = v->get<double>();
    if (!std::isfinite(x) || x > hi || x < lo || (lo_open && x == lo)) {
      std::ostringstream os;
      os << "= " << x << " is outside " << (lo_open ? "(" : "[") << lo << ", " << hi << "]";
      fail(key, os.str());
    }
    return x;
  }
  bool boolean(const std::string& key, bool fallback) {
    const nlohmann::json* v = find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_boolean())
      fail(key, std::string("is ") + json_kind(*v) + " (" + shorten(v->dump()) +
                    "), expected true or false");
    return v->get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) {
    const nlohmann::json* v = find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_string())
      fail(key, std::string("is ") + json_kind(*v) + " (" + shorten(v->dump()) +
                    "), expected a string");
    return v->get<std::string>();
  }
  // Known, and without effect on what the loaded model computes.
  void ignore(const std::string& key) { used_.insert(key); }
  // Token ids: an integer, a list of them, or null.
  std::vector<std::int64_t> token_ids(const std::string& key) {
    const nlohmann::json* v = find(key);
    std::vector<std::int64_t> out;
    if (v == nullptr || v->is_null()) return out;
    auto one = [&](const nlohmann::json& x) {
      if (!x.is_number_integer())
        fail(key, std::string("holds ") + json_kind(x) + ", expected token ids (integers)");
      out.push_back(x.get<std::int64_t>());
    };
    if (v->is_array()) {
      if (v->size() > 4096) fail(key, "lists more than 4096 token ids");
      for (const auto& x : *v) one(x);
    } else {
      one(*v);
    }
    return out;
  }
  // Every key not read: refused by name.
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (used_.count(it.key()) != 0) continue;
      graphmoe::detail::throw_error(
          op, "'", path_, "': key '", it.key(), "' (", shorten(it.value().dump()),
          ") is not known to the reader for ", arch_,
          "; a key it does not know could change what the model computes, so it is refused "
          "(docs/reference/hugging-face.md lists the keys it reads)");
    }
  }
  static std::string shorten(std::string s) {
    if (s.size() > 60) s = s.substr(0, 57) + "...";
    return s;
  }
  const std::string& path() const { return path_; }

 private:
  const nlohmann::json& j_;
  std::string path_, arch_;
  std::set<std::string> used_;
};

// Keys of every transformers config that do not change what the loaded model computes: names,
// versions, the dtype it was saved in (the tensors' own dtypes are read), cache and output
// switches, the classification heads' labels, initialisation, generation settings, and the
// choice of attention kernel.
inline const std::vector<std::string>& neutral_keys() {
  static const std::vector<std::string> keys = {
      "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
      "output_hidden_states", "output_attentions", "return_dict", "torchscript", "use_bfloat16",
      "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
      "initializer_range", "output_router_logits", "sep_token_id", "decoder_start_token_id",
      "task_specific_params", "tf_legacy_loss", "chunk_size_feed_forward", "max_length",
      "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
      "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
      "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
      "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
      "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
      "suppress_tokens", "begin_suppress_tokens",
      // which attention kernel transformers runs (the same product)
      "_attn_implementation", "_attn_implementation_autoset", "attn_implementation"};
  return keys;
}

inline Family family_of(const std::string& arch, const std::string& path) {
  for (Family f : families())
    if (arch == architecture_name(f)) return f;
  std::string valid;
  for (Family f : families()) valid += std::string(valid.empty() ? "" : ", ") + architecture_name(f);
  graphmoe::detail::throw_error("hf::read_config", "'", path, "': key 'architectures': '", arch,
                                "' is not an architecture the reader knows (", valid, ")");
}

}  // namespace detail

// Maps a parsed config.json (j, read from `path`, named in errors) onto a TransformerLMConfig.
inline ModelConfig parse_config(const nlohmann::json& j, const std::string& path) {
  const char* op = detail::ConfigKeys::op;
  GRAPHMOE_CHECK(j.is_object(), op, "'", path, "': the file holds ", detail::json_kind(j),
                 ", not a JSON object");
  // The architecture first: it decides which keys exist.
  auto arch_it = j.find("architectures");
  GRAPHMOE_CHECK(arch_it != j.end() && !arch_it->is_null(), op, "'", path,
                 "': key 'architectures' is missing (the model's class, e.g. "
                 "[\"MixtralForCausalLM\"])");
  GRAPHMOE_CHECK(arch_it->is_array() && arch_it->size() == 1 && (*arch_it)[0].is_string(), op,
                 "'", path, "': key 'architectures' must list one class name, got ",
                 detail::ConfigKeys::shorten(arch_it->dump()));
  ModelConfig out;
  out.path = path;
  out.architecture = (*arch_it)[0].get<std::string>();
  out.family = detail::family_of(out.architecture, path);
  const Family fam = out.family;
  const bool moe = fam != Family::Llama;
  const bool qwen = fam == Family::Qwen2Moe || fam == Family::Qwen3Moe;
  const bool ds = fam == Family::DeepseekV3;

  detail::ConfigKeys k(j, path, out.architecture);
  k.ignore("architectures");
  for (const auto& key : detail::neutral_keys()) k.ignore(key);
  const std::string model_type = k.string("model_type", model_type_name(fam));
  if (model_type != model_type_name(fam))
    k.fail("model_type", "= '" + model_type + "' does not match the architecture " +
                             out.architecture + " (model_type '" + model_type_name(fam) + "')");
  out.bos_token_ids = k.token_ids("bos_token_id");
  out.eos_token_ids = k.token_ids("eos_token_id");
  {
    const std::vector<std::int64_t> pad = k.token_ids("pad_token_id");
    if (pad.size() > 1) k.fail("pad_token_id", "lists several ids");
    if (!pad.empty()) out.pad_token_id = pad[0];
  }
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) out.dtype = j["torch_dtype"];
  if (j.contains("dtype") && j["dtype"].is_string()) out.dtype = j["dtype"];
  // Encoder-decoder and pruning switches of the base config: must be off.
  if (k.boolean("is_encoder_decoder", false)) k.fail("is_encoder_decoder", "is true: not a decoder-only model");
  if (k.boolean("add_cross_attention", false)) k.fail("add_cross_attention", "is true: graphmoe's blocks have no cross-attention");
  k.ignore("is_decoder");
  k.ignore("tie_encoder_decoder");
  k.ignore("cross_attention_hidden_size");
  if (const nlohmann::json* v = k.find("pruned_heads"); v != nullptr && !v->is_null() && !v->empty())
    k.fail("pruned_heads", "lists pruned attention heads, which graphmoe's attention cannot drop");
  if (const nlohmann::json* v = k.find("quantization_config"); v != nullptr && !v->is_null())
    k.fail("quantization_config", "is set: quantized checkpoints are not read (only F32, F16, "
                                  "BF16 and F64 weights)");

  TransformerLMConfig c;
  c.router = TransformerLMConfig::causal_router();
  // ---- sizes (refused above the limits before anything else is built) -------------------------
  c.vocab_size = k.integer("vocab_size", 2, ConfigLimits::vocab_size);
  c.d_model = k.integer("hidden_size", 1, ConfigLimits::hidden_size);
  c.num_layers = k.integer("num_hidden_layers", 1, ConfigLimits::layers);
  c.num_heads = k.integer("num_attention_heads", 1, ConfigLimits::heads);
  // head_dim: every family's attention reads it when set (getattr(config, "head_dim", ...)), and
  // hidden_size / num_attention_heads otherwise; DeepSeek-V3's multi-head latent attention has
  // its own widths (and its config's head_dim is qk_rope_head_dim, the rotary width)
  index_t dh = 0;
  if (ds) {
    AttentionOptions& a = c.attention;
    a.kv_lora_rank = k.integer("kv_lora_rank", 1, ConfigLimits::hidden_size);
    a.q_lora_rank = k.absent_or_null("q_lora_rank")
                        ? 0
                        : k.integer("q_lora_rank", 1, ConfigLimits::hidden_size);
    a.qk_nope_head_dim = k.integer("qk_nope_head_dim", 1, ConfigLimits::hidden_size);
    a.qk_rope_head_dim = k.integer("qk_rope_head_dim", 2, ConfigLimits::hidden_size);
    if (a.qk_rope_head_dim % 2 != 0)
      k.fail("qk_rope_head_dim", "= " + std::to_string(a.qk_rope_head_dim) +
                                     " is odd: RoPE rotates pairs");
    a.v_head_dim = k.integer("v_head_dim", 1, ConfigLimits::hidden_size);
    if (a.v_head_dim > a.qk_nope_head_dim + a.qk_rope_head_dim)
      k.fail("v_head_dim", "= " + std::to_string(a.v_head_dim) +
                               " is above qk_nope_head_dim + qk_rope_head_dim = " +
                               std::to_string(a.qk_nope_head_dim + a.qk_rope_head_dim) +
                               ": graphmoe's latent attention pads v to the key width");
    if (!k.absent_or_null("head_dim") &&
        k.integer("head_dim", 1, ConfigLimits::hidden_size) != a.qk_rope_head_dim)
      k.fail("head_dim", "differs from qk_rope_head_dim = " + std::to_string(a.qk_rope_head_dim) +
                             " (DeepSeek-V3's config sets head_dim to the rotary width)");
    if (!k.absent_or_null("qk_head_dim") &&  // derived, and saved by transformers
        k.integer("qk_head_dim", 1, ConfigLimits::hidden_size) !=
            a.qk_nope_head_dim + a.qk_rope_head_dim)
      k.fail("qk_head_dim", "differs from qk_nope_head_dim + qk_rope_head_dim = " +
                                std::to_string(a.qk_nope_head_dim + a.qk_rope_head_dim));
    // the latents' RMSNorm: DeepseekV3RMSNorm's default epsilon, not rms_norm_eps
    a.latent_norm_eps = 1e-6;
    a.rope_layout = k.boolean("rope_interleave", true) ? RopeLayout::Interleaved
                                                       : RopeLayout::HalfSplit;
    dh = a.qk_nope_head_dim + a.qk_rope_head_dim;
  } else if (!k.absent_or_null("head_dim")) {
    dh = k.integer("head_dim", 1, ConfigLimits::hidden_size);
    if (fam == Family::Olmoe && dh * c.num_heads != c.d_model)
      k.fail("head_dim", "= " + std::to_string(dh) + " with num_attention_heads = " +
                             std::to_string(c.num_heads) + " and hidden_size = " +
                             std::to_string(c.d_model) +
                             ": OLMoE's q_norm and k_norm are sized for num_attention_heads x "
                             "head_dim = hidden_size");
    if (dh * c.num_heads != c.d_model) c.attention.head_dim = dh;  // else: the default, unset
  } else {
    if (c.d_model % c.num_heads != 0)
      k.fail("num_attention_heads", "= " + std::to_string(c.num_heads) +
                                        " does not divide hidden_size = " +
                                        std::to_string(c.d_model) + " (and head_dim is not set)");
    dh = c.d_model / c.num_heads;
  }
  const std::int64_t kv = k.integer("num_key_value_heads", 1, c.num_heads, c.num_heads);
  if (ds && kv != c.num_heads)
    k.fail("num_key_value_heads", "= " + std::to_string(kv) + " differs from num_attention_heads = " +
                                      std::to_string(c.num_heads) +
                                      ": multi-head latent attention gives every head its keys");
  if (c.num_heads % kv != 0)
    k.fail("num_key_value_heads", "= " + std::to_string(kv) + " does not divide num_attention_heads = " +
                                      std::to_string(c.num_heads));
  c.attention.num_kv_heads = kv == c.num_heads ? 0 : kv;
  if (c.num_heads * dh > ConfigLimits::hidden_size)
    k.fail("head_dim", "= " + std::to_string(dh) + ": num_attention_heads x head_dim = " +
                           std::to_string(c.num_heads * dh) + " is above " +
                           std::to_string(ConfigLimits::hidden_size));
  c.max_seq_len = k.integer("max_position_embeddings", 1, ConfigLimits::positions);
  c.norm = NormKind::RMSNorm;
  c.norm_eps = k.number("rms_norm_eps", 0.0, 1.0, std::nullopt, /*lo_open=*/true);
  if (c.norm_eps >= 1.0) k.fail("rms_norm_eps", "must be below 1");

  // ---- blocks -----------------------------------------------------------------------------------
  const std::string act = k.string("hidden_act", "silu");
  if (act != "silu" && act != "swish")
    k.fail("hidden_act", "= '" + act + "': graphmoe's SwiGLU feed-forward networks use SiLU only");
  c.activation = FfnActivation::SwiGLU;
  c.ffn_bias = false;
  c.tie_embeddings = k.boolean("tie_word_embeddings", false);
  if (!ds) c.attention.rope_layout = RopeLayout::HalfSplit;  // DeepSeek's: rope_interleave
  c.attention.out_bias = false;
  c.attention.qkv_bias = false;
  if (fam == Family::Qwen2Moe) {
    c.attention.qkv_bias = k.boolean("qkv_bias", true);  // Qwen2: q, k, v biases, none on o
  } else if (k.boolean("attention_bias", false)) {
    k.fail("attention_bias", "is true: biases on the attention projections of " +
                                 out.architecture + " are not read");
  }
  if (fam == Family::Llama && k.boolean("mlp_bias", false))
    k.fail("mlp_bias", "is true: biases on the MLP projections are not read");
  if (fam == Family::Llama || ds)
    (void)k.integer("pretraining_tp", 1, 1024, 1);  // the same products, sliced
  if (k.number("attention_dropout", 0.0, 1.0, 0.0) != 0.0)
    k.fail("attention_dropout", "is not 0: graphmoe's attention has no dropout");
  if (fam == Family::Olmoe) {
    if (!k.absent_or_null("clip_qkv"))
      k.fail("clip_qkv", "is set: clamping q, k and v is not built");
    c.attention.qk_norm = QKNorm::Full;
  } else if (fam == Family::Qwen3Moe) {
    c.attention.qk_norm = QKNorm::PerHead;
  }
  c.attention.qk_norm_eps = c.norm_eps;

  // RoPE: rope_theta (transformers 4) or rope_parameters (transformers 5), unscaled only.
  std::optional<double> theta;
  if (!k.absent_or_null("rope_theta"))
    theta = k.number("rope_theta", 0.0, 1e300, std::nullopt, /*lo_open=*/true);
  auto rope_object = [&](const std::string& key) {
    const nlohmann::json* v = k.find(key);
    if (v == nullptr || v->is_null()) return;
    if (!v->is_object()) k.fail(key, std::string("is ") + detail::json_kind(*v) + ", expected an object or null");
    for (const char* sub : {"rope_type", "type"}) {  // the kind first: it explains the rest
      auto it = v->find(sub);
      if (it != v->end() && (!it->is_string() || it->get<std::string>() != "default"))
        k.fail(key, std::string("has ") + sub + " " + it->dump() +
                        ": scaled RoPE (linear, dynamic, yarn, llama3, longrope, ...) is not "
                        "built; only 'default'");
    }
    for (auto it = v->begin(); it != v->end(); ++it) {
      const std::string& sub = it.key();
      if (sub == "rope_type" || sub == "type") {
        continue;
      } else if (sub == "rope_theta") {
        if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() <= 0 ||
            it->get<double>() > 1e300)
          k.fail(key, "has rope_theta " + it->dump() + ", expected a positive number");
        const double t = it->get<double>();
        if (theta && *theta != t)
          k.fail(key, "has rope_theta " + it->dump() + ", but the key 'rope_theta' says " +
                          std::to_string(*theta));
        theta = t;
      } else {
        k.fail(key, "has the field '" + sub + "' (" + detail::ConfigKeys::shorten(it->dump()) +
                        "): only rope_type 'default' and rope_theta are read");
      }
    }
  };
  rope_object("rope_scaling");
  rope_object("rope_parameters");
  if (!theta) k.fail("rope_theta", "is missing (nor is it in 'rope_parameters'): RoPE's base is needed");
  c.attention.rope_theta = *theta;
  if (!k.absent_or_null("partial_rotary_factor") &&
      k.number("partial_rotary_factor", 0.0, 1.0, 1.0) != 1.0)
    k.fail("partial_rotary_factor", "is not 1: partial rotary embeddings are not built");

  // Sliding windows: refused where they take effect within max_position_embeddings.
  if (fam == Family::Mixtral && !k.absent_or_null("sliding_window")) {
    const std::int64_t win = k.integer("sliding_window", 0, INT64_MAX);
    if (win < c.max_seq_len)
      k.fail("sliding_window", "= " + std::to_string(win) +
                                   " is shorter than max_position_embeddings = " +
                                   std::to_string(c.max_seq_len) +
                                   ": sliding-window attention is not built");
  }
  if (qwen) {
    const bool use = k.boolean("use_sliding_window", false);
    if (use) k.fail("use_sliding_window", "is true: sliding-window attention is not built");
    k.integer("sliding_window", 0, INT64_MAX, 0);  // unused while use_sliding_window is false
    k.integer("max_window_layers", 0, INT64_MAX, 0);
    if (const nlohmann::json* lt = k.find("layer_types"); lt != nullptr && !lt->is_null()) {
      if (!lt->is_array()) k.fail("layer_types", "is not a list");
      for (const auto& t : *lt)
        if (!t.is_string() || t.get<std::string>() != "full_attention")
          k.fail("layer_types", "holds " + t.dump() + ": only 'full_attention' layers are built");
    }
  }

  // ---- feed-forward networks and experts ------------------------------------------------------
  c.d_ff = k.integer("intermediate_size", 1, ConfigLimits::intermediate_size);
  if (!moe) {
    c.layout = MoELayout::Dense;
  } else {
    c.layout = MoELayout::Switch;
    std::int64_t e = 0;
    if (fam == Family::Mixtral || fam == Family::Qwen3Moe) {
      // transformers 5 writes num_local_experts, 4 (and the Qwen3 checkpoints) num_experts
      const bool a = !k.absent_or_null("num_local_experts"), b = !k.absent_or_null("num_experts");
      if (a) e = k.integer("num_local_experts", 1, ConfigLimits::experts);
      if (b) {
        const std::int64_t e2 = k.integer("num_experts", 1, ConfigLimits::experts);
        if (a && e2 != e)
          k.fail("num_experts", "= " + std::to_string(e2) + " disagrees with num_local_experts = " +
                                    std::to_string(e));
        e = e2;
      }
      if (!a && !b) k.fail("num_local_experts", "is missing (nor is there 'num_experts')");
    } else if (ds) {
      // transformers' DeepseekV3Config: n_routed_experts (num_local_experts is its alias)
      const bool a = !k.absent_or_null("n_routed_experts"), b = !k.absent_or_null("num_local_experts");
      if (a) e = k.integer("n_routed_experts", 1, ConfigLimits::experts);
      if (b) {
        const std::int64_t e2 = k.integer("num_local_experts", 1, ConfigLimits::experts);
        if (a && e2 != e)
          k.fail("num_local_experts", "= " + std::to_string(e2) +
                                          " disagrees with n_routed_experts = " + std::to_string(e));
        e = e2;
      }
      if (!a && !b) k.fail("n_routed_experts", "is missing (nor is there 'num_local_experts')");
    } else {
      e = k.integer("num_experts", 1, ConfigLimits::experts);
    }
    c.router.num_experts = e;
    c.router.k = k.integer("num_experts_per_tok", 1, e);
    auto& topk = c.router.options<TopK>();
    if (ds) {
      c.router.options<SigmoidScorer>().bias = false;  // DeepSeek-V3's gate has no bias
      // DeepseekV3Config's defaults where a key is absent
      topk.norm_topk_prob = k.boolean("norm_topk_prob", true);
      topk.routed_scaling_factor = k.number("routed_scaling_factor", 0.0, 1e6, 2.5, /*lo_open=*/true);
      topk.n_group = k.integer("n_group", 1, e, 8);
      if (e % topk.n_group != 0)
        k.fail("n_group", "= " + std::to_string(topk.n_group) + " does not divide n_routed_experts = " +
                              std::to_string(e));
      if (topk.n_group > 1 && e / topk.n_group < 2)
        k.fail("n_group", "= " + std::to_string(topk.n_group) + " makes groups of one expert (a "
                              "group's score is the sum of its two best scores)");
      topk.topk_group = k.integer("topk_group", 1, topk.n_group, 4);
      if (c.router.k > topk.topk_group * (e / topk.n_group))
        k.fail("num_experts_per_tok", "= " + std::to_string(c.router.k) +
                                          " experts cannot come from topk_group = " +
                                          std::to_string(topk.topk_group) + " groups of " +
                                          std::to_string(e / topk.n_group));
      // the original release's remote-code keys, with the only values this routing computes
      if (k.string("scoring_func", "sigmoid") != "sigmoid")
        k.fail("scoring_func", "is not 'sigmoid' (DeepSeek-V3's router scores are sigmoids)");
      if (const std::string m = k.string("topk_method", "noaux_tc"); m != "noaux_tc")
        k.fail("topk_method", "= '" + m + "': only 'noaux_tc' (top-k of the biased scores within "
                              "the best groups) is built");
      if (k.integer("moe_layer_freq", 1, ConfigLimits::layers, 1) != 1)
        k.fail("moe_layer_freq", "is not 1: DeepSeek-V3's MoE layers are every layer from "
                                 "first_k_dense_replace on");
      k.ignore("ep_size");   // expert parallelism of the original code: the same products
      k.ignore("auto_map");  // the original remote code's class names
      // training only: the sequence-wise balance loss (seq_aux) or the batch one
      const double alpha = k.number("aux_loss_alpha", 0.0, 1e6, 0.0);
      (k.boolean("seq_aux", true) ? c.router.seq_aux_loss_coef : c.router.load_balance_coef) = alpha;
      const bool m1 = !k.absent_or_null("num_nextn_predict_layers"),
                 m2 = !k.absent_or_null("num_mtp_layers");
      out.mtp_layers = 1;  // DeepseekV3Config's default
      if (m1) out.mtp_layers = k.integer("num_nextn_predict_layers", 0, ConfigLimits::layers);
      if (m2) {
        const std::int64_t n = k.integer("num_mtp_layers", 0, ConfigLimits::layers);
        if (m1 && n != out.mtp_layers)
          k.fail("num_mtp_layers", "= " + std::to_string(n) +
                                       " disagrees with num_nextn_predict_layers = " +
                                       std::to_string(out.mtp_layers));
        out.mtp_layers = n;
      }
    } else {
      c.router.options<LinearScorer>().bias = false;  // the families' routers have no bias
      topk.norm_topk_prob = fam == Family::Mixtral ? true : k.boolean("norm_topk_prob", false);
      topk.routed_scaling_factor = 1.0;
      // training only: graphmoe's load-balancing loss (its normalisation differs from transformers')
      c.router.load_balance_coef = k.number("router_aux_loss_coef", 0.0, 1e6, 0.0);
    }
    if (fam == Family::Mixtral && k.number("router_jitter_noise", 0.0, 1.0, 0.0) != 0.0)
      k.fail("router_jitter_noise", "is not 0: the router's multiplicative jitter in training is not built");
    if (fam == Family::Mixtral) {
      c.expert_d_ff = c.d_ff;
    } else {
      c.expert_d_ff = fam == Family::Olmoe
                          ? c.d_ff
                          : k.integer("moe_intermediate_size", 1, ConfigLimits::intermediate_size);
    }
    if (qwen) {
      c.moe_every = k.integer("decoder_sparse_step", 1, c.num_layers, 1);
      // mlp_only_layers: graphmoe's dense blocks are the first first_k_dense ones
      if (const nlohmann::json* v = k.find("mlp_only_layers"); v != nullptr && !v->is_null()) {
        if (!v->is_array()) k.fail("mlp_only_layers", "is not a list");
        std::int64_t n = 0;
        for (const auto& x : *v) {
          if (!x.is_number_integer() || x.get<std::int64_t>() != n)
            k.fail("mlp_only_layers", "= " + detail::ConfigKeys::shorten(v->dump()) +
                                          ": only the first layers (0, 1, ..., n - 1) can be dense");
          ++n;
        }
        if (n > c.num_layers) k.fail("mlp_only_layers", "lists more layers than num_hidden_layers");
        c.first_k_dense = n;
      }
    }
    if (fam == Family::Qwen2Moe) {
      c.shared_d_ff = k.integer("shared_expert_intermediate_size", 1, ConfigLimits::intermediate_size);
      c.shared_expert_gate = true;
    }
    if (ds) {
      // layers from first_k_dense_replace on are MoE (none when it is num_hidden_layers or more)
      c.first_k_dense =
          std::min<std::int64_t>(k.integer("first_k_dense_replace", 0, ConfigLimits::layers, 3),
                                 c.num_layers);
      // the shared experts: one MLP of n_shared_experts x moe_intermediate_size, ungated
      const std::int64_t n = k.integer("n_shared_experts", 1, 1024, 1);
      if (n * c.expert_d_ff > ConfigLimits::intermediate_size)
        k.fail("n_shared_experts", "x moe_intermediate_size = " + std::to_string(n * c.expert_d_ff) +
                                       " is above " + std::to_string(ConfigLimits::intermediate_size));
      c.shared_d_ff = n * c.expert_d_ff;
      c.shared_expert_gate = false;
    }
  }
  k.finish();
  try {
    c.validate();
  } catch (const Error& e) {
    graphmoe::detail::throw_error(op, "'", path, "': the model it describes is not valid: ", e.what());
  }
  out.lm = c;
  return out;
}

// Reads and maps config.json (at most 16 MB).
inline ModelConfig read_config(const std::string& path) {
  const char* op = detail::ConfigKeys::op;
  graphmoe::detail::require_regular_file(op, path);
  struct stat st {};
  GRAPHMOE_CHECK(::stat(path.c_str(), &st) == 0 && st.st_size <= (16 << 20), op, "'", path,
                 "' is larger than 16 MB: not a config.json");
  const std::string text = graphmoe::detail::read_file(op, path);
  graphmoe::detail::check_json_depth(op, "'" + path + "'", text);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    graphmoe::detail::throw_error(op, "'", path, "' is not valid JSON: ", e.what());
  }
  return parse_config(j, path);
}

}  // namespace graphmoe::hf
