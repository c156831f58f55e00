// train_vision: options and data shared by main.cpp and the per-router training loops.
#pragma once

#include <string>
#include <vector>

#include "common/data_parallel.hpp"
#include "common/divergence.hpp"
#include "graphmoe/models/vision_moe.hpp"
#include "graphmoe/train/image_corruptions.hpp"
#include "graphmoe/train/image_datasets.hpp"

namespace train_vision {

struct Options {
  std::string router = "softmax";
  graphmoe::VisionMoEConfig model;
  int epochs = 2;
  graphmoe::index_t batch = 64;
  graphmoe::index_t train_limit = 0;  // use the first N training images (0 = all)
  double lr = 2e-3, min_lr = 1e-4, weight_decay = 0.05, clip = 1.0;
  std::int64_t warmup = 100;
  std::int64_t eval_every = 0;  // steps; 0 = once per epoch
  std::uint64_t seed = 1;
  int threads = 2;
  std::string device = "cpu";  // cpu, or cuda when built with CUDA (see examples/CMakeLists.txt)
  std::string out_dir = "runs/vision";
  examples::DataParallel dp;  // --dp: data parallel over the ranks of an MPI job
  examples::DivergenceOptions divergence;  // --divergence-factor, --max-grad-norm, --max-loss
  bool resume = false;
  // after training: the test accuracy under each of these corruptions (robustness.csv)
  std::vector<graphmoe::Corruption> corruptions;
  int severity = 3;               // 1..5 (ImageNet-C's levels)
  std::uint64_t corrupt_seed = 1;  // the Gaussian noise's seed
};

struct Data {
  graphmoe::ImageDataset train, test;
};

// The training loop for one router on backend B (graphmoe::cpu or graphmoe::cuda).
template <class Policy, class B>
int run(const Options& opt, const Data& data);

}  // namespace train_vision
