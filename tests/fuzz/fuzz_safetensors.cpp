// Fuzz target: the safetensors reader (graphmoe/train/checkpoint.hpp).
//
// Input: the bytes of a .safetensors file. load_safetensors(path) must either throw
// graphmoe::Error or return a file whose tensors are consistent with their headers; each tensor
// is then read through LoadedTensor::to_tensor<T> with its own dtype (and refused with another),
// and the file is loaded into a small arena, strictly and not, which must either throw
// graphmoe::Error or copy exactly the matching tensors.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/train/checkpoint.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

template <class T>
void read_as(const LoadedTensor& t) {
  Tensor<T, cpu> v;
  const bool ok = expect_clean([&] { v = t.to_tensor<T>(); });
  FUZZ_REQUIRE(ok == (t.dtype == dtype_of<T>()), "to_tensor accepts exactly its own dtype");
  if (!ok) return;
  FUZZ_REQUIRE(v.shape() == t.shape, "to_tensor keeps the shape");
  FUZZ_REQUIRE(static_cast<std::size_t>(v.numel()) * sizeof(T) == t.bytes.size(),
               "to_tensor copies every byte");
  FUZZ_REQUIRE(t.bytes.empty() || std::memcmp(v.data(), t.bytes.data(), t.bytes.size()) == 0,
               "to_tensor copies the bytes unchanged");
}

// "w" (2, 3) and "b" (3) as F32, all 7.0 before a load.
void small_arena(ParameterArena<float>& a) {
  a.add("w", Shape{2, 3});
  a.add("b", Shape{3});
  a.allocate();
  for (index_t i = 0; i < a.values().numel(); ++i) a.values().data()[i] = 7.0f;
}

void load_into_arena(const SafetensorsFile& f, const std::string& prefix, bool strict) {
  ParameterArena<float> a;
  small_arena(a);
  const bool ok = expect_clean([&] { load_arena(f, a, prefix, strict); });
  for (index_t p = 0; p < a.size(); ++p) {
    const std::string name = prefix + a.params()[static_cast<std::size_t>(p)].name;
    const Tensor<float> v = a.value(p);
    const bool copied = ok && f.contains(name);
    for (index_t i = 0; i < v.numel(); ++i) {
      if (copied) {
        float x = 0;
        std::memcpy(&x, f.at(name).bytes.data() + sizeof(float) * static_cast<std::size_t>(i),
                    sizeof x);
        FUZZ_REQUIRE(std::memcmp(&x, v.data() + i, sizeof x) == 0,
                     "load_arena copies the tensor's bytes");
      } else {
        FUZZ_REQUIRE(v.data()[i] == 7.0f, "a failed or partial load_arena leaves values unchanged");
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = graphmoe_fuzz::files().write("input.safetensors", data, size);
  SafetensorsFile f;
  if (!expect_clean([&] { f = load_safetensors(path); })) return 0;

  // Accepted: 8-byte size, header, and tensors that tile the rest of the file exactly.
  std::size_t data_bytes = 0;
  for (const auto& [name, t] : f.tensors) {
    FUZZ_REQUIRE(name == t.name && !name.empty(), "a tensor keeps its (non-empty) name");
    FUZZ_REQUIRE(t.bytes.size() == static_cast<std::size_t>(t.shape.numel()) * dtype_size(t.dtype),
                 "a tensor's byte count is its shape times its dtype size");
    data_bytes += t.bytes.size();
    read_as<float>(t);
    read_as<double>(t);
    read_as<std::int32_t>(t);
    read_as<std::int64_t>(t);
    read_as<std::uint8_t>(t);
  }
  FUZZ_REQUIRE(data_bytes <= size - 8, "the tensors fit in the file");
  load_into_arena(f, "", true);
  load_into_arena(f, "", false);
  load_into_arena(f, "model.", true);
  return 0;
}
