// The token-graph kernels' math on the host: backend/cuda/detail/token_graph_math.hpp (the
// online softmax, the causal masks, the entropy sums, the posterior logits, the head choice),
// compiled by g++ and driven in the kernels' tile order by plain loops that copy the kernels of
// backend/cuda/similarity_graph.cuh phase by phase (one "block" at a time, its "threads" as
// loops), and the Attention graph's per-head sequence of strided GEMMs (the per-head form of
// backend/cuda/attention_graph.cuh's attention_graph_forward / _backward, with the same row
// kernels). Everything is compared with the CPU GraphImpl, the reference,
// for float and double, causal and not, both tau modes, sequence lengths that are not multiples
// of the tiles (16 owned rows, 32 streamed columns, depth chunks of 32).
//
// The kernels run the same functions on the GPU, so this checks the tiling and online-softmax
// logic on machines without a GPU; tests/cuda/test_cuda_graphs.cu compares the kernels
// themselves with the CPU where a GPU exists. The per-sequence head choice runs through
// thrust::for_each on Thrust's CPP system (one call per sequence, as the kernel's one thread per
// sequence).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include "graphmoe/backend/cuda/detail/token_graph_math.hpp"
#include "graphmoe/ops/gemm.hpp"
#include "graphmoe/routing/token_graphs.hpp"
#include "routing/router_fixtures.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

#if THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CPP && \
    THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_OMP
#error "test_host_graphs needs THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP or _OMP"
#endif

using namespace graphmoe;
using graphmoe::test::random_attention_cache;
using graphmoe::test::random_normal;
using graphmoe::test::random_probs;
namespace gm = graphmoe::detail::graph_math;

namespace {

constexpr int kOwn = gm::kOwnTile, kStream = gm::kStreamTile, kDepth = gm::kDepthTile;

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

// max |got - ref| / max(max |ref|, floor); NaN anywhere gives +inf. Entropies use floor 1 (nats):
// nearly one-hot rows have entropies close to 0 whose fp rounding is absolute, not relative.
template <class T>
double normwise_error(const Tensor<T, cpu>& ref, const Tensor<T, cpu>& got, double floor = 0.0) {
  REQUIRE(ref.shape() == got.shape());
  double diff = 0, scale = 0;
  for (index_t i = 0; i < ref.numel(); ++i) {
    const double r = static_cast<double>(ref.data()[i]), g = static_cast<double>(got.data()[i]);
    if (std::isnan(r) || std::isnan(g)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(g - r));
    scale = std::max(scale, std::abs(r));
  }
  return diff == 0 ? 0.0 : diff / std::max(scale, floor);
}

template <class T>
void check_close(const std::string& what, const Tensor<T, cpu>& ref, const Tensor<T, cpu>& got,
                 double floor = 0.0) {
  const double err = normwise_error(ref, got, floor);
  CHECK_MESSAGE(err <= tolerance<T>(), what, ": error ", err, " > tolerance ", tolerance<T>());
}

template <class T>
Tensor<T, cpu> filled(const Shape& s, T v) {
  Tensor<T, cpu> t(s);
  t.fill(v);
  return t;
}

// ---- one block of the Similarity kernels, on the host -------------------------------------------

template <class T>
using Tile = T[kOwn][kStream + 1];

// similarity_tile_dot: out[a][b] = sum_k X[x0 + a] . Y[y0 + b] in depth chunks of kDepth, zero
// padded outside (nx, ny), k in order.
template <class T>
void tile_dot(const T* X, index_t ldx, index_t x0, int nx, const T* Y, index_t ldy, index_t y0,
              int ny, index_t depth, Tile<T>& out) {
  for (int a = 0; a < kOwn; ++a) {
    for (int b = 0; b < kStream; ++b) {
      T acc = T(0);
      for (index_t k0 = 0; k0 < depth; k0 += kDepth) {
        const index_t kn = std::min<index_t>(kDepth, depth - k0);
        for (int k = 0; k < kDepth; ++k) {
          const T x = a < nx && k < kn ? X[(x0 + a) * ldx + k0 + k] : T(0);
          const T y = b < ny && k < kn ? Y[(y0 + b) * ldy + k0 + k] : T(0);
          acc += x * y;
        }
      }
      out[a][b] = acc;
    }
  }
}

// similarity_tile_accumulate (factor nullptr = 1).
template <class T>
void tile_accumulate(const Tile<T>& W, int nx, int ny, const T* Y, index_t ldy, index_t y0,
                     index_t cols, T alpha, const T* factor, T* out, index_t ldo, index_t o0) {
  for (index_t c = 0; c < cols; ++c) {
    T acc[kOwn] = {};
    for (int b = 0; b < ny; ++b) {
      const T y = Y[(y0 + b) * ldy + c];
      for (int a = 0; a < kOwn; ++a) acc[a] += W[a][b] * y;
    }
    for (int a = 0; a < nx; ++a) {
      T& o = out[(o0 + a) * ldo + c];
      o = gm::rescale_add(o, factor != nullptr ? factor[a] : T(1), alpha * acc[a]);
    }
  }
}

template <class T>
T tile_max(const T* l, int n) {
  T m = gm::neg_inf<T>();
  for (int b = 0; b < n; ++b) m = std::max(m, l[b]);
  return m;
}

// similarity_forward_kernel over every block.
template <class T>
void similarity_forward_tiles(const Tensor<T>& u, const Tensor<T>& r, index_t len, T inv_tau,
                              bool causal, Tensor<T>& p, Tensor<T>& lse, Tensor<T>& entropy) {
  const index_t n = u.rows(), d = u.cols(), e = r.cols(), tiles = (len + kOwn - 1) / kOwn;
  for (index_t blk = 0; blk < n / len * tiles; ++blk) {
    const index_t seq = blk / tiles, i0 = blk % tiles * kOwn, s0 = seq * len;
    const int ni = static_cast<int>(std::min<index_t>(kOwn, len - i0));
    const index_t jend = gm::stream_end_for_rows(i0, ni, len, causal);
    gm::OnlineSoftmax<T> st[kOwn];
    Tile<T> L;
    T factor[kOwn];
    for (index_t j0 = 0; j0 < jend; j0 += kStream) {
      const int nj = static_cast<int>(std::min<index_t>(kStream, jend - j0));
      tile_dot(u.data(), d, s0 + i0, ni, u.data(), d, s0 + j0, nj, d, L);
      for (int a = 0; a < kOwn; ++a) {  // warp a / 2, lane b
        T l[kStream];
        for (int b = 0; b < kStream; ++b)
          l[b] = gm::masked_logit(L[a][b], inv_tau,
                                  gm::visible(i0 + a, j0 + b, len, causal) && b < nj);
        const T m = st[a].next_max(tile_max(l, kStream));
        T tsum = 0, tdot = 0;
        for (int b = 0; b < kStream; ++b) {
          L[a][b] = gm::softmax_weight(l[b], m);
          tsum += L[a][b];
          tdot += gm::entropy_weight(l[b], m);
        }
        factor[a] = st[a].rescale(m);
        st[a].merge(m, tsum, tdot);
      }
      tile_accumulate(L, ni, nj, r.data(), e, s0 + j0, e, T(1), factor, p.data(), e, s0 + i0);
    }
    for (int a = 0; a < ni; ++a) {
      lse.data()[s0 + i0 + a] = st[a].lse();
      entropy.data()[s0 + i0 + a] = st[a].entropy();
      for (index_t c = 0; c < e; ++c) p.data()[(s0 + i0 + a) * e + c] /= st[a].sum;
    }
  }
}

// similarity_backward_rows_kernel and similarity_backward_cols_kernel over every block.
template <class T>
void similarity_backward_tiles(const Tensor<T>& u, const Tensor<T>& r, const Tensor<T>& p,
                               const Tensor<T>& dp, const Tensor<T>& lse, index_t len, T inv_tau,
                               bool causal, bool to_u, Tensor<T>& dr, Tensor<T>& du) {
  const index_t n = u.rows(), d = u.cols(), e = r.cols(), tiles = (len + kOwn - 1) / kOwn;
  Tensor<T> c({n});
  for (index_t i = 0; i < n; ++i)
    for (index_t k = 0; k < e; ++k) c.data()[i] += dp.data()[i * e + k] * p.data()[i * e + k];
  Tile<T> A, B;
  if (to_u) {
    for (index_t blk = 0; blk < n / len * tiles; ++blk) {  // rows
      const index_t seq = blk / tiles, i0 = blk % tiles * kOwn, s0 = seq * len;
      const int ni = static_cast<int>(std::min<index_t>(kOwn, len - i0));
      const index_t jend = gm::stream_end_for_rows(i0, ni, len, causal);
      for (index_t j0 = 0; j0 < jend; j0 += kStream) {
        const int nj = static_cast<int>(std::min<index_t>(kStream, jend - j0));
        tile_dot(u.data(), d, s0 + i0, ni, u.data(), d, s0 + j0, nj, d, A);
        tile_dot(dp.data(), e, s0 + i0, ni, r.data(), e, s0 + j0, nj, e, B);
        for (int a = 0; a < kOwn; ++a) {
          for (int b = 0; b < kStream; ++b) {
            T ds = T(0);
            if (a < ni && b < nj && gm::visible(i0 + a, j0 + b, len, causal)) {
              const index_t i = s0 + i0 + a;
              const T l = gm::masked_logit(A[a][b], inv_tau, true);
              const T s = gm::prob_from_lse(l, lse.data()[i]);
              ds = gm::softmax_dlogit(s, B[a][b], c.data()[i]);
            }
            A[a][b] = ds;
          }
        }
        tile_accumulate(A, ni, nj, u.data(), d, s0 + j0, d, inv_tau, static_cast<const T*>(nullptr),
                        du.data(), d, s0 + i0);
      }
    }
  }
  for (index_t blk = 0; blk < n / len * tiles; ++blk) {  // columns
    const index_t seq = blk / tiles, j0 = blk % tiles * kOwn, s0 = seq * len;
    const int nj = static_cast<int>(std::min<index_t>(kOwn, len - j0));
    bool first = true;
    for (index_t i0 = gm::stream_begin_for_cols(j0, causal); i0 < len; i0 += kStream) {
      const int ni = static_cast<int>(std::min<index_t>(kStream, len - i0));
      tile_dot(u.data(), d, s0 + j0, nj, u.data(), d, s0 + i0, ni, d, A);
      if (to_u) tile_dot(r.data(), e, s0 + j0, nj, dp.data(), e, s0 + i0, ni, e, B);
      T factor[kOwn];
      for (int a = 0; a < kOwn; ++a) factor[a] = first ? T(0) : T(1);
      for (int a = 0; a < kOwn; ++a) {
        for (int b = 0; b < kStream; ++b) {
          const bool vis = a < nj && b < ni && gm::visible(i0 + b, j0 + a, len, causal);
          T s = T(0), ds = T(0);
          if (vis) {
            const index_t i = s0 + i0 + b;
            s = gm::prob_from_lse(gm::masked_logit(A[a][b], inv_tau, true), lse.data()[i]);
            if (to_u) ds = gm::softmax_dlogit(s, B[a][b], c.data()[i]);
          }
          A[a][b] = s;
          if (to_u) B[a][b] = ds;
        }
      }
      tile_accumulate(A, nj, ni, dp.data(), e, s0 + i0, e, T(1), static_cast<const T*>(factor),
                      dr.data(), e, s0 + j0);
      if (to_u)
        tile_accumulate(B, nj, ni, u.data(), d, s0 + i0, d, inv_tau, static_cast<const T*>(nullptr),
                        du.data(), d, s0 + j0);
      first = false;
    }
  }
}

struct SimilarityCase {
  index_t nseq, len, d, e;
};

template <class T>
void check_similarity(const SimilarityCase& sc, bool causal, TauMode mode, bool detach, Rng& rng) {
  CAPTURE(sc.nseq);
  CAPTURE(sc.len);
  CAPTURE(sc.d);
  CAPTURE(sc.e);
  CAPTURE(causal);
  CAPTURE(static_cast<int>(mode));
  CAPTURE(detach);
  const index_t n = sc.nseq * sc.len;
  RouterConfig cfg;
  cfg.num_experts = sc.e;
  cfg.causal = causal;
  cfg.options<Similarity>().tau_mode = mode;
  cfg.options<Similarity>().tau = mode == TauMode::Fixed ? 2.0 : 0.5;
  cfg.options<Similarity>().detach = detach;
  GraphImpl<Similarity, T> ref;
  ref.configure(sc.d, cfg);
  auto u = random_normal<T>({n, sc.d}, rng, 1.0);
  auto r = random_probs<T>(n, sc.e, rng);
  Tensor<T> p_ref;
  ref.forward(u, r, {sc.len, nullptr}, p_ref);

  const T inv_tau = static_cast<T>(1.0 / ref.tau());
  // p starts as NaN: the first column tile must assign it, not rescale it
  auto p = filled<T>({n, sc.e}, std::numeric_limits<T>::quiet_NaN());
  Tensor<T> lse({n}), ent({n});
  similarity_forward_tiles(u, r, sc.len, inv_tau, causal, p, lse, ent);
  check_close("p", p_ref, p);
  check_close("row entropy", ref.row_entropy(), ent, 1.0);
  double mean = 0;
  for (index_t i = 0; i < n; ++i) mean += static_cast<double>(ent.data()[i]);
  mean /= static_cast<double>(n);
  CHECK(std::abs(mean - ref.mean_entropy()) <= tolerance<T>() * std::max(1.0, ref.mean_entropy()));

  // lse against a direct evaluation
  Tensor<T> lse_direct({n});
  for (index_t i = 0; i < n; ++i) {
    const index_t s0 = i / sc.len * sc.len, il = i % sc.len;
    double mx = -std::numeric_limits<double>::infinity();
    std::vector<double> l;
    for (index_t j = 0; j < sc.len; ++j) {
      if (causal && j > il) break;
      double dot = 0;
      for (index_t k = 0; k < sc.d; ++k)
        dot += static_cast<double>(u.data()[i * sc.d + k]) * u.data()[(s0 + j) * sc.d + k];
      l.push_back(dot / ref.tau());
      mx = std::max(mx, l.back());
    }
    double s = 0;
    for (double x : l) s += std::exp(x - mx);
    lse_direct.data()[i] = static_cast<T>(mx + std::log(s));
  }
  check_close("lse", lse_direct, lse);

  auto dp = random_normal<T>({n, sc.e}, rng);
  auto du0 = random_normal<T>({n, sc.d}, rng);
  Tensor<T> dr_ref, du_ref = du0.clone();
  ref.backward(u, r, p_ref, dp, {sc.len, nullptr}, dr_ref, du_ref);
  auto dr = filled<T>({n, sc.e}, std::numeric_limits<T>::quiet_NaN());  // assigned
  Tensor<T> du = du0.clone();                                              // accumulated
  similarity_backward_tiles(u, r, p, dp, lse, sc.len, inv_tau, causal, !detach, dr, du);
  check_close("dr", dr_ref, dr);
  check_close("du", du_ref, du);
  if (detach) CHECK(normwise_error(du0, du) == 0.0);
}

// ---- the Attention graph, per head, with the row kernels of backend/cuda/attention_graph.cuh ----

// gemm.cuh's batched_gemm on the host: per batch, row-major C (m, n; ldc) =
// alpha op(A) op(B) + beta C, A with row stride lda, B with ldb, batch strides sa, sb, sc.
template <class T>
void graph_gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, T alpha, const T* A,
                index_t lda, index_t sa, const T* B, index_t ldb, index_t sb, T beta, T* C,
                index_t ldc, index_t sc, index_t batch) {
  for (index_t q = 0; q < batch; ++q) {
    const T* a = A + q * sa;
    const T* b = B + q * sb;
    T* c = C + q * sc;
    for (index_t i = 0; i < m; ++i) {
      for (index_t j = 0; j < n; ++j) {
        T acc = T(0);
        for (index_t x = 0; x < k; ++x) {
          const T av = ta == Trans::N ? a[i * lda + x] : a[x * lda + i];
          const T bv = tb == Trans::N ? b[x * ldb + j] : b[j * ldb + x];
          acc += av * bv;
        }
        T& out = c[i * ldc + j];
        out = beta == T(0) ? alpha * acc : alpha * acc + beta * out;
      }
    }
  }
}

template <class T>
struct HostAttention {
  RouterConfig cfg;
  index_t d_model = 0;
  Tensor<T> post, row_entropy;
  std::vector<std::int32_t> heads;

  bool head_used(index_t h) const {
    return std::find(heads.begin(), heads.end(), static_cast<std::int32_t>(h)) != heads.end();
  }

  // head_mean + attention_mean_finish_kernel
  void head_mean(const AttentionCache<T>& c, index_t h, Tensor<T>& m, Tensor<T>& msq) const {
    const index_t n = c.v.rows(), dvc = c.v.cols(), dh = dvc / c.num_heads, dm = d_model;
    graph_gemm(Trans::N, Trans::T, n, dm, dh, static_cast<T>(c.num_heads), c.v.data() + h * dh,
               dvc, 0, c.w_o.data() + h * dh, dvc, 0, T(0), m.data(), dm, 0, 1);
    for (index_t row = 0; row < n; ++row) {
      T s = T(0);
      for (index_t j = 0; j < dm; ++j) {
        T v = m.data()[row * dm + j];
        if (!c.b_o.empty()) v += c.b_o.data()[j];
        m.data()[row * dm + j] = v;
        s += v * v;
      }
      msq.data()[row] = s;
    }
  }

  // attention_head_query: q = H Aout W_o,h (N, dh)
  void head_query(const AttentionCache<T>& c, index_t h, Tensor<T>& q) const {
    const index_t n = c.v.rows(), dvc = c.v.cols(), dh = dvc / c.num_heads, dm = d_model;
    graph_gemm(Trans::N, Trans::N, n, dh, dm, static_cast<T>(c.num_heads), c.out.data(), dm, 0,
               c.w_o.data() + h * dh, dvc, 0, T(0), q.data(), dh, 0, 1);
  }

  // Returns "" or the error message's tail.
  std::string forward(const Tensor<T>& r, const AttentionCache<T>& c, index_t len, Tensor<T>& p) {
    const index_t n = r.rows(), nh = c.num_heads, nb = n / len, e = r.cols(), dm = d_model;
    post = filled<T>({n, len}, std::numeric_limits<T>::quiet_NaN());
    row_entropy = Tensor<T>({n});
    heads.assign(static_cast<std::size_t>(n), -1);
    const T inv_var = static_cast<T>(1.0 / (cfg.options<Attention>().sigma * cfg.options<Attention>().sigma));
    // attention_row_entropy_kernel
    Tensor<T> ent = c.row_entropy;
    if (ent.empty()) {
      ent = Tensor<T>({nb, nh, len});
      for (index_t row = 0; row < nb * nh * len; ++row) {
        T s = T(0);
        for (index_t j = 0; j < len; ++j) s += gm::plogp(c.probs.data()[row * len + j]);
        ent.data()[row] = -s;
      }
    }
    // attention_choose_heads_kernel: one call per sequence
    std::vector<double> prefix(static_cast<std::size_t>(nb * nh));
    const bool causal_choice = cfg.options<Attention>().head_choice == HeadChoice::PerSequenceCausal;
    thrust::for_each(thrust::cpp::par, thrust::counting_iterator<index_t>(0),
                     thrust::counting_iterator<index_t>(nb), [&](index_t b) {
                       gm::choose_heads(ent.data() + b * nh * len, nh, len, causal_choice,
                                        prefix.data() + b * nh, heads.data() + b * len);
                     });
    index_t first_bad = -1;
    const index_t dvc = c.v.cols(), dh = dvc / nh;
    Tensor<T> m({n, dm}), msq({n}), q({n, dh}), g({n, len});
    for (index_t h = 0; h < nh; ++h) {
      if (!head_used(h)) continue;
      head_mean(c, h, m, msq);
      head_query(c, h, q);
      graph_gemm(Trans::N, Trans::T, len, len, dh, T(1), q.data(), dh, len * dh,
                 c.v.data() + h * dh, dvc, len * dvc, T(0), g.data(), len, len * len, nb);
      // attention_posterior_rows_kernel
      for (index_t i = 0; i < n; ++i) {
        if (heads[static_cast<std::size_t>(i)] != h) continue;
        const index_t b = i / len, il = i % len;
        const T* arow = c.probs.data() + ((b * nh + h) * len + il) * len;
        T* row = post.data() + i * len;
        T mx = gm::neg_inf<T>();
        for (index_t j = 0; j < len; ++j) {
          row[j] = gm::posterior_logit(arow[j], g.data()[i * len + j], msq.data()[b * len + j],
                                       inv_var);
          mx = std::max(mx, row[j]);
        }
        if (!(mx > gm::neg_inf<T>())) {
          const index_t key = (b * nh + h) * len + il;
          if (first_bad < 0 || key < first_bad) first_bad = key;
          continue;
        }
        T s = 0, dot = 0;
        for (index_t j = 0; j < len; ++j) {
          const T l = row[j];
          row[j] = gm::softmax_weight(l, mx);
          s += row[j];
          dot += gm::entropy_weight(l, mx);
        }
        for (index_t j = 0; j < len; ++j) row[j] /= s;
        row_entropy.data()[i] = gm::log_of(s) - dot / s;
      }
    }
    if (first_bad >= 0)
      return "attention row " + std::to_string(first_bad % len) + " of sequence " +
             std::to_string(first_bad / (nh * len)) + " is all zero";
    graph_gemm(Trans::N, Trans::N, len, e, len, T(1), post.data(), len, len * len, r.data(), e,
               len * e, T(0), p.data(), e, len * e, nb);
    return "";
  }

  void backward(const Tensor<T>& r, const Tensor<T>& p, const Tensor<T>& dp, AttentionCache<T>& c,
                index_t len, Tensor<T>& dr) {
    const index_t n = r.rows(), nh = c.num_heads, nb = n / len, e = r.cols(), dm = d_model;
    const index_t dvc = c.v.cols(), dh = dvc / nh;
    graph_gemm(Trans::T, Trans::N, len, e, len, T(1), post.data(), len, len * len, dp.data(), e,
               len * e, T(0), dr.data(), e, len * e, nb);
    if (cfg.options<Attention>().detach) return;
    const T inv_var = static_cast<T>(1.0 / (cfg.options<Attention>().sigma * cfg.options<Attention>().sigma));
    const T fh = static_cast<T>(nh);
    Tensor<T> rowdot({n}), dl({n, len});
    for (index_t i = 0; i < n; ++i)
      for (index_t k = 0; k < e; ++k)
        rowdot.data()[i] += dp.data()[i * e + k] * p.data()[i * e + k];
    graph_gemm(Trans::N, Trans::T, len, len, e, T(1), dp.data(), e, len * e, r.data(), e, len * e,
               T(0), dl.data(), len, len * len, nb);
    for (index_t k = 0; k < n * len; ++k)  // attention_dlogit_kernel
      dl.data()[k] = post.data()[k] * (dl.data()[k] - rowdot.data()[k / len]);
    Tensor<T> dlh({n, len}), m({n, dm}), msq({n}), colsum({n}), q({n, dh}), dq({n, dh}),
        y({n, dh});
    for (index_t h = 0; h < nh; ++h) {
      if (!head_used(h)) continue;
      for (index_t k = 0; k < n * len; ++k)  // attention_head_rows_kernel
        dlh.data()[k] = heads[static_cast<std::size_t>(k / len)] == h ? dl.data()[k] : T(0);
      if (!c.dprobs.empty()) {
        for (index_t k = 0; k < n * len; ++k) {  // attention_dprobs_kernel
          const index_t i = k / len, j = k % len;
          if (heads[static_cast<std::size_t>(i)] != h) continue;
          const index_t at = ((i / len * nh + h) * len + i % len) * len + j;
          c.dprobs.data()[at] += gm::dprob_term(dl.data()[k], c.probs.data()[at]);
        }
      }
      head_mean(c, h, m, msq);
      head_query(c, h, q);
      for (index_t k = 0; k < n; ++k) {  // attention_column_sum_kernel
        T s = T(0);
        for (index_t i = 0; i < len; ++i) s += dlh.data()[(k / len * len + i) * len + k % len];
        colsum.data()[k] = s;
      }
      const T* vh = c.v.data() + h * dh;
      graph_gemm(Trans::N, Trans::N, len, dh, len, fh * inv_var, dlh.data(), len, len * len, vh,
                 dvc, len * dvc, T(0), dq.data(), dh, len * dh, nb);
      if (!c.dout.empty())
        graph_gemm(Trans::N, Trans::T, n, dm, dh, T(1), dq.data(), dh, 0, c.w_o.data() + h * dh,
                   dvc, 0, T(1), c.dout.data(), dm, 0, 1);
      if (!c.dw_o.empty()) {
        graph_gemm(Trans::T, Trans::N, dm, dh, n, T(1), c.out.data(), dm, 0, dq.data(), dh, 0,
                   T(1), c.dw_o.data() + h * dh, dvc, 0, 1);
        for (index_t k = 0; k < n * dh; ++k)  // attention_scale_rows_kernel
          y.data()[k] = colsum.data()[k / dh] * vh[(k / dh) * dvc + k % dh];
        graph_gemm(Trans::T, Trans::N, dm, dh, n, -fh * inv_var, m.data(), dm, 0, y.data(), dh,
                   0, T(1), c.dw_o.data() + h * dh, dvc, 0, 1);
      }
      if (!c.dv.empty()) {
        graph_gemm(Trans::T, Trans::N, len, dh, len, inv_var, dlh.data(), len, len * len,
                   q.data(), dh, len * dh, T(1), c.dv.data() + h * dh, dvc, len * dvc, nb);
        graph_gemm(Trans::N, Trans::N, n, dh, dm, T(1), m.data(), dm, 0, c.w_o.data() + h * dh,
                   dvc, 0, T(0), y.data(), dh, 0, 1);
        for (index_t k = 0; k < n * dh; ++k)  // attention_dv_mean_kernel
          c.dv.data()[(k / dh) * dvc + h * dh + k % dh] -=
              fh * inv_var * colsum.data()[k / dh] * y.data()[k];
      }
      if (!c.db_o.empty())
        graph_gemm(Trans::T, Trans::N, dm, index_t(1), n, -inv_var, m.data(), dm, 0,
                   colsum.data(), 1, 0, T(1), c.db_o.data(), 1, 0, 1);
    }
  }
};

template <class T>
AttentionCache<T> clone_cache(const AttentionCache<T>& c) {
  AttentionCache<T> k;
  k.num_heads = c.num_heads;
  k.probs = c.probs.clone();
  k.v = c.v.clone();
  k.w_o = c.w_o.clone();
  k.b_o = c.b_o.clone();
  k.out = c.out.clone();
  k.row_entropy = c.row_entropy.clone();
  k.dprobs = c.dprobs.clone();
  k.dv = c.dv.clone();
  k.dw_o = c.dw_o.clone();
  k.db_o = c.db_o.clone();
  k.dout = c.dout.clone();
  return k;
}

template <class T>
void check_attention(index_t nb, index_t len, index_t nh, index_t d, index_t e, bool causal,
                     HeadChoice choice, bool detach, bool with_bias, Rng& rng) {
  CAPTURE(nb);
  CAPTURE(len);
  CAPTURE(nh);
  CAPTURE(causal);
  CAPTURE(static_cast<int>(choice));
  CAPTURE(detach);
  CAPTURE(with_bias);
  const index_t n = nb * len;
  auto cache = random_attention_cache<T>(nb, len, nh, d, causal, rng, 2.0);
  // small likelihood terms so that the posterior is not one-hot and every term matters
  for (index_t i = 0; i < cache.out.numel(); ++i) cache.out.data()[i] *= T(0.3);
  if (!with_bias) cache.b_o = Tensor<T>();
  if (!with_bias) cache.db_o = Tensor<T>();
  // random initial gradient sinks: the graph accumulates into them
  for (Tensor<T>* g : {&cache.dprobs, &cache.dv, &cache.dw_o, &cache.db_o, &cache.dout})
    if (!g->empty()) *g = random_normal<T>(g->shape(), rng, 0.1);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.options<Attention>().sigma = 1.5;
  cfg.options<Attention>().head_choice = choice;
  cfg.options<Attention>().detach = detach;
  auto u = random_normal<T>({n, d}, rng);
  auto r = random_probs<T>(n, e, rng);
  auto dp = random_normal<T>({n, e}, rng);

  GraphImpl<Attention, T> ref;
  ref.configure(d, cfg);
  AttentionCache<T> ref_cache = clone_cache(cache);
  Tensor<T> p_ref, dr_ref, du_unused;
  ref.forward(u, r, {len, &ref_cache}, p_ref);
  ref.backward(u, r, p_ref, dp, {len, &ref_cache}, dr_ref, du_unused);

  HostAttention<T> host;
  host.cfg = cfg;
  host.d_model = d;
  auto p = filled<T>({n, e}, std::numeric_limits<T>::quiet_NaN());
  REQUIRE(host.forward(r, cache, len, p).empty());
  CHECK(std::vector<int>(host.heads.begin(), host.heads.end()) == ref.heads());
  check_close("p", p_ref, p);
  check_close("posterior", ref.posterior(), host.post);
  double mean = 0;
  for (index_t i = 0; i < n; ++i) mean += static_cast<double>(host.row_entropy.data()[i]);
  mean /= static_cast<double>(n);
  CHECK(std::abs(mean - ref.mean_entropy()) <= tolerance<T>() * std::max(1.0, ref.mean_entropy()));
  auto dr = filled<T>({n, e}, std::numeric_limits<T>::quiet_NaN());
  host.backward(r, p, dp, cache, len, dr);
  check_close("dr", dr_ref, dr);
  check_close("dprobs", ref_cache.dprobs, cache.dprobs);
  check_close("dv", ref_cache.dv, cache.dv);
  check_close("dw_o", ref_cache.dw_o, cache.dw_o);
  check_close("dout", ref_cache.dout, cache.dout);
  if (with_bias) check_close("db_o", ref_cache.db_o, cache.db_o);
}

}  // namespace

// ---- the element functions ----------------------------------------------------------------------

TEST_CASE_TEMPLATE("graph math: online softmax over tiles equals the softmax of the whole row", T,
                   float, double) {
  Rng rng(1);
  for (const index_t cols : {1, 5, 32, 33, 100}) {
    for (const int tile : {1, 7, 32}) {
      CAPTURE(cols);
      CAPTURE(tile);
      std::vector<T> l(static_cast<std::size_t>(cols));
      for (auto& x : l) x = static_cast<T>(rng.normal(0.0, 6.0));
      if (cols > 2) l[1] = gm::neg_inf<T>();  // a masked entry
      gm::OnlineSoftmax<T> st;
      double acc = 0;  // sum_j e_j v_j with v_j = j, rescaled like p
      for (index_t j0 = 0; j0 < cols; j0 += tile) {
        const index_t jn = std::min<index_t>(cols, j0 + tile);
        T tmax = gm::neg_inf<T>();
        for (index_t j = j0; j < jn; ++j) tmax = std::max(tmax, l[static_cast<std::size_t>(j)]);
        const T m = st.next_max(tmax);
        T s = 0, dt = 0, add = 0;
        for (index_t j = j0; j < jn; ++j) {
          const T w = gm::softmax_weight(l[static_cast<std::size_t>(j)], m);
          s += w;
          dt += gm::entropy_weight(l[static_cast<std::size_t>(j)], m);
          add += w * static_cast<T>(j);
        }
        acc = static_cast<double>(gm::rescale_add(static_cast<T>(acc), st.rescale(m), add));
        st.merge(m, s, dt);
      }
      // reference in double
      double mx = -std::numeric_limits<double>::infinity();
      for (T x : l) mx = std::max(mx, static_cast<double>(x));
      double s = 0, ev = 0, h = 0;
      for (index_t j = 0; j < cols; ++j) {
        const double w = std::exp(static_cast<double>(l[static_cast<std::size_t>(j)]) - mx);
        s += w;
        ev += w * static_cast<double>(j);
      }
      for (index_t j = 0; j < cols; ++j) {
        const double q = std::exp(static_cast<double>(l[static_cast<std::size_t>(j)]) - mx) / s;
        if (q > 0) h -= q * std::log(q);
      }
      const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
      CHECK(std::abs(static_cast<double>(st.lse()) - (mx + std::log(s))) <=
            tol * (1 + std::abs(mx)));
      CHECK(std::abs(static_cast<double>(st.entropy()) - h) <= tol * (1 + std::abs(mx)));
      CHECK(std::abs(acc / static_cast<double>(st.sum) - ev / s) <=
            tol * static_cast<double>(cols));
    }
  }
}

TEST_CASE("graph math: masks, tile bounds and the first-tile assignment") {
  // causal: j <= i; outside the sequence: never
  CHECK(gm::visible(3, 3, 5, true));
  CHECK(!gm::visible(3, 4, 5, true));
  CHECK(gm::visible(3, 4, 5, false));
  CHECK(!gm::visible(5, 0, 5, false));
  CHECK(!gm::visible(0, 5, 5, false));
  CHECK(gm::stream_end_for_rows(16, 16, 70, true) == 32);
  CHECK(gm::stream_end_for_rows(64, 6, 70, true) == 70);
  CHECK(gm::stream_end_for_rows(16, 16, 70, false) == 70);
  CHECK(gm::stream_begin_for_cols(48, true) == 48);
  CHECK(gm::stream_begin_for_cols(48, false) == 0);
  // masked logits contribute exactly 0, never NaN
  const double ninf = gm::neg_inf<double>();
  CHECK(gm::softmax_weight(ninf, 2.0) == 0.0);
  CHECK(gm::entropy_weight(ninf, 2.0) == 0.0);
  CHECK(gm::prob_from_lse(ninf, 2.0) == 0.0);
  CHECK(gm::masked_logit(3.0, 0.5, false) == ninf);
  CHECK(gm::masked_logit(3.0, 0.5, true) == 1.5);
  // factor 0 assigns: NaN in the output is dropped
  CHECK(gm::rescale_add(std::numeric_limits<double>::quiet_NaN(), 0.0, 2.0) == 2.0);
  CHECK(gm::rescale_add(3.0, 0.5, 2.0) == 3.5);
  // a fresh state rescales by 0 and merges without NaN; an all-masked tile leaves it unchanged
  gm::OnlineSoftmax<double> st;
  CHECK(st.rescale(1.0) == 0.0);
  st.merge(1.0, 2.0, -0.5);
  CHECK(st.sum == 2.0);
  CHECK(st.dot == -0.5);
  const double m = st.next_max(ninf);
  CHECK(m == 1.0);
  CHECK(st.rescale(m) == 1.0);
  st.merge(m, 0.0, 0.0);
  CHECK(st.sum == 2.0);
  CHECK(st.dot == -0.5);
  // posterior logits: -inf where A = 0, log A + (g - msq / 2) / sigma^2 elsewhere
  CHECK(gm::posterior_logit(0.0, 5.0, 1.0, 1.0) == ninf);
  CHECK(gm::posterior_logit(0.5, 3.0, 2.0, 0.25) == doctest::Approx(std::log(0.5) + 0.5));
  CHECK(gm::plogp(0.0) == 0.0);
  CHECK(gm::plogp(0.5) == doctest::Approx(0.5 * std::log(0.5)));
  CHECK(gm::dprob_term(3.0, 0.0) == 0.0);
  CHECK(gm::dprob_term(3.0, 0.5) == 6.0);
  // at or below attention_prior_floor a prior counts as 0 (no 1 / A overflow for denormals)
  CHECK(gm::posterior_logit(1e-20f, 50.0f, 1.0f, 1.0f) == -std::numeric_limits<float>::infinity());
  CHECK(gm::posterior_logit(1e-40f, 50.0f, 1.0f, 1.0f) == -std::numeric_limits<float>::infinity());
  CHECK(gm::dprob_term(1.0f, 1e-40f) == 0.0f);
  CHECK(gm::dprob_term(1.0f, 2e-19f) == doctest::Approx(5e18f));
  CHECK(gm::posterior_logit(1e-140, 0.0, 0.0, 1.0) == doctest::Approx(std::log(1e-140)));
}

TEST_CASE("graph math: head choice, whole sequence and causal prefix, ties to the lower head") {
  // 3 heads x 4 rows
  const double ent[] = {1.0, 1.0, 1.0, 1.0,    // head 0: mean 1
                        0.0, 3.0, 3.0, 3.0,    // head 1: prefix means 0, 1.5, 2, 2.25
                        1.0, 0.5, 1.5, 1.0};   // head 2: mean 1 (ties with head 0)
  double prefix[3];
  std::int32_t heads[4];
  gm::choose_heads(ent, 3, 4, false, prefix, heads);
  for (std::int32_t h : heads) CHECK(h == 0);
  gm::choose_heads(ent, 3, 4, true, prefix, heads);
  CHECK(heads[0] == 1);  // 0 < 1
  CHECK(heads[1] == 2);  // 0.75 < 1 < 1.5
  CHECK(heads[2] == 0);  // 1 == 1 (head 2), tie to head 0
  CHECK(heads[3] == 0);
}

// ---- the kernels' tile order against the CPU graphs ---------------------------------------------

TEST_CASE_TEMPLATE("host tiles vs cpu: Similarity forward and backward", T, float, double) {
  Rng rng(7);
  // lengths: below, at and across the tiles (16 rows, 32 columns); D across the depth chunk
  for (const SimilarityCase sc : {SimilarityCase{3, 1, 4, 3}, SimilarityCase{2, 7, 5, 4},
                                  SimilarityCase{2, 16, 33, 8}, SimilarityCase{1, 33, 6, 5},
                                  SimilarityCase{2, 50, 70, 3}, SimilarityCase{1, 70, 9, 40}}) {
    for (const bool causal : {false, true}) {
      for (const TauMode mode : {TauMode::Fixed, TauMode::ScaledSqrtD}) {
        check_similarity<T>(sc, causal, mode, false, rng);
      }
    }
    check_similarity<T>(sc, true, TauMode::Fixed, true, rng);
  }
}

TEST_CASE_TEMPLATE("host tiles vs cpu: Attention forward and backward", T, float, double) {
  Rng rng(8);
  for (const index_t len : {1, 5, 19}) {
    for (const bool causal : {false, true}) {
      for (const HeadChoice choice : {HeadChoice::PerSequence, HeadChoice::PerSequenceCausal}) {
        check_attention<T>(3, len, 3, 6, 4, causal, choice, false, true, rng);
      }
    }
  }
  check_attention<T>(2, 9, 2, 4, 3, true, HeadChoice::PerSequenceCausal, true, true, rng);
  check_attention<T>(2, 9, 4, 8, 5, false, HeadChoice::PerSequenceCausal, false, false, rng);
}

TEST_CASE("host tiles vs cpu: Attention heads from the cache's row entropies, all-zero rows") {
  Rng rng(9);
  const index_t nb = 3, len = 8, nh = 4, d = 4, e = 3;
  auto cache = random_attention_cache<double>(nb, len, nh, d, true, rng, 3.0);
  auto u = random_normal<double>({nb * len, d}, rng);
  auto r = random_probs<double>(nb * len, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.options<Attention>().head_choice = HeadChoice::PerSequenceCausal;
  // reversed entropies pick other heads; host and CPU agree exactly
  cache.row_entropy = random_normal<double>({nb, nh, len}, rng);
  GraphImpl<Attention, double> ref;
  ref.configure(d, cfg);
  Tensor<double> p_ref;
  ref.forward(u, r, {len, &cache}, p_ref);
  HostAttention<double> host;
  host.cfg = cfg;
  host.d_model = d;
  Tensor<double> p({nb * len, e});
  REQUIRE(host.forward(r, cache, len, p).empty());
  CHECK(std::vector<int>(host.heads.begin(), host.heads.end()) == ref.heads());
  check_close("p", p_ref, p);

  // an all-zero attention row of the chosen head: the same message as the CPU
  cache.row_entropy = Tensor<double>();
  cfg.options<Attention>().head_choice = HeadChoice::PerSequence;
  ref.configure(d, cfg);
  host.cfg = cfg;
  ref.forward(u, r, {len, &cache}, p_ref);
  const int h1 = ref.heads()[static_cast<std::size_t>(len)];  // sequence 1
  for (index_t j = 0; j < len; ++j) {
    cache.probs(1, h1, 5, j) = 0;
    cache.probs(2, ref.heads()[static_cast<std::size_t>(2 * len)], 3, j) = 0;
  }
  std::string cpu_msg;
  try {
    ref.forward(u, r, {len, &cache}, p_ref);
  } catch (const Error& err) {
    cpu_msg = err.what();
  }
  const std::string host_msg = host.forward(r, cache, len, p);
  CHECK(cpu_msg == "graphmoe::Attention: " + host_msg);
  CHECK(host_msg == "attention row 5 of sequence 1 is all zero");
}
