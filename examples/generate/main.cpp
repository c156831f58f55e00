// generate: text from a trained train_lm checkpoint, streamed to stdout.
//
//   generate --checkpoint runs/lm/checkpoint.safetensors --vocab runs/lm/vocab.txt
//            --prompt "the king said" --max-new-tokens 40 --seed 1 --temperature 0.8 --top-k 40
//
// Loads any train_lm checkpoint (its router, shape and word or character vocabulary come from the
// checkpoint's metadata; the router must be one this binary is built for, GRAPHMOE_EXAMPLE_ROUTERS),
// encodes the prompt with the vocabulary train_lm wrote beside it, and samples with
// graphmoe::generate (graphmoe/inference/generate.hpp): by default the incremental decoder (a KV
// cache per attention layer and a routing cache per MoE layer, O(t) per token); --decoder full runs
// a full forward over the context per token (the O(t^2) reference; the same tokens). stdout
// receives the generated text only, each token as soon as it is drawn (words: separated by
// spaces, <eos> as a line break; characters: the bytes); stderr the prompt as the model reads it,
// and the count, time and tokens/s. --explain prints instead one line per generated token: its
// position and text, and per MoE block the experts it was routed to with their gates and, for a
// graph router, the earlier tokens with the largest weights in its row of S or A^p:
//   [7] "king" | block 0: experts 3 (0.61) 1 (0.39); from [6] "the" 0.42 [2] "said" 0.18 ...
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/cli_checks.hpp"
#include "common/device_dispatch.hpp"
#include "common/lm_config.hpp"
#include "common/vocabulary.hpp"
#include "generate/run.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"

using namespace graphmoe;

namespace {

inline constexpr index_t kMaxNewTokens = 1'000'000;
inline constexpr double kMaxTemperature = 1000.0;  // beyond, every kept token is equally likely
inline constexpr double kMaxPenalty = 1000.0;      // --repeat-penalty, |--frequency/presence-penalty|

// The prompt's ids and the text of generated ids, for the checkpoint's kind of vocabulary.
struct Vocabulary {
  std::size_t size = 0;
  std::string prompt_text;                // the prompt as the model reads it (unknowns as <unk>)
  std::size_t unknown = 0;                // prompt tokens outside the vocabulary
  std::vector<std::int32_t> prompt, banned;
  std::vector<std::string> stop;          // --stop texts as printed (<eos>: a line break)
  std::function<std::string(std::int32_t)> text;
  std::function<std::string(std::int32_t)> label;  // an id quoted, for --explain
  std::string fingerprint;                // the tokenizer's (with the normalisation it reads with)
};

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

Vocabulary word_vocabulary(const std::string& path, const std::string& prompt,
                           const std::vector<std::string>& stops, const std::vector<std::string>& bans,
                           const TextNormalisation& norm) {
  auto loaded = WordTokenizer::load(path);
  loaded.set_normalisation(norm);  // prompts read as the training text was
  auto tok = std::make_shared<const WordTokenizer>(std::move(loaded));
  Vocabulary v;
  v.size = tok->size();
  v.fingerprint = tok->fingerprint();
  // the prompt's lines, each but the last followed by <eos> (as train_lm reads a text file)
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = prompt.find('\n', begin);
    const std::string line = prompt.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const std::vector<std::int32_t> ids = tok->encode_line(line);
    v.prompt.insert(v.prompt.end(), ids.begin(), ids.end());
    if (end == std::string::npos) break;
    v.prompt.push_back(tok->eos());
    begin = end + 1;
  }
  for (std::int32_t id : v.prompt) v.unknown += id == tok->unk();
  v.prompt_text = tok->decode(v.prompt);
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
  auto line_start = std::make_shared<bool>(v.prompt.empty() || v.prompt.back() == tok->eos());
  v.text = [tok, line_start](std::int32_t id) {
    if (id == tok->eos()) {
      *line_start = true;
      return std::string("\n");
    }
    std::string s = *line_start ? "" : " ";
    *line_start = false;
    return s + tok->decode(id);
  };
  v.label = [tok](std::int32_t id) { return quoted(tok->decode(id)); };
  return v;
}

Vocabulary char_vocabulary(const std::string& path, const std::string& prompt,
                           const std::vector<std::string>& stops, const std::vector<std::string>& bans,
                           const TextNormalisation& norm) {
  auto loaded = CharTokenizer::load(path);
  loaded.set_normalisation(norm);
  auto tok = std::make_shared<const CharTokenizer>(std::move(loaded));
  Vocabulary v;
  v.size = tok->size();
  v.fingerprint = tok->fingerprint();
  v.prompt = tok->encode(prompt);
  for (std::int32_t id : v.prompt) v.unknown += id == tok->unk();
  v.prompt_text = tok->decode(v.prompt);
  for (const std::string& s : stops) v.stop.push_back(normalised_stop(s, norm));
  for (const std::string& b : bans) {
    const bool unk = b == "<unk>";
    GRAPHMOE_CHECK(unk || (b.size() == 1 && tok->id(b[0]) != tok->unk()), "generate", "--ban '", b,
                   "' is not one character of the vocabulary '", path, "' (nor <unk>)");
    v.banned.push_back(unk ? tok->unk() : tok->id(b[0]));
  }
  v.text = [tok](std::int32_t id) { return tok->decode(id); };
  v.label = [tok](std::int32_t id) { return quoted(tok->decode(id)); };
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, vocab, prompt;
  std::vector<std::string> stops, bans;
  GenerateOptions gen;
  gen.max_new_tokens = 50;
  gen.sampling.seed = 1;
  int threads = 2;
  CLI::App app{"Generate text from a train_lm checkpoint (graphmoe)"};
  app.add_option("--checkpoint", checkpoint, "the model (a train_lm checkpoint.safetensors)")->required()->check(CLI::ExistingFile);
  app.add_option("--vocab", vocab, "its vocabulary (the vocab.txt train_lm wrote beside it)")->required()->check(CLI::ExistingFile);
  app.add_option("--prompt", prompt, "the text to continue (words, or characters for a --char model)")->required();
  app.add_option("--max-new-tokens", gen.max_new_tokens, "tokens to generate at most")->check(examples::integer<index_t>(1, kMaxNewTokens));
  app.add_option("--seed", gen.sampling.seed, "random seed of the draws")->check(examples::seed());
  auto* greedy = app.add_flag("--greedy", gen.sampling.greedy, "always the most probable token (no sampling)");
  app.add_option("--temperature", gen.sampling.temperature, "softmax temperature (1: the model's distribution)")->check(examples::positive_real(kMaxTemperature))->excludes(greedy);
  app.add_option("--top-k", gen.sampling.top_k, "sample among the k most probable tokens (0: all)")->check(examples::integer<index_t>(0, examples::kMaxCount))->excludes(greedy);
  app.add_option("--top-p", gen.sampling.top_p, "sample among the smallest set of most probable tokens of mass >= p (1: all)")->check(examples::positive_real(1.0))->excludes(greedy);
  app.add_option("--stop", stops, "stop once the generated text holds this text (any text, <eos> a line break in a word model; repeatable); the output ends with it")
      ->check(CLI::Validator([](std::string& t) { return t.empty() ? std::string("an empty --stop would match anywhere") : std::string(); }, "TEXT"));
  auto& so = gen.sampling;
  app.add_option("--repeat-penalty", so.repeat_penalty, "divide the positive logits, multiply the negative ones, of the tokens in the last --repeat-last-n by this (1: off)")->check(examples::positive_real(kMaxPenalty));
  app.add_option("--repeat-last-n", so.repeat_last_n, "the window of the penalties: the last n tokens of the context, prompt included (0: penalties off, -1: the whole context)")->check(examples::integer<index_t>(-1, examples::kMaxCount));
  app.add_option("--frequency-penalty", so.frequency_penalty, "subtract this x the count of each token in the window from its logit (0: off)")->check(examples::real(-kMaxPenalty, kMaxPenalty));
  app.add_option("--presence-penalty", so.presence_penalty, "subtract this from the logit of each token in the window (0: off)")->check(examples::real(-kMaxPenalty, kMaxPenalty));
  app.add_option("--min-p", so.min_p, "drop the tokens less probable than p x the most probable one (0: off)")->check(examples::real(0.0, 1.0))->excludes(greedy);
  app.add_option("--ban", bans, "never generate this token (a word, <unk>, <eos>, or one character; repeatable)");
  app.add_option("--threads", threads, "CPU threads")->check(examples::threads());
  std::string device = "cpu";
  app.add_option("--device", device, "where to run the model: " + examples::device_help())
      ->check(CLI::IsMember({"cpu", "cuda"}));
  std::string decoder = "incremental";
  app.add_option("--decoder", decoder, "incremental (KV and routing caches) or full (a full forward per token)")
      ->check(CLI::IsMember({"incremental", "full"}));
  app.add_flag("--explain", gen.explain, "one line per generated token: its experts and, for graph routers, the earlier tokens it was routed by");
  app.add_option("--explain-sources", gen.explain_sources, "earlier tokens shown per MoE block with --explain")->check(examples::integer<index_t>(1, 64));
  CLI11_PARSE(app, argc, argv);
  try {
    set_num_threads(threads);
    gen.decoding = decoder == "full" ? Decoding::FullForward : Decoding::Incremental;
    GRAPHMOE_CHECK(!gen.explain || gen.decoding == Decoding::Incremental, "generate",
                   "--explain needs --decoder incremental (the routing caches hold the graph weights)");
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
    Vocabulary v = char_level ? char_vocabulary(vocab, prompt, stops, bans, norm)
                              : word_vocabulary(vocab, prompt, stops, bans, norm);
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
    GRAPHMOE_CHECK(!v.prompt.empty(), "generate", "--prompt holds no ",
                   char_level ? "character" : "word", ": give at least one");
    GRAPHMOE_CHECK(static_cast<index_t>(v.prompt.size()) <= in.config.max_seq_len, "generate",
                   "--prompt is ", v.prompt.size(), char_level ? " characters" : " words",
                   ", longer than the model's context of max_seq_len = ", in.config.max_seq_len);
    GRAPHMOE_CHECK(gen.sampling.top_k <= in.config.vocab_size, "generate", "--top-k ",
                   gen.sampling.top_k, " exceeds the vocabulary of ", in.config.vocab_size,
                   " tokens (0 samples among all of them)");
    std::fprintf(stderr, "generate: prompt (%zu %s%s): %s\n", v.prompt.size(),
                 char_level ? "characters" : "words",
                 v.unknown > 0 ? (", " + std::to_string(v.unknown) + " not in the vocabulary, read as <unk>").c_str() : "",
                 v.prompt_text.c_str());
    in.prompt = std::move(v.prompt);
    in.stop = std::move(v.stop);
    gen.sampling.banned = std::move(v.banned);
    in.options = gen;
    in.text = v.text;
    in.label = v.label;
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
