// graphmoe/core/decode.hpp: the shared types of incremental decoding (inference/decoder.hpp):
// which sequence and position each row of a decode step is, the KV cache of an attention layer,
// and what that layer hands the Attention graph for the rows it just decoded.
//
// A decoder holds S sequence slots of at most max_len tokens each. A decode step takes new tokens
// for some slots: row i of the step's tensors is the token at position rows.pos[i] of slot
// rows.slot[i]. A slot has one row in a step of generation, or a *chunk* of rows at consecutive
// positions p, p+1, ... (in row order, not necessarily adjacent rows) when a prompt is fed
// (Decoder::prefill); positions [0, p) of that slot are already cached. Every op first writes all
// the step's rows into its caches at their positions and only then lets any row read, so the row
// at position t reads positions 0..t of its slot, the ones its own step wrote included: a chunk
// of L rows equals L steps of one row, with the per-token work done as GEMMs of L rows, and a
// step costs O(pos) per row instead of a forward over the whole prefix. Every cache is addressed
// by position and a step at position t reads positions <= t only, so a slot continues from any
// position t by stepping there (Decoder::rewind): what was cached at t and after is overwritten,
// never read.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// The rows of one decode step, on the host.
struct DecodeRows {
  std::vector<index_t> slot;  // the sequence slot of each row
  std::vector<index_t> pos;   // its position (a slot's rows: consecutive positions in row order)
  index_t size() const { return static_cast<index_t>(slot.size()); }

  // Checks the rows against a cache of `slots` slots of `max_len` positions: both vectors of one
  // length, every slot in [0, slots), every position in [0, max_len), and the rows of a slot
  // that appears more than once at consecutive increasing positions in row order (p, p+1, ...):
  // the ops append every row before any row reads, and a row reads its slot's positions up to
  // its own, so a gap would read an entry no step wrote and a repeat would write one twice.
  void validate(const char* op, index_t slots, index_t max_len) const {
    GRAPHMOE_CHECK(slot.size() == pos.size() && !slot.empty(), op,
                   "a decode step needs one slot and one position per row, got ", slot.size(),
                   " slots and ", pos.size(), " positions");
    // per slot: its last row so far (-1: none yet)
    std::vector<index_t> last(static_cast<std::size_t>(slots > 0 ? slots : 0), -1);
    for (std::size_t i = 0; i < slot.size(); ++i) {
      GRAPHMOE_CHECK(slot[i] >= 0 && slot[i] < slots, op, "row ", i, " names slot ", slot[i],
                     ", outside the cache's [0, ", slots, ")");
      GRAPHMOE_CHECK(pos[i] >= 0 && pos[i] < max_len, op, "row ", i, " is at position ", pos[i],
                     ", outside the cache's [0, ", max_len, ")");
      index_t& prev = last[static_cast<std::size_t>(slot[i])];
      if (prev >= 0) {
        const index_t want = pos[static_cast<std::size_t>(prev)] + 1;
        GRAPHMOE_CHECK(pos[i] == want, op, "slot ", slot[i], " has row ", prev, " at position ",
                       pos[static_cast<std::size_t>(prev)], " and then row ", i, " at position ",
                       pos[i], ": a slot's rows in one step must be at consecutive increasing "
                       "positions in row order (expected ", want, ")");
      }
      prev = static_cast<index_t>(i);
    }
  }
};

// The keys and values of one attention layer for every slot, head by head so that a head's
// cached rows are one contiguous (len, dh) matrix. Under grouped-query attention the cache holds
// the Hkv key/value heads only (Hkv = kv_heads() divides H = heads()); query head h reads key/value
// head h / (H / Hkv), as repeat_heads maps them (ops/heads.hpp).
template <class T, class B>
struct KVCache {
  Tensor<T, B> k;  // (S, Hkv, max_len, dh)
  Tensor<T, B> v;  // (S, Hkv, max_len, dh)
  index_t query_heads = 0;  // H; 0: H = Hkv (multi-head attention)

  KVCache() = default;
  KVCache(index_t slots, index_t heads, index_t max_len, index_t head_dim)
      : k(Shape{slots, heads, max_len, head_dim}), v(Shape{slots, heads, max_len, head_dim}) {}
  // Grouped-query: H query heads over kv_heads cached heads (kv_heads divides heads).
  KVCache(index_t slots, index_t heads, index_t kv_heads, index_t max_len, index_t head_dim)
      : k(Shape{slots, kv_heads, max_len, head_dim}), v(Shape{slots, kv_heads, max_len, head_dim}),
        query_heads(heads) {
    GRAPHMOE_CHECK(kv_heads >= 1 && heads >= kv_heads && heads % kv_heads == 0, "KVCache",
                   "kv_heads = ", kv_heads, " must divide heads = ", heads);
  }
  index_t slots() const { return k.empty() ? 0 : k.dim(0); }
  // The query heads H (what the attention rows and probs are indexed by).
  index_t heads() const { return query_heads > 0 ? query_heads : kv_heads(); }
  // The cached key/value heads Hkv.
  index_t kv_heads() const { return k.empty() ? 0 : k.dim(1); }
  // The query heads per cached head (H / Hkv; 1 without grouping).
  index_t group() const { return kv_heads() == 0 ? 1 : heads() / kv_heads(); }
  index_t max_len() const { return k.empty() ? 0 : k.dim(2); }
  index_t head_dim() const { return k.empty() ? 0 : k.dim(3); }
  // The values the cache holds per token (a key and a value per cached head).
  index_t values_per_token() const { return 2 * kv_heads() * head_dim(); }
};

// What an attention layer computed for the rows of a decode step: the Attention graph of the
// same block reads it (as it reads AttentionCache in a forward).
template <class T, class B>
struct AttentionStep {
  index_t num_heads = 0;
  Tensor<T, B> probs;        // (n, H, max_len): row i, head h: A_h[pos_i, 0..pos_i], the rest 0
  Tensor<T, B> row_entropy;  // (n, H) H(A_h[pos_i, :]) from the attention softmax
  Tensor<T, B> out;          // (n, D) the attention sublayer's output a of each row
  Tensor<T, B> w_o;          // (D, D) output projection
  Tensor<T, B> b_o;          // (D) or empty
  const KVCache<T, B>* kv = nullptr;  // the layer's cache, the step's rows included
};

// The Similarity graph's routing cache: what a later token's row of S and p = S r read.
template <class T, class B>
struct SimilarityDecodeCache {
  Tensor<T, B> u;  // (S, max_len, D) the tokens u_j (the keys of S)
  Tensor<T, B> r;  // (S, max_len, E) their expert scores softmax(gamma_j)
  index_t values_per_token() const { return u.empty() ? 0 : u.dim(2) + r.dim(2); }
};

// The Attention graph's routing cache. Its logits q_i . v_hj read the V cache; besides that, per
// token, the expert scores, |m_hj|^2 - |b_o|^2 of every head (h* may change with the prefix) and
// the prefix sums of the attention-row entropies that choose h* (in double, as the forward sums
// them), kept per position so that every entry of a slot is addressed by position.
template <class T, class B>
struct AttentionDecodeCache {
  Tensor<T, B> r;                       // (S, max_len, E)
  Tensor<T, B> msq;                     // (S, H, max_len)
  std::vector<double> entropy_prefix;   // (S, max_len, H) on the host: sum_{i <= t} H(A_h[i, :])
  index_t values_per_token() const { return r.empty() ? 0 : r.dim(2) + 2 * msq.dim(1); }
};

// h* of the token at position t of slot s, on the host (every backend's attention_graph_decode):
// adds its attention-row entropies ent[0..H) to the slot's prefix sums, in double (entry (s, t)
// = entry (s, t - 1) + ent; entry (s, t) alone at t = 0; so the rows of a chunk are taken in
// row order, which is position order, each after the one before it), and returns the head whose mean
// entropy over positions 0..t is the smallest (the first on ties), as the forward's
// PerSequenceCausal choice does. prefix is AttentionDecodeCache::entropy_prefix (S max_len H).
template <class T>
int decode_choose_head(std::vector<double>& prefix, index_t s, index_t t, index_t max_len,
                       index_t heads, const T* ent) {
  double* esum = prefix.data() + (s * max_len + t) * heads;
  const double* prev = t > 0 ? esum - heads : nullptr;
  int best = 0;
  double best_v = std::numeric_limits<double>::infinity();
  for (index_t h = 0; h < heads; ++h) {
    esum[h] = (prev != nullptr ? prev[h] : 0.0) + static_cast<double>(ent[h]);
    const double mean = esum[h] / static_cast<double>(t + 1);
    if (mean < best_v) {
      best_v = mean;
      best = static_cast<int>(h);
    }
  }
  return best;
}

}  // namespace graphmoe
