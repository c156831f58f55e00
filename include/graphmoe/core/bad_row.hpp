// graphmoe/core/bad_row.hpp: what a backend's softmax found in a row without a finite maximum.
//
// The softmax ops (ops/softmax.hpp) and the log-softmax inside cross-entropy throw for the first
// row of x whose maximum is not finite (a NaN, a +inf, or every entry -inf), naming the cause with
// the counts of NaN and +inf entries of that row. The backend scans the data where it lives and
// returns them as a BadRow (core/offender.hpp's Offender, with the two counts an error message
// needs); the op layer formats the message.
#pragma once

#include "graphmoe/core/shape.hpp"

namespace graphmoe {

struct BadRow {
  index_t row = -1;     // the first row without a finite maximum; -1: none
  index_t nan = 0;      // its NaN entries
  index_t pos_inf = 0;  // its +inf entries (none of either: the row is entirely -inf)

  // >= 0: not known yet; the check's entry in the thread's deferred checks
  // (core/deferred_check.hpp), row is then -1
  index_t deferred = -1;

  bool found() const { return row >= 0; }
  bool pending() const { return deferred >= 0; }
};

}  // namespace graphmoe
