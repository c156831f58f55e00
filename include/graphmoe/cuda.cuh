// graphmoe/cuda.cuh: the library with its CUDA backend, for .cu translation units.
//
// Includes the CUDA system (every backend/cuda/ header but nccl.cuh), the op layer (ops/), and
// then the layers, routers, models and optimizers (not the rest of train/:
// include checkpoints and data readers from their own headers). The layers, routers and models are written
// once for every backend; their op calls resolve by argument type, so a .cu file gets the CUDA
// versions of Linear, LayerNorm, MultiHeadAttention, RouterImpl, ExpertBank, MoELayer, ... by
// naming graphmoe::cuda as the backend argument:
//
//   #include "graphmoe/cuda.cuh"
//   graphmoe::ParameterArena<float, graphmoe::cuda> arena;
//   graphmoe::MoELayer<graphmoe::SimilarityRouter, float, graphmoe::cuda> moe;
//
// Name the tag graphmoe::cuda in full: under `using namespace graphmoe;` at global scope, `cuda`
// is ambiguous with CCCL's `namespace cuda` (libcu++), which the CUDA headers declare.
#pragma once

// the CUDA system: every op's implementation on graphmoe::cuda (NCCL: backend/cuda/nccl.cuh)
#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/attention.cuh"
#include "graphmoe/backend/cuda/aux_losses.cuh"
#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/cross_entropy.cuh"
#include "graphmoe/backend/cuda/decode.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/backend/cuda/dispatch.cuh"
#include "graphmoe/backend/cuda/dropout.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/embedding.cuh"
#include "graphmoe/backend/cuda/gates.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/graph.cuh"
#include "graphmoe/backend/cuda/graph_blend.cuh"
#include "graphmoe/backend/cuda/grouped.cuh"
#include "graphmoe/backend/cuda/heads.cuh"
#include "graphmoe/backend/cuda/layernorm.cuh"
#include "graphmoe/backend/cuda/optim.cuh"
#include "graphmoe/backend/cuda/rmsnorm.cuh"
#include "graphmoe/backend/cuda/rope.cuh"
#include "graphmoe/backend/cuda/softmax.cuh"
#include "graphmoe/backend/cuda/swiglu.cuh"
#include "graphmoe/backend/cuda/token_graph.cuh"
#include "graphmoe/backend/cuda/topk.cuh"

// the op layer: contracts and checks, then the call into the tensors' backend
#include "graphmoe/ops/attention.hpp"
#include "graphmoe/ops/aux_losses.hpp"
#include "graphmoe/ops/cross_entropy.hpp"
#include "graphmoe/ops/decode.hpp"
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

#include "graphmoe/routing/token_graphs.hpp"
#include "graphmoe/layers/attention.hpp"
#include "graphmoe/layers/block.hpp"
#include "graphmoe/layers/expert_bank.hpp"
#include "graphmoe/layers/ffn.hpp"
#include "graphmoe/layers/linear.hpp"
#include "graphmoe/layers/moe.hpp"
#include "graphmoe/layers/norm.hpp"
#include "graphmoe/routing/router.hpp"
#include "graphmoe/models/sequence_classifier.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/models/vision_moe.hpp"
#include "graphmoe/train/optim.hpp"
