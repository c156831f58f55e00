// finetune_classifier: the reference fine-tuning loop (instantiated per router): a
// SequenceClassifier initialised from an LM checkpoint, AdamW, accuracy on the test split.
//
// --dp N (common/data_parallel.hpp, docs/distributed.md): every rank reads the LM checkpoint and
// runs this loop with the same seed, so it draws the same epoch order and the same global batch
// of --batch examples, and trains on its contiguous shard of --batch / N of them; rank 0's
// parameters are broadcast once the backbone is loaded, the losses are averaged over the ranks
// (the whole batch's) and so are the gradients, before clipping. The test accuracy is sharded:
// rank r classifies its contiguous share of the test set and the correct counts are summed over
// the ranks, so every rank gets the whole set's accuracy (the value one process gets). Rank 0
// alone prints and writes metrics.csv.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/accuracy.hpp"
#include "common/data_parallel.hpp"
#include "common/device.hpp"
#include "common/divergence.hpp"
#include "finetune_classifier/options.hpp"
#include "graphmoe/train/metrics.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/train/pretrained.hpp"
#include "graphmoe/train/progress.hpp"
#include "graphmoe/train/schedule.hpp"

namespace finetune_classifier {

using namespace graphmoe;
using Scalar = float;

// Examples order[first .. first + n) as right-padded ids (n, T), lengths and labels.
inline void make_batch(const Encoded& d, const std::vector<index_t>& order, index_t first, index_t n,
                       Tensor<std::int32_t, cpu>& ids, Tensor<std::int32_t, cpu>& lengths,
                       Tensor<std::int32_t, cpu>& labels) {
  index_t t = 1;
  for (index_t i = 0; i < n; ++i)
    t = std::max<index_t>(t, static_cast<index_t>(d.ids[static_cast<std::size_t>(order[static_cast<std::size_t>(first + i)])].size()));
  ids = Tensor<std::int32_t, cpu>(Shape{n, t});
  lengths = Tensor<std::int32_t, cpu>(Shape{n});
  labels = Tensor<std::int32_t, cpu>(Shape{n});
  for (index_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(order[static_cast<std::size_t>(first + i)]);
    const auto& x = d.ids[k];
    std::copy(x.begin(), x.end(), ids.data() + i * t);
    lengths.data()[i] = static_cast<std::int32_t>(x.size());
    labels.data()[i] = d.labels[k];
  }
}

// The share of d classified correctly (common/accuracy.hpp; a collective with --dp).
template <class B, class Model>
double accuracy(Model& m, const Encoded& d, index_t batch, const examples::DataParallel& dp) {
  Tensor<std::int32_t, B> none;
  return examples::sharded_accuracy(
      m, static_cast<index_t>(d.labels.size()), batch, dp,
      [&](const std::vector<index_t>& order, index_t s, index_t b, Tensor<std::int32_t, cpu>& y) {
        Tensor<std::int32_t, cpu> ids, len;
        make_batch(d, order, s, b, ids, len, y);
        m.forward(examples::on_backend<B>(ids), len, none);
      });
}

// The largest weight magnitude a pretrained backbone may hold. Trained weights are of order 1
// (initialised with standard deviation 0.02); a weight far beyond that is a corrupted or diverged
// checkpoint. Such a weight need not show in the loss: token or position embeddings of 1e30 are
// normalised by every LayerNorm, which scales the gradients reaching them by its 1 / std (about
// 1e-30), so the backbone cannot move and the run used to train the new head alone, to chance
// accuracy, and exit 0. 1e6 leaves a wide margin above trained weights of order 1 and is far below
// where float arithmetic breaks down (squares overflow above ~1.8e19).
inline constexpr double kMaxPretrainedWeight = 1e6;

// The rule train_lm --resume applies to a checkpoint's "model." tensors (load_arena, strict, and
// check_weight_values: finite weights), here against the backbone (every parameter but the new
// "cls_head.*"): each parameter present with its exact dtype and shape, no "model." tensor that is
// not one of them (a stray tensor is refused by name, not ignored), and every weight finite and at
// most kMaxPretrainedWeight in magnitude. Checks only; load_pretrained
// (graphmoe/train/pretrained.hpp) copies.
template <class T, class B>
void check_pretrained(const SafetensorsFile& f, const ParameterArena<T, B>& arena) {
  ParameterArena<T, cpu> backbone;
  for (const auto& p : arena.params())
    if (p.name.rfind("cls_head.", 0) != 0) backbone.add(p.name, p.shape, p.trainable);
  backbone.allocate();
  load_arena(f, backbone, "model.");
  check_weight_values<T>(f, "model.", "finetune_classifier", "a pretrained backbone's",
                         kMaxPretrainedWeight);
}

// --hf: the backbone from a Hugging Face model directory (hf::load_lm on the host, its parameters
// handed to load_backbone by name; the classification head keeps its initialisation).
template <class Policy, class Model>
void load_hf_backbone(const Options& opt, Model& model) {
  if constexpr (hf::loadable_router<Policy>) {
    const auto lm = hf::load_lm<Policy, Scalar>(opt.hf_dir);
    model.load_backbone([&](const std::string& name, const Shape& shape) {
      GRAPHMOE_CHECK(lm->arena().contains(name), "finetune_classifier --hf", "'", opt.hf_dir,
                     "' gives the model no parameter '", name, "'");
      const Tensor<Scalar, cpu> v = lm->arena().value(name);
      GRAPHMOE_CHECK(v.shape() == shape, "finetune_classifier --hf", "parameter '", name,
                     "' has shape ", v.shape(), " in '", opt.hf_dir, "', the classifier expects ",
                     shape);
      return v.clone();
    });
  } else {
    (void)model;
    graphmoe::detail::throw_error("finetune_classifier --hf", "the router ", opt.router,
                                  " cannot load a Hugging Face model");
  }
}

template <class Policy, class B>
int run(const Options& opt, const Data& data) {
  namespace fs = std::filesystem;
  set_num_threads(opt.threads);
  examples::require_device<B>("finetune_classifier");
  SequenceClassifier<Policy, Scalar, B> model(opt.model, opt.num_classes, opt.seed);
  if (!opt.from_scratch && !opt.hf_dir.empty()) {
    load_hf_backbone<Policy>(opt, model);
  } else if (!opt.from_scratch) {
    const SafetensorsFile f = load_safetensors(opt.checkpoint);
    check_pretrained(f, model.arena());
    load_pretrained(model, f, "model.");
  }
  const examples::DataParallel& dp = opt.dp;
  const bool root = dp.root();  // prints and writes files; the other ranks write nothing
  const index_t shard = opt.batch / dp.size();  // examples per rank (main() checks the division)
  // every rank read the backbone and drew the head from the same seed: start from rank 0's values
  examples::broadcast_parameters(dp, model.arena());
  const index_t n = static_cast<index_t>(data.train.labels.size());
  const index_t steps_per_epoch = n / opt.batch;
  GRAPHMOE_CHECK(steps_per_epoch >= 1, "finetune_classifier", "fewer training examples (", n,
                 ") than one batch (", opt.batch, ")");
  const std::int64_t total = steps_per_epoch * opt.epochs;
  AdamWConfig ac;
  ac.lr = opt.lr;
  ac.weight_decay = opt.weight_decay;
  AdamW<Scalar, B> adam(model.arena(), ac);
  LRSchedule sched{opt.lr, 0.0, std::min<std::int64_t>(opt.warmup, total), total};
  std::optional<CsvLog> csv;  // rank 0's
  if (root) {
    fs::create_directories(opt.out_dir);
    csv.emplace((fs::path(opt.out_dir) / "metrics.csv").string(),
                std::vector<std::string>{"step", "epoch", "train_loss", "test_accuracy"});
  }
  const double initial = accuracy<B>(model, data.test, 64, dp);
  if (root) {
    std::printf("router=%s initial_test_accuracy=%.4f\n", opt.router.c_str(), initial);
    std::fflush(stdout);
  }
  ProgressBar bar(total, "finetune " + opt.router);
  DivergenceGuard guard(examples::divergence_config(opt.divergence, static_cast<double>(opt.num_classes)),
                        "finetune_classifier");
  double ema = 0;
  std::vector<index_t> order(static_cast<std::size_t>(n));
  for (std::int64_t step = 0; step < total; ++step) {
    if (step % steps_per_epoch == 0) {
      std::iota(order.begin(), order.end(), index_t{0});
      Rng rng(opt.seed * 31337ull + static_cast<std::uint64_t>(step / steps_per_epoch));
      for (std::size_t i = order.size(); i > 1; --i)
        std::swap(order[i - 1], order[rng.uniform_int(static_cast<std::uint32_t>(i))]);
    }
    Tensor<std::int32_t, cpu> ids, len, y;
    // with --dp, this rank's contiguous shard of the global batch every rank draws
    make_batch(data.train, order, (step % steps_per_epoch) * opt.batch + dp.rank() * shard, shard,
               ids, len, y);
    model.set_step(step);
    double loss = 0;
    examples::before_optimizer_step("finetune_classifier", step + 1, [&] {
      loss = model.forward(examples::on_backend<B>(ids), len, examples::on_backend<B>(y)).total();
      loss = examples::mean_over_ranks(dp, loss);  // the whole batch's: the same guard everywhere
      guard.check_loss(step + 1, loss);
      model.arena().zero_grad();
      model.backward();
      examples::average_gradients(dp, model.arena());  // clipping sees the whole batch's gradient
      examples::clip_checked(guard, step + 1, model.arena(), opt.clip, [&](auto& a, double c) {
        return examples::clip_grad_norm(dp, a, c);
      });
    });
    adam.step(model.arena(), sched.at(step));
    model.after_optimizer_step(examples::routers_comm<B>(dp));  // stateful router policies (bias balancing)
    ema = step == 0 ? loss : 0.98 * ema + 0.02 * loss;
    const double eps = static_cast<double>((step + 1) * opt.batch) / std::max(1e-9, bar.elapsed_seconds());
    char stats[96];
    std::snprintf(stats, sizeof stats, "loss %.3f | %s ex/s", ema, ProgressBar::si(eps).c_str());
    if (root) bar.update(step + 1, stats);
    if ((step + 1) % steps_per_epoch == 0) {
      const double acc = accuracy<B>(model, data.test, 64, dp);
      if (root) {
        bar.finish();
        std::fprintf(stderr, "epoch %lld  train loss %.4f  test accuracy %.4f\n",
                     static_cast<long long>((step + 1) / steps_per_epoch), ema, acc);
        csv->row({static_cast<double>(step + 1), static_cast<double>((step + 1) / steps_per_epoch), ema, acc});
      }
    }
  }
  if (root) bar.finish();
  if (dp.active()) {
    // the ranks must still hold the same parameters (checked once: it broadcasts the arena)
    const double divergence = examples::max_parameter_divergence(dp, model.arena());
    if (divergence != 0)
      examples::throw_same_on_every_rank(
          "finetune_classifier", "--dp ", dp.size(), ": after training, the ranks' parameters differ "
          "from rank 0's by up to ", divergence, " (they must be identical)");
    if (root)
      std::fprintf(stderr,
                   "finetune_classifier: data parallel over %d ranks: parameters identical on every rank\n",
                   dp.size());
  }
  const double final_accuracy = accuracy<B>(model, data.test, 64, dp);
  if (root) std::printf("router=%s test_accuracy=%.4f\n", opt.router.c_str(), final_accuracy);
  return 0;
}

}  // namespace finetune_classifier
