// generate: text from a trained train_lm checkpoint, streamed to stdout.
//
//   generate --checkpoint runs/lm/checkpoint.safetensors --vocab runs/lm/vocab.txt
//            --prompt "the king said" --max-new-tokens 40 --seed 1 --temperature 0.8 --top-k 40
//
// Loads any train_lm checkpoint (its router, shape and word or character vocabulary come from the
// checkpoint's metadata; the router must be one this binary is built for, GRAPHMOE_EXAMPLE_ROUTERS),
// checks that --vocab is the vocabulary it was trained with (the fingerprint train_lm recorded;
// checkpoints without one load with a warning), reads the prompt with the normalisation recorded
// with it, and samples with graphmoe::generate (graphmoe/inference/generate.hpp): by default the
// incremental decoder (a KV cache per attention layer and a routing cache per MoE layer, O(t) per
// token); --decoder full runs a full forward over the context per token (the O(t^2) reference;
// the same tokens). The prompt is --prompt TEXT, --prompt-file FILE, or either with "-" for stdin
// (a file's final line break is dropped; its other line breaks are <eos> in a word model). One
// prompt and one sample: stdout receives the generated text only, each token as soon as it is
// drawn (words: separated by spaces, <eos> as a line break; characters: the bytes). Several
// (--num-samples N, --prompts-file FILE: one prompt a line) are decoded as one batch
// (generate_batch; output j of the batch draws with --seed + j) and printed when done, one line per
// output in order (prompt by prompt, sample by sample), line breaks written \n and backslashes
// \\. stderr receives the prompt as the model reads it, the seed when it was not given (drawn at
// random), the time to first token with the prompt's tokens/s, and the decode tokens/s.
// --explain prints instead one line per generated token (past the context window too): its
// position and text, and per MoE block the experts it was routed to with their gates and, for a
// graph router, the experts its own scores would have chosen and the earlier tokens with the
// largest weights in its row of S or A^p (a legend on stderr; --explain-prompt: the prompt's
// tokens too; in a batch each line starts with the output's index):
//   [7] "king" | block 0: experts 3 (0.61) 1 (0.39); alone 3 2; from [6] "the" 0.42 [2] "said" 0.18
//
// --hf DIR instead of --checkpoint and --vocab: a Hugging Face model directory (hf/reader.hpp: the
// six families, loaded on the CPU in float with the family's own router, SoftmaxRouter or
// DeepSeek-V3's SigmoidBiasRouter; --device cuda refused)
// with its tokenizer (hf::load_tokenizer: tokenizer.json, or tokenizer.model where libsentencepiece
// is linked). Prompts are encoded with the special tokens the tokenizer adds (a bos) and refused
// beyond max_position_embeddings; generation stops at config.json's eos ids and the tokenizer's;
// the text is streamed by hf::StreamDecoder (special tokens not printed); --ban takes the text of
// one token; the model's ids that name no token are never drawn (docs/reference/hugging-face.md).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/cli_checks.hpp"
#include "common/device_dispatch.hpp"
#include "common/lm_config.hpp"
#include "common/vocabulary.hpp"
#include "generate/run.hpp"
#include "graphmoe/hf/reader.hpp"
#if defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
#include "graphmoe/hf/tokenizer.hpp"
#endif
#if defined(GRAPHMOE_EXAMPLES_SENTENCEPIECE)
#include "graphmoe/hf/sentencepiece.hpp"  // load_tokenizer reads tokenizer.model files too
#endif
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"

using namespace graphmoe;

namespace {

inline constexpr index_t kMaxNewTokens = 1'000'000;
inline constexpr double kMaxTemperature = 1000.0;  // beyond, every kept token is equally likely
inline constexpr double kMaxPenalty = 1000.0;      // --repeat-penalty, |--frequency/presence-penalty|
inline constexpr index_t kMaxBatch = 1024;         // prompts x --num-samples decoded together

// A vocabulary as generate reads it, for the checkpoint's kind (words or characters).
struct Vocabulary {
  std::size_t size = 0;
  bool char_level = false;
  std::int32_t unk = 0;
  std::string fingerprint;                // the tokenizer's (with the normalisation it reads with)
  std::vector<std::int32_t> banned;
  std::vector<std::string> stop;          // --stop texts as printed (<eos>: a line break)
  std::function<std::vector<std::int32_t>(const std::string&)> encode;  // a prompt's ids
  std::function<std::string(const std::vector<std::int32_t>&)> decode;  // the prompt as read
  // the printer of one output: the text of each generated id after that prompt
  std::function<generate_cli::Printer(const std::vector<std::int32_t>&)> printer;
  std::function<std::string(std::int32_t)> label;  // an id quoted, for --explain
};

// s in double quotes, with line breaks, tabs, quotes and backslashes escaped (--explain lines).
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '\n') q += "\\n";
    else if (c == '\t') q += "\\t";
    else if (c == '"' || c == '\\') q += std::string("\\") + c;
    else q += c;
  }
  return q + "\"";
}

// A --stop text as the printed text shows it: normalised as the prompt is (a word model's words
// then joined by single spaces, a line break kept; leading or trailing blanks kept as one).
std::string normalised_stop(const std::string& s, const TextNormalisation& norm) {
  if (norm.none()) return s;
  std::string out;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = s.find('\n', begin);
    const std::string seg = s.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    std::string joined;
    graphmoe::detail::for_each_word(norm.apply(seg), [&](std::string_view w) {
      if (!joined.empty()) joined += ' ';
      joined.append(w);
    });
    if (!seg.empty() && graphmoe::detail::is_space(seg.front())) out += ' ';
    out += joined;
    if (!joined.empty() && graphmoe::detail::is_space(seg.back())) out += ' ';
    if (end == std::string::npos) break;
    out += '\n';
    begin = end + 1;
  }
  return out;
}

Vocabulary word_vocabulary(const std::string& path, const std::vector<std::string>& stops,
                           const std::vector<std::string>& bans, const TextNormalisation& norm) {
  auto loaded = WordTokenizer::load(path);
  loaded.set_normalisation(norm);  // prompts read as the training text was
  auto tok = std::make_shared<const WordTokenizer>(std::move(loaded));
  Vocabulary v;
  v.size = tok->size();
  v.unk = tok->unk();
  v.fingerprint = tok->fingerprint();
  // the prompt's lines, each but the last followed by <eos> (as train_lm reads a text file)
  v.encode = [tok](const std::string& prompt) {
    std::vector<std::int32_t> ids;
    std::size_t begin = 0;
    while (true) {
      const std::size_t end = prompt.find('\n', begin);
      const std::vector<std::int32_t> line = tok->encode_line(
          std::string_view(prompt).substr(begin, end == std::string::npos ? std::string::npos : end - begin));
      ids.insert(ids.end(), line.begin(), line.end());
      if (end == std::string::npos) break;
      ids.push_back(tok->eos());
      begin = end + 1;
    }
    return ids;
  };
  v.decode = [tok](const std::vector<std::int32_t>& ids) { return tok->decode(ids); };
  for (const std::string& s : stops) {
    // <eos> is printed as a line break: a stop text holding it matches that line break
    std::string t;
    for (std::size_t i = 0; i < s.size();) {
      if (s.compare(i, WordTokenizer::kEos.size(), WordTokenizer::kEos) == 0) {
        t += '\n';
        i += WordTokenizer::kEos.size();
      } else {
        t += s[i++];
      }
    }
    v.stop.push_back(normalised_stop(t, norm));
  }
  for (const std::string& b : bans) {
    GRAPHMOE_CHECK(tok->contains(b), "generate", "--ban '", b, "' is not a word of the vocabulary '",
                   path, "' (", tok->size(), " words; <unk> and <eos> are words too)");
    v.banned.push_back(tok->id(b));
  }
  // words separated by spaces, <eos> as a line break; the first continues the prompt's line
  v.printer = [tok](const std::vector<std::int32_t>& prompt) {
    auto line_start = std::make_shared<bool>(prompt.empty() || prompt.back() == tok->eos());
    return generate_cli::Printer{[tok, line_start](std::int32_t id) {
                                   if (id == tok->eos()) {
                                     *line_start = true;
                                     return std::string("\n");
                                   }
                                   std::string s = *line_start ? "" : " ";
                                   *line_start = false;
                                   return s + tok->decode(id);
                                 },
                                 {}};
  };
  v.label = [tok](std::int32_t id) { return quoted(tok->decode(id)); };
  return v;
}

Vocabulary char_vocabulary(const std::string& path, const std::vector<std::string>& stops,
                           const std::vector<std::string>& bans, const TextNormalisation& norm) {
  auto loaded = CharTokenizer::load(path);
  loaded.set_normalisation(norm);
  auto tok = std::make_shared<const CharTokenizer>(std::move(loaded));
  Vocabulary v;
  v.size = tok->size();
  v.char_level = true;
  v.unk = tok->unk();
  v.fingerprint = tok->fingerprint();
  v.encode = [tok](const std::string& prompt) { return tok->encode(prompt); };
  v.decode = [tok](const std::vector<std::int32_t>& ids) { return tok->decode(ids); };
  for (const std::string& s : stops) v.stop.push_back(normalised_stop(s, norm));
  for (const std::string& b : bans) {
    const bool unk = b == "<unk>";
    GRAPHMOE_CHECK(unk || (b.size() == 1 && tok->id(b[0]) != tok->unk()), "generate", "--ban '", b,
                   "' is not one character of the vocabulary '", path, "' (nor <unk>)");
    v.banned.push_back(unk ? tok->unk() : tok->id(b[0]));
  }
  v.printer = [tok](const std::vector<std::int32_t>&) {
    return generate_cli::Printer{[tok](std::int32_t id) { return tok->decode(id); }, {}};
  };
  v.label = [tok](std::int32_t id) { return quoted(tok->decode(id)); };
  return v;
}

#if defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
// The text of one output as hf::StreamDecoder streams it (special tokens skipped), primed with the
// prompt (its text is not printed: a continuation's leading space comes out right). The decoder,
// as the `tokenizers` library's DecodeStream, refuses an id after which it would rewrite text it
// already returned (byte tokens that regroup: <0x1F> printed, then <0x9F> makes both U+FFFD);
// generation goes on: the decoder restarts at the ids not printed yet, after the last printed one
// as context (without it if that fails, else their decode at once). The printed text then differs
// from the decode of all the ids where the bytes regrouped (<0x1F> printed, U+FFFD after it).
class OutputStream {
 public:
  OutputStream(std::shared_ptr<const hf::Tokenizer> tok, const std::vector<std::int32_t>& prompt)
      : tok_(std::move(tok)), dec_(*tok_, /*skip_special_tokens=*/true) {
    for (std::int32_t id : prompt) step(id);
  }
  std::string step(std::int32_t id) {
    std::string s;
    try {
      s = dec_.step(id);
    } catch (const graphmoe::Error&) {
      s = restart(id);
    }
    if (s.empty()) {
      held_.push_back(id);
    } else {
      held_.clear();
      context_ = id;
    }
    return s;
  }
  // What the decoder held back; the held ids' own text where it would rewrite printed text.
  std::string finish() {
    std::string s = dec_.finish();
    if (s.empty() && !held_.empty()) s = tok_->decode(held_, true);
    held_.clear();
    return s;
  }

 private:
  std::string restart(std::int32_t id) {
    std::vector<std::int32_t> ids = held_;
    ids.push_back(id);
    for (int attempt = 0; attempt < 2; ++attempt) {
      dec_.reset();
      try {
        if (attempt == 0 && (!context_ || dec_.step(*context_).empty())) continue;
        std::string s;
        for (std::int32_t i : ids) s += dec_.step(i);
        return s;
      } catch (const graphmoe::Error&) {
      }
    }
    dec_.reset();
    return tok_->decode(ids, true);
  }

  std::shared_ptr<const hf::Tokenizer> tok_;
  hf::StreamDecoder dec_;
  std::vector<std::int32_t> held_;      // the ids since the last text returned
  std::optional<std::int32_t> context_;  // the last id that returned text
};

// --hf: the tokenizer of the model directory (hf::load_tokenizer: tokenizer.json, or
// tokenizer.model where sentencepiece is linked). Prompts are encoded with the special tokens its
// post-processor adds (a bos); the output is an OutputStream's text. *eos: the end-of-text ids
// (config.json's eos_token_id, one or a list, and the tokenizer's eos). The ids of the model that
// name no token of the tokenizer (an embedding padded beyond it) are banned: they have no text.
Vocabulary hf_vocabulary(const std::string& dir, const hf::ModelConfig& mc,
                         const std::vector<std::string>& stops, const std::vector<std::string>& bans,
                         std::vector<std::int32_t>* eos) {
  std::shared_ptr<const hf::Tokenizer> tok(hf::load_tokenizer(dir));
  const index_t vocab = mc.lm.vocab_size;
  GRAPHMOE_CHECK(tok->vocab_size() <= vocab, "generate", "the tokenizer '", tok->path(),
                 "' has ids up to ", tok->vocab_size() - 1, ", beyond the model's vocabulary of ",
                 vocab, " ('", mc.path, "': vocab_size)");
  Vocabulary v;
  v.size = static_cast<std::size_t>(vocab);
  v.encode = [tok](const std::string& prompt) { return tok->encode(prompt, true); };
  v.decode = [tok](const std::vector<std::int32_t>& ids) { return tok->decode(ids, false); };
  v.stop = stops;  // matched against the text as printed
  const auto texts = [tok](const std::vector<std::int32_t>& ids) {
    std::string t;
    for (std::int32_t id : ids) t += (t.empty() ? "" : " ") + quoted(tok->decode(std::vector<std::int32_t>{id}, false));
    return t;
  };
  for (const std::string& b : bans) {
    const std::vector<std::int32_t> ids = tok->encode(b, false);
    GRAPHMOE_CHECK(ids.size() == 1, "generate", "--ban '", b, "' is ", ids.size(),
                   " tokens of the tokenizer '", tok->path(), "'", ids.empty() ? "" : " (", texts(ids),
                   ids.empty() ? "" : ")", ": --ban takes the text of one token");
    v.banned.push_back(ids[0]);
  }
  std::size_t unnamed = 0;
  for (index_t id = 0; id < vocab; ++id)
    if (id >= tok->vocab_size() || tok->id_to_token(static_cast<std::int32_t>(id)).empty()) {
      v.banned.push_back(static_cast<std::int32_t>(id));
      ++unnamed;
    }
  if (unnamed > 0)
    std::fprintf(stderr, "generate: %zu ids of the model's vocabulary of %lld name no token of '%s': "
                 "never generated\n", unnamed, static_cast<long long>(vocab), tok->path().c_str());
  eos->clear();
  for (std::int64_t id : mc.eos_token_ids) {
    GRAPHMOE_CHECK(id >= 0 && id < vocab, "generate", "'", mc.path, "': eos_token_id ", id,
                   " is not in the model's vocabulary [0, ", vocab, ")");
    eos->push_back(static_cast<std::int32_t>(id));
  }
  if (tok->eos_id()) eos->push_back(*tok->eos_id());
  std::sort(eos->begin(), eos->end());
  eos->erase(std::unique(eos->begin(), eos->end()), eos->end());
  if (eos->empty())
    std::fprintf(stderr, "generate: warning: neither '%s' nor the tokenizer names an eos token: "
                 "every output runs to --max-new-tokens\n", mc.path.c_str());
  v.printer = [tok](const std::vector<std::int32_t>& prompt) {
    auto stream = std::make_shared<OutputStream>(tok, prompt);
    return generate_cli::Printer{[stream](std::int32_t id) { return stream->step(id); },
                                 [stream] { return stream->finish(); }};
  };
  v.label = [tok](std::int32_t id) { return quoted(tok->decode(std::vector<std::int32_t>{id}, false)); };
  return v;
}
#endif

// The text of --prompt / --prompt-file: "-" reads stdin; a file's final line break is dropped.
std::string read_prompt(const std::string& value, bool is_file, const char* flag) {
  if (!is_file && value != "-") return value;
  std::string text;
  if (value == "-") {
    std::ostringstream all;
    all << std::cin.rdbuf();
    GRAPHMOE_CHECK(!std::cin.bad(), "generate", flag, " -: error while reading stdin");
    text = all.str();
  } else {
    text = graphmoe::detail::read_file("generate", value);
  }
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  return text;
}

// --hf DIR: the model (hf::Checkpoint: config.json, every header checked) and its tokenizer, the
// prompts encoded and checked against max_position_embeddings, then the CPU run with the family's
// own router (SoftmaxRouter; DeepSeek-V3: SigmoidBiasRouter).
int generate_hf(const std::string& dir, const std::vector<std::string>& texts, const char* prompt_flag,
                index_t num_samples, const std::vector<std::string>& stops,
                const std::vector<std::string>& bans, GenerateOptions gen) {
#if defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  const hf::ModelConfig& mc = ck.config();
  std::vector<std::int32_t> eos;
  Vocabulary v = hf_vocabulary(dir, mc, stops, bans, &eos);
  generate_cli::Input in;
  in.hf = &ck;
  in.config = mc.lm;
  // the family's own router: DeepSeek-V3's sigmoid scores with a selection bias, else softmax
  const bool sigmoid = hf::sigmoid_routed(mc.family) && mc.lm.layout != MoELayout::Dense;
  in.router = sigmoid ? "sigmoid-bias" : "softmax";
  examples::require_cpu_router("generate", in.router, "cpu");
  in.model_name = mc.architecture + " '" + dir + "' (" +
                  (sigmoid ? "SigmoidBiasRouter" : "SoftmaxRouter") + ", float)";
  GRAPHMOE_CHECK(gen.sampling.top_k <= in.config.vocab_size, "generate", "--top-k ",
                 gen.sampling.top_k, " exceeds the vocabulary of ", in.config.vocab_size,
                 " tokens (0 samples among all of them)");
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::vector<std::int32_t> ids = v.encode(texts[i]);
    const std::string which = texts.size() > 1 ? " line " + std::to_string(i + 1) : "";
    GRAPHMOE_CHECK(!ids.empty(), "generate", prompt_flag, which, " holds no token: give at least one");
    GRAPHMOE_CHECK(static_cast<index_t>(ids.size()) <= in.config.max_seq_len, "generate",
                   prompt_flag, which, " is ", ids.size(), " tokens, longer than the model's context "
                   "of max_position_embeddings = ", in.config.max_seq_len, " ('", mc.path, "')");
    std::string index;  // (appends: GCC 12 warns falsely about operator+ here, -Wrestrict)
    if (texts.size() > 1) index.append(" ").append(std::to_string(i));
    std::fprintf(stderr, "generate: prompt%s (%zu tokens): %s\n", index.c_str(), ids.size(),
                 v.decode(ids).c_str());
    for (index_t k = 0; k < num_samples; ++k) in.prompts.push_back(ids);
  }
  in.stop = std::move(v.stop);
  gen.sampling.banned = std::move(v.banned);
  gen.stop_ids = std::move(eos);
  in.options = gen;
  in.printer = v.printer;
  in.label = v.label;
  in.batch = in.prompts.size() > 1;
  if (sigmoid)
    return examples::on_device<SigmoidBiasRouter>("generate", "cpu", in.router, [&]<class B>() {
      return generate_cli::run<SigmoidBiasRouter, B>(in);
    });
  return examples::on_device<SoftmaxRouter>("generate", "cpu", in.router, [&]<class B>() {
    return generate_cli::run<SoftmaxRouter, B>(in);
  });
#else
  (void)dir, (void)texts, (void)prompt_flag, (void)num_samples, (void)stops, (void)bans, (void)gen;
  graphmoe::detail::throw_error("generate", "--hf: this generate was built without the Hugging Face "
                                "tokenizer (graphmoe::hf_tokenizer: PCRE2 and utf8proc, found with "
                                "pkg-config); run scripts/install-deps.sh and reconfigure");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, vocab, hf_dir, prompt, prompt_file, prompts_file;
  std::vector<std::string> stops, bans;
  GenerateOptions gen;
  gen.max_new_tokens = 50;
  int threads = 2;
  index_t num_samples = 1;
  CLI::App app{"Generate text from a train_lm checkpoint or a Hugging Face model directory (graphmoe)"};
  app.option_defaults()->always_capture_default();  // --help shows every default
  auto* ckpt_opt = app.add_option("--checkpoint", checkpoint, "the model (a train_lm checkpoint.safetensors; with --vocab)")->check(CLI::ExistingFile);
  auto* vocab_opt = app.add_option("--vocab", vocab, "its vocabulary (the vocab.txt train_lm wrote beside it)")->check(CLI::ExistingFile);
  auto* hf_opt = app.add_option("--hf", hf_dir, "or the model as a Hugging Face model directory (config.json, safetensors and tokenizer.json or tokenizer.model; Llama, Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; CPU)")
                     ->excludes(ckpt_opt)->excludes(vocab_opt);
  auto* p_text = app.add_option("--prompt", prompt, "the text to continue (words, or characters for a --char model; any text with --hf; - reads stdin)");
  auto* p_file = app.add_option("--prompt-file", prompt_file, "read the prompt from this file (- for stdin; its line breaks are <eos> in a word model)")->excludes(p_text);
  auto* p_many = app.add_option("--prompts-file", prompts_file, "one prompt a line (- for stdin), decoded as one batch; one output line each, in order")->excludes(p_text)->excludes(p_file);
  app.add_option("--num-samples", num_samples, "outputs per prompt, decoded as one batch (output j of the batch draws with --seed + j)")->check(examples::integer<index_t>(1, kMaxBatch));
  app.add_option("--max-new-tokens", gen.max_new_tokens, "tokens to generate at most")->check(examples::integer<index_t>(1, kMaxNewTokens));
  auto* seed_opt = app.add_option("--seed", gen.sampling.seed, "random seed of the draws (default: drawn at random, and printed)")->check(examples::seed());
  auto* greedy = app.add_flag("--greedy", gen.sampling.greedy, "always the most probable token (no sampling)");
  app.add_option("--temperature", gen.sampling.temperature, "softmax temperature (1: the model's distribution)")->check(examples::positive_real(kMaxTemperature))->excludes(greedy);
  app.add_option("--top-k", gen.sampling.top_k, "sample among the k most probable tokens (0: all)")->check(examples::integer<index_t>(0, examples::kMaxCount))->excludes(greedy);
  app.add_option("--top-p", gen.sampling.top_p, "sample among the smallest set of most probable tokens of mass >= p (1: all)")->check(examples::positive_real(1.0))->excludes(greedy);
  app.add_option("--stop", stops, "stop once the generated text holds this text (any text, <eos> a line break in a word model; repeatable); the output ends with it")
      ->check(CLI::Validator([](std::string& t) { return t.empty() ? std::string("an empty --stop would match anywhere") : std::string(); }, ""));
  auto& so = gen.sampling;
  app.add_option("--repeat-penalty", so.repeat_penalty, "divide the positive logits, multiply the negative ones, of the tokens in the last --repeat-last-n by this (1: off)")->check(examples::positive_real(kMaxPenalty));
  app.add_option("--repeat-last-n", so.repeat_last_n, "the window of the penalties: the last n tokens of the context, prompt included (0: penalties off, -1: the whole context)")->check(examples::integer<index_t>(-1, examples::kMaxCount));
  app.add_option("--frequency-penalty", so.frequency_penalty, "subtract this x the count of each token in the window from its logit (0: off)")->check(examples::real(-kMaxPenalty, kMaxPenalty));
  app.add_option("--presence-penalty", so.presence_penalty, "subtract this from the logit of each token in the window (0: off)")->check(examples::real(-kMaxPenalty, kMaxPenalty));
  app.add_option("--min-p", so.min_p, "drop the tokens less probable than p x the most probable one (0: off)")->check(examples::real(0.0, 1.0))->excludes(greedy);
  app.add_option("--ban", bans, "never generate this token (a word, <unk>, <eos>, or one character; with --hf text that is one token; repeatable)");
  app.add_option("--threads", threads, "CPU threads")->check(examples::threads());
  std::string device = "cpu";
  app.add_option("--device", device, "where to run the model: " + examples::device_help())
      ->check(CLI::IsMember({"cpu", "cuda"}));
  std::string decoder = "incremental";
  app.add_option("--decoder", decoder, "incremental (KV and routing caches) or full (a full forward per token)")
      ->check(CLI::IsMember({"incremental", "full"}));
  app.add_flag("--explain", gen.explain, "one line per generated token: its experts and, for graph routers, the earlier tokens it was routed by");
  app.add_option("--explain-sources", gen.explain_sources, "earlier tokens shown per MoE block with --explain")->check(examples::integer<index_t>(1, 64));
  app.add_flag("--explain-prompt", gen.explain_prompt, "with --explain, a line for each prompt token too");
  // defaults computed at run time are not captured: said in the text above
  seed_opt->default_str("");
  CLI11_PARSE(app, argc, argv);
  try {
    GRAPHMOE_CHECK(hf_opt->count() || ckpt_opt->count() || vocab_opt->count(), "generate",
                   "give the model: --checkpoint FILE with --vocab FILE (a train_lm checkpoint), or "
                   "--hf DIR (a Hugging Face model directory)");
    GRAPHMOE_CHECK(p_text->count() + p_file->count() + p_many->count() == 1, "generate",
                   "give the prompt: --prompt TEXT, --prompt-file FILE or --prompts-file FILE "
                   "(- reads stdin)");
    GRAPHMOE_CHECK(!gen.explain_prompt || gen.explain, "generate", "--explain-prompt needs --explain");
    GRAPHMOE_CHECK(hf_opt->count() || ckpt_opt->count(), "generate",
                   "--vocab needs --checkpoint (the train_lm checkpoint it belongs to)");
    GRAPHMOE_CHECK(hf_opt->count() || vocab_opt->count(), "generate",
                   "--checkpoint needs --vocab (the vocab.txt train_lm wrote beside it)");
    GRAPHMOE_CHECK(!hf_opt->count() || device == "cpu", "generate", "--hf with --device ", device,
                   ": a Hugging Face model is loaded and run on the CPU only; use --device cpu");
    examples::require_device_built("generate", device);
    if (seed_opt->count() == 0 && !gen.sampling.greedy) {  // --greedy draws nothing
      std::random_device rd;
      gen.sampling.seed = (static_cast<std::uint64_t>(rd()) << 32) | rd();
      std::fprintf(stderr, "generate: seed %llu (drawn at random: --seed %llu repeats this run)\n",
                   static_cast<unsigned long long>(gen.sampling.seed),
                   static_cast<unsigned long long>(gen.sampling.seed));
    }
    std::vector<std::string> texts;  // the prompts' text
    if (p_many->count()) {
      const std::string all = read_prompt(prompts_file, true, "--prompts-file");
      std::size_t begin = 0, line = 1;
      while (true) {
        const std::size_t end = all.find('\n', begin);
        std::string t = all.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
        if (!t.empty() && t.back() == '\r') t.pop_back();
        GRAPHMOE_CHECK(!t.empty(), "generate", "--prompts-file '", prompts_file, "': line ", line,
                       " is empty (one prompt a line)");
        texts.push_back(std::move(t));
        if (end == std::string::npos) break;
        begin = end + 1;
        ++line;
      }
    } else {
      texts.push_back(p_file->count() ? read_prompt(prompt_file, true, "--prompt-file")
                                      : read_prompt(prompt, false, "--prompt"));
    }
    GRAPHMOE_CHECK(static_cast<index_t>(texts.size()) * num_samples <= kMaxBatch, "generate",
                   texts.size(), " prompts x --num-samples ", num_samples, " = ",
                   static_cast<index_t>(texts.size()) * num_samples,
                   " outputs, more than one batch of ", kMaxBatch, " decodes");
    const char* prompt_flag = p_many->count() ? "--prompts-file" : p_file->count() ? "--prompt-file" : "--prompt";
    set_num_threads(threads);
    gen.decoding = decoder == "full" ? Decoding::FullForward : Decoding::Incremental;
    GRAPHMOE_CHECK(!gen.explain || gen.decoding == Decoding::Incremental, "generate",
                   "--explain needs --decoder incremental (the routing caches hold the graph weights)");
    if (hf_opt->count()) return generate_hf(hf_dir, texts, prompt_flag, num_samples, stops, bans, gen);
    const SafetensorsFile f = load_safetensors(checkpoint);
    GRAPHMOE_CHECK(f.metadata.count("config") && f.metadata.count("step"), "generate", "'",
                   checkpoint, "' has no 'config' and 'step' metadata: is it a train_lm checkpoint?");
    const nlohmann::json cfg = metadata_json(f, "config");
    GRAPHMOE_CHECK(cfg.is_object() && cfg.contains("router") && cfg.contains("d_model") &&
                       cfg.contains("char_level"),
                   "generate", "'", checkpoint, "' is not a train_lm checkpoint (its config has no "
                   "router, d_model or char_level)");
    const std::string where = "'" + checkpoint + "'";
    generate_cli::Input in;
    in.file = &f;
    in.config = examples::lm_config_from_json(cfg, where);
    in.router = examples::detail::config_field<std::string>(cfg, "router", where);
    const auto& known = router_names();
    GRAPHMOE_CHECK(std::find(known.begin(), known.end(), in.router) != known.end(), "generate",
                   where, ": config field 'router' is '", in.router, "', not a known router");
    examples::require_cpu_router("generate", in.router, device);
    in.step = metadata_int(f, "step", 0, std::numeric_limits<std::int64_t>::max());
    // non-finite weights would make every logit NaN: refused by name before the model is built
    check_weight_values<float>(f, "model.", "generate", "a checkpoint's");

    const bool char_level = examples::detail::config_field<bool>(cfg, "char_level", where);
    const std::optional<examples::VocabularyRecord> rec = examples::vocabulary_record(f, where);
    GRAPHMOE_CHECK(!rec || rec->char_level == char_level, "generate", where, ": its config says ",
                   char_level ? "char" : "word", "-level and its vocabulary record ",
                   rec && rec->char_level ? "char" : "word", "-level");
    const TextNormalisation norm = rec ? rec->normalisation : TextNormalisation{};
    Vocabulary v = char_level ? char_vocabulary(vocab, stops, bans, norm)
                              : word_vocabulary(vocab, stops, bans, norm);
    if (!rec) {
      std::fprintf(stderr, "generate: warning: %s records no vocabulary fingerprint (written before "
                   "train_lm recorded one): that '%s' is its vocabulary is not checked, and the "
                   "prompt is read without normalisation\n", where.c_str(), vocab.c_str());
    } else {
      GRAPHMOE_CHECK(v.fingerprint == rec->fingerprint, "generate", "the vocabulary '", vocab,
                     "' (", v.size, " entries, ", v.fingerprint, ") is not the one the model ",
                     where, " was trained with (", rec->size, " entries, ", rec->fingerprint,
                     ", normalisation ", rec->normalisation.name(), ", written to '", rec->file,
                     "'): pass the vocab.txt train_lm wrote beside the checkpoint");
    }
    GRAPHMOE_CHECK(static_cast<index_t>(v.size) == in.config.vocab_size, "generate", "the vocabulary '",
                   vocab, "' has ", v.size, " entries, the model ", where, " ", in.config.vocab_size,
                   ": pass the vocab.txt train_lm wrote beside the checkpoint");
    GRAPHMOE_CHECK(gen.sampling.top_k <= in.config.vocab_size, "generate", "--top-k ",
                   gen.sampling.top_k, " exceeds the vocabulary of ", in.config.vocab_size,
                   " tokens (0 samples among all of them)");
    const char* unit = char_level ? "characters" : "words";
    for (std::size_t i = 0; i < texts.size(); ++i) {
      std::vector<std::int32_t> ids = v.encode(texts[i]);
      const std::string which = texts.size() > 1 ? " line " + std::to_string(i + 1) : "";
      GRAPHMOE_CHECK(!ids.empty(), "generate", prompt_flag, which, " holds no ",
                     char_level ? "character" : "word", ": give at least one");
      GRAPHMOE_CHECK(static_cast<index_t>(ids.size()) <= in.config.max_seq_len, "generate",
                     prompt_flag, which, " is ", ids.size(), " ", unit,
                     ", longer than the model's context of max_seq_len = ", in.config.max_seq_len);
      const std::size_t unknown = static_cast<std::size_t>(std::count(ids.begin(), ids.end(), v.unk));
      std::fprintf(stderr, "generate: prompt%s (%zu %s%s): %s\n",
                   texts.size() > 1 ? (" " + std::to_string(i)).c_str() : "", ids.size(), unit,
                   unknown > 0 ? (", " + std::to_string(unknown) + " not in the vocabulary, read as <unk>").c_str() : "",
                   v.decode(ids).c_str());
      for (index_t k = 0; k < num_samples; ++k) in.prompts.push_back(ids);
    }
    in.stop = std::move(v.stop);
    gen.sampling.banned = std::move(v.banned);
    in.options = gen;
    in.printer = v.printer;
    in.label = v.label;
    in.batch = in.prompts.size() > 1;
    return with_router(in.router, [&]<class Policy>() {
      return examples::on_device<Policy>("generate", device, in.router, [&]<class B>() {
        return generate_cli::run<Policy, B>(in);
      });
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate: error: %s\n", e.what());
    return 1;
  }
}
