// Compile-fail test (tests/CMakeLists.txt, "compile_fail: ..."): a policy missing one member must
// not compile, and the compiler's first error must name that member. Which policy is incomplete is
// chosen by GRAPHMOE_CF_CASE:
//   1  a token graph without mean_entropy()
//   2  a scorer without backward(u, dgamma, du)
//   3  a selector without set_step(step)
//   4  a token graph without `impl`
//   5  (not a user policy) a causal LM with the ExpertChoice selector, which it refuses
//   6  a complete token graph without the incremental form, asked for a decode cache
//   7  (not a user policy) a layer with a compute type other than T on graphmoe::cpu, a backend
//      without mixed_precision
#include "graphmoe/routing/router.hpp"
#if GRAPHMOE_CF_CASE == 5 || GRAPHMOE_CF_CASE == 6
#include "graphmoe/models/transformer_lm.hpp"
#endif
#if GRAPHMOE_CF_CASE == 7
#include "graphmoe/layers/linear.hpp"
#endif

namespace user {
using graphmoe::index_t;
using graphmoe::Tensor;

template <class T, class B>
struct Graph {
  void configure(index_t, const graphmoe::RouterConfig&) {}
  void forward(const Tensor<T, B>&, const Tensor<T, B>& r, const graphmoe::GraphContext<T, B>&,
               Tensor<T, B>& p) { p = r.clone(); }
  void backward(const Tensor<T, B>&, const Tensor<T, B>&, const Tensor<T, B>&,
                const Tensor<T, B>& dp, const graphmoe::GraphContext<T, B>&, Tensor<T, B>& dr,
                Tensor<T, B>&) { dr = dp.clone(); }
#if GRAPHMOE_CF_CASE != 1
  double mean_entropy() const { return 0; }
#endif
};
struct MyGraph {
  static constexpr const char* name = "my-graph";
#if GRAPHMOE_CF_CASE != 4
  template <class T, class B>
  using impl = Graph<T, B>;
#endif
};

template <class T, class B>
struct Scorer : graphmoe::LinearScorer::impl<T, B> {
#if GRAPHMOE_CF_CASE == 2
  void backward() = delete;
#endif
};
struct MyScorer {
  static constexpr const char* name = "my-scorer";
  template <class T, class B>
  using impl = Scorer<T, B>;
};

template <class T, class B>
struct Selector : graphmoe::TopK::impl<T, B> {
#if GRAPHMOE_CF_CASE == 3
  void set_step() = delete;
#endif
};
struct MySelector {
  static constexpr const char* name = "my-selector";
  template <class T, class B>
  using impl = Selector<T, B>;
};
}  // namespace user

int main() {
#if GRAPHMOE_CF_CASE == 7
  graphmoe::Linear<float, graphmoe::cpu, double> linear;
  (void)linear;
#endif
#if GRAPHMOE_CF_CASE == 5
  graphmoe::TransformerLM<graphmoe::ExpertChoiceRouter, float> lm{graphmoe::TransformerLMConfig{}};
  (void)lm;
#endif
#if GRAPHMOE_CF_CASE == 6  // a complete graph without the incremental form: training compiles,
                           // decoding does not
  using Policy = graphmoe::Router<user::MyScorer, user::MyGraph, user::MySelector>;
  graphmoe::TransformerLM<Policy, float> lm{graphmoe::TransformerLMConfig{}};
  auto cache = lm.decode_cache(1);
  (void)cache;
#endif
  graphmoe::RouterImpl<graphmoe::Router<user::MyScorer, user::MyGraph, user::MySelector>, float> router;
  (void)router;
  return 0;
}
