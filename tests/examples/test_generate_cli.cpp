// examples/generate on tiny train_lm checkpoints written by the test (seconds): it generates from a
// word-level and a character-level model, streams exactly --max-new-tokens tokens of the
// vocabulary, repeats itself for a seed, stops at --stop, and refuses absurd command lines and
// broken checkpoints with a non-zero exit and a message naming the option, file or field.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <utility>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "examples_routers.hpp"  // generated: built_for_cpu<Policy>, the examples' CPU routers
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "support/processes.hpp"

#if !defined(GRAPHMOE_TRAIN_LM) || !defined(GRAPHMOE_GENERATE)
#error "GRAPHMOE_TRAIN_LM and GRAPHMOE_GENERATE (the executables) must be defined by CMake"
#endif

using namespace graphmoe;

namespace {

const std::string kTrainLM = GRAPHMOE_TRAIN_LM;
const std::string kGenerate = GRAPHMOE_GENERATE;

using test::check_refused;
using test::Result;
using test::Scratch;

Result run(const Scratch& s, const std::string& exe, const std::vector<std::string>& args) {
  return test::run_program(s, "", exe, args, 120);
}


// A tiny train_lm run (about a second); char: a character-level model.
void train(const Scratch& s, const std::string& out, bool char_level,
           const std::string& router = "softmax", const std::vector<std::string>& extra = {}) {
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  std::vector<std::string> args = {
      "--train", corpus, "--test", "", "--valid-fraction", "0.5", "--router", router,
      "--layers", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8", "--experts", "2",
      "--top-k", "1", "--seq", "8", "--batch", "2", "--steps", "20", "--warmup", "0",
      "--eval-every", "0", "--threads", "1", "--out", out};
  if (char_level) args.push_back("--char");
  args.insert(args.end(), extra.begin(), extra.end());
  const Result r = run(s, kTrainLM, args);
  INFO(r.text());
  REQUIRE(r.status == 0);
}

std::vector<std::string> gen_args(const std::string& dir, const std::string& prompt,
                                  std::vector<std::string> extra) {
  std::vector<std::string> a = {"--checkpoint", dir + "/checkpoint.safetensors", "--vocab",
                                dir + "/vocab.txt", "--prompt", prompt, "--threads", "1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// The words and line breaks of generated word-level text: the number of tokens it shows.
std::size_t count_tokens(const std::string& out, std::set<std::string>* words) {
  REQUIRE(!out.empty());
  REQUIRE(out.back() == '\n');  // generate ends its output with a line break
  const std::string text = out.substr(0, out.size() - 1);
  std::size_t n = 0;
  std::string w;
  for (char c : text + " ") {
    if (c == ' ' || c == '\n') {
      if (!w.empty()) {
        words->insert(w);
        ++n;
        w.clear();
      }
      n += c == '\n';  // <eos>
    } else {
      w += c;
    }
  }
  return n;
}

// Rewrites the checkpoint `src` to `dst` after edit(tensors, metadata).
void rewrite(const std::string& src, const std::string& dst,
             const std::function<void(std::map<std::string, LoadedTensor>&,
                                      std::map<std::string, std::string>&)>& edit) {
  const SafetensorsFile f = load_safetensors(src);
  std::map<std::string, LoadedTensor> tensors = f.tensors;
  std::map<std::string, std::string> meta = f.metadata;
  edit(tensors, meta);
  std::vector<TensorRef> refs;
  for (const auto& [name, t] : tensors) refs.push_back({name, t.dtype, t.shape, t.bytes.data()});
  save_safetensors(dst, refs, meta);
}

}  // namespace

TEST_CASE("generate: a word-level train_lm checkpoint generates --max-new-tokens words of its vocabulary, the same for a seed") {
  Scratch s("generate_words");
  const std::string dir = s / "lm";
  train(s, dir, false);
  const Result a = run(s, kGenerate, gen_args(dir, "the cat sat", {"--max-new-tokens", "12", "--seed", "3", "--temperature", "0.9", "--top-k", "8"}));
  INFO(a.text());
  REQUIRE(a.status == 0);
  std::set<std::string> words;
  CHECK(count_tokens(a.out, &words) == 12);
  std::set<std::string> known(test::kCorpusWords.begin(), test::kCorpusWords.end());
  known.insert("<unk>");
  for (const std::string& w : words) {
    CAPTURE(w);
    CHECK(known.count(w) == 1);
  }
  CHECK(a.err.find("generate: prompt (3 words): the cat sat") != std::string::npos);
  CHECK(a.err.find("generate: 12 tokens in ") != std::string::npos);
  CHECK(a.err.find("tokens/s") != std::string::npos);
  // the same seed: the same text; another seed: another (12 draws among 8 tokens)
  const Result b = run(s, kGenerate, gen_args(dir, "the cat sat", {"--max-new-tokens", "12", "--seed", "3", "--temperature", "0.9", "--top-k", "8"}));
  CHECK(b.status == 0);
  CHECK(b.out == a.out);
  const Result c = run(s, kGenerate, gen_args(dir, "the cat sat", {"--max-new-tokens", "12", "--seed", "4", "--temperature", "0.9", "--top-k", "8"}));
  CHECK(c.status == 0);
  CHECK(c.out != a.out);
  // a word outside the vocabulary is read as <unk>, and said so
  const Result u = run(s, kGenerate, gen_args(dir, "the zebra", {"--max-new-tokens", "2"}));
  CHECK(u.status == 0);
  CHECK(u.err.find("1 not in the vocabulary, read as <unk>): the <unk>") != std::string::npos);
}

TEST_CASE("generate: checkpoints of a modern preset and of a bias-free router rebuild their model") {
  // the checkpoint's config records what the model was built with (router_bias false among the
  // modern fields), so that generate rebuilds the same parameters; a missing or extra tensor would
  // be refused by name
  Scratch s("generate_modern");
  for (const auto& [name, extra] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"olmoe", {"--arch", "olmoe", "--expert-d-ff", "4"}},
           {"gpt-router-bias-false", {"--router-bias", "false"}}}) {
    CAPTURE(name);
    const std::string dir = s / name;
    train(s, dir, false, "softmax", extra);
    std::ifstream ckpt(dir + "/checkpoint.safetensors", std::ios::binary);  // its metadata
    const std::string text((std::istreambuf_iterator<char>(ckpt)), std::istreambuf_iterator<char>());
    CHECK(text.find("router_bias") != std::string::npos);
    const Result g = run(s, kGenerate, gen_args(dir, "the cat", {"--greedy", "--max-new-tokens", "4"}));
    INFO(g.text());
    CHECK(g.status == 0);
    std::set<std::string> words;
    CHECK(count_tokens(g.out, &words) == 4);
  }
}

TEST_CASE("generate: --stop ends at the first stop token, and a character-level checkpoint generates characters") {
  Scratch s("generate_stop");
  const std::string dir = s / "lm";
  train(s, dir, false);
  // greedy: the first word drawn, then stop at it
  const Result g = run(s, kGenerate, gen_args(dir, "the", {"--greedy", "--max-new-tokens", "5"}));
  INFO(g.text());
  REQUIRE(g.status == 0);
  CHECK(g.err.find("generate: seed ") == std::string::npos);  // --greedy draws nothing: no seed
  std::set<std::string> words;
  REQUIRE(count_tokens(g.out, &words) == 5);
  std::istringstream first_word(g.out);
  std::string first;
  first_word >> first;
  const bool eos_first = g.out.rfind("\n", 0) == 0;
  const std::string stop = eos_first ? "<eos>" : first;
  const Result st = run(s, kGenerate, gen_args(dir, "the", {"--greedy", "--max-new-tokens", "5", "--stop", stop}));
  INFO(st.text());
  CHECK(st.status == 0);
  CHECK(st.err.find("generate: 1 tokens in ") != std::string::npos);
  CHECK(st.err.find("stopped at --stop '") != std::string::npos);
  CHECK(st.out == (eos_first ? "\n\n" : " " + first + "\n"));

  const std::string cdir = s / "char";
  train(s, cdir, true);
  const Result c = run(s, kGenerate, gen_args(cdir, "the c", {"--max-new-tokens", "20", "--seed", "2"}));
  INFO(c.text());
  CHECK(c.status == 0);
  CHECK(c.err.find("generate: prompt (5 characters): the c") != std::string::npos);
  CHECK(c.err.find("generate: 20 tokens in ") != std::string::npos);
  // every byte is one of the corpus's (or of "<unk>", the unknown id's text)
  const std::string allowed = "abcdefghilmnorstvwy <>uk\n";
  for (char ch : c.out) {
    CAPTURE(static_cast<int>(ch));
    CHECK(allowed.find(ch) != std::string::npos);
  }
}

TEST_CASE("generate: --decoder full draws the incremental decoder's text, --explain one routing line per token, train_lm a sample") {
  Scratch s("generate_explain");
  const std::string dir = s / "lm";
  // a Similarity router the examples are built for (CI builds xmoe-similarity, not similarity)
  std::string router;
  for (const std::string& r : router_names())
    if (router.empty() && r.find("similarity") != std::string::npos &&
        with_router(r, []<class P>() { return examples::built_for_cpu<P>; }))
      router = r;
  REQUIRE(!router.empty());
  train(s, dir, false, router);
  const std::vector<std::string> opts = {"--max-new-tokens", "6", "--seed", "5", "--temperature", "0.9"};
  const Result inc = run(s, kGenerate, gen_args(dir, "the cat", opts));
  std::vector<std::string> full_opts = opts;
  full_opts.insert(full_opts.end(), {"--decoder", "full"});
  const Result full = run(s, kGenerate, gen_args(dir, "the cat", full_opts));
  INFO(inc.text(), full.text());
  REQUIRE(inc.status == 0);
  REQUIRE(full.status == 0);
  CHECK(inc.out == full.out);
  CHECK(inc.err.find("incremental: KV and routing caches") != std::string::npos);
  CHECK(full.err.find("a full forward per token") != std::string::npos);
  std::vector<std::string> ex_opts = opts;
  ex_opts.push_back("--explain");
  const Result ex = run(s, kGenerate, gen_args(dir, "the cat", ex_opts));
  INFO(ex.text());
  REQUIRE(ex.status == 0);
  std::istringstream lines(ex.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    CAPTURE(line);
    // "[2] "word" | block 0: experts e (g); from [j] "w" x ..." (a 1-layer similarity model, top-1)
    CHECK(line.rfind("[" + std::to_string(2 + n) + "] \"", 0) == 0);
    CHECK(line.find(" | block 0: experts ") != std::string::npos);
    CHECK(line.find("; from [") != std::string::npos);
    ++n;
  }
  CHECK(n == 6);
  check_refused(run(s, kGenerate, gen_args(dir, "the cat", {"--explain", "--decoder", "full"})),
                {"--explain needs --decoder incremental"});
  check_refused(run(s, kGenerate, gen_args(dir, "the cat", {"--decoder", "fast"})), {"--decoder"});
  // train_lm's own sample: one line at the end of its output
  const std::string corpus = s / "corpus.txt";
  const Result t = run(s, kTrainLM, {"--train", corpus, "--test", "", "--valid-fraction", "0.5",
                                     "--layers", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8",
                                     "--experts", "2", "--top-k", "1", "--seq", "8", "--batch", "2",
                                     "--steps", "4", "--warmup", "0", "--eval-every", "0",
                                     "--threads", "1", "--sample-tokens", "5", "--out", s / "lm2"});
  INFO(t.text());
  REQUIRE(t.status == 0);
  const std::size_t at = t.out.find("\nsample: ");
  REQUIRE(at != std::string::npos);
  CHECK(t.out.find(" >>> ", at) != std::string::npos);
}

TEST_CASE("generate: absurd command lines and broken checkpoints are refused, naming the option, file or field") {
  Scratch s("generate_refusals");
  const std::string dir = s / "lm";
  train(s, dir, false);
  const std::string ckpt = dir + "/checkpoint.safetensors";
  auto refused = [&](const std::vector<std::string>& extra, const std::string& message,
                     const std::string& prompt = "the cat") {
    CAPTURE(message);
    check_refused(run(s, kGenerate, gen_args(dir, prompt, extra)), {message});
  };
  refused({"--max-new-tokens", "0"}, "--max-new-tokens: value 0 is out of range; expected an integer in [1, 1000000]");
  refused({"--max-new-tokens", "99999999999999999999"}, "--max-new-tokens: value '99999999999999999999' is out of range");
  refused({"--max-new-tokens", "-3"}, "--max-new-tokens: value -3 is out of range");
  refused({"--temperature", "0"}, "--temperature: value 0 is out of range; expected a number in (0, 1000]");
  refused({"--temperature", "nan"}, "--temperature: value 'nan' is out of range");
  refused({"--temperature", "-1"}, "--temperature: value -1 is out of range");
  refused({"--top-p", "0"}, "--top-p: value 0 is out of range; expected a number in (0, 1]");
  refused({"--top-p", "1.5"}, "--top-p: value 1.5 is out of range");
  refused({"--top-k", "-1"}, "--top-k: value -1 is out of range");
  refused({"--top-k", "1000"}, "--top-k 1000 exceeds the vocabulary of 17 tokens");
  refused({"--seed", "-1"}, "--seed: value '-1' is negative");
  refused({"--greedy", "--temperature", "0.5"}, "--greedy excludes --temperature");
  refused({"--stop", ""}, "--stop: an empty --stop would match anywhere");
  refused({"--ban", "zebra"}, "--ban 'zebra' is not a word of the vocabulary");
  refused({"--repeat-penalty", "0"}, "--repeat-penalty: value 0 is out of range");
  refused({"--repeat-penalty", "nan"}, "--repeat-penalty: value 'nan' is out of range");
  refused({"--repeat-last-n", "-2"}, "--repeat-last-n: value -2 is out of range; expected an integer in [-1, ");
  refused({"--frequency-penalty", "inf"}, "--frequency-penalty: value 'inf' is out of range");
  refused({"--presence-penalty", "1e9"}, "--presence-penalty: value 1e9 is out of range");
  refused({"--min-p", "1.5"}, "--min-p: value 1.5 is out of range; expected a number in [0, 1]");
  refused({"--greedy", "--min-p", "0.1"}, "--greedy excludes --min-p");
  refused({}, "--prompt is 9 words, longer than the model's context of max_seq_len = 8",
          "the cat sat on a mat the dog ran");
  refused({}, "--prompt holds no word", "   ");
  check_refused(run(s, kGenerate, {"--checkpoint", ckpt, "--vocab", dir + "/vocab.txt"}),
                {"give the prompt: --prompt TEXT, --prompt-file FILE or --prompts-file FILE"});
  // files: a text file as the checkpoint, the corpus as the vocabulary, a char vocabulary
  check_refused(run(s, kGenerate, {"--checkpoint", s / "corpus.txt", "--vocab", dir + "/vocab.txt", "--prompt", "the"}),
                {"corpus.txt"});
  check_refused(run(s, kGenerate, {"--checkpoint", ckpt, "--vocab", s / "corpus.txt", "--prompt", "the"}),
                {"expected the header 'graphmoe::WordTokenizer v1 <size>'"});
  // checkpoints: an unknown router, NaN weights, no metadata
  const std::string bad = s / "bad.safetensors";
  rewrite(ckpt, bad, [](auto&, auto& meta) {
    auto cfg = nlohmann::json::parse(meta.at("config"));
    cfg["router"] = "nonsense";
    meta["config"] = cfg.dump();
  });
  check_refused(run(s, kGenerate, {"--checkpoint", bad, "--vocab", dir + "/vocab.txt", "--prompt", "the"}),
                {"config field 'router' is 'nonsense', not a known router"});
  rewrite(ckpt, bad, [](auto& tensors, auto&) {
    LoadedTensor& t = tensors.at("model.tok_emb.weight");
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(t.bytes.data() + 4, &nan, 4);
  });
  check_refused(run(s, kGenerate, {"--checkpoint", bad, "--vocab", dir + "/vocab.txt", "--prompt", "the"}),
                {"model tensor 'model.tok_emb.weight' holds nan at element 1"});
  rewrite(ckpt, bad, [](auto&, auto& meta) { meta.clear(); });
  check_refused(run(s, kGenerate, {"--checkpoint", bad, "--vocab", dir + "/vocab.txt", "--prompt", "the"}),
                {"has no 'config' and 'step' metadata: is it a train_lm checkpoint?"});
}

TEST_CASE("generate: every router built into the examples generates past the context window, the others are refused by name") {
  Scratch s("generate_routers");
  const std::string soft = s / "softmax";
  train(s, soft, false);
  int built = 0;
  std::string built_names;  // as the user types them
  for (const std::string& r : router_names())
    if (with_router(r, []<class P>() { return examples::built_for_cpu<P>; }))
      built_names += (built_names.empty() ? "" : ", ") + r;
  for (const std::string& router : router_names()) {
    CAPTURE(router);
    const bool is_built = with_router(router, []<class P>() { return examples::built_for_cpu<P>; });
    if (is_built) {
      ++built;
      const std::string dir = s / router;
      if (router != "softmax") train(s, dir, false, router);
      // prompt 3 + 12 tokens > --seq 8: the window slides
      const Result r = run(s, kGenerate, gen_args(router == "softmax" ? soft : dir, "the cat sat",
                                                  {"--max-new-tokens", "12", "--top-p", "0.9"}));
      INFO(r.text());
      CHECK(r.status == 0);
      CHECK(r.err.find("generate: " + router + " model (step 20)") != std::string::npos);
      std::set<std::string> words;
      CHECK(count_tokens(r.out, &words) == 12);
    } else {
      // the softmax checkpoint relabelled: refused before the model is built, naming the routers
      const std::string bad = s / "relabelled.safetensors";
      rewrite(soft + "/checkpoint.safetensors", bad, [&](auto&, auto& meta) {
        auto cfg = nlohmann::json::parse(meta.at("config"));
        cfg["router"] = router;
        meta["config"] = cfg.dump();
      });
      check_refused(run(s, kGenerate, {"--checkpoint", bad, "--vocab", soft + "/vocab.txt", "--prompt", "the"}),
                    {"router '" + router + "' is not built in this binary (built: " + built_names});
    }
  }
  CHECK(built >= 1);
}

// The tokens of generated word-level text in order, <eos> for a line break (the final one left out).
std::vector<std::string> tokens_of(const std::string& out) {
  std::vector<std::string> t;
  std::string w;
  for (char c : out.substr(0, out.size() - 1) + " ") {
    if (c == ' ' || c == '\n') {
      if (!w.empty()) t.push_back(w);
      w.clear();
      if (c == '\n') t.push_back("<eos>");
    } else {
      w += c;
    }
  }
  return t;
}

TEST_CASE("generate: penalties, --min-p and --ban change what is drawn as defined, and --stop text spanning tokens ends the output at its end") {
  Scratch s("generate_sampling");
  const std::string dir = s / "lm";
  train(s, dir, false);
  const Result g = run(s, kGenerate, gen_args(dir, "the cat", {"--greedy", "--max-new-tokens", "10"}));
  INFO(g.text());
  REQUIRE(g.status == 0);
  const std::vector<std::string> greedy = tokens_of(g.out);
  REQUIRE(greedy.size() == 10);
  // a presence penalty of 1000 over the whole context: no token twice, the prompt's included
  const Result p = run(s, kGenerate, gen_args(dir, "the cat", {"--greedy", "--max-new-tokens", "10", "--presence-penalty", "1000", "--repeat-last-n", "-1"}));
  INFO(p.text());
  REQUIRE(p.status == 0);
  std::vector<std::string> seen = tokens_of(p.out);
  REQUIRE(seen.size() == 10);
  seen.insert(seen.end(), {"the", "cat"});
  std::set<std::string> distinct(seen.begin(), seen.end());
  CHECK(distinct.size() == seen.size());
  // the greedy loop repeats itself (else the check above shows nothing)
  std::set<std::string> greedy_distinct(greedy.begin(), greedy.end());
  CHECK(greedy_distinct.size() < greedy.size());
  // --repeat-penalty changes greedy text; --repeat-last-n 0 turns it off
  const Result rp = run(s, kGenerate, gen_args(dir, "the cat", {"--greedy", "--max-new-tokens", "10", "--repeat-penalty", "50"}));
  CHECK(rp.status == 0);
  CHECK(rp.out != g.out);
  const Result off = run(s, kGenerate, gen_args(dir, "the cat", {"--greedy", "--max-new-tokens", "10", "--repeat-penalty", "50", "--repeat-last-n", "0"}));
  CHECK(off.out == g.out);
  // --min-p 1 keeps the most probable token only: the greedy text at any temperature and seed
  const Result m = run(s, kGenerate, gen_args(dir, "the cat", {"--min-p", "1", "--temperature", "3", "--seed", "9", "--max-new-tokens", "10"}));
  CHECK(m.status == 0);
  CHECK(m.out == g.out);
  // --ban the most frequent token of 40 hot draws: never drawn in 40 hot draws with it banned
  const Result unbanned = run(s, kGenerate, gen_args(dir, "the cat", {"--temperature", "2", "--max-new-tokens", "40", "--seed", "2"}));
  REQUIRE(unbanned.status == 0);
  const std::vector<std::string> hot2 = tokens_of(unbanned.out);
  std::map<std::string, int> counts;
  for (const std::string& t : hot2) ++counts[t];
  std::string banned = "<eos>";
  for (const auto& [t, c] : counts)
    if (c > counts[banned]) banned = t;
  REQUIRE(counts[banned] > 0);
  const Result b = run(s, kGenerate, gen_args(dir, "the cat", {"--ban", banned, "--ban", "<unk>", "--temperature", "2", "--max-new-tokens", "40", "--seed", "2"}));
  INFO(b.text());
  REQUIRE(b.status == 0);
  const std::vector<std::string> hot = tokens_of(b.out);
  CHECK(hot.size() == 40);
  CHECK(std::count(hot.begin(), hot.end(), banned) == 0);
  CHECK(std::count(hot.begin(), hot.end(), "<unk>") == 0);
  // --stop: the last letter of the 3rd word, the space, the first letter of the 4th
  const std::string text = g.out.substr(0, g.out.size() - 1);
  std::size_t at = 0;
  for (int w = 0; w < 3; ++w) at = text.find_first_of(" \n", at + 1);
  const std::string stop = text.substr(at - 1, 3);
  const std::size_t end = text.find(stop) + stop.size();
  const Result st = run(s, kGenerate, gen_args(dir, "the cat", {"--greedy", "--max-new-tokens", "10", "--stop", "nothing like it", "--stop", stop}));
  INFO(st.text());
  CHECK(st.status == 0);
  CHECK(st.out == text.substr(0, end) + "\n");
  CHECK(st.err.find("stopped at --stop '" + stop + "'") != std::string::npos);
}

namespace {

// A tiny word-level train_lm run on `corpus` (as train(), with extra arguments).
void train_on(const Scratch& s, const std::string& out, const std::string& corpus,
              const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {
      "--train", corpus, "--test", "", "--valid-fraction", "0.5", "--layers", "1", "--d-model", "8",
      "--heads", "2", "--d-ff", "8", "--experts", "2", "--top-k", "1", "--seq", "8", "--batch", "2",
      "--steps", "20", "--warmup", "0", "--eval-every", "0", "--threads", "1", "--out", out};
  args.insert(args.end(), extra.begin(), extra.end());
  const Result r = run(s, kTrainLM, args);
  INFO(r.text());
  REQUIRE(r.status == 0);
}

// Each line of `src` rewritten by f into `dst`.
void rewrite_lines(const std::string& src, const std::string& dst,
                   const std::function<std::string(const std::string&)>& f) {
  std::ifstream in(src);
  std::ofstream out(dst);
  for (std::string line; std::getline(in, line);) out << f(line) << "\n";
}

nlohmann::json vocabulary_of(const std::string& ckpt) {
  return nlohmann::json::parse(load_safetensors(ckpt).metadata.at("vocabulary"));
}

}  // namespace

TEST_CASE("generate: a vocabulary other than the checkpoint's, of the same size, is refused naming both, either way, and a checkpoint without the record loads with a warning") {
  Scratch s("generate_vocab");
  const std::string a = s / "a", b = s / "b";
  train(s, a, false);
  // the same words, each renamed to the next: the same size, other ids
  rewrite_lines(s / "corpus.txt", s / "renamed.txt", [](const std::string& line) {
    std::istringstream in(line);
    std::string out, w;
    while (in >> w) {
      const auto it = std::find(test::kCorpusWords.begin(), test::kCorpusWords.end(), w);
      const std::size_t i = static_cast<std::size_t>(it - test::kCorpusWords.begin());
      out += (out.empty() ? "" : " ") + test::kCorpusWords[(i + 1) % test::kCorpusWords.size()];
    }
    return out;
  });
  train_on(s, b, s / "renamed.txt");
  const nlohmann::json va = vocabulary_of(a + "/checkpoint.safetensors"), vb = vocabulary_of(b + "/checkpoint.safetensors");
  CHECK(va.at("size") == 17);
  CHECK(vb.at("size") == 17);
  CHECK(va.at("kind") == "word");
  CHECK(va.at("normalisation") == "none");
  const std::string fa = va.at("fingerprint"), fb = vb.at("fingerprint");
  CHECK(fa != fb);
  CHECK(std::string(va.at("file")).find("/a/vocab.txt") != std::string::npos);
  // A's model with B's vocabulary, and B's with A's
  check_refused(run(s, kGenerate, {"--checkpoint", a + "/checkpoint.safetensors", "--vocab", b + "/vocab.txt", "--prompt", "the"}),
                {"the vocabulary '" + b + "/vocab.txt' (17 entries, " + fb + ") is not the one the model '" + a +
                     "/checkpoint.safetensors' was trained with (17 entries, " + fa, "pass the vocab.txt train_lm wrote"});
  check_refused(run(s, kGenerate, {"--checkpoint", b + "/checkpoint.safetensors", "--vocab", a + "/vocab.txt", "--prompt", "the"}),
                {"the vocabulary '" + a + "/vocab.txt' (17 entries, " + fa + ") is not the one the model '" + b +
                     "/checkpoint.safetensors' was trained with (17 entries, " + fb});
  // the right pair generates, with no warning
  const Result ok = run(s, kGenerate, gen_args(b, "the", {"--max-new-tokens", "3"}));
  CHECK(ok.status == 0);
  CHECK(ok.err.find("warning") == std::string::npos);
  // a checkpoint written before the record: loads, with a warning (any vocabulary of its size)
  const std::string old = s / "old.safetensors";
  rewrite(a + "/checkpoint.safetensors", old, [](auto&, auto& meta) { meta.erase("vocabulary"); });
  const Result o = run(s, kGenerate, {"--checkpoint", old, "--vocab", a + "/vocab.txt", "--prompt", "the", "--max-new-tokens", "3"});
  INFO(o.text());
  CHECK(o.status == 0);
  CHECK(o.err.find("generate: warning: '" + old + "' records no vocabulary fingerprint") != std::string::npos);
  // hostile records
  const std::string bad = s / "bad.safetensors";
  auto refused_record = [&](const std::string& record, const std::string& message) {
    CAPTURE(record);
    rewrite(a + "/checkpoint.safetensors", bad, [&](auto&, auto& meta) { meta["vocabulary"] = record; });
    check_refused(run(s, kGenerate, {"--checkpoint", bad, "--vocab", a + "/vocab.txt", "--prompt", "the"}), {message});
  };
  refused_record("{", "metadata field 'vocabulary' is not JSON");
  refused_record("[1]", "metadata field 'vocabulary' is not a JSON object");
  nlohmann::json r = va;
  r["normalisation"] = "upper";
  refused_record(r.dump(), "unknown normalisation 'upper'");
  r = va;
  r["kind"] = "char";
  refused_record(r.dump(), "its config says word-level and its vocabulary record char-level");
  r = va;
  r.erase("fingerprint");
  refused_record(r.dump(), "has no text field 'fingerprint'");
  // --resume on another training text of the same vocabulary size is refused
  check_refused(run(s, kTrainLM, {"--train", s / "renamed.txt", "--test", "", "--valid-fraction", "0.5", "--layers", "1",
                                  "--d-model", "8", "--heads", "2", "--d-ff", "8", "--experts", "2", "--top-k", "1",
                                  "--seq", "8", "--batch", "2", "--steps", "20", "--warmup", "0", "--eval-every", "0",
                                  "--threads", "1", "--out", a, "--resume"}),
                {"was trained with the vocabulary " + fa, "this run's --train gives " + fb});
}

TEST_CASE("generate: the normalisation train_lm recorded is applied to the prompt and --stop, so plain text reads as the training text") {
  Scratch s("generate_normalise");
  test::write_word_corpus(s / "plain.txt");
  // capitalised lines ending with a full stop, a comma after the third word
  rewrite_lines(s / "plain.txt", s / "prose.txt", [](const std::string& line) {
    std::istringstream in(line);
    std::string out, w;
    for (int i = 0; in >> w; ++i) {
      if (i == 0) w[0] = static_cast<char>(w[0] - 'a' + 'A');
      out += (out.empty() ? "" : " ") + w + (i == 2 ? "," : "");
    }
    return out + ".";
  });
  const std::string n = s / "norm", raw = s / "raw";
  train_on(s, n, s / "prose.txt", {"--normalise", "lower,punct"});
  CHECK(vocabulary_of(n + "/checkpoint.safetensors").at("normalisation") == "lower,punct");
  const Result r = run(s, kGenerate, gen_args(n, "The CAT, sat.", {"--max-new-tokens", "4"}));
  INFO(r.text());
  CHECK(r.status == 0);
  CHECK(r.err.find("generate: prompt (5 words): the cat , sat .") != std::string::npos);
  // without: the words as typed are not in the vocabulary
  train_on(s, raw, s / "prose.txt");
  const Result u = run(s, kGenerate, gen_args(raw, "The CAT, sat.", {"--max-new-tokens", "4"}));
  CHECK(u.status == 0);
  CHECK(u.err.find("generate: prompt (3 words, ") != std::string::npos);
  CHECK(u.err.find(" not in the vocabulary, read as <unk>)") != std::string::npos);
  // --stop on the normalised output: "." is printed as a word of its own
  const Result g = run(s, kGenerate, gen_args(n, "The cat", {"--greedy", "--max-new-tokens", "30"}));
  REQUIRE(g.status == 0);
  const std::size_t dot = g.out.find('.');
  if (dot != std::string::npos) {
    const Result st = run(s, kGenerate, gen_args(n, "The cat", {"--greedy", "--max-new-tokens", "30", "--stop", "."}));
    CHECK(st.out == g.out.substr(0, dot + 1) + "\n");
  }
}

namespace {

// As run(), with stdin read from the file `input`.
Result run_with_stdin(const Scratch& s, const std::vector<std::string>& args, const std::string& input) {
  std::string cmd = "timeout -k 5 120 ";
  cmd.append(test::quote(kGenerate));
  for (const auto& a : args) cmd.append(" ").append(test::quote(a));
  Result r;
  r.command = cmd + " <" + test::quote(input);
  const std::string out = s / "stdin_out.txt", err = s / "stdin_err.txt";
  cmd.append(" >").append(test::quote(out)).append(" 2>").append(test::quote(err));
  cmd.append(" <").append(test::quote(input));
  const int raw = std::system(cmd.c_str());
  r.status = raw != -1 && WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream o(out), e(err);
  std::stringstream so, se;
  so << o.rdbuf();
  se << e.rdbuf();
  r.out = so.str();
  r.err = se.str();
  return r;
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A batch's line for the output of a single run: line breaks as \n, backslashes as \\.
std::string as_line(const std::string& single_out) {
  std::string out;
  for (char c : single_out.substr(0, single_out.size() - 1)) {
    if (c == '\n') out += "\\n";
    else if (c == '\\') out += "\\\\";
    else out += c;
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> l;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) l.push_back(line);
  return l;
}

}  // namespace

TEST_CASE("generate: --prompt-file, --prompt - and --prompt-file - read the same prompt, and a seed not given is drawn and printed") {
  Scratch s("generate_prompt_files");
  const std::string dir = s / "lm";
  train(s, dir, false);
  const std::vector<std::string> opts = {"--max-new-tokens", "8", "--seed", "3", "--temperature", "0.9"};
  const Result a = run(s, kGenerate, gen_args(dir, "the cat", opts));
  REQUIRE(a.status == 0);
  const std::string file = s / "prompt.txt";
  write_file(file, "the cat\n");  // the final line break is not an <eos>
  std::vector<std::string> args = {"--checkpoint", dir + "/checkpoint.safetensors", "--vocab", dir + "/vocab.txt", "--threads", "1"};
  args.insert(args.end(), opts.begin(), opts.end());
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = args;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const Result f = run(s, kGenerate, with({"--prompt-file", file}));
  INFO(f.text());
  CHECK(f.status == 0);
  CHECK(f.out == a.out);
  CHECK(f.err.find("generate: prompt (2 words): the cat") != std::string::npos);
  const Result in1 = run_with_stdin(s, with({"--prompt", "-"}), file);
  INFO(in1.text());
  CHECK(in1.status == 0);
  CHECK(in1.out == a.out);
  const Result in2 = run_with_stdin(s, with({"--prompt-file", "-"}), file);
  CHECK(in2.out == a.out);
  // a file's inner line breaks are <eos>
  write_file(file, "the cat\nsat on");
  const Result two = run(s, kGenerate, with({"--prompt-file", file}));
  CHECK(two.err.find("generate: prompt (5 words): the cat\nsat on") != std::string::npos);
  // refusals: no such file, two prompts, none
  check_refused(run(s, kGenerate, with({"--prompt-file", s / "absent.txt"})), {"absent.txt"});
  check_refused(run(s, kGenerate, with({"--prompt-file", file, "--prompt", "the"})), {"--prompt excludes --prompt-file"});
  check_refused(run(s, kGenerate, with({})), {"give the prompt"});
  check_refused(run(s, kGenerate, gen_args(dir, "the", {"--explain-prompt"})), {"--explain-prompt needs --explain"});
  // no --seed: one is drawn, printed, and repeats the run
  const Result r = run(s, kGenerate, gen_args(dir, "the cat", {"--max-new-tokens", "8", "--temperature", "0.9"}));
  INFO(r.text());
  REQUIRE(r.status == 0);
  const std::size_t at = r.err.find("generate: seed ");
  REQUIRE(at != std::string::npos);
  const std::string seed = r.err.substr(at + 15, r.err.find(' ', at + 15) - (at + 15));
  CHECK(r.err.find("--seed " + seed + " repeats this run") != std::string::npos);
  const Result again = run(s, kGenerate, gen_args(dir, "the cat", {"--max-new-tokens", "8", "--temperature", "0.9", "--seed", seed}));
  CHECK(again.out == r.out);
  CHECK(again.err.find("generate: seed ") == std::string::npos);
  // the timings: time to first token with the prompt's rate, then the decode rate, in microseconds
  for (const char* part : {"generate: prompt 2 tokens, time to first token ", " prompt tokens/s)",
                           "generate: 8 tokens in ", "(decode ", " tokens/s after the first"})
    CHECK(a.err.find(part) != std::string::npos);
  const std::size_t ttft = a.err.find("time to first token ") + 20;
  const std::string secs = a.err.substr(ttft, a.err.find(' ', ttft) - ttft);
  CAPTURE(secs);
  CHECK(secs.size() == 8);  // "0.000123": six decimals
  CHECK(secs[1] == '.');
}

TEST_CASE("generate: --num-samples and --prompts-file decode one batch whose outputs, in order, are what each draws alone with its seed") {
  Scratch s("generate_batch");
  const std::string dir = s / "lm";
  train(s, dir, false);
  const std::string file = s / "prompts.txt";
  const std::vector<std::string> prompts = {"the cat", "a dog ran", "the"};
  write_file(file, "the cat\na dog ran\nthe\n");
  const std::vector<std::string> opts = {"--max-new-tokens", "6", "--temperature", "0.9"};
  std::vector<std::string> args = {"--checkpoint", dir + "/checkpoint.safetensors", "--vocab", dir + "/vocab.txt",
                                   "--threads", "1", "--prompts-file", file, "--seed", "7"};
  args.insert(args.end(), opts.begin(), opts.end());
  const Result b = run(s, kGenerate, args);
  INFO(b.text());
  REQUIRE(b.status == 0);
  const std::vector<std::string> got = lines_of(b.out);
  REQUIRE(got.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    std::vector<std::string> one = opts;
    one.insert(one.end(), {"--seed", std::to_string(7 + i)});
    const Result r = run(s, kGenerate, gen_args(dir, prompts[i], one));
    REQUIRE(r.status == 0);
    CHECK(got[i] == as_line(r.out));
  }
  CHECK(got[0] != got[2]);
  CHECK(b.err.find("generate: prompt 1 (3 words): a dog ran") != std::string::npos);
  // --num-samples: seeds 4, 5, 6 of one prompt
  const Result n = run(s, kGenerate, gen_args(dir, "the cat", {"--max-new-tokens", "6", "--temperature", "0.9", "--seed", "4", "--num-samples", "3"}));
  INFO(n.text());
  REQUIRE(n.status == 0);
  const std::vector<std::string> samples = lines_of(n.out);
  REQUIRE(samples.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    const Result r = run(s, kGenerate, gen_args(dir, "the cat", {"--max-new-tokens", "6", "--temperature", "0.9", "--seed", std::to_string(4 + i)}));
    CHECK(samples[i] == as_line(r.out));
  }
  CHECK(samples[0] != samples[1]);
  // an empty line, a line too long
  write_file(file, "the cat\n\nthe\n");
  std::vector<std::string> bad = args;
  check_refused(run(s, kGenerate, bad), {"--prompts-file '" + file + "': line 2 is empty"});
  write_file(file, "the cat\nthe cat sat on a mat the dog ran\n");
  check_refused(run(s, kGenerate, bad), {"--prompts-file line 2 is 9 words, longer than the model's context"});
}

TEST_CASE("generate: --explain prints a line for every generated token past the context window, and the prompt's with --explain-prompt") {
  Scratch s("generate_explain_window");
  std::string router;
  for (const std::string& r : router_names())
    if (router.empty() && r.find("similarity") != std::string::npos &&
        with_router(r, []<class P>() { return examples::built_for_cpu<P>; }))
      router = r;
  REQUIRE(!router.empty());
  const std::string dir = s / "lm";
  train(s, dir, false, router);  // --seq 8
  for (const std::string& prompt : {std::string("the cat sat"), std::string("the cat sat on a mat the dog")}) {
    for (bool with_prompt : {false, true}) {
      CAPTURE(prompt);
      CAPTURE(with_prompt);
      std::vector<std::string> extra = {"--max-new-tokens", "12", "--seed", "2", "--explain"};
      if (with_prompt) extra.push_back("--explain-prompt");
      const Result r = run(s, kGenerate, gen_args(dir, prompt, extra));
      INFO(r.text());
      REQUIRE(r.status == 0);
      CHECK(r.err.find("generate: explain: [position]") != std::string::npos);  // the legend
      const std::size_t words = static_cast<std::size_t>(std::count(prompt.begin(), prompt.end(), ' ') + 1);
      const std::vector<std::string> lines = lines_of(r.out);
      const std::size_t first = with_prompt ? 0 : words;
      REQUIRE(lines.size() == words + 12 - first);
      for (std::size_t i = 0; i < lines.size(); ++i) {
        CAPTURE(lines[i]);
        CHECK(lines[i].rfind("[" + std::to_string(first + i) + "] \"", 0) == 0);
        CHECK(lines[i].find(" | block 0: experts ") != std::string::npos);
        CHECK(lines[i].find("; alone ") != std::string::npos);
        CHECK(lines[i].find("; from [") != std::string::npos);
      }
    }
  }
}

TEST_CASE("generate: --device cuda on a binary without CUDA says so") {
  if (GRAPHMOE_GENERATE_CUDA) return;  // this build has generate's CUDA path
  Scratch s("generate_no_cuda");
  const std::string dir = s / "lm";
  train(s, dir, false);
  check_refused(run(s, kGenerate, gen_args(dir, "the", {"--device", "cuda"})),
                {"--device cuda: this generate was built without CUDA", "use --device cpu"});
}

TEST_CASE("train_lm: --help lists only the routers built in, refusals name what was typed, no default data path, and a last line with time, tokens/s and the checkpoint") {
  Scratch s("train_lm_cli");
  std::vector<std::string> built, missing;
  for (const std::string& r : router_names())
    (with_router(r, []<class P>() { return examples::built_for_cpu<P>; }) ? built : missing).push_back(r);
  std::string list;
  for (const std::string& r : built) list += (list.empty() ? "" : ", ") + r;
  const Result h = run(s, kTrainLM, {"--help"});
  REQUIRE(h.status == 0);
  const std::size_t at = h.out.find("router: ");
  REQUIRE(at != std::string::npos);
  const std::string routers = h.out.substr(at, h.out.find('\n', at) - at);
  CHECK(routers == "router: " + list);
  CHECK(h.out.find("--steps INT:[1, 1000000000]=1000") != std::string::npos);  // defaults shown
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  for (const std::string& r : missing) {
    CAPTURE(r);
    check_refused(run(s, kTrainLM, {"--train", corpus, "--router", r}), {"--router: " + r + " not in {"});
    const Result m = run(s, kTrainLM, {"--router", r});
    CHECK(m.err.find("Router") == std::string::npos);  // no C++ class names
  }
  // no default data: --train is required, --test and --valid are optional files
  check_refused(run(s, kTrainLM, {"--steps", "3"}), {"--train is required"});
  check_refused(run(s, kTrainLM, {"--train", corpus, "--test", s / "absent.txt"}), {"--test", "absent.txt"});
  // a run from another folder without --test: trains, and ends with the summary line
  const std::string out = s / "lm";
  const Result r = test::run_program(s, "env -C " + test::quote(s.dir.string()), kTrainLM,
                                     {"--train", corpus, "--valid-fraction", "0.5", "--layers", "1", "--d-model", "8",
                                      "--heads", "2", "--d-ff", "8", "--experts", "2", "--top-k", "1", "--seq", "8",
                                      "--batch", "2", "--steps", "6", "--warmup", "0", "--eval-every", "0",
                                      "--threads", "1", "--sample-tokens", "3", "--out", out},
                                     120);
  INFO(r.text());
  REQUIRE(r.status == 0);
  CHECK(r.out.find("test_ppl") == std::string::npos);
  REQUIRE(r.out.size() > 1);
  const std::size_t last = r.out.rfind('\n', r.out.size() - 2);
  const std::string line = r.out.substr(last + 1);
  CAPTURE(line);
  CHECK(line.rfind("train_lm: 6 steps in ", 0) == 0);
  CHECK(line.find(" s in all), ") != std::string::npos);
  CHECK(line.find(" tokens/s, checkpoint " + out + "/checkpoint.safetensors\n") != std::string::npos);
  CHECK(std::filesystem::exists(out + "/checkpoint.safetensors"));
}
