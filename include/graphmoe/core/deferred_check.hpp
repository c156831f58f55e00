// graphmoe/core/deferred_check.hpp: content checks whose outcome a backend learns later.
//
// A backend that scans tensor contents on a device (CUDA) learns what a check found only by
// copying a flag back to the host, and that copy stops the host until the device has caught up:
// on a GPU each such check costs a pipeline drain, and it is what keeps a step out of a CUDA
// graph. The router's forward has four (check_finite of its input, the softmax of the scores,
// top-k, the renormalised gates), each guarding against NaN or nonsense that would otherwise flow
// on silently, plus the dispatch plan's read of the expert offsets, which it needs anyway.
//
// with_deferred_checks(B{}, body) runs body with those checks deferred where the backend can
// defer them; the error a user sees does not change:
//   - a backend that defers returns the check's result "pending" (Offender::deferred or
//     BadRow::deferred set to the check's entry in the thread's DeferredChecks) and keeps the
//     flag on the device; the op layer passes the error it would throw to report_check, which
//     attaches it to that entry instead of throwing now;
//   - the backend reads every pending flag together with the next synchronising read of the same
//     thread (the dispatch plan's expert offsets), or, failing that, when body returns;
//   - when body returns, or throws, the first flagged check in program order throws the error it
//     would have thrown at once, with the same message (naming the op, the row, the value). An
//     exception body threw after a flagged check (a later op tripping over the bad values) is
//     replaced by that earlier check's error, as the immediate check would have stopped first.
// Between a flagged check and the end of body, the ops that follow run on the bad values: they
// must be safe on any values (the CUDA ones are: NaN stays arithmetic, and expert ids are
// range-checked by the dispatch plan before anything indexes with them). So a scope ends before
// anything indexes memory with the checked results from the host, or keeps state the error
// should have prevented: in MoELayer it spans the router's forward and the dispatch plan, and
// TransformerLM::forward opens one over the whole forward and its loss (the layers' scopes join
// it), so that with the padded expert layout the first read is the loss's.
//
// The CPU backend checks at once (its checks cost nothing extra): with_deferred_checks(cpu{}, f)
// is f(). A user's backend does the same unless it provides its own with_deferred_checks(B, F).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/bad_row.hpp"
#include "graphmoe/core/offender.hpp"

namespace graphmoe {

namespace detail {

// The host half of one batch of deferred checks: per check, in program order, how to turn its
// flagged index into the op's result (`resolve`, from the backend, which may read the offending
// data back) and what the op layer does with that result (`report`, which throws).
class DeferredChecks {
 public:
  template <class R>
  struct Entry {
    std::function<R(index_t)> resolve;
    std::function<void(const R&)> report;
  };

  // Adds a check; returns its entry number (what the pending result carries).
  template <class R>
  index_t add(const char* op, std::function<R(index_t)> resolve) {
    entries_.push_back(Slot{op, Entry<R>{std::move(resolve), {}}});
    return static_cast<index_t>(entries_.size()) - 1;
  }

  template <class R>
  void set_report(index_t entry, std::function<void(const R&)> report) {
    GRAPHMOE_CHECK(entry >= 0 && entry < size(), "DeferredChecks", "no entry ", entry, " (",
                   size(), " registered)");
    auto* e = std::get_if<Entry<R>>(&entries_[static_cast<std::size_t>(entry)].entry);
    GRAPHMOE_CHECK(e != nullptr, "DeferredChecks", "entry ", entry, " of '",
                   entries_[static_cast<std::size_t>(entry)].op,
                   "' was registered with another result type");
    e->report = std::move(report);
  }

  index_t size() const { return static_cast<index_t>(entries_.size()); }

  // Throws the error of entry `entry`, whose flag holds index `flagged` (>= 0): the op layer's
  // report, or, if the op layer attached none (a caller that read the result without
  // report_check), a message naming the op and the index.
  [[noreturn]] void fire(index_t entry, index_t flagged) const {
    const Slot& s = entries_.at(static_cast<std::size_t>(entry));
    std::visit(
        [&](const auto& e) {
          const auto result = e.resolve(flagged);
          if (e.report) e.report(result);
        },
        s.entry);
    throw_error(s.op, "bad input at flat index ", flagged,
                " (found by a deferred check whose op reported nothing)");
  }

 private:
  struct Slot {
    const char* op;
    std::variant<Entry<BadRow>, Entry<Offender>> entry;
  };
  std::vector<Slot> entries_;
};

// The thread's open batch, or null: set by a backend's with_deferred_checks for the body's
// duration (a body on another thread checks at once).
inline DeferredChecks*& active_deferred_checks() {
  thread_local DeferredChecks* active = nullptr;
  return active;
}

}  // namespace detail

// The op layer's way to act on a backend's content check: `report` (which throws) runs now when
// the backend found something, or is kept for the deferred check the backend left pending.
// `report` must not refer to the op's locals: it may run after the op has returned.
template <class R, class F>
void report_check(const R& result, F&& report) {
  if (result.pending()) {
    detail::DeferredChecks* batch = detail::active_deferred_checks();
    GRAPHMOE_CHECK(batch != nullptr, "report_check",
                   "a backend returned a pending check outside with_deferred_checks");
    batch->set_report<R>(result.deferred, std::function<void(const R&)>(std::forward<F>(report)));
  } else if (result.found()) {
    report(result);
  }
}

// Runs body with the content checks deferred where backend B defers them (see above). The
// default, for the CPU backend and any backend without its own overload: body() (checks at once).
template <Backend B, class F>
void with_deferred_checks(B, F&& body) {
  std::forward<F>(body)();
}

}  // namespace graphmoe
