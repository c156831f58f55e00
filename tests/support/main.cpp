// doctest's main, compiled once into the graphmoe_test_main object library.
//
// One rule on top of doctest's: a run given a --test-case filter (every ctest entry is one, from
// doctest_discover_tests) that matches no test case fails. Without it, a case whose name the
// discovery cannot pass through (a ';' splits a CMake list) would run nothing and pass.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>

namespace {

int g_cases_started = 0;

struct CountCases : doctest::IReporter {
  explicit CountCases(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override { ++g_cases_started; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("graphmoe_count_cases", 1, CountCases);

bool has_test_case_filter(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    for (const char* prefix : {"--test-case=", "-tc=", "--dt-test-case=", "--dt-tc="})
      if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --help, --list-test-cases, ...
  if (rc == 0 && g_cases_started == 0 && has_test_case_filter(argc, argv)) {
    std::fprintf(stderr, "graphmoe tests: no test case matches the --test-case filter, so none "
                         "ran (a ';' in a test case's name splits its ctest entry)\n");
    return 1;
  }
  return rc;
}
