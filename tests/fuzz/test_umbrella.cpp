// test_sanitize_umbrella: the public headers that no other test program includes, for the
// sanitizer job (scripts/sanitize.sh, docs/reliability.md): graphmoe/graphmoe.hpp (the
// umbrella include), graphmoe/routing/registry.hpp (run-time router names) and
// graphmoe/train/progress.hpp (the progress bar). Built only with GRAPHMOE_SANITIZE.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <type_traits>

#include "graphmoe/graphmoe.hpp"

using namespace graphmoe;

namespace {

// The registry name of policy P, from the type itself (not from registry.hpp).
template <class P>
std::string name_of() {
  if constexpr (std::is_same_v<P, SoftmaxRouter>) return "softmax";
  else if constexpr (std::is_same_v<P, SimilarityRouter>) return "similarity";
  else if constexpr (std::is_same_v<P, AttentionRouter>) return "attention";
  else if constexpr (std::is_same_v<P, XMoERouter>) return "xmoe";
  else if constexpr (std::is_same_v<P, SimilarityXMoERouter>) return "xmoe-similarity";
  else if constexpr (std::is_same_v<P, AttentionXMoERouter>) return "xmoe-attention";
  else if constexpr (std::is_same_v<P, SMoEDropoutRouter>) return "smoe-dropout";
  else if constexpr (std::is_same_v<P, SimilaritySMoEDropoutRouter>) return "smoe-dropout-similarity";
  else if constexpr (std::is_same_v<P, AttentionSMoEDropoutRouter>) return "smoe-dropout-attention";
  else if constexpr (std::is_same_v<P, SigmoidBiasRouter>) return "sigmoid-bias";
  else if constexpr (std::is_same_v<P, SimilaritySigmoidBiasRouter>) return "sigmoid-bias-similarity";
  else if constexpr (std::is_same_v<P, AttentionSigmoidBiasRouter>) return "sigmoid-bias-attention";
  else if constexpr (std::is_same_v<P, BlendedSimilarityRouter>) return "blended-similarity";
  else if constexpr (std::is_same_v<P, BlendedAttentionRouter>) return "blended-attention";
  else return "?";
}

// stderr of f() (file descriptor 2 sent to a temporary file while f runs).
template <class F>
std::string capture_stderr(F&& f) {
  char path[] = "/tmp/graphmoe-umbrella-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  std::fflush(stderr);
  const int saved = ::dup(2);
  REQUIRE(saved >= 0);
  REQUIRE(::dup2(fd, 2) == 2);
  f();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(fd);
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::unlink(path);
  return text;
}

}  // namespace

TEST_CASE("registry: every router name selects the policy of that name") {
  REQUIRE(router_names().size() == 14);
  for (const std::string& name : router_names()) {
    CAPTURE(name);
    CHECK(with_router(name, []<class P>() { return name_of<P>(); }) == name);
  }
}

TEST_CASE("registry: an unknown router name throws, listing the valid ones") {
  try {
    with_router("similarity ", []<class P>() { return name_of<P>(); });
    FAIL("no exception");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("unknown router 'similarity '") != std::string::npos);
    CHECK(msg.find("softmax, similarity, attention, xmoe") != std::string::npos);
  }
}

TEST_CASE("progress: clock and SI formatting") {
  CHECK(ProgressBar::clock_text(0) == "00:00");
  CHECK(ProgressBar::clock_text(83.4) == "01:23");
  CHECK(ProgressBar::clock_text(3661) == "1:01:01");
  CHECK(ProgressBar::si(812) == "812");
  CHECK(ProgressBar::si(8123) == "8.1k");
  CHECK(ProgressBar::si(2.5e6) == "2.5M");
}

TEST_CASE("progress: off a terminal, one plain line per tenth and one at the end") {
  const std::string out = capture_stderr([] {
    ProgressBar bar(20, "train", 0);
    for (std::int64_t i = 0; i <= 20; ++i) bar.update(i, "loss 1.0");
    bar.finish();
  });
  std::size_t lines = 0;
  for (char c : out) lines += c == '\n';
  CHECK(lines == 11);  // deciles 0, 1, ..., 10
  CHECK(out.find("train [") == 0);
  CHECK(out.find("20/20 100%  loss 1.0 | ETA") != std::string::npos);
  CHECK(out.find('\r') == std::string::npos);
}
