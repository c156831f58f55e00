// graphmoe/graphmoe.hpp: the umbrella header. Includes the whole public API.
//
// Each concept also has its own header (one per file below), which compiles on its own; include
// those directly to keep a translation unit small.
#pragma once

#include "graphmoe/config.hpp"

// core: tensors, shapes, backend tags, the parameter arena, RNG, threads, Eigen maps
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

// backend/cpu: the op set on Eigen (and OpenBLAS through Eigen when GRAPHMOE_USE_BLAS)
#include "graphmoe/backend/cpu/attention.hpp"
#include "graphmoe/backend/cpu/cross_entropy.hpp"
#include "graphmoe/backend/cpu/dispatch.hpp"
#include "graphmoe/backend/cpu/dropout.hpp"
#include "graphmoe/backend/cpu/embedding.hpp"
#include "graphmoe/backend/cpu/gelu.hpp"
#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/backend/cpu/layernorm.hpp"
#include "graphmoe/backend/cpu/softmax.hpp"
#include "graphmoe/backend/cpu/topk.hpp"
