// The LM configuration as JSON, stored in checkpoints' __metadata__["config"] by train_lm and read
// back by finetune_classifier.
#pragma once

#include <cmath>
#include <initializer_list>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "graphmoe/models/transformer_lm.hpp"

namespace examples {

inline nlohmann::json lm_config_json(const graphmoe::TransformerLMConfig& m, const std::string& router,
                                     bool char_level) {
  const auto& r = m.router;
  const auto& sim = r.options<graphmoe::Similarity>();
  const auto& sched = r.options<graphmoe::ScheduledTopK>();
  nlohmann::json j = {{"vocab_size", m.vocab_size}, {"max_seq_len", m.max_seq_len}, {"d_model", m.d_model},
          {"num_layers", m.num_layers}, {"num_heads", m.num_heads}, {"d_ff", m.d_ff},
          {"layout", static_cast<int>(m.layout)}, {"tie_embeddings", m.tie_embeddings},
          {"router", router}, {"num_experts", r.num_experts}, {"k", r.k}, {"k_min", sched.k_min},
          {"k_max", sched.k_max}, {"tau", sim.tau}, {"tau_mode", static_cast<int>(sim.tau_mode)},
          {"sigma", r.options<graphmoe::Attention>().sigma}, {"load_balance_coef", r.load_balance_coef},
          {"z_loss_coef", r.z_loss_coef}, {"char_level", char_level}};
  // written only when set, so that checkpoints from before the option still match on --resume
  if (sim.exclude_self) j["exclude_self"] = true;
  if (sim.projection) j["projection"] = true;
  if (r.seq_aux_loss_coef != 0) j["seq_aux_loss_coef"] = r.seq_aux_loss_coef;
  // SMoE-Dropout's k schedule (k at a checkpoint's step depends on it)
  if (router.rfind("smoe-dropout", 0) == 0) j["schedule_steps"] = sched.schedule_steps;
  // the modern blocks and token-choice options (docs/reference/architectures.md), each written
  // only when it differs from GPT-2's default
  const graphmoe::TransformerLMConfig d;
  const auto& a = m.attention;
  if (m.activation != d.activation) j["activation"] = graphmoe::ffn_activation_name(m.activation);
  if (!m.ffn_bias) j["ffn_bias"] = false;
  if (m.norm != d.norm) j["norm"] = graphmoe::norm_kind_name(m.norm);
  if (m.norm_eps != d.norm_eps) j["norm_eps"] = m.norm_eps;
  if (a.num_kv_heads != 0) j["num_kv_heads"] = a.num_kv_heads;
  if (a.head_dim != 0) j["head_dim"] = a.head_dim;
  if (a.latent()) {
    j["kv_lora_rank"] = a.kv_lora_rank;
    j["q_lora_rank"] = a.q_lora_rank;
    j["qk_nope_head_dim"] = a.qk_nope_head_dim;
    j["qk_rope_head_dim"] = a.qk_rope_head_dim;
    j["v_head_dim"] = a.v_head_dim;
    j["latent_norm_eps"] = a.latent_norm_eps;
  }
  if (a.rope_theta != 0) {
    j["rope_theta"] = a.rope_theta;
    j["rope_layout"] = graphmoe::rope_layout_name(a.rope_layout);
  }
  if (a.qk_norm != graphmoe::QKNorm::None) {
    j["qk_norm"] = graphmoe::name_of(graphmoe::kQKNormNames, a.qk_norm);
    j["qk_norm_eps"] = a.qk_norm_eps;
  }
  if (!a.qkv_bias) j["qkv_bias"] = false;
  if (!a.out_bias) j["out_bias"] = false;
  if (m.expert_d_ff != 0) j["expert_d_ff"] = m.expert_d_ff;
  if (m.shared_d_ff != 0) j["shared_d_ff"] = m.shared_d_ff;
  if (m.shared_expert_gate) j["shared_expert_gate"] = true;
  if (m.first_k_dense != 0) j["first_k_dense"] = m.first_k_dense;
  if (m.moe_every != 1) j["moe_every"] = m.moe_every;
  if (!r.options<graphmoe::LinearScorer>().bias) j["router_bias"] = false;
  const graphmoe::TokenChoiceOptions& choice = r.options<graphmoe::TopK>();  // BiasBalancedTopK's too
  const bool biased = router.rfind("sigmoid-bias", 0) == 0;
  if (!choice.norm_topk_prob) j["norm_topk_prob"] = false;
  if (choice.routed_scaling_factor != 1.0) j["routed_scaling_factor"] = choice.routed_scaling_factor;
  if (choice.n_group != 1) {
    j["n_group"] = choice.n_group;
    j["topk_group"] = choice.topk_group;
  }
  if (biased) j["bias_update_rate"] = r.options<graphmoe::BiasBalancedTopK>().bias_update_rate;
  return j;
}

namespace detail {
// j[key] as T, or graphmoe::Error "<where>: config field '<key>' is missing / is a string, expected
// an integer / is 1e+30, out of range" (where: "'<checkpoint path>'").
template <class T>
T config_field(const nlohmann::json& j, const char* key, const std::string& where) {
  auto fail = [&](const auto&... what) {
    graphmoe::detail::throw_error("lm_config_from_json", where, ": config field '", key, "' ", what...);
  };
  if (!j.is_object()) fail("cannot be read: the config is not a JSON object (", j.type_name(), ")");
  const auto it = j.find(key);
  if (it == j.end()) fail("is missing");
  const nlohmann::json& v = *it;
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) fail("is a ", v.type_name(), ", expected true or false");
    return v.get<bool>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) fail("is a ", v.type_name(), ", expected a string");
    return v.get<std::string>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) fail("is ", v.dump(), ", expected an integer");
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) fail("is ", v.dump(), ", out of range");
      return static_cast<T>(u);
    }
    const auto x = v.get<std::int64_t>();
    if (x < static_cast<std::int64_t>(std::numeric_limits<T>::min()) ||
        x > static_cast<std::int64_t>(std::numeric_limits<T>::max()))
      fail("is ", v.dump(), ", out of range");
    return static_cast<T>(x);
  } else {
    static_assert(std::is_floating_point_v<T>);
    if (!v.is_number()) fail("is ", v.dump(), ", expected a number");
    const double x = v.get<double>();
    if (!std::isfinite(x)) fail("is ", v.dump(), ", not finite");
    return static_cast<T>(x);
  }
}
}  // namespace detail

// The LM configuration stored by lm_config_json. `where` names the source in errors (the
// checkpoint's path, quoted): a missing field or one of the wrong type or range throws
// graphmoe::Error naming it; the sizes themselves are checked by TransformerLMConfig::validate.
inline graphmoe::TransformerLMConfig lm_config_from_json(const nlohmann::json& j,
                                                         const std::string& where = "config") {
  using detail::config_field;
  using graphmoe::index_t;
  graphmoe::TransformerLMConfig m;
  m.vocab_size = config_field<index_t>(j, "vocab_size", where);
  m.max_seq_len = config_field<index_t>(j, "max_seq_len", where);
  m.d_model = config_field<index_t>(j, "d_model", where);
  m.num_layers = config_field<index_t>(j, "num_layers", where);
  m.num_heads = config_field<index_t>(j, "num_heads", where);
  m.d_ff = config_field<index_t>(j, "d_ff", where);
  const int layout = config_field<int>(j, "layout", where);
  GRAPHMOE_CHECK(layout >= 0 && layout <= static_cast<int>(graphmoe::MoELayout::Dense),
                 "lm_config_from_json", where, ": config field 'layout' is ", layout,
                 ", not 0 (switch), 1 (glam) or 2 (dense)");
  m.layout = static_cast<graphmoe::MoELayout>(layout);
  m.tie_embeddings = config_field<bool>(j, "tie_embeddings", where);
  m.router.num_experts = config_field<index_t>(j, "num_experts", where);
  m.router.k = config_field<index_t>(j, "k", where);
  m.router.allow_unused_options = true;  // a config file configures every router
  auto& sim = m.router.options<graphmoe::Similarity>();
  auto& sched = m.router.options<graphmoe::ScheduledTopK>();
  sched.k_min = config_field<index_t>(j, "k_min", where);
  sched.k_max = config_field<index_t>(j, "k_max", where);
  sim.tau = config_field<double>(j, "tau", where);
  const int tau_mode = config_field<int>(j, "tau_mode", where);
  GRAPHMOE_CHECK(tau_mode >= 0 && tau_mode <= static_cast<int>(graphmoe::TauMode::Learned),
                 "lm_config_from_json", where, ": config field 'tau_mode' is ", tau_mode,
                 ", not 0 (fixed), 1 (scaled) or 2 (learned)");
  sim.tau_mode = static_cast<graphmoe::TauMode>(tau_mode);
  m.router.options<graphmoe::Attention>().sigma = config_field<double>(j, "sigma", where);
  m.router.load_balance_coef = config_field<double>(j, "load_balance_coef", where);
  m.router.z_loss_coef = config_field<double>(j, "z_loss_coef", where);
  if (j.contains("exclude_self")) sim.exclude_self = config_field<bool>(j, "exclude_self", where);
  if (j.contains("projection")) sim.projection = config_field<bool>(j, "projection", where);
  if (j.contains("seq_aux_loss_coef"))
    m.router.seq_aux_loss_coef = config_field<double>(j, "seq_aux_loss_coef", where);
  if (j.contains("schedule_steps"))
    sched.schedule_steps = config_field<std::int64_t>(j, "schedule_steps", where);
  GRAPHMOE_CHECK(sched.schedule_steps >= 1, "lm_config_from_json", where,
                 ": config field 'schedule_steps' is ", sched.schedule_steps, ", must be >= 1");
  // the modern blocks (absent: GPT-2's defaults)
  // the value a field names, from its enum's table (core/enum_names.hpp)
  const auto one_of = [&]<class E, std::size_t N>(const char* key,
                                                  const graphmoe::EnumName<E> (&table)[N]) -> E {
    const std::string v = config_field<std::string>(j, key, where);
    if (const graphmoe::EnumName<E>* t = graphmoe::find_name(table, v)) return t->value;
    graphmoe::detail::throw_error("lm_config_from_json", where, ": config field '", key, "' is '", v,
                                  "', not one of ", graphmoe::joined_names(table));
  };
  if (j.contains("norm"))
    m.norm = one_of("norm", graphmoe::kNormKindNames);
  if (j.contains("norm_eps")) m.norm_eps = config_field<double>(j, "norm_eps", where);
  if (j.contains("activation"))
    m.activation = one_of("activation", graphmoe::kFfnActivationNames);
  if (j.contains("ffn_bias")) m.ffn_bias = config_field<bool>(j, "ffn_bias", where);
  auto& a = m.attention;
  if (j.contains("num_kv_heads")) a.num_kv_heads = config_field<index_t>(j, "num_kv_heads", where);
  if (j.contains("head_dim")) a.head_dim = config_field<index_t>(j, "head_dim", where);
  for (const auto& [key, field] :
       {std::pair<const char*, index_t*>{"kv_lora_rank", &a.kv_lora_rank},
        {"q_lora_rank", &a.q_lora_rank}, {"qk_nope_head_dim", &a.qk_nope_head_dim},
        {"qk_rope_head_dim", &a.qk_rope_head_dim}, {"v_head_dim", &a.v_head_dim}})
    if (j.contains(key)) *field = config_field<index_t>(j, key, where);
  if (j.contains("latent_norm_eps"))
    a.latent_norm_eps = config_field<double>(j, "latent_norm_eps", where);
  if (j.contains("rope_theta")) a.rope_theta = config_field<double>(j, "rope_theta", where);
  if (j.contains("rope_layout"))
    a.rope_layout = one_of("rope_layout", graphmoe::kRopeLayoutNames);
  if (j.contains("qk_norm"))
    a.qk_norm = one_of("qk_norm", graphmoe::kQKNormNames);
  if (j.contains("qk_norm_eps")) a.qk_norm_eps = config_field<double>(j, "qk_norm_eps", where);
  if (j.contains("qkv_bias")) a.qkv_bias = config_field<bool>(j, "qkv_bias", where);
  if (j.contains("out_bias")) a.out_bias = config_field<bool>(j, "out_bias", where);
  if (j.contains("expert_d_ff")) m.expert_d_ff = config_field<index_t>(j, "expert_d_ff", where);
  if (j.contains("shared_d_ff")) m.shared_d_ff = config_field<index_t>(j, "shared_d_ff", where);
  if (j.contains("shared_expert_gate"))
    m.shared_expert_gate = config_field<bool>(j, "shared_expert_gate", where);
  if (j.contains("first_k_dense")) m.first_k_dense = config_field<index_t>(j, "first_k_dense", where);
  if (j.contains("moe_every")) m.moe_every = config_field<index_t>(j, "moe_every", where);
  if (j.contains("router_bias"))
    m.router.options<graphmoe::LinearScorer>().bias = config_field<bool>(j, "router_bias", where);
  graphmoe::TokenChoiceOptions choice;
  if (j.contains("norm_topk_prob")) choice.norm_topk_prob = config_field<bool>(j, "norm_topk_prob", where);
  if (j.contains("routed_scaling_factor"))
    choice.routed_scaling_factor = config_field<double>(j, "routed_scaling_factor", where);
  if (j.contains("n_group")) {
    choice.n_group = config_field<index_t>(j, "n_group", where);
    choice.topk_group = config_field<index_t>(j, "topk_group", where);
  }
  m.router.options<graphmoe::TopK>() = choice;  // BiasBalancedTopK reads TopK's token choice
  if (j.contains("bias_update_rate"))
    m.router.options<graphmoe::BiasBalancedTopK>().bias_update_rate =
        config_field<double>(j, "bias_update_rate", where);
  return m;
}

}  // namespace examples
