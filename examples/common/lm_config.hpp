// The LM configuration as JSON, stored in checkpoints' __metadata__["config"] by train_lm and read
// back by finetune_classifier.
#pragma once

#include <cmath>
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
  // SMoE-Dropout's k schedule (k at a checkpoint's step depends on it)
  if (router.rfind("smoe-dropout", 0) == 0) j["schedule_steps"] = sched.schedule_steps;
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
  if (j.contains("schedule_steps"))
    sched.schedule_steps = config_field<std::int64_t>(j, "schedule_steps", where);
  GRAPHMOE_CHECK(sched.schedule_steps >= 1, "lm_config_from_json", where,
                 ": config field 'schedule_steps' is ", sched.schedule_steps, ", must be >= 1");
  return m;
}

}  // namespace examples
