// graphmoe/backend/cpu/embedding.hpp: the CPU system's embedding lookup and its scatter-add
// backward (contract and argument checks: ops/embedding.hpp, which calls these through the
// backend tag).
//
// The ids are scanned on the host before anything is written. The backward pass splits the
// columns of D over threads, so that two equal ids never race, and adds the rows of dout in id
// order: the result is the same for every thread count.
#pragma once

#include <algorithm>
#include <cstdint>

#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

// The first id of `ids` outside [0, vocab), if any (flat position and value).
inline Offender embedding_first_bad_id(cpu, const Tensor<std::int32_t, cpu>& ids, index_t vocab) {
  const std::int32_t* p = ids.data();
  for (index_t i = 0; i < ids.numel(); ++i)
    if (p[i] < 0 || p[i] >= vocab) return {i, static_cast<double>(p[i])};
  return {};
}

// out = table[ids]: (ids.shape..., D), prepared by ops/embedding.hpp; the ids are in range.
template <class T>
void embedding_forward(cpu, const Tensor<std::int32_t, cpu>& ids, const Tensor<T, cpu>& table,
                       Tensor<T, cpu>& out) {
  const index_t d = table.dim(1);
  const index_t n = ids.numel();
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

// dtable[ids[i], :] += dout[i, :], shapes checked by ops/embedding.hpp; returns the first id out
// of [0, V) (dtable untouched then).
template <class T>
Offender embedding_backward(cpu, const Tensor<std::int32_t, cpu>& ids, const Tensor<T, cpu>& dout,
                            Tensor<T, cpu>& dtable) {
  const index_t d = dtable.dim(1);
  const index_t n = ids.numel();
  const Offender bad = embedding_first_bad_id(cpu{}, ids, dtable.dim(0));
  if (bad.found()) return bad;
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
  return {};
}

}  // namespace graphmoe
