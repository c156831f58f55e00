// The CUDA emulation itself (cuda_emulation.hpp, runtime.cpp): that its blocks, barriers, shuffles
// and shared memory behave as on a GPU where the CUDA programming model defines the result, that
// it reports the errors a GPU leaves undefined (divergent barriers, shuffles with exited lanes, bad
// launch shapes), and that its runtime and cuBLAS stand-ins check their arguments like CUDA's.
#include <doctest/doctest.h>

#include <cublas_v2.h>

#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "graphmoe/cuda.cuh"

using namespace graphmoe;

namespace {

// out[block] = sum of in[block * blockDim.x + t] over the block's threads (block_reduce).
__global__ void block_sum_kernel(const double* in, double* out) {
  const double v = in[blockIdx.x * blockDim.x + threadIdx.x];
  const double s = detail::block_reduce(v, detail::SumOp{}, 0.0);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// Each thread stores its index in shared memory and reads its right neighbour's, with or without
// the barrier between the two.
template <bool Barrier>
__global__ void neighbour_kernel(int* out) {
  __shared__ int slot[64];
  slot[threadIdx.x] = static_cast<int>(threadIdx.x + 1000 * blockIdx.x);
  if constexpr (Barrier) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot[(threadIdx.x + 1) % blockDim.x];
}

__global__ void early_exit_then_barrier_kernel(int* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void early_exit_then_shuffle_kernel(float* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = detail::warp_reduce(1.0f, detail::SumOp{});
}

__global__ void shuffle_kernel(float* out) {
  out[threadIdx.x] = detail::warp_reduce(1.0f, detail::SumOp{});
}

// Half of warp 0 waits at the block barrier, the other half in a shuffle that needs the first.
__global__ void divergent_barriers_kernel(float* out) {
  if (threadIdx.x < 16)
    __syncthreads();
  else
    out[threadIdx.x] = detail::warp_reduce(1.0f, detail::SumOp{});
}

__global__ void index_kernel(unsigned* out) {
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  out[b * blockDim.x * blockDim.y * blockDim.z + t] = b * 1000 + t;
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_CASE("emulation: blocks, block_reduce over shuffles and shared memory, grid indices") {
  const int blocks = 5, threads = 256;
  std::vector<double> in(blocks * threads);
  std::iota(in.begin(), in.end(), 1.0);
  Tensor<double> h_in({blocks * threads});
  std::copy(in.begin(), in.end(), h_in.data());
  const auto d_in = to_device(h_in);
  Tensor<double, graphmoe::cuda> d_out(Shape{blocks});
  detail::launch_kernel<block_sum_kernel>(blocks, threads, d_in.data(), d_out.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  const auto out = to_host(d_out);
  for (int b = 0; b < blocks; ++b) {
    double want = 0;
    for (int t = 0; t < threads; ++t) want += in[b * threads + t];
    CHECK(out.data()[b] == want);
  }

  // Three-dimensional grids and blocks: every (block, thread) pair runs exactly once.
  const dim3 grid(2, 3, 2), block(4, 2, 8);
  const unsigned n = 12 * 64;
  Tensor<unsigned, graphmoe::cuda> d_idx(Shape{n});
  detail::launch_kernel<index_kernel>(grid, block, d_idx.data());
  const auto idx = to_host(d_idx);
  for (unsigned i = 0; i < n; ++i) CHECK(idx.data()[i] == (i / 64) * 1000 + i % 64);
}

TEST_CASE("emulation: a missing __syncthreads shows as a wrong result, the barrier fixes it") {
  Tensor<int, graphmoe::cuda> d_out(Shape{2 * 64});
  detail::launch_kernel<neighbour_kernel<true>>(2, 64, d_out.data());
  auto out = to_host(d_out);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 64; ++t) CHECK(out.data()[b * 64 + t] == (t + 1) % 64 + 1000 * b);
  detail::launch_kernel<neighbour_kernel<false>>(2, 64, d_out.data());
  out = to_host(d_out);
  int right = 0;
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 64; ++t) right += out.data()[b * 64 + t] == (t + 1) % 64 + 1000 * b;
  CHECK(right < 2 * 64);  // threads ran one after the other: most read a stale neighbour
}

TEST_CASE("emulation: undefined behaviour on a GPU is an error naming the kernel") {
  Tensor<int, graphmoe::cuda> ints(Shape{256});
  Tensor<float, graphmoe::cuda> floats(Shape{256});
  std::string msg = what_of([&] {
    detail::launch_kernel<early_exit_then_barrier_kernel>(1, 64, ints.data());
  });
  CHECK(msg.find("early_exit_then_barrier_kernel") != std::string::npos);
  CHECK(msg.find("__syncthreads() reached by 16 of 64 threads") != std::string::npos);

  msg = what_of([&] {
    detail::launch_kernel<early_exit_then_shuffle_kernel>(1, 32, floats.data());
  });
  CHECK(msg.find("early_exit_then_shuffle_kernel") != std::string::npos);
  CHECK(msg.find("lane 7 of warp 0, which has exited") != std::string::npos);

  msg = what_of([&] { detail::launch_kernel<shuffle_kernel>(1, 16, floats.data()); });
  CHECK(msg.find("lane 16, which does not exist") != std::string::npos);

  msg = what_of([&] { detail::launch_kernel<divergent_barriers_kernel>(1, 32, floats.data()); });
  CHECK(msg.find("deadlock") != std::string::npos);

  msg = what_of([&] { detail::launch_kernel<early_exit_then_barrier_kernel>(1, 2048, ints.data()); });
  CHECK(msg.find("invalid launch configuration") != std::string::npos);
  msg = what_of([&] { detail::launch_kernel<early_exit_then_barrier_kernel>(0, 32, ints.data()); });
  CHECK(msg.find("invalid launch configuration") != std::string::npos);

  // After a failed launch the emulation runs the next kernel normally.
  detail::launch_kernel<neighbour_kernel<true>>(1, 64, ints.data());
  CHECK(to_host(ints).data()[63] == 0);
}

TEST_CASE("emulation: the runtime and cuBLAS stand-ins check their arguments") {
  // Exact allocations (the caching allocator behind Tensor rounds sizes up).
  float *d = nullptr, *a = nullptr, *c = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), 32) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&a), 12 * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&c), 16 * sizeof(float)) == cudaSuccess);
  std::vector<float> host(9, 1.0f);
  // Copies must name the memory spaces they touch and stay inside the allocation.
  CHECK(cudaMemcpy(host.data(), d, 32, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(d, host.data(), 36, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(d, host.data(), 32, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);  // the last error, then cleared
  CHECK(cudaGetLastError() == cudaSuccess);

  cublasHandle_t h = detail::cublas_handle();
  const float one = 1, zero = 0;
  // lda smaller than the rows of A (column-major m = 4): rejected as cuBLAS does.
  CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, 4, 4, 3, &one, a, 3, a, 4, &zero, c, 4) ==
        CUBLAS_STATUS_INVALID_VALUE);
  CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, 4, 4, 3, &one, a, 4, a, 4, &zero, c, 4) ==
        CUBLAS_STATUS_SUCCESS);
  // A matrix that runs past its allocation (a wrong leading dimension or size) throws.
  CHECK(what_of([&] {
          (void)cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, a, 4, a, 4, &zero, c, 4);
        }).find("outside device memory") != std::string::npos);
  CHECK(cudaFree(d) == cudaSuccess);
  CHECK(cudaFree(a) == cudaSuccess);
  CHECK(cudaFree(c) == cudaSuccess);
  CHECK(cudaFree(c) == cudaErrorInvalidValue);  // freed twice
  (void)cudaGetLastError();
}

namespace {
// Writes one element past the end of its n elements.
__global__ void write_past_end_kernel(float* x, index_t n) {
  if (threadIdx.x == 0) x[n] = 1.0f;
}
__global__ void read_kernel(const float* x, float* out) {
  if (threadIdx.x == 0) out[0] = x[0];
}
}  // namespace

TEST_CASE("emulation: device memory is poisoned, and writes past a tensor's end are reported") {
  Tensor<float, graphmoe::cuda> out(Shape{1});
  {
    // A tensor's bytes beyond its end read as NaN (as uninitialised or freed memory does).
    float* raw = static_cast<float*>(detail::CudaCachingAllocator::instance().allocate(12));
    detail::launch_kernel<read_kernel>(1, 32, raw + 3, out.data());
    CHECK(std::isnan(to_host(out).data()[0]));
    detail::CudaCachingAllocator::instance().deallocate(raw);
  }
  {
    Tensor<float, graphmoe::cuda> x(Shape{3});
    detail::launch_kernel<write_past_end_kernel>(1, 32, x.data(), index_t(3));
  }  // freed here: the canary after the 12 bytes changed
  const std::string msg = what_of([&] { detail::launch_kernel<read_kernel>(1, 32, out.data(), out.data()); });
  CHECK(msg.find("wrote past the end of a device tensor of 12 bytes") != std::string::npos);
  CHECK(msg.find("read_kernel") != std::string::npos);
  // Copies are checked against the tensor's bytes, not its block's.
  Tensor<float, graphmoe::cuda> y(Shape{3});
  std::vector<float> host(4, 0.0f);
  CHECK(cudaMemcpy(host.data(), y.data(), 16, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(host.data(), y.data(), 12, cudaMemcpyDeviceToHost) == cudaSuccess);
  (void)cudaGetLastError();
}

// The GPU expert bank groups its steps over the experts: an MoE layer's forward and backward issue
// the same number of kernel launches and cuBLAS calls for 4 experts as for 16 (the proxy for
// launch overhead that the emulation can measure; per-expert GEMMs issued 6 per expert).
TEST_CASE("emulation: an MoE layer's launches and cuBLAS calls do not grow with the experts") {
  auto count = [](index_t experts) {
    MoEConfig cfg;
    cfg.d_model = 16;
    cfg.d_ff = 24;
    cfg.router.num_experts = experts;
    cfg.router.k = 2;
    ParameterArena<float, graphmoe::cuda> arena;
    MoELayer<SoftmaxRouter, float, graphmoe::cuda> layer;
    layer.declare(arena, "moe.", cfg);
    arena.allocate();
    layer.bind(arena);
    Rng rng(3);
    layer.init(rng);
    Tensor<float> u({64, cfg.d_model});
    for (index_t i = 0; i < u.numel(); ++i) u.data()[i] = static_cast<float>(rng.normal());
    const auto du = to_device(u);
    GraphContext<float, graphmoe::cuda> ctx{16, nullptr};
    Tensor<float, graphmoe::cuda> y, dx;
    layer.forward(du, ctx, y);  // warm-up: buffers allocated once
    layer.backward(du, dx);
    const auto before = graphmoe_cuda_emulation::counters();
    layer.forward(du, ctx, y);
    layer.backward(du, dx);
    const auto after = graphmoe_cuda_emulation::counters();
    MESSAGE(experts, " experts: ", after.kernel_launches - before.kernel_launches, " launches, ",
            after.cublas_calls - before.cublas_calls, " cuBLAS calls");
    return std::pair{after.kernel_launches - before.kernel_launches,
                     after.cublas_calls - before.cublas_calls};
  };
  const auto few = count(4), many = count(16);
  CHECK(few.first == many.first);
  CHECK(few.second == many.second);
  CHECK(many.second <= 12);  // 6 grouped expert GEMMs + the router's
}
