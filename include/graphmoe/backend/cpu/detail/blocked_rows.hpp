// graphmoe/backend/cpu/detail/blocked_rows.hpp: column sums over rows, in fixed blocks of rows
// reduced in block order (internal).
//
// The parameter gradients of the normalisations (LayerNorm's dgamma and dbeta, RMSNorm's dweight)
// are sums over every row. Each block of `block` rows (a constant, not derived from the thread
// count) sums into its own partials in double, the blocks run in parallel, and the partials are
// added in block order: no data race, and the same bits for every thread count.
#pragma once

#include <cstddef>
#include <vector>

#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe::detail {

// Calls row(i, acc) for every row i in [0, n), where acc points at `width` doubles of the partial
// sums of i's block (zero at the block's start); blocks of `block` rows run in parallel, `grain`
// blocks per task. Returns the blocks' partials added in block order (width doubles).
template <class RowFn>
std::vector<double> blocked_row_sums(index_t n, index_t width, index_t block, index_t grain,
                                     RowFn&& row) {
  const index_t blocks = (n + block - 1) / block;
  std::vector<double> partial(static_cast<std::size_t>(blocks * width), 0.0);
  parallel_for(
      0, blocks,
      [&](index_t bk) {
        double* acc = partial.data() + bk * width;
        const index_t end = n < (bk + 1) * block ? n : (bk + 1) * block;
        for (index_t i = bk * block; i < end; ++i) row(i, acc);
      },
      grain);
  std::vector<double> total(static_cast<std::size_t>(width), 0.0);
  for (index_t bk = 0; bk < blocks; ++bk) {
    const double* p = partial.data() + bk * width;
    for (index_t j = 0; j < width; ++j) total[static_cast<std::size_t>(j)] += p[j];
  }
  return total;
}

}  // namespace graphmoe::detail
