// graphmoe/train/lm_batcher.hpp: contiguous-stream language-model batches, as in the AWD-LSTM
// and Transformer-XL WikiText setups ("batchify" + "get_batch").
//
// The token stream is cut into `batch` equal contiguous lanes (the tail that does not fill a
// lane is dropped): lane b holds stream[b*L, (b+1)*L) with L = stream.size() / batch. Batch i
// takes positions [i*T, (i+1)*T] (T + 1 tokens) of every lane:
//   inputs(b, t)  = lane_b[i*T + t]         (batch, T)
//   targets(b, t) = lane_b[i*T + t + 1]     (batch, T)   inputs shifted by one
// so batches 0, 1, ... tile each lane, and batch i+1 of a lane continues batch i (the state of
// a recurrent or memory model can be carried over). num_batches() = (L - 1) / T; the last
// incomplete window is dropped. batch(i) is a pure function of i; order(rng) gives a shuffled
// visiting order for models that do not carry state.
#pragma once

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

struct LMBatch {
  Tensor<std::int32_t, cpu> inputs;   // (batch, seq_len)
  Tensor<std::int32_t, cpu> targets;  // (batch, seq_len), inputs shifted by one position
};

class LMBatcher {
 public:
  LMBatcher(std::vector<std::int32_t> stream, index_t batch, index_t seq_len)
      : stream_(std::move(stream)), batch_(batch), seq_len_(seq_len) {
    GRAPHMOE_CHECK(batch > 0 && seq_len > 0, "LMBatcher", "batch (", batch, ") and seq_len (",
                   seq_len, ") must be positive");
    lane_len_ = static_cast<index_t>(stream_.size()) / batch_;
    GRAPHMOE_CHECK(lane_len_ >= seq_len_ + 1, "LMBatcher", "a stream of ", stream_.size(),
                   " tokens is too short for batch ", batch_, " and seq_len ", seq_len_,
                   ": each lane needs at least ", seq_len_ + 1, " tokens");
  }

  index_t num_batches() const { return (lane_len_ - 1) / seq_len_; }
  index_t batch_size() const { return batch_; }
  index_t seq_len() const { return seq_len_; }
  // Tokens per lane: L above.
  index_t lane_length() const { return lane_len_; }
  const std::vector<std::int32_t>& stream() const { return stream_; }

  // Batch i, 0 <= i < num_batches().
  LMBatch batch(index_t i) const {
    GRAPHMOE_CHECK(0 <= i && i < num_batches(), "LMBatcher::batch", "batch ", i,
                   " out of range [0, ", num_batches(), ")");
    LMBatch out{Tensor<std::int32_t, cpu>({batch_, seq_len_}),
                Tensor<std::int32_t, cpu>({batch_, seq_len_})};
    for (index_t b = 0; b < batch_; ++b) {
      const std::int32_t* src = stream_.data() + b * lane_len_ + i * seq_len_;
      std::int32_t* in = out.inputs.data() + b * seq_len_;
      std::int32_t* tg = out.targets.data() + b * seq_len_;
      for (index_t t = 0; t < seq_len_; ++t) {
        in[t] = src[t];
        tg[t] = src[t + 1];
      }
    }
    return out;
  }

  // A uniformly random permutation of [0, num_batches()) (Fisher-Yates on rng).
  std::vector<index_t> order(Rng& rng) const {
    GRAPHMOE_CHECK(num_batches() <= index_t(0xFFFFFFFF), "LMBatcher::order", num_batches(),
                   " batches exceed the 32-bit range of Rng::uniform_int");
    std::vector<index_t> idx(static_cast<std::size_t>(num_batches()));
    std::iota(idx.begin(), idx.end(), index_t(0));
    for (std::size_t k = idx.size(); k > 1; --k) {
      const std::size_t j = rng.uniform_int(static_cast<std::uint32_t>(k));
      std::swap(idx[k - 1], idx[j]);
    }
    return idx;
  }

 private:
  std::vector<std::int32_t> stream_;
  index_t batch_, seq_len_;
  index_t lane_len_ = 0;
};

}  // namespace graphmoe
