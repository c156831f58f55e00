// graphmoe/graphmoe.hpp: the umbrella header. Includes the public API, the training code
// (train/: optimizers, checkpoints with nlohmann_json, data readers with zlib) included, but what
// needs more than graphmoe::graphmoe (nvcc, NCCL, MPI, PCRE2 and utf8proc, libsentencepiece) and
// a few headers a program takes by name (tests/docs/check_docs.py claims keeps this list true):
// Not included: graphmoe/cuda.cuh, graphmoe/backend/cuda/nccl.cuh, graphmoe/dist/mpi.hpp,
//   graphmoe/hf/tokenizer.hpp, graphmoe/hf/sentencepiece.hpp, graphmoe/hf/writer.hpp,
//   graphmoe/models/upcycling.hpp, graphmoe/train/distributed_checkpoint.hpp,
//   graphmoe/testing/gradcheck.hpp, graphmoe/testing/router_gradcheck.hpp,
//   graphmoe/backend/cpu/instances.hpp.
//
// Each concept also has its own header (one per file below), which compiles on its own; include
// those directly to keep a translation unit small (the README's header table). The layers/ and
// models/ headers include nothing from train/, nor nlohmann_json or zlib: an MoE layer alone is
// <graphmoe/layers/moe.hpp> (docs/benchmarks.md, "Compile time", measures the difference).
#pragma once

#include "graphmoe/config.hpp"

// core: tensors, shapes, backend tags, the parameter arena, RNG, threads, Eigen maps
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/mode.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

// the Communicator interface and SelfCommunicator (MPI: graphmoe/dist/mpi.hpp, NCCL:
// graphmoe/backend/cuda/nccl.cuh, not here; data parallelism: train/data_parallel.hpp below)
#include "graphmoe/core/communicator.hpp"

// ops: every op's contract and argument checks, then the call into the tensors' backend (the CPU
// system of backend/cpu/, on Eigen and OpenBLAS through Eigen when GRAPHMOE_USE_BLAS, is included
// by each op; graphmoe/cuda.cuh adds the CUDA system)
#include "graphmoe/ops/attention.hpp"
#include "graphmoe/ops/aux_losses.hpp"
#include "graphmoe/ops/cross_entropy.hpp"
#include "graphmoe/ops/dispatch.hpp"
#include "graphmoe/ops/dropout.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/embedding.hpp"
#include "graphmoe/ops/experts.hpp"
#include "graphmoe/ops/gates.hpp"
#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/ops/gemm.hpp"
#include "graphmoe/ops/heads.hpp"
#include "graphmoe/ops/layernorm.hpp"
#include "graphmoe/ops/optim.hpp"
#include "graphmoe/ops/rmsnorm.hpp"
#include "graphmoe/ops/rope.hpp"
#include "graphmoe/ops/softmax.hpp"
#include "graphmoe/ops/swiglu.hpp"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/ops/topk.hpp"

// routing: Router<Scorer, TokenGraph, Selector>, named routers, auxiliary losses
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/routing/aux_losses.hpp"
#include "graphmoe/routing/policies.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/routing/router.hpp"
#include "graphmoe/routing/scorers.hpp"
#include "graphmoe/routing/selectors.hpp"
#include "graphmoe/routing/token_graphs.hpp"

// layers: linear, layer norm, attention, FFN, expert bank, MoE layer, transformer block
#include "graphmoe/layers/attention.hpp"
#include "graphmoe/layers/block.hpp"
#include "graphmoe/layers/expert_bank.hpp"
#include "graphmoe/layers/ffn.hpp"
#include "graphmoe/layers/linear.hpp"
#include "graphmoe/layers/moe.hpp"
#include "graphmoe/layers/norm.hpp"

// models
#include "graphmoe/models/sequence_classifier.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/models/vision_moe.hpp"

// train: optimizers, schedules, checkpoints, data parallelism, pretrained backbones, data, metrics,
// progress
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/data_parallel.hpp"
#include "graphmoe/train/datasets.hpp"
#include "graphmoe/train/divergence.hpp"
#include "graphmoe/train/image_corruptions.hpp"
#include "graphmoe/train/lm_batcher.hpp"
#include "graphmoe/train/metrics.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/pretrained.hpp"
#include "graphmoe/train/progress.hpp"
#include "graphmoe/train/routing_report.hpp"
#include "graphmoe/train/schedule.hpp"
#include "graphmoe/train/text_attack.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"

// inference: sampling (greedy, temperature, top-k, top-p) and generate (the full-forward decoder)
#include "graphmoe/inference/generate.hpp"
#include "graphmoe/inference/sampling.hpp"

// Hugging Face model directories: config.json and safetensors shards into a TransformerLM
#include "graphmoe/hf/config.hpp"
#include "graphmoe/hf/reader.hpp"
