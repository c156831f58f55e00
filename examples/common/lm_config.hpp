// The LM configuration as JSON, stored in checkpoints' __metadata__["config"] by train_lm and read
// back by finetune_classifier.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "graphmoe/models/transformer_lm.hpp"

namespace examples {

inline nlohmann::json lm_config_json(const graphmoe::TransformerLMConfig& m, const std::string& router,
                                     bool char_level) {
  const auto& r = m.router;
  nlohmann::json j = {{"vocab_size", m.vocab_size}, {"max_seq_len", m.max_seq_len}, {"d_model", m.d_model},
          {"num_layers", m.num_layers}, {"num_heads", m.num_heads}, {"d_ff", m.d_ff},
          {"layout", static_cast<int>(m.layout)}, {"tie_embeddings", m.tie_embeddings},
          {"router", router}, {"num_experts", r.num_experts}, {"k", r.k}, {"k_min", r.k_min},
          {"k_max", r.k_max}, {"tau", r.similarity_tau}, {"tau_mode", static_cast<int>(r.tau_mode)},
          {"sigma", r.attention_sigma}, {"load_balance_coef", r.load_balance_coef},
          {"z_loss_coef", r.z_loss_coef}, {"char_level", char_level}};
  // written only when set, so that checkpoints from before the option still match on --resume
  if (r.similarity_exclude_self) j["exclude_self"] = true;
  if (r.similarity_projection) j["projection"] = true;
  // SMoE-Dropout's k schedule (k at a checkpoint's step depends on it)
  if (router.rfind("smoe-dropout", 0) == 0) j["schedule_steps"] = r.schedule_steps;
  return j;
}

inline graphmoe::TransformerLMConfig lm_config_from_json(const nlohmann::json& j) {
  graphmoe::TransformerLMConfig m;
  m.vocab_size = j.at("vocab_size");
  m.max_seq_len = j.at("max_seq_len");
  m.d_model = j.at("d_model");
  m.num_layers = j.at("num_layers");
  m.num_heads = j.at("num_heads");
  m.d_ff = j.at("d_ff");
  m.layout = static_cast<graphmoe::MoELayout>(j.at("layout").get<int>());
  m.tie_embeddings = j.at("tie_embeddings");
  m.router.num_experts = j.at("num_experts");
  m.router.k = j.at("k");
  m.router.k_min = j.at("k_min");
  m.router.k_max = j.at("k_max");
  m.router.similarity_tau = j.at("tau");
  const int tau_mode = j.at("tau_mode").get<int>();
  GRAPHMOE_CHECK(tau_mode >= 0 && tau_mode <= static_cast<int>(graphmoe::TauMode::Learned),
                 "lm_config_from_json", "tau_mode ", tau_mode, " is not 0 (fixed), 1 (scaled) or 2 (learned)");
  m.router.tau_mode = static_cast<graphmoe::TauMode>(tau_mode);
  m.router.attention_sigma = j.at("sigma");
  m.router.load_balance_coef = j.at("load_balance_coef");
  m.router.z_loss_coef = j.at("z_loss_coef");
  m.router.similarity_exclude_self = j.value("exclude_self", false);
  m.router.similarity_projection = j.value("projection", false);
  m.router.schedule_steps = j.value("schedule_steps", m.router.schedule_steps);
  GRAPHMOE_CHECK(m.router.schedule_steps >= 1, "lm_config_from_json", "schedule_steps ",
                 m.router.schedule_steps, " must be >= 1");
  return m;
}

}  // namespace examples
