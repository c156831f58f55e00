// graphmoe/core/cross_entropy.hpp: what every backend's cross_entropy shares: the rule for a bad
// target, and what a backend's scan of the targets returns (contract and argument checks:
// ops/cross_entropy.hpp).
#pragma once

#include <cstdint>

#include "graphmoe/config.hpp"
#include "graphmoe/core/bad_row.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// What cross_entropy_forward_into (ops/cross_entropy.hpp) leaves for its caller and for the
// backward. On a backend that defers (CUDA inside with_deferred_checks, or a CUDA graph), loss and
// count are deferred values: delivered by the scope's read (or the graph's replay), so they must
// outlive it; `device` then holds the count where the backward's kernel reads it, so that the
// backward needs nothing from the host.
template <class B>
struct CrossEntropyResult {
  double loss = 0;    // mean negative log-likelihood over the rows not ignored (0 if all are)
  double count = -1;  // the rows not ignored (an integer); -1: no forward (or it threw)
  Tensor<unsigned long long, B> device;  // empty, or {count} on the device (the backend's)
};

// A backend's scan of cross_entropy's targets (rows, one target each).
struct TargetScan {
  index_t count = 0;  // rows whose target is not ignore_index (among the rows scanned)
  Offender bad;       // the first row whose target is out of range: its row and its target
};

namespace detail {

// Whether target t of a row is neither ignore_index nor a class in [0, classes).
GRAPHMOE_HOST_DEVICE inline bool cross_entropy_bad_target(std::int32_t t, index_t classes,
                                                          std::int32_t ignore_index) {
  return t != ignore_index && (t < 0 || t >= classes);
}

}  // namespace detail

// What a backend's cross_entropy_forward returns: the mean negative log-likelihood, or the first
// row of logits without a finite maximum (bad.found(): the loss is not computed, and the op layer
// throws the softmax's message for it).
template <class T>
struct CrossEntropyValue {
  T loss = T(0);
  BadRow bad;
};

// A backend's forward with the target scan in the same pass (optional: a backend that provides
// cross_entropy_forward_scanned(B, logits, targets, log_probs, ignore_index) returns both at once,
// e.g. a GPU reading its flags, count and loss back in one copy). The op layer checks scan first,
// then value, so the error is the one the two-step form throws.
template <class T>
struct CrossEntropyScanned {
  TargetScan scan;
  CrossEntropyValue<T> value;
};

// The content checks of a backend's deferred forward (cross_entropy_forward_deferred): each may be
// pending (core/deferred_check.hpp).
struct CrossEntropyChecks {
  Offender target;  // the first row whose target is out of range (and that target)
  BadRow row;       // the first row of logits without a finite maximum
};

}  // namespace graphmoe
