// graphmoe/backend/cpu/embedding.hpp: table lookup by integer id, and its scatter-add backward.
//
//   forward:   out[i, :] = table[ids[i], :]          ids: any shape, n ids; table (V, D)
//                                                    out: (ids.shape..., D)
//   backward:  dtable[ids[i], :] += dout[i, :]       accumulates (dtable is a parameter gradient)
//
// Every id must lie in [0, V); a bad id throws naming its position and value before anything is
// written. The backward pass splits the columns of D over threads, so that two equal ids never
// race, and adds the rows of dout in id order: the result is the same for every thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "graphmoe/backend/common/checks.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {
// Throws naming the first id of `ids` outside [0, vocab).
inline void check_ids(const char* op, const Tensor<std::int32_t, cpu>& ids, index_t vocab) {
  const std::int32_t* p = ids.data();
  for (index_t i = 0; i < ids.numel(); ++i)
    if (p[i] < 0 || p[i] >= vocab) embedding_throw_bad_id(op, ids.shape(), i, p[i], vocab);
}
}  // namespace detail

// out = table[ids]: (ids.shape..., D). An empty `out` is allocated.
template <class T>
void embedding_forward(const Tensor<std::int32_t, cpu>& ids, const Tensor<T, cpu>& table,
                       Tensor<T, cpu>& out) {
  constexpr const char* op = "embedding_forward";
  const detail::EmbeddingDims s = detail::embedding_check_table(op, ids, table);
  const index_t vocab = s.vocab, d = s.d;
  const index_t n = ids.numel();
  detail::check_ids(op, ids, vocab);
  prepare_output(op, "out", out, detail::embedding_output_shape(op, ids.shape(), d));
  const std::int32_t* id = ids.data();
  const T* src = table.data();
  T* dst = out.data();
  const index_t grain = std::max<index_t>(1, 16384 / std::max<index_t>(d, 1));
  parallel_for(
      0, n,
      [&](index_t i) {
        std::copy_n(src + static_cast<index_t>(id[i]) * d, d, dst + i * d);
      },
      grain);
}

// dtable[ids[i], :] += dout[i, :]. dtable (V, D) must be allocated (V cannot be inferred from the
// ids); dout must have the shape (ids.shape..., D).
template <class T>
void embedding_backward(const Tensor<std::int32_t, cpu>& ids, const Tensor<T, cpu>& dout,
                        Tensor<T, cpu>& dtable) {
  constexpr const char* op = "embedding_backward";
  const detail::EmbeddingDims s = detail::embedding_check_backward(op, ids, dout, dtable);
  const index_t vocab = s.vocab, d = s.d;
  const index_t n = ids.numel();
  detail::check_ids(op, ids, vocab);
  const std::int32_t* id = ids.data();
  const T* g = dout.data();
  T* acc = dtable.data();
  // Column blocks of 64 entries (a few cache lines); each thread owns whole blocks.
  constexpr index_t kBlock = 64;
  const index_t blocks = (d + kBlock - 1) / kBlock;
  const index_t grain = n * d >= 32768 ? 1 : blocks;  // small problems run serially
  parallel_for(
      0, blocks,
      [&](index_t b) {
        const index_t c0 = b * kBlock, c1 = std::min(d, c0 + kBlock);
        for (index_t i = 0; i < n; ++i) {
          T* row = acc + static_cast<index_t>(id[i]) * d;
          const T* gi = g + i * d;
          for (index_t c = c0; c < c1; ++c) row[c] += gi[c];
        }
      },
      grain);
}

}  // namespace graphmoe
