// graphmoe/hf/writer.hpp: a TransformerLM (CPU) saved as a Hugging Face model directory.
//
//   hf::save_lm(lm, hf::Family::Mixtral, "out/model");               // F32, one file
//   hf::SaveOptions o;  o.dtype = DType::BF16;  o.max_shard_size = 2'000'000'000;
//   hf::save_lm(lm, ck.config(), "out/model", o);   // as loaded: family and token ids kept
//
// The directory is what transformers' save_pretrained writes and AutoModelForCausalLM loads:
// config.json (the keys of the family's config class: architectures, model_type, sizes,
// rope_parameters and rope_theta, rms_norm_eps, the experts' keys, bos/eos/pad ids, dtype, ...)
// and model.safetensors, or shards model-0000i-of-0000n.safetensors with
// model.safetensors.index.json above SaveOptions::max_shard_size (bytes of tensor data per shard,
// as save_pretrained's max_shard_size; a tensor larger than it gets a shard of its own). Tensors
// in F32, BF16 or F16 (rounded to nearest, ties to even; a value beyond F16's range is refused).
//
// The names and layouts are the reader's (hf/reader.hpp for_each_tensor, the one mapping): the
// writer builds config.json, reads it back with hf::parse_config and writes every TensorSlot of
// that description from the parameter it names, after checking that the description computes
// what the model does and that its tensors cover every parameter of the model exactly.
//
// Refused by name (graphmoe::Error "graphmoe::hf::save: ..."), before anything is written: a model
// the family cannot express: LayerNorm, learned positions, GELU, biases the family lacks (FFN,
// output projection, q/k/v outside Qwen2-MoE), a QK-norm other than the family's, latent
// attention and interleaved RoPE outside DeepSeek-V3, a router bias, routed_scaling_factor != 1
// and group-limited routing outside DeepSeek-V3, a capacity factor, shared experts outside
// Qwen2-MoE and DeepSeek-V3, dense blocks Mixtral and OLMoE lack, a router of the other kind than
// the family's (DeepSeek-V3: Router<SigmoidScorer, Graph, BiasBalancedTopK>, its expert_bias
// written as e_score_correction_bias; the others: Router<LinearScorer, Graph, TopK>), a
// classification head, an expert-parallel (sharded) parameter, a weight that is not finite. A router with a token graph (SimilarityRouter,
// AttentionRouter) routes through a graph transformers does not have: refused unless
// SaveOptions::drop_graph, which writes its linear router's weights only (the saved model then
// routes as SoftmaxRouter, or SigmoidBiasRouter; the graph's parameters, e.g. a learned log_tau,
// are not written).
// Other scorers and selectors are a compile-time error. Training-only settings that config.json
// cannot hold (z_loss_coef, seq_aux_loss_coef) are not written; load_balance_coef is
// router_aux_loss_coef.
//
// Atomic: everything is written into a fresh directory beside the target (".<name>.tmp.<pid>",
// each file fsynced) that is renamed into place only when complete (an existing target is
// exchanged with it, then removed). A failed save removes its temporary directory and leaves the
// target as it was; a killed one can leave only the hidden temporary directory, which the next
// save to the same target removes once its process is gone. A target that exists and holds files
// is refused unless SaveOptions::overwrite (then it is replaced as a whole: other files in it, a
// tokenizer, are not carried over). POSIX (Linux: renameat2 for the exchange where available).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/hf/config.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace graphmoe::hf {

struct SaveOptions {
  // The tensors' dtype: F32, BF16 or F16 (rounded to nearest even). config.json's dtype says it.
  DType dtype = DType::F32;
  // Bytes of tensor data per shard above which the weights are split into shards with an index
  // (save_pretrained's max_shard_size; transformers 5's default "50GB").
  std::uint64_t max_shard_size = 50'000'000'000ULL;
  // Replace a target directory that exists and holds files (as a whole).
  bool overwrite = false;
  // A graph router: write its linear router's weights and drop the graph (see the header).
  bool drop_graph = false;
};

// "float32", "bfloat16", "float16" (config.json's dtype of the tensors written).
inline const char* torch_dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::F64: return "float64";
    default: return "?";
  }
}

namespace detail {

inline constexpr const char* save_op = "hf::save";

template <class... Args>
[[noreturn]] void refuse(Family f, const std::string& field, Args&&... why) {
  graphmoe::detail::throw_error(save_op, "the model's ", field, " ", std::forward<Args>(why)...,
                                ": ", architecture_name(f), " cannot express it");
}

// float to bfloat16, rounded to nearest even (NaN stays NaN).
inline std::uint16_t float_to_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// float to IEEE half, rounded to nearest even (subnormals included; beyond 65504 + half an ulp:
// infinity; NaN stays NaN).
inline std::uint16_t float_to_f16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (u >= 0x47800000u) return sign | 0x7c00u;  // >= 65536, infinity
  if (u <= 0x33000000u) return sign;            // <= 2^-25: rounds to zero (2^-25 ties to even)
  const int e = static_cast<int>(u >> 23) - 127;  // >= -25 here
  const std::uint32_t m = (u & 0x7fffffu) | 0x800000u;
  const int shift = e >= -14 ? 13 : 13 + (-14 - e);  // bits of m below half's last place
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  // normal: the implicit bit (q's bit 10) adds one to the exponent field; a carry out of the
  // mantissa moves to the next binade (to infinity past 65504); subnormal: q itself
  const std::uint32_t bits = e >= -14 ? (static_cast<std::uint32_t>(e + 14) << 10) + q : q;
  return static_cast<std::uint16_t>(sign | bits);
}

// double to float rounded to odd (the last bit set when inexact): rounding that to bfloat16 or
// half then rounds double to them correctly (no double rounding). |x| <= FLT_MAX.
inline float double_to_float_odd(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) == x) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}

// Whether x (finite) is representable in dt without overflow once rounded.
template <class T>
bool fits(T x, DType dt) {
  if (!std::isfinite(x)) return false;
  const double a = std::fabs(static_cast<double>(x));
  if (a > static_cast<double>(std::numeric_limits<float>::max())) return false;
  if (dt == DType::F16) return a < 65520.0;  // 65504 + half an ulp rounds to infinity
  if (dt == DType::BF16) {
    const float f = std::is_same_v<T, double> ? double_to_float_odd(static_cast<double>(x))
                                              : static_cast<float>(x);
    return (float_to_bf16(f) & 0x7f80u) != 0x7f80u;
  }
  return true;
}

// n values of T at src written as dt (little-endian) at dst.
template <class T>
void encode(const T* src, std::size_t n, DType dt, std::uint8_t* dst) {
  for (std::size_t i = 0; i < n; ++i) {
    const float f = std::is_same_v<T, double> && dt != DType::F32
                        ? double_to_float_odd(static_cast<double>(src[i]))
                        : static_cast<float>(src[i]);  // F32: round to nearest
    if (dt == DType::F32) {
      std::memcpy(dst + 4 * i, &f, 4);
    } else {
      const std::uint16_t h = dt == DType::BF16 ? float_to_bf16(f) : float_to_f16(f);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

// The first field in which two configs compute differently ("" when none): what the reader's
// Checkpoint::load compares, the graph and training-only fields aside.
inline std::string computation_difference(const TransformerLMConfig& m, const TransformerLMConfig& c) {
  if (m.vocab_size != c.vocab_size) return "vocab_size";
  if (m.d_model != c.d_model) return "d_model";
  if (m.num_layers != c.num_layers) return "num_layers";
  if (m.num_heads != c.num_heads) return "num_heads";
  for (index_t i = 0; i < m.num_layers; ++i)
    if (m.is_moe_layer(i) != c.is_moe_layer(i)) return "MoE layout (block " + std::to_string(i) + ")";
  bool any_dense = false, any_moe = false;
  for (index_t i = 0; i < m.num_layers; ++i) (m.is_moe_layer(i) ? any_moe : any_dense) = true;
  if (any_dense && m.d_ff != c.d_ff) return "d_ff";
  if (m.tie_embeddings != c.tie_embeddings) return "tie_embeddings";
  if (m.activation != c.activation || m.ffn_bias != c.ffn_bias) return "activation or ffn_bias";
  if (m.norm != c.norm || m.norm_eps != c.norm_eps) return "norm or norm_eps";
  const AttentionOptions &a = m.attention, &b = c.attention;
  if (a.num_kv_heads != b.num_kv_heads) return "attention.num_kv_heads";
  if (a.head_dim_for(m.d_model, m.num_heads) != b.head_dim_for(c.d_model, c.num_heads))
    return "attention.head_dim";
  if (a.rope_theta != b.rope_theta || a.rope_layout != b.rope_layout)
    return "attention.rope_theta or rope_layout";
  if (!a.same_latent(b)) return "multi-head latent attention's options";
  if (a.qk_norm != b.qk_norm || (a.qk_norm != QKNorm::None && a.qk_norm_eps != b.qk_norm_eps))
    return "attention.qk_norm";
  if (a.qkv_bias != b.qkv_bias || a.out_bias != b.out_bias) return "attention biases";
  if (any_moe) {
    if (m.experts_width() != c.experts_width()) return "expert_d_ff";
    if (m.shared_d_ff != c.shared_d_ff || m.shared_expert_gate != c.shared_expert_gate)
      return "shared_d_ff or shared_expert_gate";
    if (m.router.num_experts != c.router.num_experts || m.router.k != c.router.k)
      return "router.num_experts or router.k";
    const auto &t = m.router.options<TopK>(), &u = c.router.options<TopK>();
    if (t.norm_topk_prob != u.norm_topk_prob) return "norm_topk_prob";
    if (t.routed_scaling_factor != u.routed_scaling_factor || t.n_group != u.n_group ||
        t.topk_group != u.topk_group)
      return "routed_scaling_factor, n_group or topk_group";
    if (m.router.options<LinearScorer>().bias != c.router.options<LinearScorer>().bias ||
        m.router.options<SigmoidScorer>().bias != c.router.options<SigmoidScorer>().bias)
      return "router bias";
    if (m.router.capacity_factor != c.router.capacity_factor) return "capacity_factor";
  }
  return "";
}

inline const char* qk_norm_name(QKNorm q) {
  switch (q) {
    case QKNorm::None: return "None";
    case QKNorm::Full: return "Full";
    case QKNorm::PerHead: return "PerHead";
  }
  return "?";
}

// Writes text to path (a new file), fsynced.
inline void write_new_file(const std::string& path, const std::string& text) {
  const int raw = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  GRAPHMOE_CHECK(raw >= 0, save_op, "cannot create '", path, "': ",
                 graphmoe::detail::errno_text(errno));
  graphmoe::detail::Fd fd(raw);
  graphmoe::detail::write_all(fd.get(), text.data(), text.size(), path);
  GRAPHMOE_CHECK(::fsync(fd.get()) == 0, save_op, "fsync of '", path, "' failed: ",
                 graphmoe::detail::errno_text(errno));
  GRAPHMOE_CHECK(fd.close() == 0, save_op, "closing '", path, "' failed: ",
                 graphmoe::detail::errno_text(errno));
}

inline void fsync_directory(const std::string& dir) {
  graphmoe::detail::Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  GRAPHMOE_CHECK(dfd.get() >= 0, save_op, "cannot open the directory '", dir, "' to fsync it: ",
                 graphmoe::detail::errno_text(errno));
  GRAPHMOE_CHECK(::fsync(dfd.get()) == 0 || errno == EINVAL, save_op, "fsync of the directory '",
                 dir, "' failed: ", graphmoe::detail::errno_text(errno));
}

// Removes the temporary directories ".<name>.tmp.<pid>" beside `target` whose process is gone.
inline void remove_stale_save_directories(const std::filesystem::path& parent,
                                          const std::string& name) {
  namespace fs = std::filesystem;
  const std::string prefix = "." + name + ".tmp.";
  std::error_code ec;
  fs::directory_iterator it(parent, ec);
  if (ec) return;
  for (const fs::directory_entry& e : it) {
    const long pid = graphmoe::detail::temporary_pid(e.path().filename().string(), prefix);
    if (pid == 0 || pid == static_cast<long>(::getpid())) continue;
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ec);
  }
}

}  // namespace detail

// The description of a model of config `c` as a checkpoint of `family` (family, architecture and
// lm = c; no token ids, dtype ""), or graphmoe::Error naming the field the family cannot express.
// The router's graph is not looked at (save_lm refuses or drops it).
inline ModelConfig to_model_config(const TransformerLMConfig& c, Family family) {
  using detail::refuse;
  const Family f = family;
  c.validate();
  if (c.num_classes > 0)
    refuse(f, "num_classes", "= ", c.num_classes, " (a classification head)");
  if (c.norm != NormKind::RMSNorm) refuse(f, "norm", "is LayerNorm (the families use RMSNorm)");
  if (c.learned_positions())
    refuse(f, "attention.rope_theta", "= 0 (learned position embeddings; the families use RoPE)");
  const bool ds = f == Family::DeepseekV3;
  if (c.attention.rope_layout != RopeLayout::HalfSplit && !ds)
    refuse(f, "attention.rope_layout", "is Interleaved (the families but DeepSeek-V3 rotate "
           "half-split pairs)");
  if (c.activation != FfnActivation::SwiGLU)
    refuse(f, "activation", "is GELU (the families' feed-forward networks are SwiGLU)");
  if (c.ffn_bias) refuse(f, "ffn_bias", "is true (biases on the feed-forward networks)");
  if (c.attention.out_bias) refuse(f, "attention.out_bias", "is true (a bias on the output projection)");
  if (c.attention.latent() && !ds)
    refuse(f, "attention.kv_lora_rank", "= ", c.attention.kv_lora_rank,
           " (multi-head latent attention: only DeepSeek-V3 has it)");
  if (ds && !c.attention.latent())
    refuse(f, "attention.kv_lora_rank", "= 0 (DeepSeek-V3's attention is multi-head latent "
           "attention)");
  if (ds && c.attention.latent_norm_eps != 1e-6)
    refuse(f, "attention.latent_norm_eps", "= ", c.attention.latent_norm_eps,
           " (DeepSeek-V3's latent norms use 1e-6)");
  if (ds && c.attention.num_kv_heads != 0 && c.attention.num_kv_heads != c.num_heads)
    refuse(f, "attention.num_kv_heads", "= ", c.attention.num_kv_heads,
           " (multi-head latent attention gives every head its keys)");
  if (c.attention.qkv_bias && f != Family::Qwen2Moe)
    refuse(f, "attention.qkv_bias", "is true (only Qwen2-MoE has q/k/v biases)");
  const QKNorm want = f == Family::Olmoe ? QKNorm::Full
                      : f == Family::Qwen3Moe ? QKNorm::PerHead
                                              : QKNorm::None;
  if (c.attention.qk_norm != want)
    refuse(f, "attention.qk_norm", "is ", detail::qk_norm_name(c.attention.qk_norm), " (",
           architecture_name(f), " has ", detail::qk_norm_name(want), ")");
  if (want != QKNorm::None && c.attention.qk_norm_eps != c.norm_eps)
    refuse(f, "attention.qk_norm_eps", "= ", c.attention.qk_norm_eps, " differs from norm_eps = ",
           c.norm_eps, " (one rms_norm_eps)");
  if (f == Family::Olmoe && c.attention.head_dim_for(c.d_model, c.num_heads) * c.num_heads != c.d_model)
    refuse(f, "attention.head_dim", "= ", c.attention.head_dim, " (OLMoE's q_norm and k_norm are sized for "
           "num_heads x head_dim = d_model)");
  index_t moe_layers = 0;
  for (index_t i = 0; i < c.num_layers; ++i) moe_layers += c.is_moe_layer(i) ? 1 : 0;
  if (f == Family::Llama) {
    if (moe_layers > 0) refuse(f, "layout", "has MoE blocks (Llama is dense)");
  } else {
    if (moe_layers == 0) refuse(f, "layout", "has no MoE block (save a dense model as Llama)");
    if (ds && (c.moe_every != 1 || c.layout != MoELayout::Switch))
      refuse(f, "layout", "is not MoE in every block from first_k_dense on (moe_every = ",
             c.moe_every, ")");
    if ((f == Family::Mixtral || f == Family::Olmoe) && moe_layers != c.num_layers)
      refuse(f, "layout", "has dense blocks (first_k_dense = ", c.first_k_dense, ", moe_every = ",
             c.moe_every, "; every block of ", architecture_name(f), " is MoE)");
    // Qwen: dense blocks are mlp_only_layers = [0, first_k_dense) and decoder_sparse_step
    if (c.layout == MoELayout::GLaM && (f == Family::Qwen2Moe || f == Family::Qwen3Moe) &&
        c.moe_every != 1)
      refuse(f, "moe_every", "= ", c.moe_every, " with the GLaM layout");
    if (c.shared_d_ff > 0 && f != Family::Qwen2Moe && !ds)
      refuse(f, "shared_d_ff", "= ", c.shared_d_ff,
             " (shared experts: only Qwen2-MoE and DeepSeek-V3 have them)");
    if (ds && (c.shared_d_ff == 0 || c.shared_d_ff % c.experts_width() != 0 || c.shared_expert_gate))
      refuse(f, c.shared_expert_gate ? "shared_expert_gate" : "shared_d_ff",
             c.shared_expert_gate ? "is true" : "= " + std::to_string(c.shared_d_ff),
             " (DeepSeek-V3's blocks have n_shared_experts x moe_intermediate_size = a multiple of "
             "expert_d_ff = ", c.experts_width(), " of shared experts, ungated)");
    if (f == Family::Qwen2Moe && (c.shared_d_ff == 0 || !c.shared_expert_gate))
      refuse(f, c.shared_d_ff == 0 ? "shared_d_ff" : "shared_expert_gate",
             c.shared_d_ff == 0 ? "= 0" : "is false",
             " (Qwen2-MoE's blocks have one shared expert behind a sigmoid gate)");
    const RouterConfig& r = c.router;
    if (ds ? r.options<SigmoidScorer>().bias : r.options<LinearScorer>().bias)
      refuse(f, "router bias", ds ? "(SigmoidScorer bias) is on" : "(LinearScorer bias) is on");
    const auto& t = r.options<TopK>();
    if (t.routed_scaling_factor != 1.0 && !ds)
      refuse(f, "routed_scaling_factor", "= ", t.routed_scaling_factor, " (not 1)");
    if (t.n_group != 1 && !ds) refuse(f, "n_group", "= ", t.n_group, " (group-limited routing)");
    if (ds && t.n_group > 1 && r.num_experts / t.n_group < 2)
      refuse(f, "n_group", "= ", t.n_group, " (groups of one expert: a group's score is the sum "
             "of its two best scores)");
    if (f == Family::Mixtral && !t.norm_topk_prob)
      refuse(f, "norm_topk_prob", "is false (Mixtral always renormalises the top-k gates)");
    if (r.capacity_factor > 0)
      refuse(f, "router.capacity_factor", "= ", r.capacity_factor, " (tokens dropped by capacity)");
  }
  ModelConfig out;
  out.family = f;
  out.architecture = architecture_name(f);
  out.lm = c;
  return out;
}

// config.json for mc (mc.lm written as mc.family, with mc's token ids and dtype; "float32" when
// mc.dtype is empty). The keys of transformers 5's config class of the family, with rope_theta
// (and Qwen3-MoE's num_experts) beside them for transformers 4. Checks to_model_config first.
inline nlohmann::json config_json(const ModelConfig& mc) {
  (void)to_model_config(mc.lm, mc.family);
  const TransformerLMConfig& c = mc.lm;
  const Family f = mc.family;
  using J = nlohmann::json;
  J j = J::object();
  j["architectures"] = J::array({architecture_name(f)});
  j["model_type"] = model_type_name(f);
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.d_model;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] =
      c.attention.num_kv_heads == 0 ? c.num_heads : c.attention.num_kv_heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_seq_len;
  j["initializer_range"] = c.init_std;
  j["rms_norm_eps"] = c.norm_eps;
  j["use_cache"] = true;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["rope_parameters"] = {{"rope_theta", c.attention.rope_theta}, {"rope_type", "default"}};
  j["rope_theta"] = c.attention.rope_theta;  // transformers 4
  j["attention_dropout"] = 0.0;
  auto ids = [](const std::vector<std::int64_t>& v) {
    if (v.empty()) return J(nullptr);
    if (v.size() == 1) return J(v[0]);
    return J(v);
  };
  // always written: absent ids would be the config class's defaults (OLMoE's pad_token_id 1)
  j["bos_token_id"] = ids(mc.bos_token_ids);
  j["eos_token_id"] = ids(mc.eos_token_ids);
  j["pad_token_id"] = mc.pad_token_id ? J(*mc.pad_token_id) : J(nullptr);
  const std::string dtype = mc.dtype.empty() ? "float32" : mc.dtype;
  j["dtype"] = dtype;
  j["torch_dtype"] = dtype;  // transformers 4
  const index_t dh = c.attention.head_dim_for(c.d_model, c.num_heads);
  // intermediate_size: the dense blocks' width (Llama, Qwen), the experts' (Mixtral, OLMoE)
  j["intermediate_size"] =
      (f == Family::Mixtral || f == Family::Olmoe) ? c.experts_width() : c.d_ff;
  if (f != Family::Qwen2Moe) j["attention_bias"] = false;
  if (f == Family::Mixtral) j.erase("attention_bias");  // MixtralConfig has none
  // every family's attention reads head_dim when the config has it (OLMoE's is refused above)
  if (f == Family::DeepseekV3) {
    const AttentionOptions& a = c.attention;
    const RouterConfig& r = c.router;
    const auto& t = r.options<TopK>();
    j["head_dim"] = a.qk_rope_head_dim;  // as DeepseekV3Config sets them
    j["qk_head_dim"] = a.qk_nope_head_dim + a.qk_rope_head_dim;
    j["kv_lora_rank"] = a.kv_lora_rank;
    j["q_lora_rank"] = a.q_lora_rank == 0 ? J(nullptr) : J(a.q_lora_rank);
    j["qk_nope_head_dim"] = a.qk_nope_head_dim;
    j["qk_rope_head_dim"] = a.qk_rope_head_dim;
    j["v_head_dim"] = a.v_head_dim;
    j["rope_interleave"] = a.rope_layout == RopeLayout::Interleaved;
    j["pretraining_tp"] = 1;
    j["n_routed_experts"] = r.num_experts;
    j["num_experts_per_tok"] = r.k;
    j["moe_intermediate_size"] = c.experts_width();
    j["n_shared_experts"] = c.shared_d_ff / c.experts_width();
    j["first_k_dense_replace"] = std::min(c.first_k_dense, c.num_layers);
    j["norm_topk_prob"] = t.norm_topk_prob;
    j["routed_scaling_factor"] = t.routed_scaling_factor;
    j["n_group"] = t.n_group;
    j["topk_group"] = t.topk_group;
    j["num_nextn_predict_layers"] = 0;  // no multi-token-prediction modules are written
    j["output_router_logits"] = false;
    return j;
  }
  if (f == Family::Llama || f == Family::Mixtral || f == Family::Qwen3Moe || dh * c.num_heads != c.d_model)
    j["head_dim"] = dh;
  if (f == Family::Llama) {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
    return j;
  }
  const RouterConfig& r = c.router;
  j["num_experts_per_tok"] = r.k;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = r.load_balance_coef;
  if (f != Family::Mixtral) j["norm_topk_prob"] = r.options<TopK>().norm_topk_prob;
  switch (f) {
    case Family::Mixtral:
      j["num_local_experts"] = r.num_experts;
      j["router_jitter_noise"] = 0.0;
      j["sliding_window"] = nullptr;
      break;
    case Family::Olmoe:
      j["num_experts"] = r.num_experts;
      j["clip_qkv"] = nullptr;
      break;
    case Family::Qwen2Moe:
    case Family::Qwen3Moe: {
      if (f == Family::Qwen3Moe) {
        j["num_local_experts"] = r.num_experts;
        j["num_experts"] = r.num_experts;  // transformers 4
        j["sliding_window"] = nullptr;
      } else {
        j["num_experts"] = r.num_experts;
        j["qkv_bias"] = c.attention.qkv_bias;
        j["shared_expert_intermediate_size"] = c.shared_d_ff;
        j["sliding_window"] = 0;
        j["max_window_layers"] = c.num_layers;
        j["layer_types"] = J(std::vector<std::string>(static_cast<std::size_t>(c.num_layers),
                                                      "full_attention"));
      }
      j["use_sliding_window"] = false;
      j["moe_intermediate_size"] = c.experts_width();
      j["decoder_sparse_step"] = c.layout == MoELayout::GLaM ? 2 : c.moe_every;
      std::vector<index_t> dense(static_cast<std::size_t>(std::min(c.first_k_dense, c.num_layers)));
      for (std::size_t i = 0; i < dense.size(); ++i) dense[i] = static_cast<index_t>(i);
      j["mlp_only_layers"] = dense;
      break;
    }
    case Family::Llama:
    case Family::DeepseekV3: break;  // returned above
  }
  return j;
}

// Saves lm as a Hugging Face model directory of mc.family at `dir`, with mc's token ids (a
// ModelConfig from hf::Checkpoint::config() or read_config: load, then save, keeps them). The
// model's own config is written (mc.lm is not read). See the header for what is refused.
template <class Router, class T>
void save_lm(const TransformerLM<Router, T, cpu>& lm, const ModelConfig& mc, const std::string& dir,
             const SaveOptions& opts = {}) {
  static_assert(loadable_router<Router>,
                "graphmoe::hf::save_lm: the families' routers are a linear map to softmax scores "
                "and a top-k choice (Router<LinearScorer, Graph, TopK>) or, DeepSeek-V3's, to "
                "sigmoid scores with a selection bias (Router<SigmoidScorer, Graph, "
                "BiasBalancedTopK>): only those can be saved");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "graphmoe::hf::save_lm: T must be float or double");
  namespace fs = std::filesystem;
  const char* op = detail::save_op;
  GRAPHMOE_CHECK(opts.dtype == DType::F32 || opts.dtype == DType::BF16 || opts.dtype == DType::F16,
                 op, "SaveOptions::dtype is ", opts.dtype, ": only F32, BF16 and F16 are written");
  GRAPHMOE_CHECK(opts.max_shard_size > 0, op, "SaveOptions::max_shard_size must be > 0");
  GRAPHMOE_CHECK(!dir.empty(), op, "empty directory name");
  GRAPHMOE_CHECK(lm.bound(), op, "the model is not bound");
  const TransformerLMConfig& cfg = lm.config();
  const Family f = mc.family;
  detail::check_router_kind<Router>(op, dir, f, cfg.layout != MoELayout::Dense);
  constexpr bool has_graph = !std::is_same_v<typename Router::graph, Independent>;
  if (has_graph && !opts.drop_graph && cfg.layout != MoELayout::Dense)
    graphmoe::detail::throw_error(
        op, "the model's router routes through the token graph '", Router::graph::name, "' (",
        Router::name(), "), which ", architecture_name(f), " in transformers does not have; "
        "set SaveOptions::drop_graph to write its linear router's weights only (the saved "
        "model then routes without the graph)");

  // 1. config.json, and the model it describes read back as the reader reads it.
  ModelConfig desc = to_model_config(cfg, f);
  desc.bos_token_ids = mc.bos_token_ids;
  desc.eos_token_ids = mc.eos_token_ids;
  desc.pad_token_id = mc.pad_token_id;
  desc.dtype = torch_dtype_name(opts.dtype);
  const nlohmann::json cj = config_json(desc);
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename() && target.has_parent_path()) target = target.parent_path();  // "a/b/"
  const std::string shown = (target / "config.json").string();
  ModelConfig back;
  try {
    back = parse_config(cj, shown);
  } catch (const Error& e) {
    graphmoe::detail::throw_error(op, "the config.json of this model would not be read back: ",
                                  e.what());
  }
  const std::string diff = detail::computation_difference(cfg, back.lm);
  GRAPHMOE_CHECK(diff.empty(), op, "the model's ", diff, " is not what its config.json describes (",
                 architecture_name(f), " cannot express it)");

  // 2. The tensors: every slot of the description from the parameter it names, covering every
  // parameter of the model exactly (a graph's parameters aside, with drop_graph).
  const ParameterArena<T, cpu>& arena = lm.arena();
  const auto [first, end] = lm.parameter_ids();
  const std::string& prefix = lm.prefix();
  struct Planned {
    TensorSlot slot;
    const T* src = nullptr;
    std::uint64_t bytes = 0;
  };
  std::vector<Planned> plan;
  std::vector<std::vector<std::pair<index_t, index_t>>> cover(static_cast<std::size_t>(end - first));
  for_each_tensor(back, [&](const TensorSlot& s) {
    const std::string name = prefix + s.param;
    GRAPHMOE_CHECK(arena.contains(name), op, "the model has no parameter '", name, "' for tensor '",
                   s.name, "'");
    const index_t id = arena.find(name);
    GRAPHMOE_CHECK(id >= first && id < end, op, "parameter '", name, "' is not the model's own");
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(id)];
    GRAPHMOE_CHECK(!p.sharded(), op, "parameter '", name, "' is an expert shard (an expert-parallel "
                   "model): gather it first (dist::gather_parameter); a rank alone cannot save it");
    GRAPHMOE_CHECK(s.offset + s.shape.numel() <= p.shape.numel(), op, "tensor '", s.name,
                   "' of shape ", s.shape, " does not fit parameter '", name, "' of shape ", p.shape);
    cover[static_cast<std::size_t>(id - first)].emplace_back(s.offset, s.shape.numel());
    plan.push_back({s, arena.value(id).data() + s.offset,
                    static_cast<std::uint64_t>(s.shape.numel()) * dtype_size(opts.dtype)});
  });
  for (index_t id = first; id < end; ++id) {
    auto& c = cover[static_cast<std::size_t>(id - first)];
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(id)];
    const std::string local = p.name.substr(std::min(prefix.size(), p.name.size()));
    if (c.empty() && has_graph && opts.drop_graph &&
        local.find(".moe.router.graph.") != std::string::npos)
      continue;  // the dropped graph's own parameters
    GRAPHMOE_CHECK(!c.empty(), op, "the model's parameter '", p.name, "' of shape ", p.shape,
                   " has no tensor in a ", architecture_name(f), " checkpoint");
    std::sort(c.begin(), c.end());
    index_t at = 0;
    for (const auto& [off, n] : c) {
      GRAPHMOE_CHECK(off == at, op, "parameter '", p.name, "': the tensors ",
                     off < at ? "overlap" : "leave a gap", " at element ", std::min(off, at));
      at += n;
    }
    GRAPHMOE_CHECK(at == p.shape.numel(), op, "parameter '", p.name, "': the tensors fill ", at,
                   " of its ", p.shape.numel(), " elements");
  }
  // every value finite and within the dtype's range, before anything is written
  for (const Planned& pl : plan) {
    const auto n = static_cast<std::size_t>(pl.slot.shape.numel());
    for (std::size_t i = 0; i < n; ++i)
      if (!detail::fits(pl.src[i], opts.dtype))
        graphmoe::detail::throw_error(op, "parameter '", prefix + pl.slot.param, "' (tensor '",
                                      pl.slot.name, "') holds ", pl.src[i], " at element ",
                                      static_cast<std::size_t>(pl.slot.offset) + i, ", which is ",
                                      std::isfinite(pl.src[i]) ? "beyond the range of " : "not finite in ",
                                      opts.dtype);
  }

  // 3. Shards as save_pretrained splits them: in order, a new shard when the next tensor would
  // pass max_shard_size (a larger tensor alone).
  std::vector<std::vector<std::size_t>> shards(1);
  std::uint64_t cur = 0, total = 0, params = 0;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    if (!shards.back().empty() && cur + plan[i].bytes > opts.max_shard_size) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += plan[i].bytes;
    total += plan[i].bytes;
    params += static_cast<std::uint64_t>(plan[i].slot.shape.numel());
  }

  // 4. The target: absent, an empty directory, or (overwrite) a directory to replace.
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string name = target.filename().string();
  GRAPHMOE_CHECK(!name.empty() && name != "." && name != "..", op, "'", dir,
                 "' does not name a directory to create");
  struct stat st {};
  bool replace = false;
  if (::lstat(target.c_str(), &st) == 0) {
    GRAPHMOE_CHECK(S_ISDIR(st.st_mode), op, "'", dir, "' exists and is not a directory (",
                   graphmoe::detail::file_kind(st.st_mode), ")");
    std::error_code ec;
    const bool empty = fs::is_empty(target, ec);
    GRAPHMOE_CHECK(!ec, op, "cannot list '", dir, "': ", ec.message());
    GRAPHMOE_CHECK(empty || opts.overwrite, op, "'", dir, "' exists and holds files: refused "
                   "(set SaveOptions::overwrite to replace it as a whole)");
    replace = true;
  } else {
    GRAPHMOE_CHECK(errno == ENOENT, op, "cannot stat '", dir, "': ",
                   graphmoe::detail::errno_text(errno));
    GRAPHMOE_CHECK(::stat(parent.c_str(), &st) == 0 && S_ISDIR(st.st_mode), op, "the parent '",
                   parent.string(), "' of '", dir, "' is not a directory");
  }
  detail::remove_stale_save_directories(parent, name);
  const fs::path tmp = parent / ("." + name + ".tmp." + std::to_string(::getpid()));
  {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // this process's own leftover
  }
  GRAPHMOE_CHECK(::mkdir(tmp.c_str(), 0755) == 0, op, "cannot create the temporary directory '",
                 tmp.string(), "' for '", dir, "': ", graphmoe::detail::errno_text(errno));
  struct RemoveTmp {
    fs::path path;
    bool armed = true;
    ~RemoveTmp() {
      std::error_code ec;
      if (armed) fs::remove_all(path, ec);
    }
  } remove_tmp{tmp};

  // 5. The files, into the temporary directory.
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  nlohmann::json weight_map = nlohmann::json::object();
  const std::size_t n_shards = shards.size();
  for (std::size_t s = 0; s < n_shards; ++s) {
    std::string file = "model.safetensors";
    if (n_shards > 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", s + 1, n_shards);
      file = buf;
    }
    std::vector<std::vector<std::uint8_t>> buffers;
    std::vector<TensorRef> refs;
    buffers.reserve(shards[s].size());
    for (std::size_t i : shards[s]) {
      const Planned& pl = plan[i];
      const void* data = pl.src;
      if (!(std::is_same_v<T, float> && opts.dtype == DType::F32)) {
        buffers.emplace_back(static_cast<std::size_t>(pl.bytes));
        detail::encode(pl.src, static_cast<std::size_t>(pl.slot.shape.numel()), opts.dtype,
                       buffers.back().data());
        data = buffers.back().data();
      }
      refs.push_back({pl.slot.name, opts.dtype, pl.slot.shape, data});
      weight_map[pl.slot.name] = file;
    }
    save_safetensors((tmp / file).string(), refs, meta);
  }
  if (n_shards > 1) {
    nlohmann::json index = {{"metadata", {{"total_parameters", params}, {"total_size", total}}},
                            {"weight_map", weight_map}};
    detail::write_new_file((tmp / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  }
  detail::write_new_file((tmp / "config.json").string(), cj.dump(2) + "\n");
  detail::fsync_directory(tmp.string());

  // 6. Publish: the complete directory takes the target's name.
  if (!replace) {
    GRAPHMOE_CHECK(::rename(tmp.c_str(), target.c_str()) == 0, op, "cannot rename '", tmp.string(),
                   "' to '", dir, "': ", graphmoe::detail::errno_text(errno));
  } else {
    bool swapped = false;
#if defined(RENAME_EXCHANGE)
    swapped = ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0;
#endif
    if (!swapped) {  // no atomic exchange here: move the old one aside first
      const fs::path old = parent / ("." + name + ".old." + std::to_string(::getpid()));
      std::error_code ec;
      fs::remove_all(old, ec);
      GRAPHMOE_CHECK(::rename(target.c_str(), old.c_str()) == 0, op, "cannot move '", dir,
                     "' aside: ", graphmoe::detail::errno_text(errno));
      if (::rename(tmp.c_str(), target.c_str()) != 0) {
        const int e = errno;
        (void)::rename(old.c_str(), target.c_str());
        graphmoe::detail::throw_error(op, "cannot rename '", tmp.string(), "' to '", dir, "': ",
                                      graphmoe::detail::errno_text(e));
      }
      remove_tmp.path = old;  // the old directory, removed below
    }
    // tmp (after the exchange) or old now holds the replaced directory: removed by remove_tmp
  }
  if (!replace) remove_tmp.armed = false;
  detail::fsync_directory(parent.string());
}

// The same with a family and no token ids (bos/eos/pad_token_id written as null).
template <class Router, class T>
void save_lm(const TransformerLM<Router, T, cpu>& lm, Family family, const std::string& dir,
             const SaveOptions& opts = {}) {
  ModelConfig mc;
  mc.family = family;
  mc.architecture = architecture_name(family);
  save_lm(lm, mc, dir, opts);
}

}  // namespace graphmoe::hf
