// A small DeepSeek-V3 model description for the program tests (train_lm --hf, generate --hf):
// multi-head latent attention with a query latent, one dense block, then 8 experts in 4 groups
// (2 chosen, top-2) beside a shared expert, sigmoid scores with a selection bias, as
// hf::parse_config reads a config.json of these keys.
#pragma once

#include <nlohmann/json.hpp>

#include "graphmoe/hf/config.hpp"

namespace graphmoe::test {

inline hf::ModelConfig deepseek_v3_config(index_t vocab, index_t context) {
  const nlohmann::json j = {
      {"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"},
      {"vocab_size", vocab}, {"hidden_size", 32}, {"num_hidden_layers", 2},
      {"num_attention_heads", 4}, {"num_key_value_heads", 4}, {"intermediate_size", 32},
      {"moe_intermediate_size", 8}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2},
      {"n_group", 4}, {"topk_group", 2}, {"n_shared_experts", 1}, {"first_k_dense_replace", 1},
      {"kv_lora_rank", 16}, {"q_lora_rank", 16}, {"qk_nope_head_dim", 8},
      {"qk_rope_head_dim", 8}, {"v_head_dim", 8}, {"routed_scaling_factor", 2.5},
      {"max_position_embeddings", context}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
      {"bos_token_id", 0}, {"eos_token_id", 1}};
  return hf::parse_config(j, "deepseek_v3_config");
}

}  // namespace graphmoe::test
