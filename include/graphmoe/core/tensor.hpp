// graphmoe/core/tensor.hpp: Tensor<T, Backend>, a contiguous row-major array with a shape.
//
// A Tensor is a handle: copying it shares the storage (as torch.Tensor and std::shared_ptr do);
// clone() makes a deep copy. view() and slice() return handles onto the same storage. There are no
// strides: every tensor is contiguous, which is all the library's ops need and keeps every kernel
// a plain loop or a GEMM.
//
// Storage comes from backend_allocator<Backend>: 64-byte aligned host memory for graphmoe::cpu.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe {

template <class B>
struct backend_allocator;

template <>
struct backend_allocator<cpu> {
  static constexpr std::size_t kAlignment = 64;
  static void* allocate(std::size_t bytes) {
    std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  static void deallocate(void* p) noexcept { std::free(p); }
  // Zero-filled memory for a large, long-lived buffer (Tensor::zeros_on_demand: a model's
  // parameters and gradients), with its deleter: anonymous pages from the kernel, which read as
  // zero and are backed only when first written, so there is no fill pass and pages never written
  // (the gradients of a model that only runs inference) take no memory. No MADV_HUGEPAGE: where
  // the system compacts memory for it on request (transparent_hugepage/defrag = madvise, the
  // common setting) the first touch of a fresh buffer stalled for seconds (6 s for 4 GB).
  static std::shared_ptr<void> allocate_pages(std::size_t bytes) {
    const std::size_t n = bytes == 0 ? kAlignment : bytes;
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return std::shared_ptr<void>(p, [n](void* q) { ::munmap(q, n); });
  }
  static void zero(void* p, std::size_t bytes) { std::memset(p, 0, bytes); }
  static void copy(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
};

template <class T, class B = cpu>
class Tensor {
  static_assert(std::is_trivially_copyable_v<T>, "graphmoe::Tensor: T must be trivially copyable");

 public:
  using value_type = T;
  using backend_type = B;
  using Alloc = backend_allocator<B>;

  Tensor() = default;
  // Allocates and zero-fills.
  explicit Tensor(const Shape& shape) : Tensor(shape, Uninitialized{}) {
    Alloc::zero(data_, bytes());
  }
  // Allocates without filling: for a tensor that is written in full before it is read (an op's
  // output). On a GPU the fill is a launch of its own; the CUDA emulation fills new device
  // tensors with NaN bytes, so that a test reading an element nobody wrote fails.
  static Tensor uninitialized(const Shape& shape) { return Tensor(shape, Uninitialized{}); }
  // Zero-filled, for large long-lived buffers: where the backend's allocator has allocate_pages
  // (graphmoe::cpu), memory the system zero-fills page by page when it is first written (nothing
  // is filled here); elsewhere Tensor(shape).
  static Tensor zeros_on_demand(const Shape& shape) {
    if constexpr (requires(std::size_t n) { Alloc::allocate_pages(n); }) {
      Tensor t;
      t.shape_ = shape;
      std::shared_ptr<void> mem =
          Alloc::allocate_pages(static_cast<std::size_t>(shape.numel()) * sizeof(T));
      t.data_ = static_cast<T*>(mem.get());
      t.storage_ = std::shared_ptr<T>(std::move(mem), t.data_);
      return t;
    } else {
      return Tensor(shape);
    }
  }
  // A non-owning view onto memory that the caller keeps alive (e.g. an Eigen matrix).
  static Tensor borrow(T* data, const Shape& shape) {
    Tensor t;
    t.data_ = data;
    t.shape_ = shape;
    return t;
  }

  static Tensor zeros(const Shape& shape) { return Tensor(shape); }
  static Tensor full(const Shape& shape, T value)
    requires B::host_memory
  {
    Tensor t(shape);
    t.fill(value);
    return t;
  }
  static Tensor from(const Shape& shape, const std::vector<T>& values)
    requires B::host_memory
  {
    GRAPHMOE_CHECK(static_cast<index_t>(values.size()) == shape.numel(), "Tensor::from",
                   values.size(), " values given for shape ", shape, " (", shape.numel(),
                   " elements)");
    Tensor t(shape);
    std::copy(values.begin(), values.end(), t.data());
    return t;
  }

  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  index_t dim(int i) const { return shape_.dim(i); }
  // 0 for an empty (default-constructed) tensor, whose rank-0 shape would otherwise count 1.
  index_t numel() const { return data_ == nullptr ? 0 : shape_.numel(); }
  index_t rows() const { return shape_.rows(); }
  index_t cols() const { return shape_.cols(); }
  bool empty() const { return data_ == nullptr; }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * sizeof(T); }
  T* data() const { return data_; }

  // Same storage, new shape with the same number of elements.
  Tensor view(const Shape& shape) const {
    GRAPHMOE_CHECK(shape.numel() == numel(), "Tensor::view", "cannot view a tensor of shape ",
                   shape_, " as ", shape);
    Tensor t = *this;
    t.shape_ = shape;
    return t;
  }
  // Rows [begin, end) along dimension 0, sharing storage.
  Tensor slice(index_t begin, index_t end) const {
    GRAPHMOE_CHECK(rank() >= 1, "Tensor::slice", "cannot slice a scalar");
    GRAPHMOE_CHECK(0 <= begin && begin <= end && end <= shape_[0], "Tensor::slice", "range [",
                   begin, ", ", end, ") out of bounds for shape ", shape_);
    Tensor t = *this;
    const index_t inner = shape_[0] == 0 ? 0 : numel() / shape_[0];
    t.data_ = data_ + begin * inner;
    std::vector<index_t> dims(shape_.begin(), shape_.end());
    dims[0] = end - begin;
    t.shape_ = Shape::from_range(dims.begin(), dims.end());
    return t;
  }
  // Entry i along dimension 0, with that dimension dropped.
  Tensor operator[](index_t i) const {
    Tensor t = slice(i, i + 1);
    t.shape_ = Shape::from_range(shape_.begin() + 1, shape_.end());
    return t;
  }

  Tensor clone() const {
    if (empty()) return Tensor();
    Tensor t = uninitialized(shape_);
    Alloc::copy(t.data_, data_, bytes());
    return t;
  }
  void copy_from(const Tensor& other) {
    GRAPHMOE_CHECK(other.shape() == shape_, "Tensor::copy_from", "shape ", other.shape(),
                   " does not match ", shape_);
    Alloc::copy(data_, other.data_, bytes());
  }
  void zero() {
    if (!empty()) Alloc::zero(data_, bytes());
  }
  void fill(T value)
    requires B::host_memory
  {
    std::fill(data_, data_ + numel(), value);
  }

  // Element access on the host (tensors of a host-memory backend, B::host_memory). Bounds are
  // checked in debug builds only; use at() for a checked access.
  template <class... I>
  T& operator()(I... idx) const
    requires B::host_memory
  {
    return data_[flat_index(idx...)];
  }
  template <class... I>
  T& at(I... idx) const
    requires B::host_memory
  {
    const index_t ii[] = {static_cast<index_t>(idx)...};
    GRAPHMOE_CHECK(static_cast<int>(sizeof...(I)) == rank(), "Tensor::at", sizeof...(I),
                   " indices given for shape ", shape_);
    for (int d = 0; d < rank(); ++d)
      GRAPHMOE_CHECK(0 <= ii[d] && ii[d] < shape_[d], "Tensor::at", "index ", ii[d],
                     " out of range in dimension ", d, " of shape ", shape_);
    return data_[flat_index(idx...)];
  }
  std::vector<T> to_vector() const
    requires B::host_memory
  {
    return std::vector<T>(data_, data_ + numel());
  }

 private:
  struct Uninitialized {};
  Tensor(const Shape& shape, Uninitialized) : shape_(shape) {
    T* p = static_cast<T*>(Alloc::allocate(static_cast<std::size_t>(shape.numel()) * sizeof(T)));
    storage_ = std::shared_ptr<T>(p, [](T* q) { Alloc::deallocate(q); });
    data_ = p;
  }

  template <class... I>
  index_t flat_index(I... idx) const {
    const index_t ii[] = {static_cast<index_t>(idx)...};
    index_t f = 0;
    for (std::size_t d = 0; d < sizeof...(I); ++d) f = f * shape_[static_cast<int>(d)] + ii[d];
    return f;
  }

  std::shared_ptr<T> storage_;
  T* data_ = nullptr;
  Shape shape_;
};

// Throws unless t has exactly the expected shape; `what` names the argument in the message.
template <class T, class B>
void check_shape(const char* op, const char* what, const Tensor<T, B>& t, const Shape& expected) {
  GRAPHMOE_CHECK(!t.empty() || expected.numel() == 0, op, what, " is empty, expected shape ",
                 expected);
  GRAPHMOE_CHECK(t.shape() == expected, op, what, " has shape ", t.shape(), ", expected ",
                 expected);
}

// Throws naming the first NaN or Inf entry of a CPU tensor. Used at API boundaries (model inputs,
// router inputs, losses), not inside every op.
template <class T>
void check_finite(const char* op, const char* what, const Tensor<T, cpu>& t) {
  if constexpr (std::is_floating_point_v<T>) {
    const T* p = t.data();
    for (index_t i = 0; i < t.numel(); ++i) {
      if (!(p[i] - p[i] == T(0))) {  // false for NaN and +-Inf
        GRAPHMOE_CHECK(false, op, what, " of shape ", t.shape(), " holds ", p[i],
                       " at flat index ", i);
      }
    }
  }
}

// Output convention of every op: an empty output tensor is allocated with the expected shape; a
// non-empty one must already have exactly that shape (it may be a view into an arena) and is
// overwritten. Since every element is overwritten either way, a new output in device memory is
// not zero-filled first (a memset launch per op, hundreds per training step: the launch census in
// docs/benchmarks.md); in host memory it is (cheap, and uninitialised host memory would turn a
// broken op into a nondeterministic one instead of a wrong one that the tests see). new_output:
// such a tensor, for outputs that are not prepared through prepare_output.
template <class T, class B>
Tensor<T, B> new_output(const Shape& shape) {
  return B::host_memory ? Tensor<T, B>(shape) : Tensor<T, B>::uninitialized(shape);
}

template <class T, class B>
void prepare_output(const char* op, const char* what, Tensor<T, B>& out, const Shape& expected) {
  if (out.empty()) {
    out = new_output<T, B>(expected);
    return;
  }
  GRAPHMOE_CHECK(out.shape() == expected, op, "output ", what, " has shape ", out.shape(),
                 ", expected ", expected);
}

// For an output that an op adds to (a parameter gradient such as LayerNorm's dgamma): an empty
// one is allocated zero-filled on every backend (prepare_output's does not fill on a GPU); a
// non-empty one must have exactly the expected shape and is added to.
template <class T, class B>
void prepare_accumulator(const char* op, const char* what, Tensor<T, B>& out,
                         const Shape& expected) {
  if (out.empty())
    out = Tensor<T, B>(expected);
  else
    prepare_output(op, what, out, expected);  // the shape check
}

namespace detail {
// A host tensor with t's values: t itself on the CPU; a copy (to_host, found by argument-dependent
// lookup in graphmoe/backend/cuda/copy.cuh) for a device tensor.
template <class T>
Tensor<T, cpu> host_values(const Tensor<T, cpu>& t) {
  return t;
}
template <class T, class B>
Tensor<T, cpu> host_values(const Tensor<T, B>& t) {
  return to_host(t);
}
}  // namespace detail

}  // namespace graphmoe
