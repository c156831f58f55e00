// graphmoe/core/offender.hpp: what a backend's check of tensor contents found.
//
// Argument checks that read only shapes and scalars run once, in the op layer (ops/), before the
// backend is called. Checks of tensor contents (a NaN, an index out of range) run where the data
// lives: the backend scans it its own way and returns the first offending entry as an Offender;
// the op layer then throws graphmoe::Error with the op's message. So every backend reports the
// same bad input with the same words, and no backend formats an error message of its own.
#pragma once

#include "graphmoe/core/shape.hpp"

namespace graphmoe {

struct Offender {
  index_t index = -1;  // flat (row-major) index of the first offending entry; -1: none
  double value = 0;    // its value, widened to double (indices are exact up to 2^53)

  // >= 0: not known yet; the check's entry in the thread's deferred checks
  // (core/deferred_check.hpp), index is then -1
  index_t deferred = -1;

  bool found() const { return index >= 0; }
  bool pending() const { return deferred >= 0; }
};

}  // namespace graphmoe
