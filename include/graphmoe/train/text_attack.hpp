// graphmoe/train/text_attack.hpp: the seed paper's attacked WikiText (Section 5.1, "Robustness"):
// a seeded fraction of the input words replaced by one fixed word ("AAA", TextAttack's word-swap
// attack as the paper uses it), the prediction targets kept clean.
//
//   attack_stream(stream, rate, word, seed, keep)   a copy of stream with round(rate * m) of its m
//                                                   attackable positions set to `word`
//   attacked_batch(clean, attacked, i)              inputs of batch i from the attacked stream,
//                                                   targets from the clean one
//
// Positions are drawn uniformly without replacement (a partial Fisher-Yates shuffle on a Philox
// Rng seeded with `seed`), so a seed names one attacked test set exactly, on every machine.
// Positions holding a token of `keep` (e.g. <eos>, which marks a line break, not a word) are never
// replaced and do not count in m. Whether the word is in the model's vocabulary is the caller's
// business: train_lm encodes "AAA" with the run's tokenizer, which maps an out-of-vocabulary word
// to <unk> (WikiText-2's vocabulary has no "AAA"; the attack then replaces words by <unk>).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/train/lm_batcher.hpp"

namespace graphmoe {

struct AttackStats {
  std::size_t attackable = 0;  // positions not holding a kept token
  std::size_t replaced = 0;    // round(rate * attackable)
};

inline std::vector<std::int32_t> attack_stream(const std::vector<std::int32_t>& stream, double rate,
                                               std::int32_t word, std::uint64_t seed,
                                               const std::vector<std::int32_t>& keep = {},
                                               AttackStats* stats = nullptr) {
  constexpr const char* op = "attack_stream";
  GRAPHMOE_CHECK(std::isfinite(rate) && rate >= 0.0 && rate <= 1.0, op,
                 "the attack rate must be in [0, 1], got ", rate);
  GRAPHMOE_CHECK(word >= 0, op, "the attack word id must be >= 0, got ", word);
  GRAPHMOE_CHECK(stream.size() <= std::size_t{0xFFFFFFFF}, op, "a stream of ", stream.size(),
                 " tokens exceeds the 32-bit range of Rng::uniform_int");
  std::vector<std::uint32_t> candidates;
  candidates.reserve(stream.size());
  for (std::size_t i = 0; i < stream.size(); ++i)
    if (std::find(keep.begin(), keep.end(), stream[i]) == keep.end())
      candidates.push_back(static_cast<std::uint32_t>(i));
  const auto m = static_cast<std::size_t>(std::llround(rate * static_cast<double>(candidates.size())));
  Rng rng(seed);
  std::vector<std::int32_t> out = stream;
  // Partial Fisher-Yates: after step j, candidates[0..j] is a uniform sample without replacement.
  for (std::size_t j = 0; j < m; ++j) {
    const std::size_t pick =
        j + rng.uniform_int(static_cast<std::uint32_t>(candidates.size() - j));
    std::swap(candidates[j], candidates[pick]);
    out[candidates[j]] = word;
  }
  if (stats) *stats = {candidates.size(), m};
  return out;
}

// Batch i of an attacked evaluation: inputs from `attacked`, targets from `clean`. Both batchers
// must cut streams of the same length the same way (same batch and seq_len).
inline LMBatch attacked_batch(const LMBatcher& clean, const LMBatcher& attacked, index_t i) {
  GRAPHMOE_CHECK(clean.stream().size() == attacked.stream().size() &&
                     clean.batch_size() == attacked.batch_size() &&
                     clean.seq_len() == attacked.seq_len(),
                 "attacked_batch", "the clean and attacked batchers differ (", clean.stream().size(),
                 " vs ", attacked.stream().size(), " tokens, batch ", clean.batch_size(), " vs ",
                 attacked.batch_size(), ", seq_len ", clean.seq_len(), " vs ", attacked.seq_len(), ")");
  LMBatch b = clean.batch(i);
  b.inputs = attacked.batch(i).inputs;
  return b;
}

}  // namespace graphmoe
