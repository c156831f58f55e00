// graphmoe/inference/decoder.hpp: incremental decoding of a TransformerLM, with a KV cache per
// attention layer and a routing cache per MoE layer: one token per sequence and step while
// generating, a prompt in chunks of many tokens per step (prefill).
//
//   Decoder<SimilarityRouter, float> dec(lm, /*slots=*/2);   // caches for 2 sequences
//   dec.prefill(0, prompt);           // the prompt into slot 0 -> the last token's logits (V)
//   dec.step({0, 1}, {id_a, id_b});   // a token for each sequence -> logits (2, V) on the host
//   dec.step({1, 1, 0}, {c, d, e});   // two tokens for slot 1 (in order), one for slot 0
//   dec.reset(0);                     // slot 0 starts a new sequence
//
// A step appends each listed token to its slot at that slot's next position (a slot listed k
// times gets k consecutive positions, in the order listed) and returns the logits of those
// tokens: row i equals the full forward's logits at that position of the slot's sequence
// (TransformerLM::forward over (1, t)) up to rounding, with the same experts chosen
// (tests/inference/test_decode.cpp: every causal router, double to 1e-12, one token per step or
// in chunks). Several tokens of a slot in one step (core/decode.hpp: every op appends all rows
// before any row reads) make the projections and experts GEMMs of many rows: prefill feeds a
// prompt of L tokens in ceil(L / chunk) steps instead of L one-row steps, with the LM head on
// each step's last row only (logit_rows).
// What the caches hold (TransformerLM::DecodeCache): per layer the keys and values (2 D values per
// token) and what the layer's token graph declared (routing/concepts.hpp, GraphDecodes): nothing
// for the softmax router's Independent graph, u and softmax(r) (D + E) for the Similarity graph,
// softmax(r) and one value per head (E + H) for the Attention graph, whose logits read the V
// cache. A step costs O(t) per row (attention and graph over the t cached positions) plus the
// per-token work (projections, experts, the LM head), against O(t^2) for a full forward.
//
// Routing in a decode step is dropless: the capacity limit of training (capacity_factor) does not
// apply (a selector without select_dropless must drop nothing, else the step throws). A slot holds
// at most max_len tokens (at most the model's max_seq_len: its positional embeddings end there);
// stepping a full slot throws (generate() then slides a window with full forwards). The model's
// mode is not changed here (generate() puts it in Mode::Eval), and its forward caches are
// overwritten by every step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/ops/elementwise.hpp"

namespace graphmoe {

// C: the model's compute type (TransformerLM's; T unless mixed precision).
template <class Policy, class T, class B = cpu, class C = T>
class Decoder {
 public:
  using Model = TransformerLM<Policy, T, B, C>;

  // Caches for `slots` sequences of at most max_len tokens (0: the model's max_seq_len). The model
  // must outlive the decoder; changing its parameters invalidates what the caches hold.
  explicit Decoder(Model& lm, index_t slots = 1, index_t max_len = 0)
      : lm_(lm), cache_(lm.decode_cache(slots, max_len)),
        len_(static_cast<std::size_t>(slots), 0) {}

  index_t slots() const { return cache_.slots; }
  index_t max_len() const { return cache_.max_len; }
  // The number of tokens slot s holds (its next token goes to this position).
  index_t length(index_t s) const { return len_.at(checked(s, "length")); }
  // Slot s starts a new sequence at its next step (its cached tokens are forgotten).
  void reset(index_t s) { len_[checked(s, "reset")] = 0; }
  // Slot s keeps its first len tokens and continues after them (e.g. to try another continuation
  // of the same prefix): the caches are addressed by position and a step reads only earlier
  // positions (core/decode.hpp), so nothing needs recomputing. 0 <= len <= length(s).
  void rewind(index_t s, index_t len) {
    const std::size_t u = checked(s, "rewind");
    GRAPHMOE_CHECK(len >= 0 && len <= len_[u], "Decoder::rewind", "slot ", s, " holds ", len_[u],
                   " tokens; it can be rewound to 0..", len_[u], ", not ", len);
    len_[u] = len;
  }
  void reset_all() { std::fill(len_.begin(), len_.end(), 0); }

  // Appends ids[i] to slot slots[i] for every i, in order (a slot listed several times gets
  // consecutive positions), and returns their logits (n, V), on the host (the reference stays
  // valid until the next step); with logit_rows, only those rows' logits, (m, V) in that order
  // (e.g. each slot's last row of a step of chunks). With explain, weights() and experts()
  // describe the step's routing afterwards (every row). Throws graphmoe::Error, with the caches
  // unchanged, for a slot out of range, a slot that the step would overfill, an id outside the
  // vocabulary, or a logit row outside [0, n).
  const Tensor<T, cpu>& step(std::span<const index_t> slots, std::span<const std::int32_t> ids,
                             bool explain = false, std::span<const index_t> logit_rows = {}) {
    GRAPHMOE_CHECK(slots.size() == ids.size() && !ids.empty(), "Decoder::step",
                   "a step needs one id per slot, got ", ids.size(), " ids for ", slots.size(),
                   " slots");
    const index_t n = static_cast<index_t>(ids.size()), vocab = lm_.config().vocab_size;
    rows_.slot.assign(slots.begin(), slots.end());
    rows_.pos.resize(slots.size());
    next_ = len_;  // each slot's next position within this step
    for (index_t i = 0; i < n; ++i) {
      const std::size_t s = checked(slots[static_cast<std::size_t>(i)], "step");
      GRAPHMOE_CHECK(next_[s] < cache_.max_len, "Decoder::step", "slot ", s, " is full (",
                     cache_.max_len, " tokens, the decoder's max_len) at row ", i,
                     ": reset it to start a new sequence");
      const std::int32_t id = ids[static_cast<std::size_t>(i)];
      GRAPHMOE_CHECK(id >= 0 && id < vocab, "Decoder::step", "id ", id, " (row ", i,
                     ") is not in the model's vocabulary [0, ", vocab, ")");
      rows_.pos[static_cast<std::size_t>(i)] = next_[s]++;
    }
    rows_.validate("Decoder::step", cache_.slots, cache_.max_len);
    Tensor<std::int32_t, cpu> host_ids(Shape{n});
    std::copy(ids.begin(), ids.end(), host_ids.data());
    Tensor<std::int32_t, B> dev_ids(Shape{n});
    copy_from_host(dev_ids, host_ids);
    lm_.decode(dev_ids, rows_, cache_, logits_, explain ? &weights_ : nullptr, logit_rows);
    for (index_t i = 0; i < n; ++i) ++len_[static_cast<std::size_t>(rows_.slot[static_cast<std::size_t>(i)])];
    host_logits_ = detail::host_values(logits_);
    host_weights_.clear();
    if (explain)
      for (const auto& w : weights_) host_weights_.push_back(w.empty() ? Tensor<T, cpu>() : detail::host_values(w));
    explained_ = explain;
    return host_logits_;
  }
  const Tensor<T, cpu>& step(const std::vector<index_t>& slots, const std::vector<std::int32_t>& ids,
                             bool explain = false, const std::vector<index_t>& logit_rows = {}) {
    return step(std::span<const index_t>(slots), std::span<const std::int32_t>(ids), explain,
                std::span<const index_t>(logit_rows));
  }

  // Appends a prompt (or any run of tokens) to slot s, in steps of at most `chunk` tokens, and
  // returns the logits of its last token (V) on the host (valid until the next step or prefill):
  // what ids.size() steps of one token would give, up to the rounding of the longer GEMMs (the
  // LM head runs on each chunk's last row only: the others' logits are not needed). Throws
  // graphmoe::Error, with the caches unchanged, for an empty ids, chunk < 1, an id outside the
  // vocabulary, or more tokens than the slot has room for. weights() and experts() then describe
  // the last chunk (without explain).
  const Tensor<T, cpu>& prefill(index_t s, std::span<const std::int32_t> ids, index_t chunk = 256) {
    const std::size_t u = checked(s, "prefill");
    const index_t len = static_cast<index_t>(ids.size()), vocab = lm_.config().vocab_size;
    GRAPHMOE_CHECK(len > 0, "Decoder::prefill", "no tokens to prefill slot ", s, " with");
    GRAPHMOE_CHECK(chunk >= 1, "Decoder::prefill", "chunk must be >= 1 tokens per step, got ", chunk);
    GRAPHMOE_CHECK(len <= cache_.max_len - len_[u], "Decoder::prefill", "slot ", s, " holds ",
                   len_[u], " tokens and has room for ", cache_.max_len - len_[u],
                   " more (the decoder's max_len is ", cache_.max_len, "), not ", len);
    for (index_t i = 0; i < len; ++i) {
      const std::int32_t id = ids[static_cast<std::size_t>(i)];
      GRAPHMOE_CHECK(id >= 0 && id < vocab, "Decoder::prefill", "token ", i, " is id ", id,
                     ", not in the model's vocabulary [0, ", vocab, ")");
    }
    std::vector<index_t> slots;
    for (index_t at = 0; at < len; at += chunk) {
      const index_t m = std::min(chunk, len - at), last = m - 1;
      slots.assign(static_cast<std::size_t>(m), s);
      (void)step(std::span<const index_t>(slots),
                 ids.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(m)), false,
                 std::span<const index_t>(&last, 1));
    }
    host_logits_ = host_logits_.view(Shape{vocab});  // (1, V) -> (V)
    return host_logits_;
  }
  const Tensor<T, cpu>& prefill(index_t s, const std::vector<std::int32_t>& ids, index_t chunk = 256) {
    return prefill(s, std::span<const std::int32_t>(ids), chunk);
  }

  // The rows of the last step (slot and position of each).
  const DecodeRows& rows() const { return rows_; }
  // After a step with explain: per block, each row's graph weights over its slot's positions
  // (n, max_len) on the host: the row of S (Similarity) or A^p (Attention) the token was routed
  // by; empty for a dense block or a graph without weights (Independent).
  const std::vector<Tensor<T, cpu>>& weights() const {
    GRAPHMOE_CHECK(explained_, "Decoder::weights", "the last step was not run with explain");
    return host_weights_;
  }
  // The experts the last step chose in block l (an MoE block), (n, k) on the host, by descending
  // score.
  Tensor<std::int32_t, cpu> experts(index_t l) {
    GRAPHMOE_CHECK(l >= 0 && l < lm_.num_layers() && lm_.block(l).is_moe(), "Decoder::experts",
                   "block ", l, " is not an MoE block of this model");
    return detail::host_values(lm_.block(l).moe().routing().selection.indices);
  }
  // The gates of those experts, (n, k) on the host.
  Tensor<T, cpu> gates(index_t l) {
    GRAPHMOE_CHECK(l >= 0 && l < lm_.num_layers() && lm_.block(l).is_moe(), "Decoder::gates",
                   "block ", l, " is not an MoE block of this model");
    return detail::host_values(lm_.block(l).moe().routing().selection.gates);
  }
  // The router's own scores of the last step in block l, softmax(gamma) before any token graph,
  // (n, E) on the host: the experts each row would have chosen alone are their largest.
  Tensor<T, cpu> scores(index_t l) {
    GRAPHMOE_CHECK(l >= 0 && l < lm_.num_layers() && lm_.block(l).is_moe(), "Decoder::scores",
                   "block ", l, " is not an MoE block of this model");
    return detail::host_values(lm_.block(l).moe().routing().r);
  }
  const typename Model::DecodeCache& cache() const { return cache_; }
  Model& model() { return lm_; }

 private:
  std::size_t checked(index_t s, const char* op) const {
    GRAPHMOE_CHECK(s >= 0 && s < cache_.slots, "Decoder", op, ": slot ", s,
                   " is outside the decoder's [0, ", cache_.slots, ")");
    return static_cast<std::size_t>(s);
  }

  Model& lm_;
  typename Model::DecodeCache cache_;
  std::vector<index_t> len_;
  std::vector<index_t> next_;  // step's scratch: each slot's next position
  DecodeRows rows_;
  Tensor<T, B> logits_;
  Tensor<T, cpu> host_logits_;
  std::vector<Tensor<T, B>> weights_;
  std::vector<Tensor<T, cpu>> host_weights_;
  bool explained_ = false;
};

}  // namespace graphmoe
