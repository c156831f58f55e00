// graphmoe/train/progress.hpp: a terminal progress bar with rate and ETA.
//
//   [##########..........]  512/1000  51%  loss 4.213 | 8.1k tok/s | ETA 01:23
//
// On a terminal it redraws one line at most 10 times a second; when stderr is not a terminal
// (CI logs, redirected output) it prints a plain line every 10% instead.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include <unistd.h>

namespace graphmoe {

class ProgressBar {
 public:
  explicit ProgressBar(std::int64_t total, std::string label = "", std::int64_t start = 0)
      : total_(total < 1 ? 1 : total), start_(start), label_(std::move(label)),
        tty_(isatty(fileno(stderr)) != 0), t0_(clock::now()), last_draw_(t0_) {}

  // done: items completed so far (of total); stats: free text such as "loss 4.2 | 8k tok/s".
  void update(std::int64_t done, const std::string& stats) {
    const auto now = clock::now();
    const double elapsed = seconds(t0_, now);
    const bool final = done >= total_;
    if (tty_) {
      if (!final && seconds(last_draw_, now) < 0.1) return;
    } else {
      const std::int64_t decile = done * 10 / total_;
      if (!final && decile == last_decile_) return;
      last_decile_ = decile;
    }
    last_draw_ = now;
    const double rate = done > start_ && elapsed > 0 ? static_cast<double>(done - start_) / elapsed : 0;
    const double eta = rate > 0 ? static_cast<double>(total_ - done) / rate : 0;
    const int width = 24;
    const int filled = static_cast<int>(width * static_cast<double>(done) / static_cast<double>(total_));
    std::string bar(static_cast<std::size_t>(width), '.');
    for (int i = 0; i < filled && i < width; ++i) bar[static_cast<std::size_t>(i)] = '#';
    std::fprintf(stderr, "%s%s[%s] %lld/%lld %3d%%  %s | ETA %s%s", tty_ ? "\r" : "",
                 label_.empty() ? "" : (label_ + " ").c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_),
                 static_cast<int>(100 * done / total_), stats.c_str(), clock_text(eta).c_str(),
                 tty_ ? "\033[K" : "\n");
    std::fflush(stderr);
  }
  // Ends the bar's line (on a terminal).
  void finish() {
    if (tty_) std::fprintf(stderr, "\n");
  }
  double elapsed_seconds() const { return seconds(t0_, clock::now()); }

  static std::string clock_text(double s) {
    const long long t = static_cast<long long>(std::llround(s));
    char buf[32];
    if (t >= 3600)
      std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", t / 3600, t / 60 % 60, t % 60);
    else
      std::snprintf(buf, sizeof buf, "%02lld:%02lld", t / 60, t % 60);
    return buf;
  }
  // 8123 -> "8.1k"
  static std::string si(double v) {
    char buf[32];
    if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.1fM", v / 1e6);
    else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
    else std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }

 private:
  using clock = std::chrono::steady_clock;
  static double seconds(clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  std::int64_t total_, start_;
  std::string label_;
  bool tty_;
  clock::time_point t0_, last_draw_;
  std::int64_t last_decile_ = -1;
};

}  // namespace graphmoe
