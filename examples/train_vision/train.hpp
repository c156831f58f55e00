// train_vision: the reference training loop for VisionMoE (instantiated per router).
//
// --dp N (common/data_parallel.hpp, docs/distributed.md): every rank runs this loop with the same
// seed, so it draws the same epoch order and the same global batch of --batch images, and trains
// on its contiguous shard of --batch / N of them; the losses are averaged over the ranks (the
// whole batch's) and so are the gradients, before clipping. The evaluations (test accuracy,
// clean and corrupted) are sharded too: rank r classifies its contiguous share of the test set
// and the correct counts are summed over the ranks, so every rank gets the whole set's accuracy
// (the same value one process gets). Rank 0 alone prints and writes files (metrics.csv,
// robustness.csv, load.csv, the checkpoint); with --resume every rank loads the checkpoint.
#pragma once

#include <algorithm>
#include <chrono>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/train/image_corruptions.hpp"
#include "graphmoe/train/training_state.hpp"
#include "graphmoe/train/metrics.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/progress.hpp"
#include "graphmoe/train/schedule.hpp"
#include "common/accuracy.hpp"
#include "common/data_parallel.hpp"
#include "common/device.hpp"
#include "common/divergence.hpp"
#include "common/resume.hpp"
#include "train_vision/options.hpp"

namespace train_vision {

using namespace graphmoe;
using Scalar = float;

// Images [first, first + n) of `order` as a (n, H, W, C) tensor and their labels.
inline void make_batch(const ImageDataset& ds, const std::vector<index_t>& order, index_t first,
                       index_t n, index_t channels, Tensor<Scalar, cpu>& x,
                       Tensor<std::int32_t, cpu>& y) {
  const index_t per = ds.rows * ds.cols;
  x = Tensor<Scalar, cpu>(Shape{n, ds.rows, ds.cols, channels});
  y = Tensor<std::int32_t, cpu>(Shape{n});
  for (index_t i = 0; i < n; ++i) {
    const index_t src = order[static_cast<std::size_t>(first + i)];
    std::copy_n(ds.pixels.data() + src * per, per, x.data() + i * per);
    y.data()[i] = ds.labels[static_cast<std::size_t>(src)];
  }
}

// The share of ds classified correctly (common/accuracy.hpp; a collective with --dp).
template <class B, class Model>
double accuracy(Model& m, const ImageDataset& ds, index_t batch, index_t channels,
                const examples::DataParallel& dp) {
  Tensor<std::int32_t, B> none;
  return examples::sharded_accuracy(
      m, ds.count, batch, dp,
      [&](const std::vector<index_t>& order, index_t s, index_t n, Tensor<std::int32_t, cpu>& y) {
        Tensor<Scalar, cpu> x;
        make_batch(ds, order, s, n, channels, x, y);
        m.forward(examples::on_backend<B>(x), none);
      });
}

// The test set with every image corrupted (on the host; accuracy() moves the batches to B).
inline ImageDataset corrupted(const ImageDataset& ds, Corruption c, int severity, std::uint64_t seed) {
  Tensor<Scalar, cpu> x(Shape{ds.count, ds.rows, ds.cols, 1});  // (N, H, W, 1): grey-scale
  std::copy(ds.pixels.begin(), ds.pixels.end(), x.data());
  const Tensor<Scalar, cpu> y = corrupt_images(x, c, severity, seed);
  ImageDataset out;
  out.count = ds.count;
  out.rows = ds.rows;
  out.cols = ds.cols;
  out.pixels.assign(y.data(), y.data() + y.numel());
  out.labels = ds.labels;
  return out;
}

// load.csv: the tokens routed to each expert of every MoE layer on the first n images of ds,
// share = tokens / the layer's total (k per token).
template <class B, class Model>
void write_layer_loads(Model& m, const ImageDataset& ds, index_t n, const VisionMoEConfig& mc,
                       const std::string& path) {
  std::vector<index_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), index_t{0});
  Tensor<Scalar, cpu> x;
  Tensor<std::int32_t, cpu> y;
  make_batch(ds, order, 0, n, mc.channels, x, y);
  ModeScope<Model> eval(m, Mode::Eval);
  m.forward(examples::on_backend<B>(x), Tensor<std::int32_t, B>());
  CsvLog csv(path, {"layer", "expert", "tokens", "share"});
  for (index_t l = 0; l < mc.num_layers; ++l) {
    if (!m.block(l).is_moe()) continue;
    const auto load = expert_load(examples::host_values(m.block(l).moe().routing().selection.indices),
                                  mc.router.num_experts);
    const index_t total = std::accumulate(load.begin(), load.end(), index_t{0});
    for (std::size_t e = 0; e < load.size(); ++e)
      csv.row({static_cast<double>(l), static_cast<double>(e), static_cast<double>(load[e]),
               total > 0 ? static_cast<double>(load[e]) / static_cast<double>(total) : 0.0});
  }
}

template <class Policy, class B>
int run(const Options& opt, const Data& data) {
  namespace fs = std::filesystem;
  const auto run_start = std::chrono::steady_clock::now();
  set_num_threads(opt.threads);
  examples::require_device<B>("train_vision");
  VisionMoEConfig mc = opt.model;
  mc.image_height = data.train.rows;
  mc.image_width = data.train.cols;
  VisionMoE<Policy, Scalar, B> model(mc, opt.seed);
  const examples::DataParallel& dp = opt.dp;
  const bool root = dp.root();  // prints and writes files; the other ranks write nothing
  const index_t shard = opt.batch / dp.size();  // images per rank (main() checks the division)
  const index_t n_train = opt.train_limit > 0 ? std::min(opt.train_limit, data.train.count) : data.train.count;
  const index_t steps_per_epoch = n_train / opt.batch;
  GRAPHMOE_CHECK(steps_per_epoch >= 1, "train_vision", "fewer training images (", n_train,
                 ") than one batch (", opt.batch, ")");
  const std::int64_t total = steps_per_epoch * opt.epochs;
  AdamWConfig ac;
  ac.lr = opt.lr;
  ac.weight_decay = opt.weight_decay;
  AdamW<Scalar, B> adam(model.arena(), ac);
  LRSchedule sched{opt.lr, opt.min_lr, std::min<std::int64_t>(opt.warmup, total), total};
  sched.validate();

  if (root) fs::create_directories(opt.out_dir);
  const std::string ckpt = (fs::path(opt.out_dir) / "checkpoint.safetensors").string();
  const nlohmann::json config = {{"router", opt.router}, {"d_model", mc.d_model}, {"layers", mc.num_layers},
                                 {"heads", mc.num_heads}, {"d_ff", mc.d_ff}, {"experts", mc.router.num_experts},
                                 {"k", mc.router.k}, {"patch", mc.patch}, {"batch", opt.batch}, {"seed", opt.seed}};
  std::int64_t step = 0;
  if (root) examples::remove_stale_checkpoint_temporaries(ckpt, "train_vision");
  if (opt.resume && examples::checkpoint_to_resume(ckpt, "train_vision")) {
    const SafetensorsFile f = load_safetensors(ckpt);
    const nlohmann::json saved = metadata_json(f, "config");
    GRAPHMOE_CHECK(saved == config, "train_vision --resume", "'", ckpt,
                   "': the checkpoint's configuration (metadata field 'config') differs from "
                   "this run's: ", saved.dump(), " vs ", config.dump());
    // the step is checked before load_training_state changes anything
    step = metadata_int(f, "step", 0, std::numeric_limits<std::int64_t>::max());
    load_training_state(f, model.arena(), adam);
    if (root)
      std::fprintf(stderr, "resumed from %s at step %lld\n", ckpt.c_str(), static_cast<long long>(step));
  }
  if (dp.active()) {
    // every rank read the checkpoint (the output directory must be visible to all of them);
    // they must have found the same one
    const std::vector<index_t> steps = dp.comm->all_gather(static_cast<index_t>(step));
    for (std::size_t r = 0; r < steps.size(); ++r)
      if (steps[r] != steps[0])
        examples::throw_same_on_every_rank(
            "train_vision --resume", "rank ", r, " starts at step ", steps[r], " but rank 0 at step ",
            steps[0], ": every rank must see the same '", ckpt, "' (a shared output directory)");
    examples::broadcast_parameters(dp, model.arena());  // everyone starts from rank 0's values
  }
  std::int64_t saved_at = -1;  // the step of the last checkpoint this run wrote
  auto save = [&](std::int64_t at) {  // on every rank: rank 0 writes
    examples::save_training_state(dp, ckpt, model.arena(), adam,
                                  {{"config", config.dump()}, {"step", std::to_string(at)}});
    saved_at = at;
  };
  std::optional<CsvLog> csv;  // rank 0's
  if (root)
    csv.emplace((fs::path(opt.out_dir) / "metrics.csv").string(),
                std::vector<std::string>{"step", "epoch", "train_loss", "test_accuracy", "lr", "grad_norm"},
                opt.resume && step > 0);

  auto epoch_order = [&](std::int64_t epoch) {
    std::vector<index_t> order(static_cast<std::size_t>(data.train.count));
    std::iota(order.begin(), order.end(), index_t{0});
    order.resize(static_cast<std::size_t>(n_train));
    Rng rng(opt.seed * 7919ull + static_cast<std::uint64_t>(epoch));
    for (std::size_t i = order.size(); i > 1; --i)
      std::swap(order[i - 1], order[rng.uniform_int(static_cast<std::uint32_t>(i))]);
    return order;
  };
  std::vector<index_t> order = epoch_order(step / steps_per_epoch);
  ProgressBar bar(total, "train " + opt.router, step);
  const std::int64_t first = step;
  double ema = 0, norm = 0;
  // divergence (docs/reliability.md): checked before each optimizer step, so that a diverged step
  // never updates the weights and never overwrites the last checkpoint
  DivergenceGuard guard(examples::divergence_config(opt.divergence, static_cast<double>(mc.num_classes)),
                        "train_vision");
  const auto train_start = std::chrono::steady_clock::now();
  for (; step < total; ++step) {
    if (step % steps_per_epoch == 0) order = epoch_order(step / steps_per_epoch);
    Tensor<Scalar, cpu> x;
    Tensor<std::int32_t, cpu> y;
    // with --dp, this rank's contiguous shard of the global batch every rank draws
    make_batch(data.train, order, (step % steps_per_epoch) * opt.batch + dp.rank() * shard, shard,
               mc.channels, x, y);
    model.set_step(step);
    double loss = 0;
    examples::before_optimizer_step("train_vision", step + 1, [&] {
      loss = model.forward(examples::on_backend<B>(x), examples::on_backend<B>(y)).total();
      loss = examples::mean_over_ranks(dp, loss);  // the whole batch's: the same guard everywhere
      guard.check_loss(step + 1, loss);
      model.arena().zero_grad();
      model.backward();
      examples::average_gradients(dp, model.arena());  // clipping sees the whole batch's gradient
      norm = examples::clip_checked(guard, step + 1, model.arena(), opt.clip, [&](auto& a, double c) {
        return examples::clip_grad_norm(dp, a, c);
      });
    });
    adam.step(model.arena(), sched.at(step));
    model.after_optimizer_step(examples::routers_comm<B>(dp));  // stateful router policies (bias balancing)
    ema = step == first ? loss : 0.98 * ema + 0.02 * loss;
    const double ips = static_cast<double>((step + 1 - first) * opt.batch) / std::max(1e-9, bar.elapsed_seconds());
    char stats[96];
    std::snprintf(stats, sizeof stats, "loss %.3f | %s img/s", ema, ProgressBar::si(ips).c_str());
    if (root) bar.update(step + 1, stats);
    const bool end_of_epoch = (step + 1) % steps_per_epoch == 0;
    if ((opt.eval_every > 0 && (step + 1) % opt.eval_every == 0) || (opt.eval_every == 0 && end_of_epoch)) {
      const double acc = accuracy<B>(model, data.test, 256, mc.channels, dp);
      if (root) {
        csv->row({static_cast<double>(step + 1), static_cast<double>((step + 1) / steps_per_epoch), ema, acc,
                  sched.at(step), norm});
        bar.finish();
        std::fprintf(stderr, "step %lld  train loss %.4f  test accuracy %.4f\n", static_cast<long long>(step + 1), ema, acc);
      }
      save(step + 1);
    }
  }
  const double train_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count();
  if (root) bar.finish();
  if (dp.active()) {
    // the ranks must still hold the same parameters (checked once: it broadcasts the arena)
    const double divergence = examples::max_parameter_divergence(dp, model.arena());
    if (divergence != 0)
      examples::throw_same_on_every_rank(
          "train_vision", "--dp ", dp.size(), ": after training, the ranks' parameters differ from "
          "rank 0's by up to ", divergence, " (they must be identical)");
    if (root)
      std::fprintf(stderr, "train_vision: data parallel over %d ranks: parameters identical on every rank\n",
                   dp.size());
  }
  const double clean = accuracy<B>(model, data.test, 256, mc.channels, dp);
  if (root) std::printf("router=%s test_accuracy=%.4f", opt.router.c_str(), clean);
  // robustness.csv: the clean test accuracy (severity 0) and one row per --corrupt corruption; the
  // seed column is --corrupt-seed on every row (only the noise uses it)
  std::optional<CsvLog> robustness;  // rank 0's
  if (root)
    robustness.emplace((fs::path(opt.out_dir) / "robustness.csv").string(),
                       std::vector<std::string>{"corruption", "severity", "seed", "accuracy"});
  const std::string seed = std::to_string(opt.corrupt_seed);
  if (root) robustness->row(std::vector<std::string>{"clean", "0", seed, CsvLog::format(clean)});
  for (Corruption c : opt.corruptions) {
    // every rank corrupts the whole test set alike (same seed) and classifies its share
    const double acc = accuracy<B>(model, corrupted(data.test, c, opt.severity, opt.corrupt_seed), 256,
                                   mc.channels, dp);
    if (root) {
      std::printf(" %s_accuracy=%.4f", corruption_name(c), acc);
      robustness->row(std::vector<std::string>{corruption_name(c), std::to_string(opt.severity), seed,
                                               CsvLog::format(acc)});
    }
  }
  if (root) {
    std::printf("\n");
    write_layer_loads<B>(model, data.test, std::min<index_t>(256, data.test.count), mc,
                         (fs::path(opt.out_dir) / "load.csv").string());
    // the last line: the run's time, the training steps' images/s, and the checkpoint written
    const double all =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double images = static_cast<double>((total - first) * opt.batch);
    const std::string written = saved_at < 0 ? "no checkpoint written"
                                             : "checkpoint " + ckpt + " (step " + std::to_string(saved_at) + ")";
    std::printf("train_vision: %lld steps in %.2f s (%.2f s in all), %.0f images/s, %s\n",
                static_cast<long long>(total - first), train_seconds, all,
                train_seconds > 0 ? images / train_seconds : 0.0, written.c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace train_vision
