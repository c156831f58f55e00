// graphmoe/routing/graphs/blended.hpp: Blended<G>, a token graph G mixed with the identity by a
// learned weight,
//
//     p = (1 - w) r + w G r = r + w (G r - r),   w = clamp(a, 0, 1),   a: "<router>graph.blend"  (1)
//
// so that a router whose graph starts at a = 0 (the default) routes exactly as the router without
// a graph: p = r bit for bit (r + 0 (q - r) = r), the same experts, the same gates, the same model.
// This is how a pretrained MoE's router becomes graph-aware without changing the model's outputs
// at step 0 ("graph upcycling", docs/routers.md): load its weights into
// Router<LinearScorer, Blended<Similarity>, TopK> (BlendedSimilarityRouter, routing/router.hpp)
// and fine-tune; the gradient of a, sum_ij dp_ij (G r - r)_ij, is not zero at a = 0, so training
// moves a away from 0 as far as the graph helps the loss. w stays in [0, 1], so p is a convex
// combination of two distributions (each row sums to 1, every entry >= 0): at a bound, the
// gradient of a is dropped when a descent step would push a further out (a projected gradient;
// an optimizer's momentum may still carry a a little beyond, where w stays at the bound), so a
// graph the loss rejects sits at w = 0 and comes back as soon as the loss asks for it.
//
// G is any token graph (Similarity, Attention, a user's): its own options (cfg.options<G>()) and
// parameters (a learned temperature, the projection W_s) are G's, under the same prefix; the
// Blended<G> options hold only a's initial value. Gradients (ops/token_graph.hpp):
//   dq = w dp                  into G's backward (q = G r), which assigns dr and accumulates du
//                              and G's parameters' gradients
//   dr += (1 - w) dp           the direct path
//   da += sum_ij dp_ij (q_ij - r_ij)   (0 where a step would leave [0, 1], as above)
// Decoding (routing/concepts.hpp): G's routing cache and its decode, then (1); --explain's graph
// weights (GraphDecodeContext::weights) are G's own row, not mixed with the identity.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/mode.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/routing/concepts.hpp"
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

template <class G, class T, class B>
class BlendedImpl;

namespace detail {
// "blended-" followed by G::name, as a constant string.
template <class G>
struct BlendedName {
  static constexpr std::size_t prefix = 8;  // "blended-"
  static constexpr std::size_t inner = std::char_traits<char>::length(G::name);
  static constexpr std::array<char, prefix + inner + 1> value = [] {
    std::array<char, prefix + inner + 1> a{};
    const char* pre = "blended-";
    for (std::size_t i = 0; i < prefix; ++i) a[i] = pre[i];
    for (std::size_t i = 0; i < inner; ++i) a[prefix + i] = G::name[i];
    a[prefix + inner] = '\0';
    return a;
  }();
};
}  // namespace detail

// The policy tag: Router<Scorer, Blended<G>, Selector>.
template <class G>
struct Blended {
  static constexpr const char* name = detail::BlendedName<G>::value.data();
  static constexpr bool needs_attention_cache = graph_needs_attention_cache<G>();
  using inner_graph = G;
  using shares_options_of = G;  // G's options are read (and validated) too
  struct Options {
    // a's value at initialisation, in [0, 1]: 0 routes as the graph-free router, 1 as the graph
    // G itself.
    double init = 0.0;
    void validate() const {
      GRAPHMOE_CHECK(init >= 0 && init <= 1, "Blended::Options", "init must be in [0, 1], got ",
                     init);
    }
  };
  template <class T, class B>
  using impl = BlendedImpl<G, T, B>;
};

namespace detail {
// The decode members exist when G decodes (routing/concepts.hpp's GraphDecodes).
template <class G, class T, class B, bool = GraphDecodes<G, T, B>>
class BlendedDecode {};

template <class G, class T, class B>
class BlendedDecode<G, T, B, true> {
 public:
  using decode_cache = typename policy_impl_t<G, T, B>::decode_cache;
  void decode_init(decode_cache& c, const GraphDecodeDims& dims) const {
    self().inner_.decode_init(c, dims);
  }
  void decode(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphDecodeContext<T, B>& ctx,
              decode_cache& c, Tensor<T, B>& p) {
    auto& s = self();
    s.q_decode_ = Tensor<T, B>();  // steps differ in their rows
    s.inner_.decode(u, r, ctx, c, s.q_decode_);
    graph_blend(r, s.q_decode_, s.a_, p);
  }

 private:
  BlendedImpl<G, T, B>& self() { return static_cast<BlendedImpl<G, T, B>&>(*this); }
  const BlendedImpl<G, T, B>& self() const {
    return static_cast<const BlendedImpl<G, T, B>&>(*this);
  }
};
}  // namespace detail

template <class G, class T, class B>
class BlendedImpl : public detail::BlendedDecode<G, T, B> {
  static_assert(TokenGraphPolicy<G, T, B>, "graphmoe::Blended<G>: G must be a token graph policy");
  friend class detail::BlendedDecode<G, T, B>;

 public:
  using inner_type = policy_impl_t<G, T, B>;

  // G's parameters under `prefix` (G declares or configures itself), and "<prefix>blend" (1).
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    opts_ = cfg.options<Blended<G>>();
    validate_options(opts_);
    policy_detail::declare(inner_, arena, prefix, d_model, cfg);
    GRAPHMOE_CHECK(!arena.contains(prefix + "blend"), "Blended", "the graph '", G::name,
                   "' already declares a parameter '", prefix, "blend'");
    id_a_ = arena.add(prefix + "blend", Shape{1});
  }
  void bind(const ParameterArena<T, B>& arena) {
    policy_detail::bind(inner_, arena);
    a_ = arena.value(id_a_);
    da_ = arena.grad(id_a_);
  }
  void init(Rng& rng) {
    policy_detail::init(inner_, rng);
    fill(a_, static_cast<T>(opts_.init));
  }
  void set_mode(Mode mode)
    requires requires(inner_type& g, Mode m) { g.set_mode(m); }
  {
    inner_.set_mode(mode);
  }

  void forward(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphContext<T, B>& ctx,
               Tensor<T, B>& p) {
    check_bound();
    q_ = Tensor<T, B>();
    inner_.forward(u, r, ctx, q_);
    check_shape("Blended", "the inner graph's p", q_, r.shape());
    graph_blend(r, q_, a_, p);
  }

  void backward(const Tensor<T, B>& u, const Tensor<T, B>& r, const Tensor<T, B>& p,
                const Tensor<T, B>& dp, const GraphContext<T, B>& ctx, Tensor<T, B>& dr,
                Tensor<T, B>& du) {
    check_bound();
    check_shape("Blended::backward", "p", p, r.shape());
    GRAPHMOE_CHECK(q_.shape() == r.shape(), "Blended::backward",
                   "no forward of these tokens to take the gradient of");
    Tensor<T, B> dq;
    graph_blend_backward(r, q_, a_, dp, dq, da_);  // dq = w dp; da += <dp, q - r>
    inner_.backward(u, r, q_, dq, ctx, dr, du);     // dr assigned
    check_shape("Blended::backward", "the inner graph's dr", dr, r.shape());
    graph_blend_residual(a_, dp, dr);               // dr += (1 - w) dp
  }

  double mean_entropy() const { return inner_.mean_entropy(); }
  // The mean self weight of the mixed graph, (1 - w) + w mean_i G[i,i] (reads a: on a GPU, one
  // value copied back).
  double mean_self_weight() const
    requires requires(const inner_type& g) { g.mean_self_weight(); }
  {
    const double w = weight();
    return (1.0 - w) + w * inner_.mean_self_weight();
  }
  // The parameter a's current value, and the weight w = clamp(a, 0, 1) it mixes with (on a GPU,
  // one value copied back).
  double blend() const {
    return a_.empty() ? opts_.init : static_cast<double>(read_scalar(a_));
  }
  double weight() const { return std::clamp(blend(), 0.0, 1.0); }
  inner_type& inner() { return inner_; }
  const inner_type& inner() const { return inner_; }

 private:
  void check_bound() const {
    GRAPHMOE_CHECK(!a_.empty(), "Blended", "the graph is not bound: declare it, allocate the "
                   "arena and bind it first");
  }

  typename Blended<G>::Options opts_;
  inner_type inner_;
  index_t id_a_ = -1;
  Tensor<T, B> a_, da_;
  Tensor<T, B> q_;         // G r of the last forward, for backward
  Tensor<T, B> q_decode_;  // G r of the last decode step
};

}  // namespace graphmoe
