// Strict validators for the examples' numeric options (docs/reliability.md, "Command lines").
//
// CLI11 2.1 converts integers with strtoll / strtoull without looking at errno, so an out-of-range
// value is silently clamped ("--steps 99999999999999999999" gives 2^63 - 1), "-1" gives 2^64 - 1
// for an unsigned option, and "010" is read as octal 8. Its Range validator converts the same way
// and lets NaN through. These validators run on the text before CLI11 converts it:
//
//   integer<T>(lo, hi)   a decimal integer (optional leading '-'), in [lo, hi]; anything else,
//                        including a value that does not fit 64 bits, is an error. The text is
//                        rewritten in canonical decimal, so that CLI11's own conversion (base 0)
//                        reads exactly the checked value ("010" is ten, not eight).
//   real(lo, hi)         a finite decimal floating-point number in [lo, hi].
//   positive_real(hi)    a finite number in (0, hi].
//   threads()            integer in [1, graphmoe::max_num_threads()], naming the limit's reason.
//
// CLI11 prefixes the message with the option's name ("--steps: ..."), prints it, and exits with
// a non-zero status before the program does any work.
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>

#include "common/divergence.hpp"
#include "graphmoe/core/threads.hpp"

namespace examples {

// Integers in [lo, hi]. T is the option's type; lo and hi must be representable in it.
template <class T>
CLI::Validator integer(T lo, T hi) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        // parsed as a 64-bit integer of T's signedness, then checked against [lo, hi]
        using Wide = std::conditional_t<std::is_unsigned_v<T>, std::uint64_t, std::int64_t>;
        const char* first = text.data();
        const char* last = text.data() + text.size();
        if constexpr (std::is_unsigned_v<T>) {
          // from_chars rejects a leading '-' for unsigned types; say why
          if (!text.empty() && text[0] == '-')
            return "value '" + text + "' is negative; expected an integer in " + range;
        }
        Wide value{};
        const std::from_chars_result r = std::from_chars(first, last, value, 10);
        if (text.empty() || r.ec == std::errc::invalid_argument || r.ptr != last)
          return "value '" + text + "' is not a decimal integer; expected an integer in " + range;
        if (r.ec == std::errc::result_out_of_range)
          return "value '" + text +
                 "' is out of range (it does not fit a 64-bit integer); expected an integer in " +
                 range;
        if (value < static_cast<Wide>(lo) || value > static_cast<Wide>(hi))
          return "value " + std::to_string(value) + " is out of range; expected an integer in " +
                 range;
        text = std::to_string(value);  // canonical: CLI11's base-0 conversion reads it as checked
        return {};
      },
      range);
}

namespace detail {
inline std::string real_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// A finite double in [lo, hi] (lo excluded when open_low).
inline CLI::Validator real_range(double lo, double hi, bool open_low) {
  const std::string range = (open_low ? "(" : "[") + real_text(lo) + ", " + real_text(hi) + "]";
  return CLI::Validator(
      [lo, hi, open_low, range](std::string& text) -> std::string {
        const char* first = text.data();
        const char* last = text.data() + text.size();
        if (first != last && *first == '+') ++first;  // from_chars takes no '+'; strtold does
        double value = 0;
        const auto r = std::from_chars(first, last, value, std::chars_format::general);
        if (text.empty() || r.ec == std::errc::invalid_argument || r.ptr != last)
          return "value '" + text + "' is not a number; expected a number in " + range;
        if (r.ec == std::errc::result_out_of_range || !std::isfinite(value))
          return "value '" + text + "' is out of range; expected a finite number in " + range;
        if (value < lo || value > hi || (open_low && value == lo))
          return "value " + text + " is out of range; expected a number in " + range;
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.17g", value);  // exactly the checked value
        text = buf;
        return {};
      },
      range);
}
}  // namespace detail

// A finite number in [lo, hi].
inline CLI::Validator real(double lo, double hi) { return detail::real_range(lo, hi, false); }

// A finite number in (0, hi].
inline CLI::Validator positive_real(double hi) { return detail::real_range(0.0, hi, true); }

// --threads: [1, graphmoe::max_num_threads()] (4 x the hardware threads; more crashes OpenMP).
inline CLI::Validator threads() {
  const int max = graphmoe::max_num_threads();
  const std::string why = " (the limit is " + std::to_string(max) + " = " +
                          std::to_string(graphmoe::kMaxThreadsPerHardwareThread) + " x the " +
                          std::to_string(graphmoe::hardware_threads()) +
                          " hardware threads of this machine)";
  CLI::Validator range = integer<int>(1, max);
  return CLI::Validator(
      [range, why](std::string& text) -> std::string {
        const std::string err = range(text);
        return err.empty() ? err : err + why;
      },
      "[1, " + std::to_string(max) + "]");
}

// Sane upper limits shared by the examples (docs/reliability.md lists them).
inline constexpr std::int64_t kMaxSteps = 1'000'000'000;  // steps, warmup, eval/checkpoint periods
inline constexpr std::int64_t kMaxBatch = 65'536;         // sequences or images per batch
inline constexpr std::int64_t kMaxSeq = 65'536;           // tokens per sequence
inline constexpr std::int64_t kMaxLayers = 1'024;
inline constexpr std::int64_t kMaxWidth = 65'536;         // d_model, d_ff
inline constexpr std::int64_t kMaxHeads = 4'096;
inline constexpr std::int64_t kMaxExperts = 4'096;        // experts, k, k_min, k_max
inline constexpr std::int64_t kMaxEpochs = 1'000'000;
inline constexpr std::int64_t kMaxCount = 1'000'000'000;  // vocabulary, example limits, batches
inline constexpr double kMaxLR = 10.0;
inline constexpr double kMaxCoef = 1e6;                   // tau, sigma, clip, loss coefficients

// A seed: any 64-bit unsigned integer, but nothing that does not fit.
inline CLI::Validator seed() {
  return integer<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max());
}

// --divergence-factor, --max-grad-norm, --max-loss (common/divergence.hpp).
inline void add_divergence_options(CLI::App& app, DivergenceOptions& o) {
  app.add_option("--divergence-factor", o.factor,
                 "stop when the smoothed loss exceeds this many times its lowest value (0 = off)")
      ->check(real(0, kMaxCoef))
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            const double v = std::stod(text);  // already checked: a finite number
            return v == 0 || v > 1 ? std::string() : "value " + text + " must be 0 (off) or > 1";
          },
          "0 or > 1"));
  app.add_option("--max-grad-norm", o.max_grad_norm,
                 "stop when the gradient norm before clipping exceeds this (0 = no limit)")
      ->check(real(0, 1e300));
  app.add_option("--max-loss", o.max_loss,
                 "stop when a training or evaluation loss exceeds this (0 = max(3 ln C, ln C + 5), C classes)")
      ->check(real(0, 1e300));
}

}  // namespace examples
