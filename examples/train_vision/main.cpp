// train_vision: train a ViT with MoE FFNs (V-MoE layout) on Fashion-MNIST (Debian's
// dataset-fashion-mnist) or the 8x8 digits, with any router.
//
//   train_vision --router similarity --epochs 2
//   mpirun -n 2 --bind-to none train_vision --dp 2 --batch 64   (data parallel, docs/distributed.md)
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/cli_checks.hpp"
#include "common/data_parallel_world.hpp"
#include "common/device_dispatch.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/files.hpp"
#include "train_vision/options.hpp"

using namespace graphmoe;

int main(int argc, char** argv) {
  train_vision::Options opt;
  auto& m = opt.model;
  m.patch = 7;
  m.d_model = 64;
  m.num_layers = 4;
  m.num_heads = 4;
  m.d_ff = 128;
  m.moe_last = 2;
  m.router.num_experts = 8;
  m.router.k = 2;
  std::string dataset = "fashion-mnist", dir = "/usr/share/datasets/fashion-mnist", layout = "last";
  CLI::App app{"Train a vision MoE transformer (graphmoe)"};
  std::string routers;
  const std::vector<std::string> built = examples::built_router_names();  // only these: --help and the check
  routers = examples::joined(built);
  app.add_option("--dataset", dataset, "fashion-mnist or digits")->check(CLI::IsMember({"fashion-mnist", "digits"}));
  app.add_option("--data-dir", dir, "directory of the Fashion-MNIST idx files");
  app.add_option("--router", opt.router, "router: " + routers)->check(CLI::IsMember(built));
  app.add_option("--layout", layout, "MoE blocks: last (the last --moe-last blocks) or alternating")->check(CLI::IsMember({"last", "alternating"}));
  app.add_option("--moe-last", m.moe_last, "number of final blocks with MoE (layout last)")->check(examples::integer<index_t>(0, examples::kMaxLayers));
  app.add_option("--patch", m.patch, "patch size")->check(examples::integer<index_t>(1, examples::kMaxSeq));
  app.add_option("--layers", m.num_layers, "transformer blocks")->check(examples::integer<index_t>(1, examples::kMaxLayers));
  app.add_option("--d-model", m.d_model, "model width")->check(examples::integer<index_t>(1, examples::kMaxWidth));
  app.add_option("--heads", m.num_heads, "attention heads")->check(examples::integer<index_t>(1, examples::kMaxHeads));
  app.add_option("--d-ff", m.d_ff, "expert hidden size")->check(examples::integer<index_t>(1, examples::kMaxWidth));
  app.add_option("--experts", m.router.num_experts, "experts per MoE layer")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--top-k", m.router.k, "experts per token")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  m.router.allow_unused_options = true;  // one command line for every router
  app.add_option("--tau", m.router.options<Similarity>().tau, "Similarity graph temperature")->check(examples::positive_real(examples::kMaxCoef));
  app.add_option("--sigma", m.router.options<Attention>().sigma, "Attention graph sigma")->check(examples::positive_real(examples::kMaxCoef));
  std::string head_choice = "per-sequence";
  app.add_option("--head-choice", head_choice,
                 "Attention graph: h* of lowest mean entropy over the whole image (per-sequence, "
                 "the paper) or, for token i, over tokens 0..i (per-prefix)")
      ->check(CLI::IsMember({"per-sequence", "per-prefix"}));
  app.add_option("--load-balance", m.router.load_balance_coef, "load-balancing loss coefficient")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--epochs", opt.epochs, "epochs")->check(examples::integer<int>(1, examples::kMaxEpochs));
  app.add_option("--batch", opt.batch, "images per batch (with --dp N: the global batch, a multiple of N)")->check(examples::integer<index_t>(1, examples::kMaxBatch));
  app.add_option("--train-limit", opt.train_limit, "use only the first N training images (0 = all)")->check(examples::integer<index_t>(0, examples::kMaxCount));
  app.add_option("--lr", opt.lr, "peak learning rate")->check(examples::positive_real(examples::kMaxLR));
  examples::add_divergence_options(app, opt.divergence);
  app.add_option("--warmup", opt.warmup, "warmup steps")->check(examples::integer<std::int64_t>(0, examples::kMaxSteps));
  app.add_option("--eval-every", opt.eval_every, "evaluate every N steps (0 = each epoch)")->check(examples::integer<std::int64_t>(0, examples::kMaxSteps));
  app.add_option("--seed", opt.seed, "random seed")->check(examples::seed());
  app.add_option("--threads", opt.threads, "CPU threads")->check(examples::threads());
  app.add_option("--dp", opt.dp.ranks, "data parallel over N MPI processes (mpirun -n N ... --dp N; docs/distributed.md)")->check(examples::integer<int>(1, examples::kMaxRanks));
  app.add_option("--device", opt.device, examples::device_help())->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--out", opt.out_dir, "output directory");
  app.add_flag("--resume", opt.resume, "continue from <out>/checkpoint.safetensors");
  std::string corrupt;
  app.add_option("--corrupt", corrupt,
                 "after training, also test on corrupted test images: comma-separated "
                 "gaussian_noise, blur, contrast, or all");
  app.add_option("--severity", opt.severity, "corruption severity (ImageNet-C levels)")->check(examples::integer<int>(1, 5));
  app.add_option("--corrupt-seed", opt.corrupt_seed, "seed of the corruptions' noise")->check(examples::seed());
  CLI11_PARSE(app, argc, argv);
  m.layout = layout == "alternating" ? VisionLayout::Alternating : VisionLayout::Last;
  m.router.options<Attention>().head_choice =
      head_choice == "per-prefix" ? HeadChoice::PerSequenceCausal : HeadChoice::PerSequence;
  if (opt.router.rfind("smoe-dropout", 0) == 0) {
    auto& sched = m.router.options<ScheduledTopK>();
    sched.k_max = std::max(sched.k_max, m.router.k);
  }
  examples::DataParallelWorld world(argc, argv, "train_vision", opt.dp);
  try {
    world.check();
    examples::check_data_parallel("train_vision", opt.dp, opt.batch, opt.device, "images");
    examples::require_cpu_router("train_vision", opt.router, opt.device);
    // --corrupt: names in the order given, each once; "all" = every corruption
    for (std::size_t at = 0; !corrupt.empty() && at <= corrupt.size();) {
      const std::size_t comma = std::min(corrupt.find(',', at), corrupt.size());
      const std::string name = corrupt.substr(at, comma - at);
      at = comma + 1;
      std::vector<Corruption> named(all_corruptions.begin(), all_corruptions.end());
      if (name != "all") {
        try {
          named = {parse_corruption(name)};
        } catch (const Error& e) {
          throw Error(std::string("--corrupt: ") + e.what() + ", or all");
        }
      }
      for (Corruption c : named)
        if (std::find(opt.corruptions.begin(), opt.corruptions.end(), c) == opt.corruptions.end())
          opt.corruptions.push_back(c);
    }
    train_vision::Data data;
    if (dataset == "digits") {
      const ImageDataset all = read_digits_csv(data_dir() + "/digits/digits.csv.gz");
      // first 1500 images train, the rest test
      const index_t ntr = 1500, per = all.rows * all.cols;
      for (auto* ds : {&data.train, &data.test}) { ds->rows = all.rows; ds->cols = all.cols; }
      data.train.count = ntr;
      data.test.count = all.count - ntr;
      data.train.pixels.assign(all.pixels.begin(), all.pixels.begin() + ntr * per);
      data.test.pixels.assign(all.pixels.begin() + ntr * per, all.pixels.end());
      data.train.labels.assign(all.labels.begin(), all.labels.begin() + ntr);
      data.test.labels.assign(all.labels.begin() + ntr, all.labels.end());
      if (m.patch == 7) m.patch = 2;
    } else {
      data.train = read_idx_images(dir + "/train-images-idx3-ubyte.gz", dir + "/train-labels-idx1-ubyte.gz");
      data.test = read_idx_images(dir + "/t10k-images-idx3-ubyte.gz", dir + "/t10k-labels-idx1-ubyte.gz");
    }
    m.channels = 1;
    if (opt.dp.root())
      std::fprintf(stderr, "train_vision: %s, %lld train / %lld test images of %lldx%lld, router %s\n",
                   dataset.c_str(), static_cast<long long>(data.train.count), static_cast<long long>(data.test.count),
                   static_cast<long long>(data.train.rows), static_cast<long long>(data.train.cols), opt.router.c_str());
    return with_router(opt.router, [&]<class Policy>() {
      return examples::on_device<Policy>("train_vision", opt.device, opt.router, [&]<class B>() {
        return train_vision::run<Policy, B>(opt, data);
      });
    });
  } catch (const std::exception& e) {
    return world.fail(e);
  }
}
