// train_lm --hf DIR: a Hugging Face model directory's configuration, weights and tokenizer
// (graphmoe/hf/reader.hpp, graphmoe/hf/tokenizer.hpp), read by main.cpp before training.
//
// The model is the directory's (config.json: the model-shape flags are refused, the directory
// fixes them); --seq is the training sequence length (at most max_position_embeddings). The
// text: every non-empty line of --train / --valid / --test is encoded by the directory's
// tokenizer without special tokens (no bos) and followed by the eos id (the tokenizer's
// eos_token, else config.json's first eos_token_id); a directory that names no eos gets the line
// encoded with its "\n" instead. Lines are encoded one at a time, so a token never spans two.
// The weights are loaded by the training loop (train.hpp: at step 0, not when --resume finds a
// checkpoint); the routers are the families' own (softmax) and the graph routers the reader
// accepts (hf_router_names()).
#pragma once

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/device_dispatch.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "train_lm/options.hpp"

#if defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
#include "graphmoe/hf/tokenizer.hpp"
#endif
#if defined(GRAPHMOE_EXAMPLES_SENTENCEPIECE)
#include "graphmoe/hf/sentencepiece.hpp"  // load_tokenizer reads tokenizer.model files too
#endif

namespace train_lm {

// The flags --hf refuses: the directory fixes the model's shape and the tokenizer its vocabulary
// (the --upcycle-from and attack options work on train_lm's own checkpoints and words).
inline const std::vector<std::string>& hf_fixed_flags() {
  static const std::vector<std::string> flags = {
      "--arch", "--activation", "--ffn-bias", "--norm", "--norm-eps", "--kv-heads", "--rope-theta",
      "--rope-layout", "--qk-norm", "--qkv-bias", "--out-bias", "--tie-embeddings",
      "--expert-d-ff", "--shared-d-ff", "--shared-expert-gate", "--first-dense", "--moe-every",
      "--router-bias", "--norm-topk-prob", "--routed-scaling-factor", "--n-group", "--topk-group",
      "--layout", "--layers", "--d-model", "--heads", "--d-ff", "--experts",
      "--top-k", "--capacity-factor", "--expert-layout", "--k-min", "--k-max", "--char",
      "--normalise", "--max-vocab", "--upcycle-from", "--attack-rate", "--attack-seed",
      "--attack-word"};
  return flags;
}

// The routers a Hugging Face model loads into. Softmax families (Router<LinearScorer, Graph,
// TopK>): their own (softmax), a graph router from a = 0 (blended-*: the same model at step 0,
// graph upcycling), or the graph applied to the pretrained weights at once (similarity,
// attention: another model). DeepSeek-V3 (Router<SigmoidScorer, Graph, BiasBalancedTopK>): its
// own (sigmoid-bias) or the Similarity graph at once (the Attention graph does not read latent
// attention; no blended router of the sigmoid scorer is among the programs' routers).
inline const std::vector<std::string>& hf_router_names(bool sigmoid_routed) {
  static const std::vector<std::string> softmax = {"softmax", "blended-similarity",
                                                   "blended-attention", "similarity", "attention"};
  static const std::vector<std::string> sigmoid = {"sigmoid-bias", "sigmoid-bias-similarity"};
  return sigmoid_routed ? sigmoid : softmax;
}

// The fingerprint of a tokenizer: FNV-1a of its file's bytes, the files that set its special
// tokens, and the line separator (the eos id): another tokenizer gives other ids.
inline std::string hf_tokenizer_fingerprint(const std::string& dir, const std::string& file,
                                            const std::string& separator) {
  graphmoe::detail::Fnv1a64 h;
  auto add_file = [&](const std::string& path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) return;
    h.add(path.substr(path.find_last_of('/') + 1));
    h.add(std::string(1, '\0'));
    h.add(graphmoe::detail::read_file("train_lm --hf", path));
    h.add(std::string(1, '\0'));
  };
  add_file(file);
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json"})
    add_file((std::filesystem::path(dir) / name).string());
  h.add(separator);
  return h.hex();
}

// --hf: opens the directory (the reader's errors as they are), sets opt.model to its model with
// the command line's router and training options, and encodes the text into data. `given(flag)`
// says whether a flag was on the command line.
template <class Given>
void load_hf(Options& opt, Data& data, Given&& given) {
  using namespace graphmoe;
  const char* op = "train_lm --hf";
#if !defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
  (void)opt, (void)data, (void)given;
  graphmoe::detail::throw_error(op, "this train_lm was built without the Hugging Face tokenizer "
                                "(graphmoe::hf_tokenizer: PCRE2 and utf8proc; "
                                "scripts/install-deps.sh, then re-run cmake)");
#else
  for (const std::string& f : hf_fixed_flags())
    GRAPHMOE_CHECK(!given(f), op, f, " is not an option of --hf: the model directory '",
                   opt.hf_dir, "' fixes the model's shape and its tokenizer the vocabulary");
  GRAPHMOE_CHECK(!opt.dp.expert_parallel(), op, "--ep: a Hugging Face model is loaded whole "
                 "(train without --ep)");
  auto ck = std::make_shared<const hf::Checkpoint>(hf::Checkpoint::open(opt.hf_dir));
  const TransformerLMConfig& hc = ck->config().lm;
  // the router: the family's own unless --router names another of its kind
  const bool sigmoid = hf::sigmoid_routed(ck->config().family);
  if (!given("--router")) opt.router = sigmoid ? "sigmoid-bias" : "softmax";
  const auto& routers = hf_router_names(sigmoid);
  if (std::find(routers.begin(), routers.end(), opt.router) == routers.end()) {
    std::string list;
    for (const auto& r : routers) list += (list.empty() ? "" : ", ") + r;
    graphmoe::detail::throw_error(
        op, "--router ", opt.router, " cannot load the ", ck->config().architecture, " '",
        opt.hf_dir, "' (its router is ",
        sigmoid ? "sigmoid scores with a selection bias" : "a linear map, softmax and top-k",
        "): use one of ", list);
  }
  examples::require_cpu_router("train_lm", opt.router, opt.device);
  TransformerLMConfig m = hc;  // the directory's model, with this run's router and training options
  m.router.allow_unused_options = true;
  m.router.options<Similarity>() = opt.model.router.options<Similarity>();
  m.router.options<Attention>() = opt.model.router.options<Attention>();
  if (given("--bias-update-rate"))  // DeepSeek-V3's bias balancing while fine-tuning
    m.router.options<BiasBalancedTopK>() = opt.model.router.options<BiasBalancedTopK>();
  if (given("--load-balance")) m.router.load_balance_coef = opt.model.router.load_balance_coef;
  if (given("--z-loss")) m.router.z_loss_coef = opt.model.router.z_loss_coef;
  if (given("--seq-aux-loss-coef")) m.router.seq_aux_loss_coef = opt.model.router.seq_aux_loss_coef;
  if (given("--seq")) {
    GRAPHMOE_CHECK(opt.model.max_seq_len <= hc.max_seq_len, op, "--seq ", opt.model.max_seq_len,
                   " is longer than the model's context (", hc.max_seq_len,
                   ", max_position_embeddings of '", ck->config().path, "')");
    m.max_seq_len = opt.model.max_seq_len;
  } else {
    m.max_seq_len = std::min(opt.model.max_seq_len, hc.max_seq_len);
  }
  opt.model = m;

  const std::shared_ptr<const hf::Tokenizer> tok = hf::load_tokenizer(opt.hf_dir);
  std::optional<std::int32_t> eos = tok->eos_id();
  if (!eos && !ck->config().eos_token_ids.empty())
    eos = static_cast<std::int32_t>(ck->config().eos_token_ids.front());
  const std::vector<std::int32_t> newline = tok->encode("\n", false);
  GRAPHMOE_CHECK(eos || !newline.empty(), op, "'", opt.hf_dir, "': the tokenizer names no eos "
                 "token and encodes no line break: the lines of the text cannot be separated");
  const std::vector<std::int32_t> separator = eos ? std::vector<std::int32_t>{*eos} : newline;
  const auto vocab = static_cast<std::int32_t>(hc.vocab_size);
  auto encode_file = [&](const std::string& path) {
    std::vector<std::int32_t> ids;
    std::size_t line_no = 0;
    graphmoe::detail::for_each_file_line(op, path, [&](std::string_view line) {
      ++line_no;
      if (line.empty()) return;
      const std::vector<std::int32_t> l = tok->encode(line, false);
      for (std::int32_t id : l)
        GRAPHMOE_CHECK(id >= 0 && id < vocab, op, "'", path, "' line ", line_no, ": the tokenizer "
                       "gives id ", id, ", outside the model's vocabulary of ", vocab);
      ids.insert(ids.end(), l.begin(), l.end());
      ids.insert(ids.end(), separator.begin(), separator.end());
    });
    return ids;
  };
  for (std::int32_t id : separator)
    GRAPHMOE_CHECK(id >= 0 && id < vocab, op, "the line separator's id ", id,
                   " is outside the model's vocabulary of ", vocab);
  data.train = encode_file(opt.train_path);
  if (!opt.valid_path.empty()) data.valid = encode_file(opt.valid_path);
  if (!opt.test_path.empty()) data.test = encode_file(opt.test_path);
  data.vocab_size = static_cast<std::size_t>(vocab);
  data.hf = ck;
  for (std::int32_t id = tok->vocab_size(); id < vocab; ++id) data.sample_banned.push_back(id);
  std::string sep_text;
  for (std::int32_t id : separator) sep_text += std::to_string(id) + " ";
  const std::string dir = std::filesystem::absolute(opt.hf_dir).lexically_normal().string();
  const std::string file = std::filesystem::absolute(tok->path()).lexically_normal().string();
  data.hf_record = nlohmann::json{
      {"dir", dir},
      {"architecture", ck->config().architecture},
      {"tokenizer", file},
      {"tokenizer_fingerprint", hf_tokenizer_fingerprint(dir, file, sep_text)},
      {"line_separator", separator},
      {"text", "every non-empty line encoded without special tokens, then the line separator"}}
                       .dump();
  // the sample: the ids between separators decoded (special tokens skipped), lines joined by "\n"
  data.detokenize = [tok, separator](const std::vector<std::int32_t>& ids) {
    std::string out;
    std::vector<std::int32_t> part;
    std::size_t i = 0;
    auto flush = [&] {
      out += tok->decode(part, true);
      part.clear();
    };
    while (i < ids.size()) {
      if (ids.size() - i >= separator.size() &&
          std::equal(separator.begin(), separator.end(), ids.begin() + static_cast<std::ptrdiff_t>(i))) {
        flush();
        out += "\n";
        i += separator.size();
      } else {
        if (ids[i] >= 0 && ids[i] < tok->vocab_size() && !tok->id_to_token(ids[i]).empty())
          part.push_back(ids[i]);  // an id that names no token has no text
        ++i;
      }
    }
    flush();
    return out;
  };
  if (opt.dp.root()) {
    std::string sep_ids;  // "0", or "13 10": sep_text without its trailing space
    for (std::int32_t id : separator) sep_ids += (sep_ids.empty() ? "" : " ") + std::to_string(id);
    std::fprintf(stderr, "train_lm: --hf %s: %s, %lld layers, d_model %lld, vocabulary %lld; "
                 "tokenizer %s (lines end with id%s %s)\n",
                 opt.hf_dir.c_str(), ck->config().architecture.c_str(),
                 static_cast<long long>(hc.num_layers), static_cast<long long>(hc.d_model),
                 static_cast<long long>(hc.vocab_size), tok->path().c_str(),
                 separator.size() > 1 ? "s" : "", sep_ids.c_str());
  }
#endif
}

}  // namespace train_lm
