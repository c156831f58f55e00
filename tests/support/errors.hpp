// tests/support/errors.hpp: the message of the graphmoe::Error a callable throws, for checks that
// must not stop the test case (CHECK, not REQUIRE_THROWS: the MPI tests keep every rank going).
#pragma once

#include <string>

#include "graphmoe/config.hpp"

namespace graphmoe::test {

// What f's graphmoe::Error says, or "(no graphmoe::Error)" when f throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no graphmoe::Error)";
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace graphmoe::test
