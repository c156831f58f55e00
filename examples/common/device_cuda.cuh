// The CUDA side of common/device.hpp: included (after graphmoe/cuda.cuh) by the examples' .cu
// instantiations of their training loops on graphmoe::cuda.
#pragma once

#include "common/device.hpp"
#include "graphmoe/cuda.cuh"

namespace examples {

template <>
inline void require_device<graphmoe::cuda>(const char* program) {
  GRAPHMOE_CHECK(graphmoe::cuda_device_count() > 0, program,
                 "--device cuda: no CUDA device is visible to this process");
  std::fprintf(stderr, "%s: device %s\n", program, graphmoe::cuda_device_name().c_str());
}

template <>
struct Bf16Compute<graphmoe::cuda> {
  using type = __nv_bfloat16;
};

template <>
class StepGraph<graphmoe::cuda> {
 public:
  explicit StepGraph(bool on = false) : on_(on) {}
  bool enabled() const { return on_; }
  template <class F>
  void run(F&& step) {
    if (!on_ || !warm_) {  // off, or the eager step that allocates the model's buffers
      step();
      warm_ = on_;
      return;
    }
    if (!graph_.captured()) {
      graph_.capture(step);
      ++captures_;
    }
    graph_.replay();
  }
  void reset() {
    graph_.reset();
    warm_ = false;
  }
  std::size_t captures() const { return captures_; }

 private:
  bool on_ = false, warm_ = false;
  std::size_t captures_ = 0;
  graphmoe::CudaGraph graph_;
};

}  // namespace examples
