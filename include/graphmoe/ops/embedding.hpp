// graphmoe/ops/embedding.hpp: table lookup by integer id, and its scatter-add backward.
//
//   forward:   out[i, :] = table[ids[i], :]          ids: any shape, n ids; table (V, D)
//                                                    out: (ids.shape..., D)
//   backward:  dtable[ids[i], :] += dout[i, :]       accumulates (dtable is a parameter gradient)
//
// Every id must lie in [0, V); a bad id throws naming the first bad flat position and its value,
// before anything is written. Every backend gives the same result for every thread count (the
// backward adds the rows of dout to a row of dtable in position order).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// embedding_first_bad_id(B{}, ...), embedding_forward(B{}, ...) and embedding_backward(B{}, ...)
// run the backend's system (backend/cpu/embedding.hpp, backend/cuda/embedding.cuh, or a user
// backend's overloads found by argument-dependent lookup), which return the first id out of range
// (core/offender.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "graphmoe/backend/cpu/embedding.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// The first id outside [0, vocab), found by the backend at flat position bad.index of ids.
inline void embedding_check_ids(const char* op, const Shape& ids_shape, const Offender& bad,
                                index_t vocab) {
  GRAPHMOE_CHECK(!bad.found(), op, "id ", static_cast<std::int32_t>(bad.value),
                 " at flat position ", bad.index, " of ids ", ids_shape, " is out of range [0, ",
                 vocab, ")");
}

// The shape (ids.shape..., d) of embedding's output.
inline Shape embedding_output_shape(const char* op, const Shape& ids_shape, index_t d) {
  GRAPHMOE_CHECK(ids_shape.rank() < Shape::kMaxRank, op, "ids of shape ", ids_shape, " have rank ",
                 ids_shape.rank(), "; the output would exceed the maximum rank ",
                 Shape::kMaxRank);
  std::vector<index_t> dims(ids_shape.begin(), ids_shape.end());
  dims.push_back(d);
  return Shape::from_range(dims.begin(), dims.end());
}

}  // namespace detail

// out = table[ids]: (ids.shape..., D). An empty `out` is allocated.
template <class T, Backend B>
void embedding_forward(const Tensor<std::int32_t, B>& ids, const Tensor<T, B>& table,
                       Tensor<T, B>& out) {
  constexpr const char* op = "embedding_forward";
  GRAPHMOE_CHECK(!ids.empty(), op, "ids are empty");
  GRAPHMOE_CHECK(!table.empty() && table.rank() == 2, op, "table must be a (V, D) matrix, got ",
                 (table.empty() ? "an empty tensor" : table.shape().str()));
  const index_t vocab = table.dim(0), d = table.dim(1);
  report_check(embedding_first_bad_id(B{}, ids, vocab), [shape = ids.shape(), vocab](const Offender& bad) {
    detail::embedding_check_ids("embedding_forward", shape, bad, vocab);
  });
  prepare_output(op, "out", out, detail::embedding_output_shape(op, ids.shape(), d));
  embedding_forward(B{}, ids, table, out);
}

// dtable[ids[i], :] += dout[i, :]. dtable (V, D) must be allocated (V cannot be inferred from the
// ids); dout must have the shape (ids.shape..., D).
template <class T, Backend B>
void embedding_backward(const Tensor<std::int32_t, B>& ids, const Tensor<T, B>& dout,
                        Tensor<T, B>& dtable) {
  constexpr const char* op = "embedding_backward";
  GRAPHMOE_CHECK(!ids.empty(), op, "ids are empty");
  GRAPHMOE_CHECK(!dtable.empty() && dtable.rank() == 2, op,
                 "dtable must be an allocated (V, D) matrix (it accumulates), got ",
                 (dtable.empty() ? "an empty tensor" : dtable.shape().str()));
  const index_t vocab = dtable.dim(0), d = dtable.dim(1);
  check_shape(op, "dout", dout, detail::embedding_output_shape(op, ids.shape(), d));
  report_check(embedding_backward(B{}, ids, dout, dtable), [shape = ids.shape(), vocab](const Offender& bad) {
    detail::embedding_check_ids("embedding_backward", shape, bad, vocab);
  });
}

}  // namespace graphmoe
