// tests/cuda/emulation/runtime.cpp: the CPU side of the CUDA emulation (see cuda_emulation.hpp):
// the block scheduler (fibers), and the parts of the CUDA runtime and cuBLAS the backend calls,
// implemented on host memory. Linked instead of libcudart and libcublas.
#include "cuda_emulation.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;
int warpSize = 32;
}

// ---- context switches --------------------------------------------------------------------------
// x86-64: a switch saves the callee-saved registers, MXCSR and the x87 control word on the old
// stack and loads them from the new one (glibc's swapcontext also saves the signal mask with a
// system call, which made it 80% of the emulation's time). Elsewhere: ucontext.
#if defined(__x86_64__)
extern "C" void graphmoe_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl graphmoe_emu_switch
  .type graphmoe_emu_switch, @function
graphmoe_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw (%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size graphmoe_emu_switch, .-graphmoe_emu_switch
)");
#endif

namespace {
std::string& pending_corruption();  // below, with the memory checks
graphmoe_cuda_emulation::Counters counted;
bool blocks_descending = false;  // set_blocks_descending
}  // namespace

graphmoe_cuda_emulation::Counters graphmoe_cuda_emulation::counters() { return counted; }

// ---- stream capture (CUDA graphs) ---------------------------------------------------------------
// While the stream captures (cudaStreamBeginCapture), kernel launches, asynchronous copies to or
// from device or page-locked memory, asynchronous memsets and cuBLAS GEMMs are recorded, not run;
// cudaGraphLaunch runs the recorded operations in order (and counts them as they run). What a real
// capture refuses (a synchronisation, a synchronous copy or memset, a copy to pageable host memory,
// cudaMalloc / cudaFree / cudaMallocHost outside cudaStreamCaptureModeRelaxed) returns
// cudaErrorStreamCaptureUnsupported and invalidates the capture: cudaStreamEndCapture then answers
// cudaErrorStreamCaptureInvalidated. One capture at a time (the backend has one stream); Thrust's
// host algorithms cannot be recorded (they run at once: the tests do not capture them).
namespace {
struct CaptureState {
  bool active = false;
  bool invalid = false;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::vector<std::function<void()>> ops;
};
CaptureState capture_state;
thread_local cudaStreamCaptureMode thread_capture_mode = cudaStreamCaptureModeGlobal;
struct RecordedGraph {
  std::vector<std::function<void()>> ops;
};

bool capturing() { return capture_state.active; }
// Records op when the stream captures (true), else leaves it to the caller to run now (false).
bool record_if_capturing(std::function<void()> op) {
  if (!capture_state.active) return false;
  capture_state.ops.push_back(std::move(op));
  return true;
}
// A call a capture cannot hold: the capture is invalidated.
cudaError_t capture_violation();
// Whether the calling thread may make a "potentially unsafe" call (cudaMalloc and the like).
bool unsafe_call_forbidden() {
  return capture_state.active && capture_state.mode != cudaStreamCaptureModeRelaxed &&
         thread_capture_mode != cudaStreamCaptureModeRelaxed;
}
}  // namespace

namespace {
std::map<std::string, unsigned long long>& launch_histogram() {
  static std::map<std::string, unsigned long long> h;
  return h;
}
}  // namespace

std::map<std::string, unsigned long long> graphmoe_cuda_emulation::launches_by_kernel() {
  return launch_histogram();
}

void graphmoe_cuda_emulation::set_blocks_descending(bool on) { blocks_descending = on; }

namespace graphmoe_cuda_emulation {
namespace {

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

// Makes `c` start entry() on the stack [stack, stack + bytes) at the first switch to it.
void make_context(Context& c, char* stack, std::size_t bytes, void (*entry)()) {
#if defined(__x86_64__)
  auto top = reinterpret_cast<std::uintptr_t>(stack + bytes) & ~std::uintptr_t(15);
  auto* words = reinterpret_cast<std::uint64_t*>(top);
  words[-1] = 0;                                           // entry's (absent) return address
  words[-2] = reinterpret_cast<std::uint64_t>(entry);      // where graphmoe_emu_switch returns
  for (int r = 3; r <= 8; ++r) words[-r] = 0;              // rbp rbx r12 r13 r14 r15
  std::uint32_t mxcsr = 0;
  std::uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  words[-9] = mxcsr;                                       // 8(%rsp) after the switch
  words[-10] = fpucw;                                      // (%rsp)
  c.sp = &words[-10];
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
#endif
}

// Saves the running context in `from` and resumes `to`.
void switch_context(Context& from, Context& to) {
#if defined(__x86_64__)
  graphmoe_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("CUDA emulation: " + what);
}

// ---- block scheduler ----------------------------------------------------------------------------

enum class State { ready, at_block_barrier, at_warp_barrier, done };

struct Fiber {
  Context context;
  State state = State::ready;
  unsigned mask = 0;       // lanes named by the shuffle this fiber waits in
  unsigned shuffles = 0;   // shuffles done: its parity picks the exchange buffer
};

constexpr std::size_t kStackBytes = std::size_t(256) << 10;
constexpr std::size_t kGuardBytes = 4096;
constexpr unsigned kMaxThreads = 1024;

struct Scheduler {
  const char* kernel = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  unsigned threads = 0;
  unsigned current = 0;
  Context main_context;
  std::exception_ptr error;
  // exchange[warp][parity][lane]: 16 bytes per lane, two buffers (see warp_exchange).
  std::vector<std::array<std::array<std::array<unsigned char, 16>, 32>, 2>> exchange;
  char* stacks = nullptr;  // kMaxThreads stacks, each below a guard page

  char* stack(unsigned t) {
    if (stacks == nullptr) {
      const std::size_t bytes = kMaxThreads * (kStackBytes + kGuardBytes);
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) fail("cannot map the fiber stacks");
      stacks = static_cast<char*>(p);
      for (unsigned i = 0; i < kMaxThreads; ++i)
        mprotect(stacks + i * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
    }
    return stacks + t * (kStackBytes + kGuardBytes) + kGuardBytes;
  }
};

Scheduler& scheduler() {
  static Scheduler s;
  return s;
}

bool in_kernel = false;

void set_thread_index(unsigned t) {
  threadIdx.x = t % blockDim.x;
  threadIdx.y = (t / blockDim.x) % blockDim.y;
  threadIdx.z = t / (blockDim.x * blockDim.y);
}

void fiber_main() {
  Scheduler& s = scheduler();
  try {
    (*s.body)();
  } catch (...) {
    if (!s.error) s.error = std::current_exception();
  }
  s.fibers[s.current].state = State::done;
  switch_context(s.fibers[s.current].context, s.main_context);  // never resumed
  std::abort();
}

// Back to the scheduler until the barrier this fiber waits at is released.
void yield(State wait, unsigned mask = 0) {
  Scheduler& s = scheduler();
  if (!in_kernel) fail("a barrier or shuffle called outside a kernel");
  Fiber& f = s.fibers[s.current];
  f.state = wait;
  f.mask = mask;
  switch_context(f.context, s.main_context);
}

std::string where(const Scheduler& s) {
  return std::string(s.kernel) + " block (" + std::to_string(blockIdx.x) + ", " +
         std::to_string(blockIdx.y) + ", " + std::to_string(blockIdx.z) + ")";
}

// Releases the barriers every participant has reached; false when none could be released.
bool release(Scheduler& s) {
  bool released = false;
  // Warp barriers: every lane named in the mask must be waiting in the same shuffle.
  for (unsigned t = 0; t < s.threads; ++t) {
    const Fiber& f = s.fibers[t];
    if (f.state != State::at_warp_barrier) continue;
    const unsigned warp = t / 32;
    bool all = true;
    for (unsigned lane = 0; lane < 32; ++lane) {
      if ((f.mask >> lane & 1u) == 0) continue;
      const unsigned u = warp * 32 + lane;
      if (u >= s.threads)
        fail(where(s) + ": a shuffle's mask names lane " + std::to_string(lane) +
             ", which does not exist (blockDim " + std::to_string(s.threads) + ")");
      if (s.fibers[u].state == State::done)
        fail(where(s) + ": a shuffle's mask names lane " + std::to_string(lane) + " of warp " +
             std::to_string(warp) + ", which has exited");
      if (s.fibers[u].state != State::at_warp_barrier) all = false;
    }
    if (!all) continue;
    for (unsigned lane = 0; lane < 32; ++lane)
      if (f.mask >> lane & 1u) s.fibers[warp * 32 + lane].state = State::ready;
    released = true;
  }
  if (released) return true;
  // The block barrier: every thread of the block must be waiting at it.
  unsigned waiting = 0, exited = 0;
  for (const Fiber& f : s.fibers) {
    waiting += f.state == State::at_block_barrier;
    exited += f.state == State::done;
  }
  if (waiting == 0) return false;
  if (waiting + exited != s.threads) return false;
  if (exited != 0)
    fail(where(s) + ": __syncthreads() reached by " + std::to_string(waiting) + " of " +
         std::to_string(s.threads) + " threads; the others have exited");
  for (Fiber& f : s.fibers) f.state = State::ready;
  return true;
}

void run_block(Scheduler& s) {
  for (unsigned t = 0; t < s.threads; ++t) {
    Fiber& f = s.fibers[t];
    f = Fiber{};
    make_context(f.context, s.stack(t), kStackBytes, fiber_main);
  }
  for (unsigned pass = 0;; ++pass) {
    // Alternate the order in which threads run between barriers, so that a missing barrier is
    // more likely to show as a wrong result.
    for (unsigned i = 0; i < s.threads; ++i) {
      const unsigned t = pass % 2 == 0 ? i : s.threads - 1 - i;
      if (s.fibers[t].state != State::ready) continue;
      s.current = t;
      set_thread_index(t);
      switch_context(s.main_context, s.fibers[t].context);
      if (s.error) return;
    }
    bool all_done = true;
    for (const Fiber& f : s.fibers) all_done = all_done && f.state == State::done;
    if (all_done) return;
    if (!release(s))
      fail(where(s) + ": deadlock: threads wait at barriers or shuffles that the others never "
                      "reach");
  }
}

}  // namespace

namespace {
// "graphmoe::detail::softmax_forward_kernel<float, false>" from launch_kernel's signature
// ("void graphmoe::detail::launch_kernel(...) [with auto Kernel = <name>; Args = ...]").
std::string kernel_name(const char* signature) {
  const std::string s = signature;
  const std::string key = "Kernel = ";
  const std::size_t b = s.find(key);
  if (b == std::string::npos) return s;
  std::size_t e = s.find("; ", b);
  if (e == std::string::npos) e = s.find(']', b);
  std::string name = s.substr(b + key.size(), e - b - key.size());
  if (name.rfind("& ", 0) == 0 || name.rfind("&", 0) == 0) name.erase(0, name.find_first_not_of("& "));
  return name;
}
std::string current_kernel;
}  // namespace

void launch_now(const char* signature, dim3 grid, dim3 block, const std::function<void()>& body);

void launch(const char* signature, dim3 grid, dim3 block, const std::function<void()>& body) {
  if (record_if_capturing([signature, grid, block, body] { launch_now(signature, grid, block, body); }))
    return;
  launch_now(signature, grid, block, body);
}

void launch_now(const char* signature, dim3 grid, dim3 block, const std::function<void()>& body) {
  Scheduler& s = scheduler();
  ++counted.kernel_launches;
  current_kernel = kernel_name(signature);
  ++launch_histogram()[current_kernel];
  if (const std::string& bad = pending_corruption(); !bad.empty()) {
    const std::string message = bad;
    pending_corruption().clear();
    fail(message + "; found before launching " + current_kernel);
  }
  const char* kernel = current_kernel.c_str();
  if (in_kernel) fail(std::string("launch of ") + kernel + " from inside a kernel");
  const unsigned long long threads =
      static_cast<unsigned long long>(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
    fail(std::string(kernel) + ": invalid launch configuration: grid (" +
         std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " + std::to_string(grid.z) +
         "), block (" + std::to_string(block.x) + ", " + std::to_string(block.y) + ", " +
         std::to_string(block.z) + ")");
  s.kernel = kernel;
  s.body = &body;
  s.threads = static_cast<unsigned>(threads);
  s.fibers.assign(s.threads, Fiber{});
  s.exchange.resize((s.threads + 31) / 32);
  s.error = nullptr;
  gridDim = grid;
  blockDim = block;
  in_kernel = true;
  struct Reset {
    ~Reset() { in_kernel = false; }
  } reset;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = blocks_descending
                       ? uint3{grid.x - 1 - x, grid.y - 1 - y, grid.z - 1 - z}
                       : uint3{x, y, z};
        run_block(s);
        if (s.error) {
          try {
            std::rethrow_exception(s.error);
          } catch (const std::exception& e) {
            fail(where(s) + " thread " + std::to_string(s.current) + ": " + e.what());
          }
        }
      }
}

void block_barrier() { yield(State::at_block_barrier); }

void warp_exchange(unsigned mask, const void* value, std::size_t size, int src_lane, void* out) {
  Scheduler& s = scheduler();
  if (!in_kernel) fail("a shuffle called outside a kernel");
  const unsigned t = s.current, warp = t / 32, lane = t % 32;
  if ((mask >> lane & 1u) == 0)
    fail(where(s) + ": thread " + std::to_string(t) + " shuffles with a mask that excludes it");
  if (src_lane < 0 || src_lane >= 32 || (mask >> src_lane & 1u) == 0)
    fail(where(s) + ": a shuffle reads lane " + std::to_string(src_lane) + ", not in its mask");
  // Two buffers by parity: a lane can only write buffer p again after the next shuffle's barrier,
  // which every lane passes only once it has read buffer p.
  Fiber& f = s.fibers[t];
  const unsigned parity = f.shuffles++ % 2;
  std::memcpy(s.exchange[warp][parity][lane].data(), value, size);
  yield(State::at_warp_barrier, mask);
  std::memcpy(out, s.exchange[warp][parity][static_cast<unsigned>(src_lane)].data(), size);
}

}  // namespace graphmoe_cuda_emulation

// ---- CUDA runtime on host memory ----------------------------------------------------------------

namespace {

// The bytes of a cudaMalloc allocation that may be touched: all of them for a raw allocation, the
// tensor's own bytes while the caching allocator has handed the block out, none while the block
// sits in its free lists (use after free).
struct Allocation {
  std::size_t size = 0;
  enum class Use { raw, tensor, cached } use = Use::raw;
  std::size_t tensor_bytes = 0;
};

std::mutex allocations_mutex;
std::map<std::uintptr_t, Allocation>& allocations() {
  // Never destroyed: tensors in statics are freed after main returns.
  static auto* m = new std::map<std::uintptr_t, Allocation>();
  return *m;
}

// Whether [p, p + n) lies inside the usable bytes of one live cudaMalloc allocation.
bool is_device_range(const void* p, std::size_t n) {
  std::lock_guard<std::mutex> lock(allocations_mutex);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = allocations().upper_bound(a);
  if (it == allocations().begin()) return false;
  --it;
  const Allocation& al = it->second;
  const std::size_t usable = al.use == Allocation::Use::raw      ? al.size
                             : al.use == Allocation::Use::tensor ? al.tensor_bytes
                                                                 : 0;
  return usable > 0 && a - it->first + n <= usable;
}

// A kernel wrote past a tensor's end (found when the tensor was freed): reported by the next
// launch, or at exit.
std::string& pending_corruption() {
  static std::string* message = new std::string();  // never destroyed: read at exit
  return *message;
}

struct ReportAtExit {
  ~ReportAtExit() {
    if (!pending_corruption().empty()) {
      std::fprintf(stderr, "CUDA emulation: %s\n", pending_corruption().c_str());
      std::_Exit(3);
    }
  }
} report_at_exit;

}  // namespace

namespace graphmoe_cuda_emulation {

constexpr unsigned char kPoison = 0xFF;

void on_tensor_allocate(void* p, std::size_t requested, std::size_t block) noexcept {
  std::memset(p, kPoison, block);
  std::lock_guard<std::mutex> lock(allocations_mutex);
  auto it = allocations().find(reinterpret_cast<std::uintptr_t>(p));
  if (it == allocations().end()) return;
  it->second.use = Allocation::Use::tensor;
  it->second.tensor_bytes = requested;
}

void on_tensor_free(void* p, std::size_t requested, std::size_t block) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (std::size_t i = requested; i < block; ++i)
    if (bytes[i] != kPoison && pending_corruption().empty()) {
      pending_corruption() = "a kernel wrote past the end of a device tensor of " +
                             std::to_string(requested) + " bytes (byte " + std::to_string(i) +
                             " of its " + std::to_string(block) + "-byte block changed)";
      break;
    }
  std::memset(p, kPoison, block);
  std::lock_guard<std::mutex> lock(allocations_mutex);
  auto it = allocations().find(reinterpret_cast<std::uintptr_t>(p));
  if (it != allocations().end()) it->second.use = Allocation::Use::cached;
}

void on_graph_block(void* p, std::size_t block, bool owned) noexcept {
  if (!owned) std::memset(p, kPoison, block);
  std::lock_guard<std::mutex> lock(allocations_mutex);
  auto it = allocations().find(reinterpret_cast<std::uintptr_t>(p));
  if (it == allocations().end()) return;
  it->second.use = owned ? Allocation::Use::tensor : Allocation::Use::cached;
  it->second.tensor_bytes = block;
}

}  // namespace graphmoe_cuda_emulation

namespace {

cudaError_t last_error = cudaSuccess;

cudaError_t record(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

cudaError_t capture_violation() {
  capture_state.invalid = true;
  return record(cudaErrorStreamCaptureUnsupported);
}

cudaError_t check_copy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
  if (n == 0) return cudaSuccess;
  const bool dst_dev = is_device_range(dst, n), src_dev = is_device_range(src, n);
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice: ok = dst_dev && !src_dev; break;
    case cudaMemcpyDeviceToHost: ok = src_dev && !dst_dev; break;
    case cudaMemcpyDeviceToDevice: ok = src_dev && dst_dev; break;
    case cudaMemcpyHostToHost: ok = !src_dev && !dst_dev; break;
    case cudaMemcpyDefault: ok = true; break;
    default: ok = false;
  }
  return ok ? cudaSuccess : record(cudaErrorInvalidValue);
}

}  // namespace

namespace {

// Page-locked host memory (cudaMallocHost): plain host memory here, remembered so that an
// asynchronous copy into it is counted as one that does not wait.
std::map<std::uintptr_t, std::size_t>& pinned_blocks() {
  static std::map<std::uintptr_t, std::size_t> blocks;
  return blocks;
}
std::mutex pinned_mutex;

bool is_pinned_range(const void* p, std::size_t count) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned_blocks().upper_bound(a);
  if (it == pinned_blocks().begin()) return false;
  --it;
  return a >= it->first && a + count <= it->first + it->second;
}

cudaError_t copy_now(void* dst, const void* src, size_t count, cudaMemcpyKind kind, bool async);

cudaError_t copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, bool async) {
  if (const cudaError_t e = check_copy(dst, src, count, kind); e != cudaSuccess) return e;
  if (capturing()) {
    // a capture holds asynchronous copies between device and device or page-locked memory
    const bool dst_host = count != 0 && !is_device_range(dst, count);
    const bool src_host = count != 0 && !is_device_range(src, count);
    if (!async || (dst_host && !is_pinned_range(dst, count)) ||
        (src_host && !is_pinned_range(src, count)))
      return capture_violation();
    record_if_capturing([dst, src, count, kind] { (void)copy_now(dst, src, count, kind, true); });
    return cudaSuccess;
  }
  return copy_now(dst, src, count, kind, async);
}

cudaError_t copy_now(void* dst, const void* src, size_t count, cudaMemcpyKind kind, bool async) {
  if (count != 0) std::memmove(dst, src, count);
  if (kind == cudaMemcpyDefault)
    kind = is_device_range(src, count == 0 ? 1 : count)
               ? (is_device_range(dst, count == 0 ? 1 : count) ? cudaMemcpyDeviceToDevice
                                                              : cudaMemcpyDeviceToHost)
               : cudaMemcpyHostToDevice;
  switch (kind) {
    case cudaMemcpyDeviceToHost:
      if (async && is_pinned_range(dst, count))
        ++counted.async_copies_to_host;
      else
        ++counted.copies_to_host;
      break;
    case cudaMemcpyHostToDevice: ++counted.copies_to_device; break;
    case cudaMemcpyDeviceToDevice: ++counted.copies_on_device; break;
    default: break;
  }
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return record(cudaErrorInvalidValue);
  if (unsafe_call_forbidden()) return capture_violation();
  const std::size_t bytes = (size + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, bytes == 0 ? 256 : bytes);
  if (p == nullptr) return record(cudaErrorMemoryAllocation);
  std::memset(p, 0xA5, bytes == 0 ? 256 : bytes);  // device memory is not zeroed
  ++counted.device_allocations;
  {
    std::lock_guard<std::mutex> lock(allocations_mutex);
    allocations()[reinterpret_cast<std::uintptr_t>(p)] = Allocation{size};
  }
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  if (unsafe_call_forbidden()) return capture_violation();
  {
    std::lock_guard<std::mutex> lock(allocations_mutex);
    if (allocations().erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0)
      return record(cudaErrorInvalidValue);
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy(dst, src, count, kind, false);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t) {
  return copy(dst, src, count, kind, true);
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  if (ptr == nullptr) return record(cudaErrorInvalidValue);
  if (unsafe_call_forbidden()) return capture_violation();
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) return record(cudaErrorMemoryAllocation);
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks()[reinterpret_cast<std::uintptr_t>(p)] = size;
  }
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    if (pinned_blocks().erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0)
      return record(cudaErrorInvalidValue);
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* dst, int value, size_t count) {
  if (count != 0 && !is_device_range(dst, count)) return record(cudaErrorInvalidValue);
  if (capturing()) return capture_violation();
  std::memset(dst, value, count);
  ++counted.memsets;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t) {
  if (count != 0 && !is_device_range(dst, count)) return record(cudaErrorInvalidValue);
  if (record_if_capturing([dst, value, count] {
        std::memset(dst, value, count);
        ++counted.memsets;
      }))
    return cudaSuccess;
  return cudaMemset(dst, value, count);
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : record(cudaErrorInvalidDevice);
}

cudaError_t cudaDeviceSynchronize(void) {
  if (capturing()) return capture_violation();
  ++counted.synchronizations;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  if (capturing()) return capture_violation();
  ++counted.synchronizations;
  return cudaSuccess;
}
// Every operation has completed when its call returns (NcclCommunicator polls its stream).
cudaError_t cudaStreamQuery(cudaStream_t) {
  if (capturing()) return capture_violation();
  return cudaSuccess;
}

// Streams: one queue here (every operation runs when called, or is recorded while capturing); a
// created stream is a distinct handle so that code can tell it from the legacy stream.
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  if (stream == nullptr) return record(cudaErrorInvalidValue);
  static int handles = 0;
  *stream = reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(0x1000 + 16 * ++handles));
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }

// ---- graphs: stream capture and replay (see capture_state above) ----
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (stream == cudaStreamLegacy || stream == nullptr || capture_state.active)
    return record(cudaErrorIllegalState);  // CUDA: the legacy stream cannot be captured
  capture_state = CaptureState{};
  capture_state.active = true;
  capture_state.mode = mode;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* graph) {
  if (graph == nullptr) return record(cudaErrorInvalidValue);
  if (!capture_state.active) return record(cudaErrorIllegalState);
  CaptureState done = std::move(capture_state);
  capture_state = CaptureState{};
  if (done.invalid) {
    *graph = nullptr;
    return record(cudaErrorStreamCaptureInvalidated);
  }
  *graph = reinterpret_cast<cudaGraph_t>(new RecordedGraph{std::move(done.ops)});
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return record(cudaErrorInvalidValue);
  *status = !capture_state.active ? cudaStreamCaptureStatusNone
            : capture_state.invalid ? cudaStreamCaptureStatusInvalidated
                                    : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr) return record(cudaErrorInvalidValue);
  std::swap(*mode, thread_capture_mode);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr) return record(cudaErrorInvalidValue);
  *exec = reinterpret_cast<cudaGraphExec_t>(
      new RecordedGraph{reinterpret_cast<RecordedGraph*>(graph)->ops});
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  if (exec == nullptr) return record(cudaErrorInvalidValue);
  if (capturing()) return capture_violation();  // (CUDA nests it; not needed here)
  ++counted.graph_launches;
  for (const auto& op : reinterpret_cast<RecordedGraph*>(exec)->ops) op();
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete reinterpret_cast<RecordedGraph*>(exec);
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<RecordedGraph*>(graph);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, "graphmoe CUDA emulation (CPU)", sizeof(prop->name) - 1);
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = std::size_t(1) << 30;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->multiProcessorCount = 1;
  return cudaSuccess;
}

// Events: the host's clock when recorded (every operation has finished by then: the emulation
// is synchronous), so that bench_cuda's timing code runs too.
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  if (event == nullptr) return record(cudaErrorInvalidValue);
  *event = reinterpret_cast<cudaEvent_t>(new std::chrono::steady_clock::time_point());
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<std::chrono::steady_clock::time_point*>(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  if (event == nullptr) return record(cudaErrorInvalidValue);
  *reinterpret_cast<std::chrono::steady_clock::time_point*>(event) =
      std::chrono::steady_clock::now();
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event == nullptr ? record(cudaErrorInvalidValue) : cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr || start == nullptr || end == nullptr) return record(cudaErrorInvalidValue);
  const auto* a = reinterpret_cast<std::chrono::steady_clock::time_point*>(start);
  const auto* b = reinterpret_cast<std::chrono::steady_clock::time_point*>(end);
  *ms = std::chrono::duration<float, std::milli>(*b - *a).count();
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    default: return "cudaError (emulation)";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorIllegalState: return "the resource is not valid for this operation";
    default: return "error (CUDA emulation)";
  }
}

}  // extern "C"

// ---- cuBLAS, naively, accumulating in double ----------------------------------------------------

namespace {

struct CublasContext {};

double load(const void* p, cudaDataType t, std::size_t i) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_64F: return static_cast<const double*>(p)[i];
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CUDA_R_16F: return __half2float(static_cast<const __half*>(p)[i]);
    default: throw std::runtime_error("CUDA emulation: cuBLAS data type not emulated");
  }
}

// A float rounded to TF32 as the tensor cores read it under CUBLAS_COMPUTE_32F_FAST_TF32: the
// low 13 of the 23 mantissa bits dropped, rounding to nearest even (Inf and NaN unchanged).
double round_tf32(double v) {
  const float f = static_cast<float>(v);
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u) return v;
  bits += 0x0fffu + ((bits >> 13) & 1u);
  bits &= ~0x1fffu;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

void store(void* p, cudaDataType t, std::size_t i, double v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case CUDA_R_64F: static_cast<double*>(p)[i] = v; break;
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
      break;
    case CUDA_R_16F: static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v)); break;
    default: throw std::runtime_error("CUDA emulation: cuBLAS data type not emulated");
  }
}

std::size_t type_size(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_64F: return 8;
    case CUDA_R_16BF:
    case CUDA_R_16F: return 2;
    default: return 0;
  }
}

// C (m x n, column-major) = alpha op(A) op(B) + beta C, batch times with strides (elements),
// with cuBLAS's argument checks; every matrix must lie in device memory. `count`: one cuBLAS
// call for the counters (a grouped call counts itself once, not each problem).
cublasStatus_t gemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m,
                    int n, int k, double alpha, const void* a, cudaDataType at, int lda,
                    long long sa, const void* b, cudaDataType bt, int ldb, long long sb,
                    double beta, void* c, cudaDataType ct, int ldc, long long sc, int batch,
                    bool count = true, bool tf32 = false) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (capturing()) {  // recorded with its scalars (cuBLAS reads host scalars when called)
    record_if_capturing([=] {
      const cublasStatus_t st = gemm(handle, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb,
                                     sb, beta, c, ct, ldc, sc, batch, count, tf32);
      if (st != CUBLAS_STATUS_SUCCESS)
        throw std::runtime_error("CUDA emulation: a captured cuBLAS GEMM failed at replay (" +
                                 std::to_string(static_cast<int>(st)) + ")");
    });
    return CUBLAS_STATUS_SUCCESS;
  }
  if (count) ++counted.cublas_calls;
  if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
    return CUBLAS_STATUS_INVALID_VALUE;
  const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
  const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, a_rows) ||
      ldb < std::max(1, b_rows) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (type_size(at) == 0 || type_size(bt) == 0 || type_size(ct) == 0)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  auto extent = [](int ld, int rows, int cols) {
    return cols == 0 || rows == 0 ? std::size_t(0)
                                  : static_cast<std::size_t>(ld) * (cols - 1) + rows;
  };
  for (int p = 0; p < batch; ++p) {
    const char* ap = static_cast<const char*>(a) + p * sa * static_cast<long long>(type_size(at));
    const char* bp = static_cast<const char*>(b) + p * sb * static_cast<long long>(type_size(bt));
    char* cp = static_cast<char*>(c) + p * sc * static_cast<long long>(type_size(ct));
    if ((k > 0 && (!is_device_range(ap, extent(lda, a_rows, a_cols) * type_size(at)) ||
                   !is_device_range(bp, extent(ldb, b_rows, b_cols) * type_size(bt)))) ||
        !is_device_range(cp, extent(ldc, m, n) * type_size(ct)))
      throw std::runtime_error(
          "CUDA emulation: a cuBLAS GEMM reads or writes outside device memory (m " +
          std::to_string(m) + ", n " + std::to_string(n) + ", k " + std::to_string(k) +
          ", lda " + std::to_string(lda) + ", ldb " + std::to_string(ldb) + ", ldc " +
          std::to_string(ldc) + ", batch " + std::to_string(p) + ")");
    // op(A) as m rows of k and op(B) transposed as n rows of k, in double, so that the inner
    // loop runs over contiguous memory.
    std::vector<double> oa(std::size_t(m) * k), ob(std::size_t(n) * k);
    for (int i = 0; i < m; ++i)
      for (int l = 0; l < k; ++l)
        oa[std::size_t(i) * k + l] = load(ap, at, ta == CUBLAS_OP_N ? i + std::size_t(l) * lda
                                                                    : l + std::size_t(i) * lda);
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < k; ++l)
        ob[std::size_t(j) * k + l] = load(bp, bt, tb == CUBLAS_OP_N ? l + std::size_t(j) * ldb
                                                                    : j + std::size_t(l) * ldb);
    if (tf32) {
      for (double& x : oa) x = round_tf32(x);
      for (double& x : ob) x = round_tf32(x);
    }
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const double* x = &oa[std::size_t(i) * k];
        const double* y = &ob[std::size_t(j) * k];
        double sum = 0;
        for (int l = 0; l < k; ++l) sum += x[l] * y[l];
        const std::size_t ci = i + std::size_t(j) * ldc;
        const double old = beta == 0 ? 0.0 : load(cp, ct, ci);  // beta = 0: C is not read
        store(cp, ct, ci, alpha * sum + (beta == 0 ? 0.0 : beta * old));
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  static CublasContext context;
  *handle = reinterpret_cast<cublasHandle_t>(&context);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void* workspace, size_t bytes) {
  return workspace != nullptr && is_device_range(workspace, bytes) ? CUBLAS_STATUS_SUCCESS
                                                                    : CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }

const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS (emulation)";
  }
}
const char* cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was used as an argument";
    default: return "error (CUDA emulation)";
  }
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                              int n, int k, const float* alpha, const float* a, int lda,
                              const float* b, int ldb, const float* beta, float* c, int ldc) {
  return gemm(h, ta, tb, m, n, k, *alpha, a, CUDA_R_32F, lda, 0, b, CUDA_R_32F, ldb, 0, *beta, c,
              CUDA_R_32F, ldc, 0, 1);
}

cublasStatus_t cublasDgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                              int n, int k, const double* alpha, const double* a, int lda,
                              const double* b, int ldb, const double* beta, double* c, int ldc) {
  return gemm(h, ta, tb, m, n, k, *alpha, a, CUDA_R_64F, lda, 0, b, CUDA_R_64F, ldb, 0, *beta, c,
              CUDA_R_64F, ldc, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float* alpha, const float* a, int lda,
                                         long long sa, const float* b, int ldb, long long sb,
                                         const float* beta, float* c, int ldc, long long sc,
                                         int batch) {
  return gemm(h, ta, tb, m, n, k, *alpha, a, CUDA_R_32F, lda, sa, b, CUDA_R_32F, ldb, sb, *beta,
              c, CUDA_R_32F, ldc, sc, batch);
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const double* alpha, const double* a, int lda,
                                         long long sa, const double* b, int ldb, long long sb,
                                         const double* beta, double* c, int ldc, long long sc,
                                         int batch) {
  return gemm(h, ta, tb, m, n, k, *alpha, a, CUDA_R_64F, lda, sa, b, CUDA_R_64F, ldb, sb, *beta,
              c, CUDA_R_64F, ldc, sc, batch);
}

}  // extern "C"

namespace {
// alpha and beta of a GemmEx call as doubles, by compute type: float scalars for 32F (and
// 32F_FAST_TF32 when tf32 is allowed, which sets *tf32: float operands rounded to TF32 first, as
// the tensor cores read them), double ones for 64F. False for a compute type not emulated.
bool gemm_ex_scalars(cublasComputeType_t compute, const void* alpha, const void* beta,
                     bool allow_tf32, double& al, double& be, bool* tf32) {
  switch (compute) {
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      if (!allow_tf32) return false;
      *tf32 = true;
      [[fallthrough]];
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
      al = *static_cast<const float*>(alpha);
      be = *static_cast<const float*>(beta);
      return true;
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
      al = *static_cast<const double*>(alpha);
      be = *static_cast<const double*>(beta);
      return true;
    default: return false;
  }
}
}  // namespace

extern "C" {

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void* alpha, const void* a, cudaDataType at,
                            int lda, const void* b, cudaDataType bt, int ldb, const void* beta,
                            void* c, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
  double al = 0, be = 0;
  bool tf32 = false;
  if (!gemm_ex_scalars(compute, alpha, beta, false, al, be, &tf32) || at != bt)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return gemm(h, ta, tb, m, n, k, al, a, at, lda, 0, b, bt, ldb, 0, be, c, ct, ldc, 0, 1);
}

// Strided-batched GemmEx: compute types 32F, 32F_FAST_TF32 (float operands only) and 64F; A and
// B of one type.
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void* alpha, const void* a, cudaDataType at,
                                          int lda, long long sa, const void* b, cudaDataType bt,
                                          int ldb, long long sb, const void* beta, void* c,
                                          cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t) {
  double al = 0, be = 0;
  bool tf32 = false;
  if (!gemm_ex_scalars(compute, alpha, beta, true, al, be, &tf32) || at != bt ||
      (tf32 && at != CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return gemm(h, ta, tb, m, n, k, al, a, at, lda, sa, b, bt, ldb, sb, be, c, ct, ldc, sc, batch,
              true, tf32);
}

// Grouped GEMMs: Aarray, Barray and Carray are device arrays of device pointers (one per
// problem); the other arrays are on the host, one entry per group. Like the single GEMMs, each
// problem goes through gemm() with cuBLAS's argument checks. The emulation answers
// CUBLAS_STATUS_NOT_SUPPORTED for half A/B with a float C (and accepts bf16 A/B with float C), so
// that both the grouped call and grouped_gemm's fallback to single GEMMs run in the tests.
namespace {
cublasStatus_t grouped(cublasHandle_t h, const cublasOperation_t* ta, const cublasOperation_t* tb,
                       const int* m, const int* n, const int* k, const void* alpha,
                       const void* const* a, cudaDataType at, const int* lda, const void* const* b,
                       cudaDataType bt, const int* ldb, const void* beta, void* const* c,
                       cudaDataType ct, const int* ldc, int groups, const int* sizes,
                       bool double_scalars) {
  if (groups < 0) return CUBLAS_STATUS_INVALID_VALUE;
  int problems = 0;
  for (int g = 0; g < groups; ++g) {
    if (sizes[g] < 0) return CUBLAS_STATUS_INVALID_VALUE;
    problems += sizes[g];
  }
  if (problems == 0) return CUBLAS_STATUS_SUCCESS;
  if (capturing()) {  // the host arrays are read now, the device pointer arrays at replay
    const auto g = static_cast<std::size_t>(groups);
    const std::size_t scalar = double_scalars ? sizeof(double) : sizeof(float);
    auto copy_of = [g](const auto* p) { return std::vector<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>>(p, p + g); };
    std::vector<char> al(static_cast<const char*>(alpha), static_cast<const char*>(alpha) + g * scalar);
    std::vector<char> be(static_cast<const char*>(beta), static_cast<const char*>(beta) + g * scalar);
    record_if_capturing([=, vta = copy_of(ta), vtb = copy_of(tb), vm = copy_of(m), vn = copy_of(n),
                         vk = copy_of(k), vlda = copy_of(lda), vldb = copy_of(ldb),
                         vldc = copy_of(ldc), vs = copy_of(sizes)] {
      const cublasStatus_t st =
          grouped(h, vta.data(), vtb.data(), vm.data(), vn.data(), vk.data(), al.data(), a, at,
                  vlda.data(), b, bt, vldb.data(), be.data(), c, ct, vldc.data(), groups,
                  vs.data(), double_scalars);
      if (st != CUBLAS_STATUS_SUCCESS)
        throw std::runtime_error("CUDA emulation: a captured grouped GEMM failed at replay");
    });
    return CUBLAS_STATUS_SUCCESS;
  }
  ++counted.cublas_calls;
  const std::size_t bytes = sizeof(void*) * static_cast<std::size_t>(problems);
  if (!is_device_range(a, bytes) || !is_device_range(b, bytes) || !is_device_range(c, bytes))
    throw std::runtime_error(
        "CUDA emulation: a grouped GEMM's Aarray, Barray or Carray is not in device memory");
  int p = 0;
  for (int g = 0; g < groups; ++g)
    for (int i = 0; i < sizes[g]; ++i, ++p) {
      const double al = double_scalars ? static_cast<const double*>(alpha)[g]
                                       : static_cast<const float*>(alpha)[g];
      const double be = double_scalars ? static_cast<const double*>(beta)[g]
                                       : static_cast<const float*>(beta)[g];
      const cublasStatus_t s = gemm(h, ta[g], tb[g], m[g], n[g], k[g], al, a[p], at, lda[g], 0,
                                    b[p], bt, ldb[g], 0, be, c[p], ct, ldc[g], 0, 1, false);
      if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace

cublasStatus_t cublasSgemmGroupedBatched(cublasHandle_t h, const cublasOperation_t ta[],
                                         const cublasOperation_t tb[], const int m[],
                                         const int n[], const int k[], const float alpha[],
                                         const float* const a[], const int lda[],
                                         const float* const b[], const int ldb[],
                                         const float beta[], float* const c[], const int ldc[],
                                         int groups, const int sizes[]) {
  return grouped(h, ta, tb, m, n, k, alpha, reinterpret_cast<const void* const*>(a), CUDA_R_32F,
                 lda, reinterpret_cast<const void* const*>(b), CUDA_R_32F, ldb, beta,
                 reinterpret_cast<void* const*>(c), CUDA_R_32F, ldc, groups, sizes, false);
}

cublasStatus_t cublasDgemmGroupedBatched(cublasHandle_t h, const cublasOperation_t ta[],
                                         const cublasOperation_t tb[], const int m[],
                                         const int n[], const int k[], const double alpha[],
                                         const double* const a[], const int lda[],
                                         const double* const b[], const int ldb[],
                                         const double beta[], double* const c[], const int ldc[],
                                         int groups, const int sizes[]) {
  return grouped(h, ta, tb, m, n, k, alpha, reinterpret_cast<const void* const*>(a), CUDA_R_64F,
                 lda, reinterpret_cast<const void* const*>(b), CUDA_R_64F, ldb, beta,
                 reinterpret_cast<void* const*>(c), CUDA_R_64F, ldc, groups, sizes, true);
}

cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t h, const cublasOperation_t ta[],
                                          const cublasOperation_t tb[], const int m[],
                                          const int n[], const int k[], const void* alpha,
                                          const void* const a[], cudaDataType_t at,
                                          const int lda[], const void* const b[],
                                          cudaDataType_t bt, const int ldb[], const void* beta,
                                          void* const c[], cudaDataType_t ct, const int ldc[],
                                          int groups, const int sizes[],
                                          cublasComputeType_t compute) {
  if (compute != CUBLAS_COMPUTE_32F || at != bt) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (at == CUDA_R_16F && ct == CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;  // see above
  return grouped(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, groups,
                 sizes, false);
}

}  // extern "C"
