// finetune_classifier: fine-tune an LM checkpoint written by train_lm as a sequence classifier
// on SST-2, SST-5 or Banking-77 (the paper's downstream tasks).
//
//   finetune_classifier --checkpoint runs/lm/checkpoint.safetensors --vocab runs/lm/vocab.txt --task sst2
//   mpirun -n 2 --bind-to none finetune_classifier --dp 2 --batch 16 ...   (data parallel,
//                                                                          docs/distributed.md)
//
// The router and the model shape come from the checkpoint; the classification head is new.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>

#include "common/cli_checks.hpp"
#include "common/data_parallel_world.hpp"
#include "common/device_dispatch.hpp"
#include "common/lm_config.hpp"
#include "finetune_classifier/options.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/text_datasets.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"

using namespace graphmoe;

int main(int argc, char** argv) {
  finetune_classifier::Options opt;
  std::string vocab, task = "sst2", dir = data_dir();
  graphmoe::index_t train_limit = 0, max_len = 0;
  CLI::App app{"Fine-tune a graphmoe LM checkpoint as a sequence classifier"};
  app.add_option("--checkpoint", opt.checkpoint, "LM checkpoint (train_lm's checkpoint.safetensors)")->required()->check(CLI::ExistingFile);
  app.add_option("--vocab", vocab, "the LM's vocabulary (train_lm's vocab.txt)")->required()->check(CLI::ExistingFile);
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
    if (opt.dp.ranks > 1) {
      if (opt.batch % opt.dp.ranks != 0)
        examples::throw_same_on_every_rank(
            "finetune_classifier", "--batch ", opt.batch, " is not a multiple of --dp ", opt.dp.ranks,
            ": --batch is the global batch, split into ", opt.dp.ranks,
            " equal shards of --batch / --dp examples");
      if (opt.device != "cpu")
        examples::throw_same_on_every_rank("finetune_classifier", "--dp ", opt.dp.ranks,
                                           " needs --device cpu (the MPI communicator moves host memory)");
    }
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
    const WordTokenizer tok = WordTokenizer::load(vocab);
    GRAPHMOE_CHECK(static_cast<index_t>(tok.size()) == opt.model.vocab_size, "finetune_classifier",
                   "the vocabulary has ", tok.size(), " words, the checkpoint's LM ", opt.model.vocab_size);
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
        auto ids = tok.encode_line(x.text);
        if (ids.empty()) ids.push_back(tok.unk());
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
