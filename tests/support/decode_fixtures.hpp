// tests/support/decode_fixtures.hpp: the tiny language model, the random token ids and the steps
// of the incremental-decoding tests, shared by the CPU tests (tests/inference/test_decode.cpp) and the
// cross-backend ones (tests/cuda/test_cuda_decode.cu), so that both decode the same models.
#pragma once

#include <cstdint>
#include <vector>

#include "graphmoe/core/decode.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/models/transformer_lm.hpp"

namespace graphmoe::test {

// D = 12, 3 heads, 2 blocks, E = 5 experts, k = 2, vocabulary 23; one config for every router
// (the Similarity temperature 0.7, SMoE-Dropout's k scheduled over 1..3); init_std 0.3 keeps
// attention rows and token graphs far from uniform.
inline TransformerLMConfig decode_config(index_t max_len) {
  TransformerLMConfig c;
  c.vocab_size = 23;
  c.max_seq_len = max_len;
  c.d_model = 12;
  c.num_layers = 2;
  c.num_heads = 3;
  c.d_ff = 10;
  c.router.num_experts = 5;
  c.router.k = 2;
  c.router.allow_unused_options = true;
  c.router.options<Similarity>().tau = 0.7;
  c.router.options<ScheduledTopK>().k_min = 1;
  c.router.options<ScheduledTopK>().k_max = 3;
  c.router.options<ScheduledTopK>().schedule_steps = 10;
  c.init_std = 0.3;
  return c;
}

// n ids drawn uniformly from [0, vocab) by the Philox stream of `seed`.
inline std::vector<std::int32_t> random_ids(index_t n, index_t vocab, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  return ids;
}

// Step i of decoding the sequences seqs[s] in slots s together: one row per slot that has a
// token i (slots whose sequence has ended drop out), at position i, in slot order.
struct DecodeStepInput {
  DecodeRows rows;
  std::vector<std::int32_t> ids;
};
inline DecodeStepInput decode_step_input(const std::vector<std::vector<std::int32_t>>& seqs,
                                         index_t i) {
  DecodeStepInput in;
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    if (i >= static_cast<index_t>(seqs[s].size())) continue;
    in.rows.slot.push_back(static_cast<index_t>(s));
    in.rows.pos.push_back(i);
    in.ids.push_back(seqs[s][static_cast<std::size_t>(i)]);
  }
  return in;
}

}  // namespace graphmoe::test
