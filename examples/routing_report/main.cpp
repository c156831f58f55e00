// routing_report: what a trained router does, per MoE layer, on a fixed probe set.
//
//   routing_report --checkpoint runs/lm/similarity/checkpoint.safetensors
//                  --compare runs/lm/similarity/checkpoint-step402.safetensors
//                  --baseline runs/lm/softmax/checkpoint.safetensors --out report.csv
//
// Loads any train_lm checkpoint (its router and shape come from the checkpoint's metadata), routes
// the first --probe-batches batches of --text (default: WikiText-2's test split) and writes, per
// MoE layer (graphmoe/train/routing_report.hpp): entropy of r and p, their ratio to --baseline's,
// the token graph's row entropy and self-weight, how often the graph changed the selected experts,
// top-1 / top-k fluctuation against --compare (another checkpoint of the same model, e.g. the
// previous epoch; routed at the main checkpoint's step, so that SMoE-Dropout's scheduled k is the
// same in both), and tokens per expert (--load-out). The tokenizer is the checkpoint folder's
// vocab.txt unless --vocab names another; every model must use the same one.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "common/cli_checks.hpp"
#include "common/device_dispatch.hpp"
#include "common/lm_config.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"
#include "routing_report/probe.hpp"

using namespace graphmoe;

namespace {

struct Model {
  std::string path, router;
  RoutingProbe probe;
  std::int64_t step = 0;  // the step it was routed at
};

// The probe text's ids under the checkpoint's tokenizer, which must have the model's vocabulary.
std::vector<std::int32_t> encode(const std::string& vocab, bool char_level, const std::string& text,
                                 index_t vocab_size, const std::string& checkpoint) {
  auto check = [&](std::size_t n) {
    GRAPHMOE_CHECK(static_cast<index_t>(n) == vocab_size, "routing_report", "the tokenizer '", vocab,
                   "' has ", n, " entries, the model '", checkpoint, "' ", vocab_size,
                   ": pass the vocab.txt written beside it (--vocab)");
  };
  if (char_level) {
    const CharTokenizer tok = CharTokenizer::load(vocab);
    check(tok.size());
    return tok.encode_file(text);
  }
  const WordTokenizer tok = WordTokenizer::load(vocab);
  check(tok.size());
  return tok.encode_file(text);
}

Model load_and_probe(const std::string& path, const std::string& vocab_override,
                     const std::string& text, index_t probe_batches, index_t batch,
                     std::size_t* vocab_size, const std::int64_t* route_at_step = nullptr) {
  namespace fs = std::filesystem;
  const SafetensorsFile f = load_safetensors(path);
  GRAPHMOE_CHECK(f.metadata.count("config") && f.metadata.count("step"), "routing_report", "'",
                 path, "' has no 'config' and 'step' metadata: is it a train_lm checkpoint?");
  const nlohmann::json cfg = metadata_json(f, "config");
  GRAPHMOE_CHECK(cfg.is_object() && cfg.contains("router") && cfg.contains("d_model") &&
                     cfg.contains("char_level"),
                 "routing_report", "'", path, "' is not a train_lm checkpoint (its config has no "
                 "router, d_model or char_level; train_vision checkpoints are not supported yet)");
  const std::string where = "'" + path + "'";
  routing_report::ProbeInput in;
  in.file = &f;
  in.config = examples::lm_config_from_json(cfg, where);
  const std::string router = examples::detail::config_field<std::string>(cfg, "router", where);
  in.step = metadata_int(f, "step", 0, std::numeric_limits<std::int64_t>::max());
  // --compare routes at the main checkpoint's step: a scheduled k (SMoE-Dropout) is then the same
  // in both, and fluctuation counts experts that changed, not a k that grew
  if (route_at_step != nullptr) in.step = *route_at_step;
  const std::string vocab = vocab_override.empty()
                                ? (fs::path(path).parent_path() / "vocab.txt").string()
                                : vocab_override;
  const std::vector<std::int32_t> ids =
      encode(vocab, examples::detail::config_field<bool>(cfg, "char_level", where), text,
             in.config.vocab_size, path);
  if (*vocab_size == 0) *vocab_size = static_cast<std::size_t>(in.config.vocab_size);
  GRAPHMOE_CHECK(static_cast<std::size_t>(in.config.vocab_size) == *vocab_size, "routing_report",
                 "'", path, "' has a vocabulary of ", in.config.vocab_size, " words, the first model ",
                 *vocab_size, ": the models must share one tokenizer");
  LMBatcher batches(ids, batch, in.config.max_seq_len);
  const index_t nb = probe_batches > 0 ? std::min(probe_batches, batches.num_batches()) : batches.num_batches();
  for (index_t i = 0; i < nb; ++i) in.batches.push_back(batches.batch(i));
  std::fprintf(stderr, "routing_report: %s (%s, step %lld): %lld probe tokens\n", path.c_str(),
               router.c_str(), static_cast<long long>(in.step), static_cast<long long>(nb * batch * in.config.max_seq_len));
  auto probe = [&]<class Policy>() -> graphmoe::RoutingProbe {
    examples::require_cpu_router<Policy>("routing_report", router);
    if constexpr (examples::built_for_cpu<Policy>) return routing_report::probe<Policy>(in);
    return {};
  };
  Model m{path, router, with_router(router, probe), in.step};
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, compare, baseline, vocab, out = "report.csv", load_out;
  std::string text;
  index_t probe_batches = 8, batch = 16;
  int threads = 2;
  CLI::App app{"Per-layer routing report of a train_lm checkpoint (graphmoe)"};
  app.add_option("--checkpoint", checkpoint, "the model (a train_lm checkpoint.safetensors)")->required()->check(CLI::ExistingFile);
  app.add_option("--compare", compare, "another checkpoint of the same model (e.g. the previous epoch's): top-1 / top-k fluctuation")->check(CLI::ExistingFile);
  app.add_option("--baseline", baseline, "a baseline model of the same shape (e.g. softmax): entropy ratios")->check(CLI::ExistingFile);
  app.add_option("--vocab", vocab, "tokenizer (default: vocab.txt beside each checkpoint)");
  app.add_option("--text", text, "probe text (WikiText format, e.g. WikiText-2's wiki.test.tokens)")->required()->check(CLI::ExistingFile);
  app.add_option("--probe-batches", probe_batches, "probe batches from the start of --text (0 = all)")->check(examples::integer<index_t>(0, index_t{1} << 20));
  app.add_option("--batch", batch, "sequences per probe batch")->check(examples::integer<index_t>(1, 4096));
  app.add_option("--out", out, "per-layer CSV");
  app.add_option("--load-out", load_out, "tokens-per-expert CSV (default: <out without .csv>_load.csv)");
  app.add_option("--threads", threads, "CPU threads")->check(examples::threads());
  CLI11_PARSE(app, argc, argv);
  if (load_out.empty()) {
    const std::string stem = out.size() > 4 && out.compare(out.size() - 4, 4, ".csv") == 0 ? out.substr(0, out.size() - 4) : out;
    load_out = stem + "_load.csv";
  }
  try {
    set_num_threads(threads);
    std::size_t vocab_size = 0;
    const Model model = load_and_probe(checkpoint, vocab, text, probe_batches, batch, &vocab_size);
    Model cmp, base;
    if (!compare.empty()) {
      cmp = load_and_probe(compare, vocab, text, probe_batches, batch, &vocab_size, &model.step);
      GRAPHMOE_CHECK(cmp.router == model.router, "routing_report", "--compare '", compare,
                     "' has the router ", cmp.router, ", the model ", model.router,
                     ": fluctuation compares two checkpoints of one model");
    }
    if (!baseline.empty()) base = load_and_probe(baseline, vocab, text, probe_batches, batch, &vocab_size);
    const auto reps = graphmoe::routing_report(model.probe, compare.empty() ? nullptr : &cmp.probe,
                                     baseline.empty() ? nullptr : &base.probe);
    write_routing_report(out, reps);
    write_expert_load(load_out, reps);
    std::printf("%-6s %9s %9s %9s %9s %9s %9s %9s\n", "layer", "H(r)", "H(p)", "H(p)/base",
                "graph H", "S[i,i]", "changed", "fluct");
    // H(p)/base without --baseline and fluct without --compare cannot be computed: "n/a"
    for (const auto& r : reps)
      std::printf("%-6lld %9.4f %9.4f %9s %9.4f %9.4f %9.4f %9s\n", static_cast<long long>(r.layer),
                  r.entropy_r, r.entropy_p, metric_text(r.entropy_p_ratio, 4).c_str(),
                  r.graph_entropy, r.self_weight, r.graph_changed_selection,
                  metric_text(r.fluct_topk, 4).c_str());
    std::fprintf(stderr, "routing_report: wrote %s and %s\n", out.c_str(), load_out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "routing_report: error: %s\n", e.what());
    return 1;
  }
}
