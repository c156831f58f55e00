// graphmoe/core/token_graph.hpp: the small types the token-graph ops (ops/token_graph.hpp) pass
// between routing/graphs/ and a backend: what a backend supports, the resolved options of one
// call, the learned parameters and the state one forward leaves for its backward.
//
// A state struct holds the fields the graph classes read (through their accessors: stores(),
// self_weight(), heads(), ...); a backend fills the ones it computes and leaves the others empty
// (each field says). What only a backend reads is its own: the member `backend`, of the type
// SimilarityGraphBackendState<T, B> / AttentionGraphBackendState<T, B>, empty unless B
// specialises it (the CPU's in backend/cpu/token_graph.hpp, CUDA's in backend/cuda/).
#pragma once

#include <cstdint>
#include <vector>

#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// What a backend's token graphs implement beyond the common core: a backend declares it as
//   TokenGraphSupport token_graph_support(MyBackend);   (found by argument-dependent lookup)
// and the op layer refuses an option the backend lacks, with one message for every backend.
struct TokenGraphSupport {
  bool learned_tau = false;        // Similarity: TauMode::Learned (the log_tau parameter)
  bool exclude_self = false;       // Similarity::Options::exclude_self
  bool projection = false;         // Similarity::Options::projection (the W_s parameter)
  bool reduced_precision = false;  // GraphPrecision::TF32 and ::BF16
};

// The arithmetic of the Similarity graph's (T, T) products (Similarity::Options::precision).
// Softmax, log-sum-exp, entropies and every accumulation stay in T (fp32 for float) whatever
// the choice; only the products' inputs are rounded. docs/routers.md ("Precision") gives the
// error of each against the CPU in double.
enum class GraphPrecision {
  Exact,  // T arithmetic throughout (fp32 or double): the reference, every backend
  TF32,   // float only: product inputs rounded to TF32 (10-bit mantissa), fp32 accumulation
  BF16,   // float only: product inputs rounded to bf16 (7-bit mantissa), fp32 accumulation
};

inline constexpr EnumName<GraphPrecision> kGraphPrecisionNames[] = {
    {GraphPrecision::Exact, "exact"}, {GraphPrecision::TF32, "tf32"}, {GraphPrecision::BF16, "bf16"}};
inline const char* graph_precision_name(GraphPrecision p) { return name_of(kGraphPrecisionNames, p); }
inline GraphPrecision graph_precision_from_name(std::string_view s) {
  return value_of("graph_precision_from_name", "graph precision", kGraphPrecisionNames, s);
}

// ---- Similarity ---------------------------------------------------------------------------------

// One Similarity forward / backward, its options resolved by the graph class.
struct SimilarityGraphArgs {
  index_t seq_len = 0;        // tokens per sequence
  index_t d_model = 0;        // D the graph was configured for (W_s is (D, D))
  bool causal = false;        // S[i, j] = 0 for j > i
  bool learned_tau = false;   // tau = exp(log_tau), read in forward
  bool exclude_self = false;  // S[i, i] left out of its row (a row with no other entry keeps it)
  bool projection = false;    // logits Q U^T / tau with Q = U W_s
  bool store = false;         // keep S for backward (graph_stores); a backend may always recompute
  bool detach = false;        // backward: no gradient into u, log_tau, W_s
  GraphPrecision precision = GraphPrecision::Exact;  // the products' arithmetic
};

// The Similarity graph's learned parameters (handles into the parameter arena; empty when the
// options declare none).
template <class T, class B>
struct SimilarityGraphParams {
  Tensor<T, B> log_tau, dlog_tau;  // (1)     TauMode::Learned
  Tensor<T, B> w_s, dw_s;          // (D, D)  Options::projection
};

// What a backend keeps of a token graph's forward for itself (the file comment): nothing unless
// the backend specialises these.
template <class T, class B>
struct SimilarityGraphBackendState {};
template <class T, class B>
struct AttentionGraphBackendState {};

// What a Similarity forward leaves for its backward (and for the graph's accessors).
template <class T, class B>
struct SimilarityGraphState {
  double tau = 1.0;       // the temperature of the last forward (set by configure, or learned)
  Tensor<T, B> lse;       // (N) row log-sum-exp of the logits                    every backend
  Tensor<T, B> entropy;   // (N) row entropy H(S[i, :])                           every backend
  Tensor<T, B> self;      // (N) S[i, i]; empty where a backend does not compute it (CUDA fused path)
  Tensor<T, B> s;         // (N, T) S, when the forward stored it (stores); else empty
  Tensor<T, B> q;         // (N, D) Q = U W_s under projection; else empty
  bool stores = false;    // whether s holds S; the backward follows
  SimilarityGraphBackendState<T, B> backend;
};

// ---- Attention ----------------------------------------------------------------------------------

// One Attention forward / backward, its options resolved by the graph class.
struct AttentionGraphArgs {
  index_t seq_len = 0;          // tokens per sequence
  index_t d_model = 0;          // D of the attention layer's output (w_o is (D, H dh))
  double sigma = 1.0;           // the Gaussian's standard deviation
  bool causal_heads = false;    // h* per token from the prefix (HeadChoice::PerSequenceCausal)
  bool store = false;           // keep A^p for backward (graph_stores); a backend may always keep it
  bool detach = false;          // backward: no gradient into the attention cache
  GraphPrecision precision = GraphPrecision::Exact;  // the (T, T) products' arithmetic
};

// What an Attention forward leaves for its backward (and for the graph's accessors).
template <class T, class B>
struct AttentionGraphState {
  Tensor<T, B> post;                // (N, T) A^p when stored (stores); else empty
  Tensor<T, B> self;                // (N) A^p[i, i]; empty where a backend does not compute it
  std::vector<double> row_entropy;  // (N) H(A^p[i, :]) on the host; empty where a backend keeps
                                    // the entropies on the device (CUDA)
  index_t tokens = 0;               // N of the last forward (set by ops/token_graph.hpp)
  index_t seq_len = 0;              // the sequence length of the last forward
  bool stores = false;              // whether post holds A^p; the backward follows
  AttentionGraphBackendState<T, B> backend;
};

}  // namespace graphmoe
