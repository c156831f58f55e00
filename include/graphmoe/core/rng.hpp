// graphmoe/core/rng.hpp: a counter-based random number generator, identical on every platform.
//
// The stream is Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2,
// 3"), the generator of cuRAND and of PyTorch's CUDA dropout. Counter-based means that the n-th
// random word is a pure function of (seed, n), so the CPU and CUDA backends draw the same numbers
// and any element of a stream can be computed independently.
//
// The stream, precisely:
//   key     = (low 32 bits of seed, high 32 bits of seed)
//   block b = philox4x32_10(counter = (low32(b), high32(b), 0, 0), key): four 32-bit words
//   word n  = block n / 4, word n % 4
//   uniform float  u = (word >> 8) * 2^-24                               in [0, 1)
//   uniform double u = (((word_a << 32) | word_b) >> 11) * 2^-53  (two consecutive words)
//   normal         z = sqrt(-2 ln(1 - u1)) * cos(2 pi u2)  (Box-Muller, two uniforms)
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "graphmoe/config.hpp"

namespace graphmoe {

// One Philox4x32-10 block: the raw function of Random123, counter and key given in full.
GRAPHMOE_HOST_DEVICE inline std::array<std::uint32_t, 4> philox4x32_10(
    std::array<std::uint32_t, 4> ctr, std::array<std::uint32_t, 2> key) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  std::uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kMul0) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(kMul1) * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

// Block `counter` of the stream for `seed`.
GRAPHMOE_HOST_DEVICE inline std::array<std::uint32_t, 4> philox4x32_10(std::uint64_t counter,
                                                                      std::uint64_t seed) {
  return philox4x32_10({static_cast<std::uint32_t>(counter), static_cast<std::uint32_t>(counter >> 32), 0u, 0u},
                       {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
}

// Word n of the stream for `seed` (see the header comment).
GRAPHMOE_HOST_DEVICE inline std::uint32_t philox_word(std::uint64_t seed, std::uint64_t n) {
  return philox4x32_10(n / 4, seed)[n % 4];
}

GRAPHMOE_HOST_DEVICE inline float uniform_float(std::uint32_t word) {
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

// A sequential view of the Philox stream: the n-th call to next_u32() returns word n.
class Rng {
 public:
  explicit Rng(std::uint64_t seed = 0, std::uint64_t position = 0) : seed_(seed), n_(position) {}

  std::uint64_t seed() const { return seed_; }
  // Index of the next word; save it with the seed to resume the stream exactly.
  std::uint64_t position() const { return n_; }
  void set_position(std::uint64_t n) { n_ = n; }
  // Reserves `count` words for a parallel consumer and returns the first one's index.
  std::uint64_t skip(std::uint64_t count) {
    const std::uint64_t first = n_;
    n_ += count;
    return first;
  }

  std::uint32_t next_u32() {
    if (n_ / 4 != cached_block_ || !cache_valid_) {
      cache_ = philox4x32_10(n_ / 4, seed_);
      cached_block_ = n_ / 4;
      cache_valid_ = true;
    }
    return cache_[static_cast<std::size_t>(n_++ % 4)];
  }
  // Uniform in [0, 1) with 24 random bits.
  float uniform() { return uniform_float(next_u32()); }
  // Uniform in [0, 1) with 53 random bits from two words (first word gives the high bits).
  double uniform_double() {
    const std::uint64_t hi = next_u32(), lo = next_u32();
    return static_cast<double>(((hi << 32) | lo) >> 11) * (1.0 / 9007199254740992.0);
  }
  // Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform_double(); }
  // Standard normal by Box-Muller from two uniform_double() draws (the sine branch is dropped so
  // that every draw consumes exactly four words).
  double normal() {
    const double u1 = uniform_double(), u2 = uniform_double();
    return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
  }
  double normal(double mean, double stddev) { return mean + stddev * normal(); }
  // Uniform integer in [0, n), by rejection (no modulo bias).
  std::uint32_t uniform_int(std::uint32_t n) {
    GRAPHMOE_CHECK(n > 0, "Rng::uniform_int", "range must be positive");
    const std::uint32_t limit = static_cast<std::uint32_t>((0x100000000ull / n) * n - 1);
    std::uint32_t w;
    do { w = next_u32(); } while (w > limit);
    return w % n;
  }

 private:
  std::uint64_t seed_;
  std::uint64_t n_;
  std::array<std::uint32_t, 4> cache_{};
  std::uint64_t cached_block_ = 0;
  bool cache_valid_ = false;
};

}  // namespace graphmoe
