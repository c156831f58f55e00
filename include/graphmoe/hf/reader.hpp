// graphmoe/hf/reader.hpp: a Hugging Face model directory loaded into a TransformerLM (CPU).
//
//   auto lm = hf::load_lm<SoftmaxRouter, float>("path/to/model");   // unique_ptr<TransformerLM>
//
// or in two steps, to declare the model in an arena of one's own (beside other layers) or to
// change what does not change the computation (e.g. the graph's options of a graph router):
//
//   hf::Checkpoint ck = hf::Checkpoint::open(dir);   // config.json and every shard's header
//   TransformerLMConfig cfg = ck.config().lm;        // declare, allocate, bind a model with it
//   ck.load(lm);                                     // the weights, converted into its arena
//
// The directory holds config.json (hf/config.hpp: the architectures and keys) and either
// model.safetensors or model.safetensors.index.json with the shards it names (plain file names
// in the directory: a name with a '/' or "..", e.g. one outside the directory, is refused; links
// are followed, as in the Hugging Face cache). Checkpoint::open reads config.json and the headers
// only (docs/checkpoints.md's validation of every header) and checks, before anything is
// allocated from the files' sizes: every tensor the architecture needs is present with its
// exact shape and a floating dtype (F32, F16, BF16 or F64), no tensor is left over, the index
// and the shards agree. load() maps each shard read-only (mmap) and converts tensor by tensor
// into the model's parameters (BF16 and F16 exactly, F32 exactly into float and double, F64
// rounded into float), so the model is never held twice; it first reads every tensor once to
// refuse NaN and infinite values (and F64 values beyond float's range), so a failed load writes
// nothing. Every error is graphmoe::Error naming the file and the tensor or key.
//
// The router: Router<LinearScorer, Graph, TopK> (SoftmaxRouter is the families' own; a graph
// router loads the same weights and routes through its graph, a different model by design);
// DeepSeek-V3's: Router<SigmoidScorer, Graph, BiasBalancedTopK> (SigmoidBiasRouter), its
// e_score_correction_bias the selector's expert_bias. The other kind is refused by name. A
// token graph's own parameters (those whose name contains ".router.graph." under the model's
// prefix: Blended<G>'s "blocks.i.moe.router.graph.blend", a learned temperature "...graph.log_tau",
// a projection) are not Hugging Face tensors: load() leaves them as they are, so they keep the
// values the model was initialised with (load_lm initialises the model when its graph declares
// any, so that Blended's a starts at its init, 0: the loaded model then computes what
// SoftmaxRouter's does, bit for bit; without such parameters it allocates without drawing). The
// Hugging Face routers are a bias-free linear map, softmax in float, top-k, renormalised for
// Mixtral and where norm_topk_prob is set (Qwen3-MoE), not for OLMoE / Qwen2-MoE, unscaled: with
// T = float graphmoe computes the same in float (docs/reference/hugging-face.md).
//
// Names: model.embed_tokens.weight -> tok_emb.weight, lm_head.weight -> lm_head.weight (absent
// with tie_word_embeddings), model.norm.weight -> ln_f.weight, and per layer i
// model.layers.i.{input_layernorm, post_attention_layernorm} -> blocks.i.{ln1, ln2},
// self_attn.{q,k,v}_proj (weights, Qwen2's biases) -> attn.{q,k,v}_proj, self_attn.o_proj ->
// attn.out_proj, self_attn.{q,k}_norm -> attn.{q,k}_norm, a dense mlp.{gate,up}_proj -> the two
// halves of ffn.fc1 (gate rows first), mlp.down_proj -> ffn.fc2, the router (mlp.gate, Mixtral's
// block_sparse_moe.gate) -> moe.router.weight, expert e's gate and up projections (w1 and w3 for
// Mixtral) -> rows [2eF, 2eF + F) and [2eF + F, 2(e+1)F) of moe.experts.w1, its down projection
// (w2) -> moe.experts.w2[e], Qwen2-MoE's mlp.shared_expert.* -> shared_expert.fc1 / fc2 and
// mlp.shared_expert_gate -> shared_expert_gate. DeepSeek-V3: self_attn.{q_proj | q_a_proj,
// q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj -> the same names under
// attn., o_proj -> attn.out_proj, mlp.gate.e_score_correction_bias -> moe.router.selector.expert_bias,
// mlp.shared_experts.* -> shared_expert.fc1 / fc2; its multi-token-prediction layers
// (model.layers.L .. L + num_nextn_predict_layers - 1) are skipped, as transformers skips them.
//
// POSIX (open, mmap), little-endian hosts (train/checkpoint.hpp). The files must not change
// while load() runs (a file shortened under a mapping would raise SIGBUS).
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/hf/config.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace graphmoe::hf {

// Whether a router can hold a checkpoint's weights: a softmax top-k (Router<LinearScorer, Graph,
// TopK>, every family but DeepSeek-V3) or sigmoid scores with a selection bias
// (Router<SigmoidScorer, Graph, BiasBalancedTopK>, DeepSeek-V3); which of the two a family needs
// is sigmoid_routed(family).
template <class Router>
inline constexpr bool softmax_topk_router = std::is_same_v<typename Router::scorer, LinearScorer> &&
                                            std::is_same_v<typename Router::selector, TopK>;
template <class Router>
inline constexpr bool sigmoid_bias_router =
    std::is_same_v<typename Router::scorer, SigmoidScorer> &&
    std::is_same_v<typename Router::selector, BiasBalancedTopK>;
template <class Router>
inline constexpr bool loadable_router = softmax_topk_router<Router> || sigmoid_bias_router<Router>;

namespace detail {
// Refuses Router for a model of family f (at `where`, a file or directory) when it is of the
// other kind than the family's; a dense model (moe false) takes either. Loading and saving.
template <class Router>
void check_router_kind(const char* op, const std::string& where, Family f, bool moe) {
  if (!moe) return;
  GRAPHMOE_CHECK(sigmoid_bias_router<Router> == sigmoid_routed(f), op, "'", where, "': ",
                 architecture_name(f), "'s router ",
                 sigmoid_routed(f)
                     ? "scores with sigmoids and a selection bias: it takes a "
                       "Router<SigmoidScorer, Graph, BiasBalancedTopK> (SigmoidBiasRouter, "
                       "SimilaritySigmoidBiasRouter, AttentionSigmoidBiasRouter), not "
                     : "is a softmax top-k: it takes a Router<LinearScorer, Graph, TopK> "
                       "(SoftmaxRouter, SimilarityRouter, AttentionRouter), not ",
                 Router::name());
}
}  // namespace detail

// One tensor a checkpoint holds, and the part of a graphmoe parameter it fills.
struct TensorSlot {
  std::string name;    // in the checkpoint, e.g. "model.layers.0.mlp.gate_proj.weight"
  Shape shape;         // its shape there
  std::string param;   // the parameter it fills (without the model's prefix), "blocks.0.ffn.fc1.weight"
  index_t offset = 0;  // the first element it fills (row-major); it fills shape.numel() elements
};

// Calls f(const TensorSlot&) for every tensor a checkpoint of `mc` holds, layer by layer.
template <class F>
void for_each_tensor(const ModelConfig& mc, F&& f) {
  const TransformerLMConfig& c = mc.lm;
  const index_t d = c.d_model, v = c.vocab_size;
  const index_t dh = c.attention.head_dim_for(c.d_model, c.num_heads), dq = c.num_heads * dh;
  const index_t hkv = c.attention.num_kv_heads == 0 ? c.num_heads : c.attention.num_kv_heads;
  const index_t dkv = hkv * dh;
  auto slot = [&](std::string name, Shape shape, std::string param, index_t offset = 0) {
    f(TensorSlot{std::move(name), shape, std::move(param), offset});
  };
  // a SwiGLU MLP of width w: gate and up into the halves of fc1, down into fc2
  auto mlp = [&](const std::string& hf, const std::string& gm, index_t w, const char* gate,
                 const char* up, const char* down) {
    slot(hf + gate + ".weight", Shape{w, d}, gm + "fc1.weight", 0);
    slot(hf + up + ".weight", Shape{w, d}, gm + "fc1.weight", w * d);
    slot(hf + down + ".weight", Shape{d, w}, gm + "fc2.weight");
  };
  slot("model.embed_tokens.weight", Shape{v, d}, "tok_emb.weight");
  for (index_t i = 0; i < c.num_layers; ++i) {
    const std::string L = "model.layers." + std::to_string(i) + ".";
    const std::string G = "blocks." + std::to_string(i) + ".";
    slot(L + "input_layernorm.weight", Shape{d}, G + "ln1.weight");
    slot(L + "post_attention_layernorm.weight", Shape{d}, G + "ln2.weight");
    const std::string A = L + "self_attn.";
    if (c.attention.latent()) {  // DeepSeek-V3's multi-head latent attention
      const AttentionOptions& a = c.attention;
      const index_t h = c.num_heads, dqk = a.qk_nope_head_dim + a.qk_rope_head_dim;
      if (a.q_lora_rank == 0) {
        slot(A + "q_proj.weight", Shape{h * dqk, d}, G + "attn.q_proj.weight");
      } else {
        slot(A + "q_a_proj.weight", Shape{a.q_lora_rank, d}, G + "attn.q_a_proj.weight");
        slot(A + "q_a_layernorm.weight", Shape{a.q_lora_rank}, G + "attn.q_a_layernorm.weight");
        slot(A + "q_b_proj.weight", Shape{h * dqk, a.q_lora_rank}, G + "attn.q_b_proj.weight");
      }
      slot(A + "kv_a_proj_with_mqa.weight", Shape{a.kv_lora_rank + a.qk_rope_head_dim, d},
           G + "attn.kv_a_proj_with_mqa.weight");
      slot(A + "kv_a_layernorm.weight", Shape{a.kv_lora_rank}, G + "attn.kv_a_layernorm.weight");
      slot(A + "kv_b_proj.weight", Shape{h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank},
           G + "attn.kv_b_proj.weight");
      slot(A + "o_proj.weight", Shape{d, h * a.v_head_dim}, G + "attn.out_proj.weight");
    } else {
      slot(A + "q_proj.weight", Shape{dq, d}, G + "attn.q_proj.weight");
      slot(A + "k_proj.weight", Shape{dkv, d}, G + "attn.k_proj.weight");
      slot(A + "v_proj.weight", Shape{dkv, d}, G + "attn.v_proj.weight");
      slot(A + "o_proj.weight", Shape{d, dq}, G + "attn.out_proj.weight");
    }
    if (c.attention.qkv_bias) {
      slot(A + "q_proj.bias", Shape{dq}, G + "attn.q_proj.bias");
      slot(A + "k_proj.bias", Shape{dkv}, G + "attn.k_proj.bias");
      slot(A + "v_proj.bias", Shape{dkv}, G + "attn.v_proj.bias");
    }
    if (c.attention.qk_norm != QKNorm::None) {
      const bool full = c.attention.qk_norm == QKNorm::Full;
      slot(A + "q_norm.weight", Shape{full ? dq : dh}, G + "attn.q_norm.weight");
      slot(A + "k_norm.weight", Shape{full ? dkv : dh}, G + "attn.k_norm.weight");
    }
    if (!c.is_moe_layer(i)) {
      mlp(L + "mlp.", G + "ffn.", c.d_ff, "gate_proj", "up_proj", "down_proj");
      continue;
    }
    const index_t e = c.router.num_experts, w = c.experts_width();
    const bool mixtral = mc.family == Family::Mixtral;
    const std::string M = L + (mixtral ? "block_sparse_moe." : "mlp.");
    slot(M + "gate.weight", Shape{e, d}, G + "moe.router.weight");
    if (sigmoid_routed(mc.family))  // DeepSeek-V3's selection bias
      slot(M + "gate.e_score_correction_bias", Shape{e}, G + "moe.router.selector.expert_bias");
    for (index_t x = 0; x < e; ++x) {
      const std::string X = M + "experts." + std::to_string(x) + ".";
      slot(X + (mixtral ? "w1" : "gate_proj") + ".weight", Shape{w, d}, G + "moe.experts.w1",
           x * 2 * w * d);
      slot(X + (mixtral ? "w3" : "up_proj") + ".weight", Shape{w, d}, G + "moe.experts.w1",
           x * 2 * w * d + w * d);
      slot(X + (mixtral ? "w2" : "down_proj") + ".weight", Shape{d, w}, G + "moe.experts.w2",
           x * d * w);
    }
    if (c.shared_d_ff > 0) {
      mlp(M + (mc.family == Family::DeepseekV3 ? "shared_experts." : "shared_expert."),
          G + "shared_expert.", c.shared_d_ff, "gate_proj", "up_proj", "down_proj");
      if (c.shared_expert_gate)
        slot(M + "shared_expert_gate.weight", Shape{1, d}, G + "shared_expert_gate.weight");
    }
  }
  slot("model.norm.weight", Shape{d}, "ln_f.weight");
  if (!c.tie_embeddings) slot("lm_head.weight", Shape{v, d}, "lm_head.weight");
}

namespace detail {

inline float bf16_to_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// IEEE half to float, exactly (subnormals, infinities and NaN included).
inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  std::uint32_t u;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal: man 2^-24
    return sign != 0 ? -f : f;
  }
  if (exp == 31)
    u = sign | 0x7f800000u | (man << 13);
  else
    u = sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Element i of a tensor's raw little-endian bytes, as double (exact for every accepted dtype).
inline double element_at(const std::uint8_t* p, DType dt, std::size_t i) {
  switch (dt) {
    case DType::F32: {
      float x;
      std::memcpy(&x, p + 4 * i, 4);
      return x;
    }
    case DType::F64: {
      double x;
      std::memcpy(&x, p + 8 * i, 8);
      return x;
    }
    case DType::BF16: {
      std::uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return bf16_to_float(b);
    }
    case DType::F16: {
      std::uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return f16_to_float(b);
    }
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}

// The first element of n that is not finite in T (NaN, an infinity, or an F64 value beyond
// float's range when T = float), or n when there is none. The 16- and 32-bit formats are scanned
// in blocks whose test has no branch (vectorised: a tensor is read at memory speed), and only a
// block that holds a bad element is searched element by element.
template <class T>
std::size_t first_bad_element(const std::uint8_t* p, DType dt, std::size_t n) {
  constexpr std::size_t kBlock = 4096;
  // every element of [0, n) whose exponent bits (mask) are all ones: NaN or an infinity
  auto scan = [&](auto word, std::uint32_t mask) -> std::size_t {
    using W = decltype(word);
    for (std::size_t b0 = 0; b0 < n; b0 += kBlock) {
      const std::size_t b1 = std::min(n, b0 + kBlock);
      std::uint32_t any = 0;
      for (std::size_t i = b0; i < b1; ++i) {
        W u;
        std::memcpy(&u, p + sizeof(W) * i, sizeof(W));
        any |= static_cast<std::uint32_t>((u & mask) == mask);
      }
      if (any == 0) continue;
      for (std::size_t i = b0; i < b1; ++i) {
        W u;
        std::memcpy(&u, p + sizeof(W) * i, sizeof(W));
        if ((u & mask) == mask) return i;
      }
    }
    return n;
  };
  switch (dt) {
    case DType::F32: return scan(std::uint32_t{}, 0x7f800000u);
    case DType::BF16: return scan(std::uint16_t{}, 0x7f80u);
    case DType::F16: return scan(std::uint16_t{}, 0x7c00u);
    case DType::F64:
      for (std::size_t i = 0; i < n; ++i) {
        double x;
        std::memcpy(&x, p + 8 * i, 8);
        if (!std::isfinite(static_cast<T>(x)) || !std::isfinite(x)) return i;
      }
      return n;
    default: return 0;
  }
}

// dst[0, n) = the n elements at p of dtype dt, converted to T.
template <class T>
void convert_elements(const std::uint8_t* p, DType dt, std::size_t n, T* dst) {
  if ((dt == DType::F32 && std::is_same_v<T, float>) ||
      (dt == DType::F64 && std::is_same_v<T, double>)) {
    std::memcpy(dst, p, n * sizeof(T));
    return;
  }
  switch (dt) {
    case DType::F32:
      for (std::size_t i = 0; i < n; ++i) {
        float x;
        std::memcpy(&x, p + 4 * i, 4);
        dst[i] = static_cast<T>(x);
      }
      return;
    case DType::F64:
      for (std::size_t i = 0; i < n; ++i) {
        double x;
        std::memcpy(&x, p + 8 * i, 8);
        dst[i] = static_cast<T>(x);
      }
      return;
    case DType::BF16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = static_cast<T>(bf16_to_float(b));
      }
      return;
    case DType::F16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = static_cast<T>(f16_to_float(b));
      }
      return;
    default: return;
  }
}

// A whole file mapped read-only; unmapped on scope exit.
class MappedFile {
 public:
  MappedFile(const char* op, const std::string& path, std::uint64_t expected_size) {
    struct stat st {};
    fd_ = graphmoe::detail::open_regular_for_reading(op, path, st);
    size_ = static_cast<std::size_t>(st.st_size);
    if (static_cast<std::uint64_t>(st.st_size) != expected_size) {
      ::close(fd_);
      graphmoe::detail::throw_error(op, "'", path, "' changed since the checkpoint was opened (",
                                    st.st_size, " bytes, were ", expected_size, ")");
    }
    void* a = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (a == MAP_FAILED) {
      const int e = errno;
      ::close(fd_);
      graphmoe::detail::throw_error(op, "cannot map '", path, "': ", graphmoe::detail::errno_text(e));
    }
    addr_ = static_cast<const std::uint8_t*>(a);
    ::madvise(a, size_, MADV_SEQUENTIAL);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (addr_ != nullptr) ::munmap(const_cast<std::uint8_t*>(addr_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  const std::uint8_t* data() const { return addr_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  const std::uint8_t* addr_ = nullptr;
  std::size_t size_ = 0;
};

inline bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
inline bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

inline std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

inline bool same_entries(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  if (a.entries.size() != b.entries.size() || a.data_start != b.data_start) return false;
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    const auto &x = a.entries[i], &y = b.entries[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.begin != y.begin ||
        x.end != y.end)
      return false;
  }
  return true;
}

}  // namespace detail

// A Hugging Face model directory, checked (see the header comment); load() fills a model.
class Checkpoint {
 public:
  static constexpr const char* op = "hf::Checkpoint::open";
  static constexpr const char* load_op = "hf::Checkpoint::load";

  static Checkpoint open(const std::string& dir) {
    if (!detail::is_directory(dir)) {
      graphmoe::detail::require_no_broken_link(op, dir);
      graphmoe::detail::throw_error(op, "'", dir, "' is not a directory");
    }
    Checkpoint ck;
    ck.dir_ = dir;
    ck.config_ = read_config(detail::join(dir, "config.json"));
    ck.find_files();
    ck.read_headers();
    ck.match_tensors();
    return ck;
  }

  const ModelConfig& config() const { return config_; }

  // Refuses (at compile time) a router no checkpoint has, and (here) one of the other kind than
  // the family's: a softmax top-k (Router<LinearScorer, Graph, TopK>) for every family but
  // DeepSeek-V3, sigmoid scores with a selection bias (Router<SigmoidScorer, Graph,
  // BiasBalancedTopK>) for DeepSeek-V3. A dense model (Llama) takes either.
  template <class Router>
  void require_router() const {
    static_assert(loadable_router<Router>,
                  "graphmoe::hf::Checkpoint: a Hugging Face MoE router is a linear map to "
                  "softmax scores and a top-k choice (Router<LinearScorer, Graph, TopK>: "
                  "SoftmaxRouter, SimilarityRouter, AttentionRouter) or, for DeepSeek-V3, to "
                  "sigmoid scores with a selection bias (Router<SigmoidScorer, Graph, "
                  "BiasBalancedTopK>: SigmoidBiasRouter and its graph forms)");
    detail::check_router_kind<Router>("hf::Checkpoint", config_.path, config_.family,
                                      config_.lm.layout != MoELayout::Dense);
  }
  const std::string& dir() const { return dir_; }
  // The weight files (model.safetensors, or the shards the index names, in name order), and the
  // index ("" without one).
  const std::vector<std::string>& files() const { return files_; }
  const std::string& index_path() const { return index_; }
  // The number of tensors read, and their elements.
  std::size_t tensor_count() const { return plan_.size(); }
  std::uint64_t element_count() const {
    std::uint64_t n = 0;
    for (const auto& p : plan_) n += static_cast<std::uint64_t>(p.slot.shape.numel());
    return n;
  }

  // Converts every tensor into lm's parameters. lm must be bound (CPU) and declared with a
  // config that computes what config().lm does (sizes, norms, attention, experts; the router's
  // graph and training-only fields may differ); every one of its parameters must be filled by
  // the checkpoint, except the token graph's own (a name containing ".router.graph." after the
  // model's prefix), which keep their values: initialise them first (a model declared without
  // init holds zeros there). Checks everything, including every value, before writing any
  // parameter.
  template <class Router, class T>
  void load(TransformerLM<Router, T, cpu>& lm) const {
    require_router<Router>();
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "graphmoe::hf::Checkpoint::load: T must be float or double");
    GRAPHMOE_CHECK(lm.bound(), load_op, "the model is not bound: declare it, allocate its arena "
                   "and bind it first (or use hf::load_lm)");
    check_same_model(lm.config());
    ParameterArena<T, cpu>& arena = lm.arena();
    const auto [first, end] = lm.parameter_ids();
    const std::string& prefix = lm.prefix();

    // Where each tensor goes, and that the tensors fill every parameter exactly.
    std::vector<std::pair<index_t, index_t>> dest(plan_.size());  // (parameter id, offset)
    std::vector<std::vector<std::pair<index_t, index_t>>> cover(static_cast<std::size_t>(end - first));
    for (std::size_t i = 0; i < plan_.size(); ++i) {
      const TensorSlot& s = plan_[i].slot;
      const std::string name = prefix + s.param;
      GRAPHMOE_CHECK(arena.contains(name), load_op, "the model has no parameter '", name,
                     "' for tensor '", s.name, "' of '", files_[plan_[i].file], "'");
      const index_t id = arena.find(name);
      GRAPHMOE_CHECK(id >= first && id < end, load_op, "parameter '", name,
                     "' is not one of the model's own (ids ", first, "..", end, ")");
      const ParameterInfo& p = arena.params()[static_cast<std::size_t>(id)];
      GRAPHMOE_CHECK(!p.sharded(), load_op, "parameter '", name, "' is an expert shard: loading "
                     "into an expert-parallel model is not supported");
      GRAPHMOE_CHECK(s.offset + s.shape.numel() <= p.shape.numel(), load_op, "tensor '", s.name,
                     "' of shape ", s.shape, " does not fit parameter '", name, "' of shape ",
                     p.shape, " at element ", s.offset);
      dest[i] = {id, s.offset};
      cover[static_cast<std::size_t>(id - first)].emplace_back(s.offset, s.shape.numel());
    }
    for (index_t id = first; id < end; ++id) {
      auto& c = cover[static_cast<std::size_t>(id - first)];
      const ParameterInfo& p = arena.params()[static_cast<std::size_t>(id)];
      if (c.empty() && is_graph_parameter(p.name, prefix)) continue;  // keeps its value
      GRAPHMOE_CHECK(!c.empty(), load_op, "parameter '", p.name, "' of shape ", p.shape,
                     " of the model has no tensor in the checkpoint '", dir_,
                     "' (a Hugging Face ", config_.architecture, " does not have it)");
      std::sort(c.begin(), c.end());
      index_t at = 0;
      for (const auto& [off, n] : c) {
        GRAPHMOE_CHECK(off == at, load_op, "parameter '", p.name, "': the checkpoint's tensors ",
                       off < at ? "overlap" : "leave a gap", " at element ", std::min(off, at));
        at += n;
      }
      GRAPHMOE_CHECK(at == p.shape.numel(), load_op, "parameter '", p.name, "' of shape ", p.shape,
                     ": the checkpoint's tensors fill ", at, " of its ", p.shape.numel(),
                     " elements");
    }

    // Pass 1: every value finite in T, nothing written. Pass 2: the conversion. In each, a file's
    // tensors are spread over the threads (parallel_items); the first bad tensor in the file's
    // order is the one reported.
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t f = 0; f < files_.size(); ++f) {
        const std::string& path = files_[f];
        detail::MappedFile map(load_op, path, headers_[f].file_size);
        const SafetensorsHeader now =
            graphmoe::detail::read_safetensors_header(load_op, path, map.fd(), headers_[f].file_size);
        GRAPHMOE_CHECK(detail::same_entries(now, headers_[f]), load_op, "'", path,
                       "' changed since the checkpoint was opened (its header differs)");
        const std::uint8_t* data = map.data() + headers_[f].data_start;
        std::vector<std::size_t> here;  // the plan entries of this file, in order
        for (std::size_t i = 0; i < plan_.size(); ++i)
          if (plan_[i].file == f) here.push_back(i);
        const auto count = static_cast<index_t>(here.size());
        auto source = [&](std::size_t i) { return data + plan_[i].entry.begin; };
        auto elements = [&](std::size_t i) {
          return static_cast<std::size_t>(plan_[i].slot.shape.numel());
        };
        if (pass == 0) {
          std::vector<std::size_t> bad(here.size());
          parallel_items(count, [&](index_t j) {
            const std::size_t i = here[static_cast<std::size_t>(j)];
            bad[static_cast<std::size_t>(j)] =
                detail::first_bad_element<T>(source(i), plan_[i].entry.dtype, elements(i));
          });
          for (std::size_t j = 0; j < here.size(); ++j) {
            const std::size_t i = here[j];
            if (bad[j] < elements(i))
              graphmoe::detail::throw_error(
                  load_op, "'", path, "': tensor '", plan_[i].slot.name, "' holds ",
                  detail::element_at(source(i), plan_[i].entry.dtype, bad[j]), " at element ",
                  bad[j], " (weights must be finite", std::is_same_v<T, float> ? " in float" : "",
                  ")");
          }
        } else {
          parallel_items(count, [&](index_t j) {
            const std::size_t i = here[static_cast<std::size_t>(j)];
            const auto [id, off] = dest[i];
            detail::convert_elements<T>(source(i), plan_[i].entry.dtype, elements(i),
                                        arena.value(id).data() + off);
          });
        }
      }
    }
    arena.mark_values_written();
  }

  // Whether `name` (a parameter of a model declared under `prefix`) belongs to a router's token
  // graph: ".router.graph." in the name after the prefix. Such parameters have no Hugging Face
  // tensor; load() leaves them as they are.
  static bool is_graph_parameter(const std::string& name, const std::string& prefix) {
    return name.size() >= prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
           name.find(".router.graph.", prefix.size()) != std::string::npos;
  }

 private:
  struct Planned {
    TensorSlot slot;
    std::size_t file = 0;
    SafetensorsEntry entry;
  };

  // config().lm against the model's config: every field that changes the computation.
  void check_same_model(const TransformerLMConfig& m) const {
    const TransformerLMConfig& c = config_.lm;
    auto same = [&](bool ok, const char* field) {
      GRAPHMOE_CHECK(ok, load_op, "the model's ", field, " differs from what '", config_.path,
                     "' describes: declare the model with Checkpoint::config().lm");
    };
    same(m.vocab_size == c.vocab_size, "vocab_size");
    same(m.d_model == c.d_model, "d_model");
    same(m.num_layers == c.num_layers, "num_layers");
    same(m.num_heads == c.num_heads, "num_heads");
    same(m.d_ff == c.d_ff, "d_ff");
    same(m.layout == c.layout && m.first_k_dense == c.first_k_dense && m.moe_every == c.moe_every,
         "MoE layout (layout, first_k_dense, moe_every)");
    same(m.tie_embeddings == c.tie_embeddings, "tie_embeddings");
    same(m.activation == c.activation && m.ffn_bias == c.ffn_bias, "feed-forward activation or bias");
    same(m.norm == c.norm && m.norm_eps == c.norm_eps, "norm or norm_eps");
    const AttentionOptions &a = m.attention, &b = c.attention;
    same(a.head_dim_for(m.d_model, m.num_heads) == b.head_dim_for(c.d_model, c.num_heads),
         "attention head_dim");
    same(a.same_latent(b),
         "multi-head latent attention's options (kv_lora_rank, q_lora_rank, qk_nope_head_dim, "
         "qk_rope_head_dim, v_head_dim, latent_norm_eps)");
    same(a.num_kv_heads == b.num_kv_heads && a.rope_theta == b.rope_theta &&
             a.rope_layout == b.rope_layout && a.qk_norm == b.qk_norm &&
             (a.qk_norm == QKNorm::None || a.qk_norm_eps == b.qk_norm_eps) &&
             a.qkv_bias == b.qkv_bias && a.out_bias == b.out_bias,
         "attention options");
    same(m.experts_width() == c.experts_width() && m.shared_d_ff == c.shared_d_ff &&
             m.shared_expert_gate == c.shared_expert_gate,
         "experts' or shared experts' width");
    if (c.layout != MoELayout::Dense) {
      same(m.router.num_experts == c.router.num_experts && m.router.k == c.router.k,
           "number of experts or k");
      const auto &t = m.router.options<TopK>(), &u = c.router.options<TopK>();
      same(t.norm_topk_prob == u.norm_topk_prob &&
               t.routed_scaling_factor == u.routed_scaling_factor && t.n_group == u.n_group &&
               t.topk_group == u.topk_group,
           "top-k options (norm_topk_prob, routed_scaling_factor, n_group, topk_group)");
      same(sigmoid_routed(config_.family) ? !m.router.options<SigmoidScorer>().bias
                                          : !m.router.options<LinearScorer>().bias,
           "router bias (the checkpoint's routers have none)");
      same(m.router.capacity_factor <= 0, "capacity_factor (the checkpoint's routers drop no token)");
    }
  }

  void find_files() {
    const std::string single = detail::join(dir_, "model.safetensors");
    const std::string index = detail::join(dir_, "model.safetensors.index.json");
    graphmoe::detail::require_no_broken_link(op, single);  // not "holds neither" for a bad link
    graphmoe::detail::require_no_broken_link(op, index);
    const bool has_single = detail::exists(single), has_index = detail::exists(index);
    GRAPHMOE_CHECK(!(has_single && has_index), op, "'", dir_, "' holds both model.safetensors "
                   "and model.safetensors.index.json: which is the model is ambiguous");
    if (has_single) {
      files_.push_back(single);
      return;
    }
    GRAPHMOE_CHECK(has_index, op, "'", dir_, "' holds neither model.safetensors nor "
                   "model.safetensors.index.json (only safetensors weights are read, not "
                   "pytorch_model.bin)");
    index_ = index;
    graphmoe::detail::require_regular_file(op, index);
    struct stat st {};
    GRAPHMOE_CHECK(::stat(index.c_str(), &st) == 0 && st.st_size <= (64 << 20), op, "'", index,
                   "' is larger than 64 MB: not an index");
    const std::string text = graphmoe::detail::read_file(op, index);
    graphmoe::detail::check_json_depth(op, "'" + index + "'", text);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      graphmoe::detail::throw_error(op, "'", index, "' is not valid JSON: ", e.what());
    }
    GRAPHMOE_CHECK(j.is_object(), op, "'", index, "' holds ", detail::json_kind(j),
                   ", not a JSON object");
    for (auto it = j.begin(); it != j.end(); ++it)
      GRAPHMOE_CHECK(it.key() == "metadata" || it.key() == "weight_map", op, "'", index,
                     "': key '", it.key(), "' is not an index's (metadata, weight_map)");
    GRAPHMOE_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), op, "'", index,
                   "': key 'weight_map' is missing or not an object");
    std::map<std::string, std::size_t> file_ids;
    std::vector<std::string> names;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      GRAPHMOE_CHECK(it->is_string(), op, "'", index, "': key 'weight_map' maps '", it.key(),
                     "' to ", detail::json_kind(*it), ", not a file name");
      const std::string file = it->get<std::string>();
      GRAPHMOE_CHECK(!file.empty() && file != "." && file != ".." &&
                         file.find('/') == std::string::npos && file.find('\\') == std::string::npos &&
                         file.find('\0') == std::string::npos,
                     op, "'", index, "': key 'weight_map' maps tensor '", it.key(), "' to '", file,
                     "', which is not a file name inside '", dir_, "' (no '/', no '..')");
      index_map_[it.key()] = file;
      if (file_ids.emplace(file, 0).second) names.push_back(file);
    }
    GRAPHMOE_CHECK(!names.empty(), op, "'", index, "': key 'weight_map' names no tensor");
    std::sort(names.begin(), names.end());
    for (const auto& n : names) {
      const std::string path = detail::join(dir_, n);
      if (!detail::exists(path)) {
        std::string tensor;
        for (const auto& [t, f] : index_map_)
          if (f == n) {
            tensor = t;
            break;
          }
        const std::string link = graphmoe::detail::broken_link(path);
        graphmoe::detail::throw_error(op, "'", index, "' names the shard '", n,
                                      "' (for tensor '", tensor, "'), but '", path, "' ",
                                      link.empty() ? "does not exist" : "is " + link);
      }
      files_.push_back(path);
    }
  }

  void read_headers() {
    for (const std::string& path : files_) {
      struct stat st {};
      graphmoe::detail::Fd fd(graphmoe::detail::open_regular_for_reading(op, path, st));
      headers_.push_back(graphmoe::detail::read_safetensors_header(
          op, path, fd.get(), static_cast<std::uint64_t>(st.st_size)));
    }
  }

  void match_tensors() {
    // every tensor of every file, once
    std::unordered_map<std::string, std::pair<std::size_t, std::size_t>> found;
    std::size_t total = 0;
    for (std::size_t f = 0; f < headers_.size(); ++f) total += headers_[f].entries.size();
    found.reserve(total);
    for (std::size_t f = 0; f < headers_.size(); ++f) {
      const std::string fname = files_[f].substr(files_[f].find_last_of('/') + 1);
      for (std::size_t e = 0; e < headers_[f].entries.size(); ++e) {
        const std::string& name = headers_[f].entries[e].name;
        auto [it, fresh] = found.emplace(name, std::make_pair(f, e));
        GRAPHMOE_CHECK(fresh, op, "tensor '", name, "' is in both '", files_[it->second.first],
                       "' and '", files_[f], "'");
        if (!index_.empty()) {
          auto m = index_map_.find(name);
          GRAPHMOE_CHECK(m != index_map_.end(), op, "'", files_[f], "' holds tensor '", name,
                         "', which the index '", index_, "' does not name");
          GRAPHMOE_CHECK(m->second == fname, op, "'", files_[f], "' holds tensor '", name,
                         "', which the index '", index_, "' puts in '", m->second, "'");
        }
      }
    }
    if (!index_.empty())
      for (const auto& [name, file] : index_map_) {
        auto it = found.find(name);
        GRAPHMOE_CHECK(it != found.end(), op, "'", index_, "' puts tensor '", name, "' in '", file,
                       "', which does not hold it");
      }
    // every tensor the architecture needs, with its shape and a floating dtype
    std::vector<char> used(total, 0);
    std::vector<std::size_t> base(headers_.size(), 0);
    for (std::size_t f = 1; f < headers_.size(); ++f)
      base[f] = base[f - 1] + headers_[f - 1].entries.size();
    const std::string where = index_.empty() ? files_[0] : index_;
    for_each_tensor(config_, [&](const TensorSlot& s) {
      auto it = found.find(s.name);
      GRAPHMOE_CHECK(it != found.end(), op, "'", where, "': no tensor '", s.name, "' (shape ",
                     s.shape, "), which ", config_.architecture, " as '", config_.path,
                     "' describes it needs");
      const auto [f, e] = it->second;
      const SafetensorsEntry& entry = headers_[f].entries[e];
      GRAPHMOE_CHECK(entry.dtype == DType::F32 || entry.dtype == DType::BF16 ||
                         entry.dtype == DType::F16 || entry.dtype == DType::F64,
                     op, "'", files_[f], "': tensor '", s.name, "' has dtype ", entry.dtype,
                     "; weights must be F32, F16, BF16 or F64");
      GRAPHMOE_CHECK(entry.shape == s.shape, op, "'", files_[f], "': tensor '", s.name,
                     "' has shape ", entry.shape, ", but '", config_.path, "' gives ", s.shape);
      used[base[f] + e] = 1;
      plan_.push_back(Planned{s, f, entry});
    });
    for (std::size_t f = 0; f < headers_.size(); ++f)
      for (std::size_t e = 0; e < headers_[f].entries.size(); ++e)
        GRAPHMOE_CHECK(used[base[f] + e] != 0 || is_mtp_tensor(headers_[f].entries[e].name), op,
                       "'", files_[f], "': tensor '",
                       headers_[f].entries[e].name, "' is left over: ", config_.architecture,
                       " as '", config_.path, "' describes it has no such tensor");
    // in the files' order, for sequential reads
    std::sort(plan_.begin(), plan_.end(), [](const Planned& a, const Planned& b) {
      return a.file != b.file ? a.file < b.file : a.entry.begin < b.entry.begin;
    });
  }

  // A tensor of DeepSeek-V3's multi-token-prediction modules: "model.layers.<j>." with j in
  // [num_hidden_layers, num_hidden_layers + mtp_layers), skipped as transformers skips them.
  bool is_mtp_tensor(const std::string& name) const {
    if (config_.mtp_layers == 0) return false;
    static const std::string head = "model.layers.";
    if (name.compare(0, head.size(), head) != 0) return false;
    std::size_t i = head.size();
    std::int64_t j = 0;
    const std::size_t start = i;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i - start < 9)
      j = j * 10 + (name[i++] - '0');
    if (i == start || i >= name.size() || name[i] != '.') return false;
    return j >= config_.lm.num_layers && j < config_.lm.num_layers + config_.mtp_layers;
  }

  std::string dir_, index_;
  ModelConfig config_;
  std::vector<std::string> files_;
  std::map<std::string, std::string> index_map_;  // tensor -> shard file name
  std::vector<SafetensorsHeader> headers_;        // per file
  std::vector<Planned> plan_;
};

// Whether a TransformerLM<Router, T, cpu> declared with cfg has token-graph parameters
// (Checkpoint::is_graph_parameter): declared into a scratch arena, nothing allocated.
template <class Router, class T = float>
bool has_graph_parameters(const TransformerLMConfig& cfg) {
  ParameterArena<T, cpu> arena;
  TransformerLM<Router, T, cpu> probe;
  probe.declare(arena, "", cfg);
  for (const ParameterInfo& p : arena.params())
    if (Checkpoint::is_graph_parameter(p.name, "")) return true;
  return false;
}

// A TransformerLM of its own arena with the checkpoint's weights (Checkpoint::open, a model
// declared with config().lm, load). Throws before allocating anything for a bad directory. A
// router whose graph declares parameters (Blended<G>'s a, a learned temperature) gets a model
// initialised from Rng(0) first, so that they hold their initial values (Blended: a = 0, the
// model then routes as SoftmaxRouter's); otherwise nothing is drawn (NoInit).
template <class Router, class T = float>
std::unique_ptr<TransformerLM<Router, T, cpu>> load_lm(const std::string& dir) {
  const Checkpoint ck = Checkpoint::open(dir);
  ck.require_router<Router>();
  using LM = TransformerLM<Router, T, cpu>;
  auto lm = has_graph_parameters<Router, T>(ck.config().lm)
                ? std::make_unique<LM>(ck.config().lm, std::uint64_t{0})
                : std::make_unique<LM>(ck.config().lm, typename LM::NoInit{});
  ck.load(*lm);
  return lm;
}

}  // namespace graphmoe::hf
