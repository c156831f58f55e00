// graphmoe/core/attention_dims.hpp: the dimensions of multi-head attention, read off q (B, T, H dh)
// and the number of heads. ops/attention.hpp checks them; every backend's attention reads them.
#pragma once

#include "graphmoe/core/shape.hpp"

namespace graphmoe {

struct AttentionDims {
  index_t batch = 0, seq = 0, width = 0, heads = 0, head_dim = 0;

  // The dimensions of q (B, T, H dh) split into num_heads heads (checked by ops/attention.hpp:
  // q has rank 3 and num_heads divides its width).
  static AttentionDims of(const Shape& q, index_t num_heads) {
    AttentionDims d;
    d.batch = q[0];
    d.seq = q[1];
    d.width = q[2];
    d.heads = num_heads;
    d.head_dim = d.width / num_heads;
    return d;
  }

  index_t pairs() const { return batch * heads; }
  Shape probs_shape() const { return Shape{batch, heads, seq, seq}; }
  // Offset of head h of batch b in a (B, T, H dh) tensor.
  index_t head_offset(index_t pair) const {
    return (pair / heads) * seq * width + (pair % heads) * head_dim;
  }
};

}  // namespace graphmoe
