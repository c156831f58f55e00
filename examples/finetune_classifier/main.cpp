// finetune_classifier: fine-tune an LM checkpoint written by train_lm as a sequence classifier
// on SST-2, SST-5 or Banking-77 (the paper's downstream tasks).
//
//   finetune_classifier --checkpoint runs/lm/checkpoint.safetensors --vocab runs/lm/vocab.txt --task sst2
//   mpirun -n 2 --bind-to none finetune_classifier --dp 2 --batch 16 ...   (data parallel,
//                                                                          docs/distributed.md)
//
// The router and the model shape come from the checkpoint; the classification head is new.
//
//   finetune_classifier --hf path/to/model --task sst2        (a Hugging Face model directory:
//                                                            its config, weights and tokenizer)
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <memory>
#include <functional>

#include "common/cli_checks.hpp"
#include "common/data_parallel_world.hpp"
#include "common/device_dispatch.hpp"
#include "common/lm_config.hpp"
#include "finetune_classifier/options.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/text_datasets.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"
#if defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
#include "graphmoe/hf/tokenizer.hpp"
#if defined(GRAPHMOE_EXAMPLES_SENTENCEPIECE)
#include "graphmoe/hf/sentencepiece.hpp"
#endif
#endif

using namespace graphmoe;

int main(int argc, char** argv) {
  finetune_classifier::Options opt;
  std::string vocab, task = "sst2", dir = data_dir();
  graphmoe::index_t train_limit = 0, max_len = 0;
  CLI::App app{"Fine-tune a graphmoe LM checkpoint as a sequence classifier"};
  auto* ck_opt = app.add_option("--checkpoint", opt.checkpoint, "LM checkpoint (train_lm's checkpoint.safetensors; or --hf)")->check(CLI::ExistingFile);
  auto* vocab_opt = app.add_option("--vocab", vocab, "the LM's vocabulary (train_lm's vocab.txt)")->check(CLI::ExistingFile);
  app.add_option("--hf", opt.hf_dir, "a Hugging Face model directory instead of --checkpoint and --vocab (docs/reference/hugging-face.md): its config.json fixes the model, its weights start the backbone, its tokenizer encodes the texts (special tokens included); the family's own router (softmax; DeepSeek-V3: sigmoid-bias)")->check(CLI::ExistingDirectory)->excludes(ck_opt)->excludes(vocab_opt);
  app.add_option("--task", task, "sst2, sst5 or banking77")->check(CLI::IsMember({"sst2", "sst5", "banking77"}));
  app.add_option("--data-dir", dir, "folder holding sst2/, sst5/, banking77/ (default: $GRAPHMOE_DATA_DIR or ../shared/data)");
  app.add_option("--epochs", opt.epochs, "epochs")->check(examples::integer<int>(1, examples::kMaxEpochs));
  app.add_option("--batch", opt.batch, "examples per batch (paper: 16; with --dp N: the global batch, a multiple of N)")->check(examples::integer<index_t>(1, examples::kMaxBatch));
  app.add_option("--lr", opt.lr, "learning rate (paper: 1e-3 SST, 1e-5 Banking-77)")->check(examples::positive_real(examples::kMaxLR));
  examples::add_divergence_options(app, opt.divergence);
  app.add_option("--warmup", opt.warmup, "warmup steps (paper: 0)")->check(examples::integer<std::int64_t>(0, examples::kMaxSteps));
  app.add_option("--train-limit", train_limit, "use the first N training examples (0 = all)")->check(examples::integer<index_t>(0, examples::kMaxCount));
  app.add_option("--max-len", max_len, "truncate examples to N tokens (0 = the LM's sequence length)")->check(examples::integer<index_t>(0, examples::kMaxSeq));
  app.add_option("--seed", opt.seed, "random seed")->check(examples::seed());
  app.add_option("--threads", opt.threads, "CPU threads")->check(examples::threads());
  app.add_option("--dp", opt.dp.ranks, "data parallel over N MPI processes (mpirun -n N ... --dp N; docs/distributed.md)")->check(examples::integer<int>(1, examples::kMaxRanks));
  app.add_option("--device", opt.device, examples::device_help())->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--out", opt.out_dir, "output directory (metrics.csv)");
  app.add_flag("--from-scratch", opt.from_scratch, "do not load the checkpoint's weights (baseline)");
  CLI11_PARSE(app, argc, argv);
  examples::DataParallelWorld world(argc, argv, "finetune_classifier", opt.dp);
  try {
    world.check();
    examples::check_data_parallel("finetune_classifier", opt.dp, opt.batch, opt.device, "examples");
    GRAPHMOE_CHECK(!opt.hf_dir.empty() || (!opt.checkpoint.empty() && !vocab.empty()),
                   "finetune_classifier", "give the model: --checkpoint FILE with --vocab FILE (a "
                   "train_lm checkpoint), or --hf DIR (a Hugging Face model directory)");
    // the texts' token ids: train_lm's word vocabulary, or the Hugging Face tokenizer
    std::function<std::vector<std::int32_t>(const std::string&)> encode_text;
    std::optional<WordTokenizer> words;
    if (!opt.hf_dir.empty()) {
#if defined(GRAPHMOE_EXAMPLES_HF_TOKENIZER)
      const hf::Checkpoint ck = hf::Checkpoint::open(opt.hf_dir);  // config and headers checked
      opt.model = ck.config().lm;
      // the family's own router: DeepSeek-V3's sigmoid scores with a selection bias, else softmax
      opt.router = hf::sigmoid_routed(ck.config().family) ? "sigmoid-bias" : "softmax";
      examples::require_cpu_router("finetune_classifier", opt.router, opt.device);
      std::shared_ptr<hf::Tokenizer> tok = hf::load_tokenizer(opt.hf_dir);
      GRAPHMOE_CHECK(tok->vocab_size() <= opt.model.vocab_size, "finetune_classifier", "'",
                     opt.hf_dir, "': the tokenizer has ", tok->vocab_size(),
                     " ids, more than the model's vocab_size ", opt.model.vocab_size);
      const std::int32_t fallback = tok->eos_id() ? static_cast<std::int32_t>(*tok->eos_id()) : 0;
      encode_text = [tok, fallback](const std::string& text) {
        std::vector<std::int32_t> ids = tok->encode(text, true);
        if (ids.empty()) ids.push_back(fallback);
        return ids;
      };
#else
      graphmoe::detail::throw_error("finetune_classifier", "--hf needs the Hugging Face tokenizer "
                                    "(graphmoe::hf_tokenizer: PCRE2 and utf8proc), which this "
                                    "build does not have");
#endif
    } else {
      GRAPHMOE_CHECK(!opt.checkpoint.empty() && !vocab.empty(), "finetune_classifier",
                     opt.checkpoint.empty() ? "--vocab needs --checkpoint" : "--checkpoint needs --vocab");
      const SafetensorsFile ckpt = load_safetensors(opt.checkpoint);
      GRAPHMOE_CHECK(ckpt.metadata.count("config"), "finetune_classifier", "'", opt.checkpoint,
                     "' has no config in its metadata (not a train_lm checkpoint)");
      const nlohmann::json cfg = metadata_json(ckpt, "config");
      const std::string where = "'" + opt.checkpoint + "'";
      opt.model = examples::lm_config_from_json(cfg, where);
      opt.router = examples::detail::config_field<std::string>(cfg, "router", where);
      const auto& known = router_names();
      GRAPHMOE_CHECK(std::find(known.begin(), known.end(), opt.router) != known.end(),
                     "finetune_classifier", where,
                     ": config field 'router' is '", opt.router, "', not a known router");
      examples::require_cpu_router("finetune_classifier", opt.router, opt.device);
      GRAPHMOE_CHECK(!examples::detail::config_field<bool>(cfg, "char_level", where),
                     "finetune_classifier",
                     "character-level LMs are not supported here; train a word-level LM");
      words.emplace(WordTokenizer::load(vocab));
      GRAPHMOE_CHECK(static_cast<index_t>(words->size()) == opt.model.vocab_size, "finetune_classifier",
                     "the vocabulary has ", words->size(), " words, the checkpoint's LM ", opt.model.vocab_size);
      encode_text = [&words](const std::string& text) {
        std::vector<std::int32_t> ids = words->encode_line(text);
        if (ids.empty()) ids.push_back(words->unk());
        return ids;
      };
    }
    const index_t limit = max_len > 0 ? std::min(max_len, opt.model.max_seq_len) : opt.model.max_seq_len;
    std::vector<TextExample> train, test;
    std::vector<std::string> names;
    if (task == "sst2") {
      train = read_sst2_tsv(dir + "/sst2/train.tsv");
      test = read_sst2_tsv(dir + "/sst2/dev.tsv");
      opt.num_classes = 2;
    } else if (task == "sst5") {
      train = read_sst5_trees(dir + "/sst5/train.txt");
      test = read_sst5_trees(dir + "/sst5/test.txt");
      opt.num_classes = 5;
    } else {
      names = read_banking77_categories(dir + "/banking77/categories.json");
      train = read_banking77_csv(dir + "/banking77/train.csv", names);
      test = read_banking77_csv(dir + "/banking77/test.csv", names);
      opt.num_classes = static_cast<index_t>(names.size());
    }
    if (train_limit > 0 && static_cast<std::size_t>(train_limit) < train.size()) train.resize(static_cast<std::size_t>(train_limit));
    auto encode = [&](const std::vector<TextExample>& xs, finetune_classifier::Encoded& out) {
      for (const auto& x : xs) {
        auto ids = encode_text(x.text);
        if (static_cast<index_t>(ids.size()) > limit) ids.resize(static_cast<std::size_t>(limit));
        out.ids.push_back(std::move(ids));
        out.labels.push_back(x.label);
      }
    };
    finetune_classifier::Data data;
    encode(train, data.train);
    encode(test, data.test);
    if (opt.dp.root())
      std::fprintf(stderr, "finetune_classifier: %s, %zu train / %zu test examples, %lld classes, router %s\n",
                   task.c_str(), data.train.labels.size(), data.test.labels.size(),
                   static_cast<long long>(opt.num_classes), opt.router.c_str());
    return with_router(opt.router, [&]<class Policy>() {
      return examples::on_device<Policy>("finetune_classifier", opt.device, opt.router,
                                         [&]<class B>() {
                                           return finetune_classifier::run<Policy, B>(opt, data);
                                         });
    });
  } catch (const std::exception& e) {
    return world.fail(e);
  }
}
