// Checkpoints (safetensors): bitwise round trips for every dtype, arena round trips, refusal of
// malformed files (bad input), atomic saves (failed and killed), and interop with the real
// `safetensors` Python library.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/training_state.hpp"
#include "graphmoe/train/tokenizers.hpp"

using namespace graphmoe;
namespace fs = std::filesystem;

#ifndef GRAPHMOE_SAFETENSORS_PYTHON
#define GRAPHMOE_SAFETENSORS_PYTHON ""
#endif
#ifndef GRAPHMOE_SAFETENSORS_INTEROP_SCRIPT
#define GRAPHMOE_SAFETENSORS_INTEROP_SCRIPT ""
#endif

namespace {

// doctest::Contains from a std::string (it copies the text).
doctest::Contains contains(const std::string& s) { return doctest::Contains(s.c_str()); }

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir {
  fs::path dir;
  TempDir() {
    static int counter = 0;
    dir = fs::temp_directory_path() /
          ("graphmoe_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string file(const std::string& name) const { return (dir / name).string(); }
};

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A raw safetensors file: the 8-byte size (header.size() unless overridden), header, data.
std::vector<std::uint8_t> raw_file(const std::string& header, std::size_t data_bytes,
                                   std::uint64_t size_field = std::numeric_limits<std::uint64_t>::max()) {
  const std::uint64_t n = size_field == std::numeric_limits<std::uint64_t>::max() ? header.size()
                                                                                   : size_field;
  std::vector<std::uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<std::uint8_t>(i * 13 + 1));
  return out;
}

// Writes a raw file and returns the message load_safetensors throws for it ("" if none).
std::string load_error(const TempDir& d, const std::string& header, std::size_t data_bytes,
                       std::uint64_t size_field = std::numeric_limits<std::uint64_t>::max()) {
  const std::string path = d.file("bad.safetensors");
  write_bytes(path, raw_file(header, data_bytes, size_field));
  try {
    load_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> leftover_temps(const TempDir& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d.dir))
    if (e.path().filename().string().find(".tmp.") != std::string::npos)
      out.push_back(e.path().filename().string());
  return out;
}

// IEEE half bits of a float that half represents exactly (the interop values do).
std::uint16_t half_bits(float v) {
  if (v == 0.0f) return std::signbit(v) ? 0x8000 : 0;
  std::uint32_t b;
  std::memcpy(&b, &v, 4);
  const std::uint32_t sign = b >> 31, exp = (b >> 23) & 0xff, man = b & 0x7fffff;
  const int e = static_cast<int>(exp) - 127 + 15;
  REQUIRE(e > 0);
  REQUIRE(e < 31);
  REQUIRE((man & 0x1fff) == 0);
  return static_cast<std::uint16_t>((sign << 15) | (static_cast<std::uint32_t>(e) << 10) | (man >> 13));
}

// The interop content, kept in sync with SPEC in tests/train/safetensors_interop.py: element i of
// a float tensor is i * 0.5 - 1, of I32 i * 7 - 20, of I64 i * 2^33 - 5, of U8 (i * 37) % 256.
struct InteropTensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::uint8_t> bytes;
};

template <class T>
void append_value(std::vector<std::uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

std::vector<InteropTensor> interop_spec() {
  std::vector<InteropTensor> spec = {
      {"model.f32", DType::F32, Shape{2, 3}, {}}, {"model.f64", DType::F64, Shape{4}, {}},
      {"model.f16", DType::F16, Shape{3, 1, 2}, {}}, {"model.i32", DType::I32, Shape{3, 2}, {}},
      {"model.i64", DType::I64, Shape{2, 2}, {}}, {"model.u8", DType::U8, Shape{9}, {}},
      {"scalar", DType::F32, Shape{}, {}}, {"empty", DType::F64, Shape{0, 3}, {}}};
  for (auto& t : spec) {
    for (std::int64_t i = 0; i < t.shape.numel(); ++i) {
      const double f = static_cast<double>(i) * 0.5 - 1;
      switch (t.dtype) {
        case DType::F32: append_value(t.bytes, static_cast<float>(f)); break;
        case DType::F64: append_value(t.bytes, f); break;
        case DType::F16: append_value(t.bytes, half_bits(static_cast<float>(f))); break;
        case DType::I32: append_value(t.bytes, static_cast<std::int32_t>(i * 7 - 20)); break;
        case DType::I64: append_value(t.bytes, static_cast<std::int64_t>(i * (std::int64_t(1) << 33) - 5)); break;
        case DType::U8: append_value(t.bytes, static_cast<std::uint8_t>((i * 37) % 256)); break;
        case DType::BF16: FAIL("no BF16 in the interop spec"); break;
      }
    }
  }
  return spec;
}

const std::map<std::string, std::string> kInteropMetadata = {
    {"format", "graphmoe"}, {"step", "42"}, {"unicode", "gr\u00fc\u00dfe \u2713"}};

// Runs the interop script; true when it exits with status 0.
bool run_interop(const std::string& mode, const std::string& file) {
  const std::string python = GRAPHMOE_SAFETENSORS_PYTHON;
  const std::string script = GRAPHMOE_SAFETENSORS_INTEROP_SCRIPT;
  REQUIRE(file.find('\'') == std::string::npos);
  const std::string cmd = "'" + python + "' '" + script + "' " + mode + " '" + file + "'";
  const int status = std::system(cmd.c_str());
  INFO("command: ", cmd, " returned status ", status);
  return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

int g_pipe_fd = -1;  // the killed-save child's end of its pipe to the parent

}  // namespace

TEST_CASE("checkpoint: dtype names, sizes and dtype_of") {
  static_assert(dtype_of<float>() == DType::F32);
  static_assert(dtype_of<double>() == DType::F64);
  static_assert(dtype_of<std::int32_t>() == DType::I32);
  static_assert(dtype_of<std::int64_t>() == DType::I64);
  static_assert(dtype_of<std::uint8_t>() == DType::U8);
  CHECK(std::string(dtype_name(DType::BF16)) == "BF16");
  CHECK(std::string(dtype_name(DType::F16)) == "F16");
  CHECK(dtype_size(DType::BF16) == 2);
  CHECK(dtype_size(DType::F64) == 8);
  CHECK(dtype_size(DType::U8) == 1);
}

TEST_CASE("checkpoint: round trip is bitwise for every dtype, with metadata") {
  TempDir d;
  const std::string path = d.file("all.safetensors");
  // Bit patterns that a value-based comparison would miss: NaN payloads, -0, denormals, infinity.
  std::vector<float> f32 = {1.5f, -0.0f, std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::infinity(), 3.25f, -7.0f};
  std::uint32_t nan_bits = 0x7fc12345;
  std::memcpy(&f32[4], &nan_bits, 4);
  std::vector<double> f64 = {0.1, -0.0, std::numeric_limits<double>::denorm_min(), 1e300};
  std::vector<std::uint16_t> bf16 = {0x3f80, 0xbf80, 0x7fc1, 0x0001, 0x8000};  // 1, -1, NaN, ...
  std::vector<std::uint16_t> f16 = {0x3c00, 0xfc00, 0x7e01, 0x0001};            // 1, -inf, NaN, ...
  std::vector<std::int32_t> i32 = {0, -1, std::numeric_limits<std::int32_t>::min(), 7, 8, 9};
  std::vector<std::int64_t> i64 = {std::numeric_limits<std::int64_t>::max(), -5};
  std::vector<std::uint8_t> u8 = {0, 255, 17};
  const std::vector<TensorRef> refs = {
      {"a.f32", DType::F32, Shape{2, 3}, f32.data()},  {"b.f64", DType::F64, Shape{4}, f64.data()},
      {"c.bf16", DType::BF16, Shape{5}, bf16.data()},  {"d.f16", DType::F16, Shape{2, 2}, f16.data()},
      {"e.i32", DType::I32, Shape{3, 1, 2}, i32.data()}, {"f.i64", DType::I64, Shape{2}, i64.data()},
      {"g.u8", DType::U8, Shape{3}, u8.data()},       {"h.scalar", DType::F64, Shape{}, f64.data()},
      {"i.empty", DType::F32, Shape{0, 4}, nullptr}};
  const std::map<std::string, std::string> meta = {{"step", "12"}, {"note", "w\u00fcrfel"},
                                                   {"empty", ""}};
  save_safetensors(path, refs, meta);
  CHECK(leftover_temps(d).empty());

  // The header size is a multiple of 8 and the file holds exactly header + data.
  const auto raw = read_bytes(path);
  REQUIRE(raw.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t(raw[static_cast<std::size_t>(i)]) << (8 * i);
  CHECK(n % 8 == 0);
  std::size_t data = 0;
  for (const auto& r : refs) data += static_cast<std::size_t>(r.shape.numel()) * dtype_size(r.dtype);
  CHECK(raw.size() == 8 + n + data);

  const SafetensorsFile f = load_safetensors(path);
  CHECK(f.path == path);
  CHECK(f.metadata == meta);
  REQUIRE(f.tensors.size() == refs.size());
  for (const auto& r : refs) {
    CAPTURE(r.name);
    REQUIRE(f.contains(r.name));
    const LoadedTensor& t = f.at(r.name);
    CHECK(t.dtype == r.dtype);
    CHECK(t.shape == r.shape);
    const std::size_t nb = static_cast<std::size_t>(r.shape.numel()) * dtype_size(r.dtype);
    REQUIRE(t.bytes.size() == nb);
    if (nb > 0) CHECK(std::memcmp(t.bytes.data(), r.data, nb) == 0);
  }

  auto tf = f.at("a.f32").to_tensor<float>();
  CHECK(tf.shape() == Shape{2, 3});
  CHECK(tf(0, 0) == 1.5f);
  CHECK(tf(1, 2) == -7.0f);
  auto ti = f.at("e.i32").to_tensor<std::int32_t>();
  CHECK(ti(2, 0, 1) == 9);
  CHECK(f.at("f.i64").to_tensor<std::int64_t>()(0) == std::numeric_limits<std::int64_t>::max());
  CHECK(f.at("g.u8").to_tensor<std::uint8_t>()(1) == 255);
  CHECK(f.at("h.scalar").to_tensor<double>().numel() == 1);
  CHECK(f.at("i.empty").to_tensor<float>().shape() == Shape{0, 4});

  // No metadata, no tensors: still a valid file.
  save_safetensors(path, {}, {});
  const SafetensorsFile e = load_safetensors(path);
  CHECK(e.tensors.empty());
  CHECK(e.metadata.empty());
}

TEST_CASE("checkpoint: bad input refuses reading a tensor as the wrong dtype") {
  TempDir d;
  const std::string path = d.file("w.safetensors");
  std::vector<float> v = {1, 2};
  std::vector<std::int32_t> iv = {1, 2};
  save_safetensors(path, {{"w", DType::F32, Shape{2}, v.data()}, {"n", DType::I32, Shape{2}, iv.data()}}, {});
  const SafetensorsFile f = load_safetensors(path);
  CHECK_THROWS_WITH_AS(f.at("w").to_tensor<std::int32_t>(),
                       contains("tensor 'w' in '" + path + "' has dtype F32, cannot read it as I32"),
                       Error);
  CHECK_THROWS_WITH_AS(f.at("w").to_tensor<double>(), contains("cannot read it as F64"), Error);
  CHECK_THROWS_WITH_AS(f.at("n").to_tensor<float>(), contains("has dtype I32, cannot read it as F32"),
                       Error);
  CHECK_THROWS_WITH_AS(f.at("missing"), contains("no tensor named 'missing' in '" + path + "'"),
                       Error);
}

TEST_CASE_TEMPLATE("checkpoint: arena round trip", T, float, double) {
  TempDir d;
  const std::string path = d.file("arena.safetensors");
  ParameterArena<T, cpu> a;
  a.add("wte", {5, 3});
  a.add("ln.gamma", {3});
  a.add("router.frozen", {3, 2}, /*trainable=*/false);
  a.add("scalar", {});
  a.allocate();
  for (index_t i = 0; i < a.size(); ++i) {
    auto v = a.value(i);
    for (index_t j = 0; j < v.numel(); ++j) v.data()[j] = static_cast<T>(i * 100 + j) / T(3);
  }
  auto grads = a.grads();
  grads.fill(T(9));  // gradients are not saved

  std::vector<TensorRef> refs;
  append_arena(refs, a, "model.");
  REQUIRE(refs.size() == 4);
  CHECK(refs[0].name == "model.wte");
  CHECK(refs[2].name == "model.router.frozen");
  CHECK(refs[0].dtype == dtype_of<T>());
  std::vector<float> extra = {1, 2, 3};  // e.g. optimizer state under another prefix
  refs.push_back({"adam.step", DType::F32, Shape{3}, extra.data()});
  save_safetensors(path, refs, {{"kind", "arena"}});

  ParameterArena<T, cpu> b;
  b.add("wte", {5, 3});
  b.add("ln.gamma", {3});
  b.add("router.frozen", {3, 2}, false);
  b.add("scalar", {});
  b.allocate();
  const SafetensorsFile f = load_safetensors(path);
  CHECK(f.tensors.size() == 5);
  load_arena(f, b, "model.");  // strict: "adam.step" is outside the prefix
  for (index_t i = 0; i < a.size(); ++i) {
    auto va = a.value(i), vb = b.value(i);
    REQUIRE(va.shape() == vb.shape());
    CHECK(std::memcmp(va.data(), vb.data(), va.bytes()) == 0);
  }
  for (index_t j = 0; j < b.grads().numel(); ++j) REQUIRE(b.grads().data()[j] == T(0));
}

TEST_CASE("checkpoint: load_arena refuses missing, extra, misshapen and wrongly typed tensors") {
  TempDir d;
  const std::string path = d.file("arena.safetensors");
  ParameterArena<float, cpu> a;
  a.add("w", {2, 2});
  a.add("b", {2});
  a.allocate();
  a.value("w").fill(1.0f);
  a.value("b").fill(2.0f);
  std::vector<TensorRef> refs;
  append_arena(refs, a);
  std::vector<float> extra = {5};
  refs.push_back({"extra", DType::F32, Shape{1}, extra.data()});
  save_safetensors(path, refs, {});
  const SafetensorsFile f = load_safetensors(path);

  SUBCASE("extra tensor: refused when strict, ignored otherwise") {
    ParameterArena<float, cpu> b;
    b.add("w", {2, 2});
    b.add("b", {2});
    b.allocate();
    CHECK_THROWS_WITH_AS(load_arena(f, b), contains("tensor 'extra' that matches no parameter"),
                         Error);
    CHECK(b.value("w")(0, 0) == 0.0f);  // nothing copied by the failed load
    load_arena(f, b, "", /*strict=*/false);
    CHECK(b.value("w")(1, 1) == 1.0f);
    CHECK(b.value("b")(1) == 2.0f);
  }
  SUBCASE("missing parameter: refused when strict, left unchanged otherwise") {
    ParameterArena<float, cpu> b;
    b.add("w", {2, 2});
    b.add("b", {2});
    b.add("c", {3});
    b.allocate();
    b.value("c").fill(7.0f);
    CHECK_THROWS_WITH_AS(load_arena(f, b, "", true),
                         contains("'" + path + "' has no tensor 'c' for parameter 'c'"), Error);
    load_arena(f, b, "", false);
    CHECK(b.value("c")(2) == 7.0f);
    CHECK(b.value("w")(0, 1) == 1.0f);
  }
  SUBCASE("wrong shape: refused in both modes, arena unchanged") {
    ParameterArena<float, cpu> b;
    b.add("b", {2});
    b.add("w", {4});
    b.allocate();
    CHECK_THROWS_WITH_AS(load_arena(f, b, "", false),
                         contains("tensor 'w' has shape (2, 2), parameter 'w' has shape (4)"),
                         Error);
    CHECK(b.value("b")(0) == 0.0f);
  }
  SUBCASE("wrong dtype: an F32 file into a double arena is refused") {
    ParameterArena<double, cpu> b;
    b.add("w", {2, 2});
    b.add("b", {2});
    b.allocate();
    CHECK_THROWS_WITH_AS(load_arena(f, b, "", false),
                         contains("tensor 'w' has dtype F32, the arena holds F64"), Error);
  }
  SUBCASE("unallocated arena") {
    ParameterArena<float, cpu> b;
    b.add("w", {2, 2});
    CHECK_THROWS_WITH_AS(load_arena(f, b), contains("not allocated"), Error);
    std::vector<TensorRef> out;
    CHECK_THROWS_WITH_AS(append_arena(out, b), contains("not allocated"), Error);
  }
}

TEST_CASE("checkpoint: bad input refuses files too short or with a lying header size") {
  TempDir d;
  const std::string path = d.file("bad.safetensors");
  write_bytes(path, {1, 2, 3});
  CHECK_THROWS_WITH_AS(load_safetensors(path),
                       contains("'" + path + "': file is 3 bytes, shorter than the 8-byte"), Error);
  write_bytes(path, {});
  CHECK_THROWS_WITH_AS(load_safetensors(path), contains("file is 0 bytes"), Error);
  const std::string ok = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  CHECK(load_error(d, ok, 2).empty());
  CHECK_THROWS_WITH_AS(load_safetensors(d.file("does-not-exist.safetensors")),
                       contains("cannot open"), Error);
  CHECK_THROWS_WITH_AS(load_safetensors(d.dir.string()), contains("is not a regular file"), Error);

  // The size field claims more than the file holds, or an absurd size.
  CHECK(load_error(d, ok, 2, ok.size() + 3).find("runs past the end of the file") != std::string::npos);
  CHECK(load_error(d, ok, 2, 1000000).find("header size 1000000 runs past the end") != std::string::npos);
  CHECK(load_error(d, ok, 2, 100000001).find("exceeds the limit of 100000000 bytes") != std::string::npos);
  CHECK(load_error(d, ok, 2, std::numeric_limits<std::uint64_t>::max() - 1).find("exceeds the limit") !=
        std::string::npos);
  // Too small: the JSON is cut short, or the data shifts into the header.
  CHECK(load_error(d, ok, 2, ok.size() - 5).find("header is not valid JSON") != std::string::npos);
  CHECK(load_error(d, ok, 2, 0).find("header is not valid JSON") != std::string::npos);

  // A valid file truncated in its data.
  const std::string path2 = d.file("trunc.safetensors");
  std::vector<double> big(1000, 1.0);
  save_safetensors(path2, {{"big", DType::F64, Shape{10, 100}, big.data()}}, {});
  auto bytes = read_bytes(path2);
  bytes.resize(bytes.size() - 8);
  write_bytes(path2, bytes);
  CHECK_THROWS_WITH_AS(load_safetensors(path2),
                       contains("'" + path2 + "': tensor 'big' has data_offsets [0, 8000] beyond "
                                         "the data buffer of 7992 bytes"),
                       Error);
  bytes.resize(20);
  write_bytes(path2, bytes);
  CHECK_THROWS_WITH_AS(load_safetensors(path2), contains("runs past the end of the file"), Error);
}

TEST_CASE("checkpoint: bad input refuses garbage bytes and bad JSON") {
  TempDir d;
  const std::string path = d.file("garbage.safetensors");
  std::vector<std::uint8_t> garbage(4096);
  std::uint32_t x = 12345;
  for (auto& b : garbage) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::uint8_t>(x >> 24);
  }
  write_bytes(path, garbage);
  CHECK_THROWS_WITH_AS(load_safetensors(path), contains("'" + path + "'"), Error);
  // A plausible size field followed by garbage.
  garbage[0] = 64;
  for (int i = 1; i < 8; ++i) garbage[static_cast<std::size_t>(i)] = 0;
  write_bytes(path, garbage);
  CHECK_THROWS_WITH_AS(load_safetensors(path), contains("header is not valid JSON"), Error);

  CHECK(load_error(d, R"({"a": {"dtype": "F32",)", 0).find("header is not valid JSON") != std::string::npos);
  CHECK(load_error(d, R"({} trailing)", 0).find("header is not valid JSON") != std::string::npos);
  CHECK(load_error(d, "{\"a\xff\": {}}", 0).find("header is not valid JSON") != std::string::npos);  // not UTF-8
  CHECK(load_error(d, "", 0).find("header is not valid JSON") != std::string::npos);
  CHECK(load_error(d, R"([1, 2])", 0).find("header is an array, not a JSON object") != std::string::npos);
  CHECK(load_error(d, R"("x")", 0).find("header is a string, not a JSON object") != std::string::npos);
  CHECK(load_error(d, R"({"a": [[[[[[[[[[[[1]]]]]]]]]]]]})", 0).find("entry 'a' is an array, not an object") !=
        std::string::npos);
  // Padding with spaces (what the Python library does) is fine.
  CHECK(load_error(d, "{}      ", 0).empty());
}

TEST_CASE("checkpoint: bad input refuses malformed entries") {
  TempDir d;
  auto err = [&](const std::string& header, std::size_t data = 8) { return load_error(d, header, data); };
  auto has = [](const std::string& msg, const std::string& part) {
    INFO("message: ", msg);
    CHECK(msg.find(part) != std::string::npos);
    CHECK(msg.find("graphmoe::load_safetensors: '") == 0);
  };
  has(err(R"({"a": {"shape": [2], "data_offsets": [0, 8]}})"), "tensor 'a' has no 'dtype'");
  has(err(R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})"), "tensor 'a' has no 'shape'");
  has(err(R"({"a": {"dtype": "F32", "shape": [2]}})"), "tensor 'a' has no 'data_offsets'");
  has(err(R"({"a": {"dtype": 5, "shape": [2], "data_offsets": [0, 8]}})"),
      "'dtype' of tensor 'a' is a number, expected a string");
  has(err(R"({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})"),
      "'shape' of tensor 'a' is a string, expected an array of integers");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": {"b": 0}}})"),
      "'data_offsets' of tensor 'a' is an object");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})"),
      "'data_offsets' of tensor 'a' has 1 entries, expected 2");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}})"),
      "'data_offsets' of tensor 'a' has more than 2 entries");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}})"),
      "tensor 'a' has the unknown field 'extra'");
  has(err(R"({"a": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})"),
      "tensor 'a' has a duplicate field 'dtype'");
  has(err(R"({"a": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 8]}})"),
      "tensor 'a' has the unknown or unsupported dtype 'BOOL'");
  has(err(R"({"a": {"dtype": "f32", "shape": [2], "data_offsets": [0, 8]}})"), "unsupported dtype 'f32'");
  has(err(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})"),
      "'shape' of tensor 'a' holds the negative number -2");
  has(err(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})"),
      "'shape' of tensor 'a' holds the non-integer 2.5");
  has(err(R"({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})"), "non-integer 2.0");
  has(err(R"({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}})"),
      "'shape' of tensor 'a' holds a string, expected non-negative integers");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, -8]}})"), "negative number -8");
  has(err(R"({"a": {"dtype": "F32", "shape": [1,1,1,1,1,1,2], "data_offsets": [0, 8]}})"),
      "tensor 'a' has rank above the maximum rank 6");
  has(err(R"({"a": {"dtype": "F32", "shape": [99999999999999999999], "data_offsets": [0, 8]}})"),
      "non-integer");
  has(err(R"({"a": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 8]}})"),
      "has the dimension 9223372036854775808, too large");
  has(err(R"({"a": 5})"), "entry 'a' is a number, not an object");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
          R"( "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})"),
      "duplicate tensor name 'a'");
  // An empty key is refused as save_safetensors refuses it (found by fuzz_safetensors in CI).
  has(err(R"({"": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})"),
      "a tensor has an empty name");
}

TEST_CASE("checkpoint: bad input refuses bad offsets, overlaps and size mismatches") {
  TempDir d;
  auto err = [&](const std::string& header, std::size_t data) { return load_error(d, header, data); };
  auto has = [](const std::string& msg, const std::string& part) {
    INFO("message: ", msg);
    CHECK(msg.find(part) != std::string::npos);
  };
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8),
      "tensor 'a' has data_offsets [8, 0] in reverse order");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8),
      "tensor 'a' has data_offsets [0, 16] beyond the data buffer of 8 bytes");
  has(err(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [18446744073709551615, 18446744073709551615]}})", 8),
      "beyond the data buffer");
  has(err(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8),
      "tensor 'a' spans 8 bytes, but its dtype F32 and shape need 12");
  // numel * size overflows 64 bits: refused without allocating anything.
  has(err(R"({"a": {"dtype": "F64", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8),
      "tensor 'a' has a shape whose byte size overflows 64 bits");
  has(err(R"({"a": {"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 8]}})", 8),
      "overflows 64 bits");
  // A header that asks for a terabyte: refused from the file size, nothing allocated.
  has(err(R"({"a": {"dtype": "F32", "shape": [262144, 1048576], "data_offsets": [0, 1099511627776]}})", 8),
      "beyond the data buffer of 8 bytes");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
          R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 12),
      "tensors 'a' and 'b' overlap in the data buffer");
  has(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
          R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8),
      "overlap in the data buffer");
  has(err(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8),
      "gap of 4 bytes in the data buffer before tensor 'a'");
  has(err(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8),
      "4 bytes after the last tensor are not covered by any tensor");
  // Tensors listed out of offset order are fine; so are empty tensors between others.
  CHECK(err(R"({"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},)"
            R"( "e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [4, 4]},)"
            R"( "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", 8)
            .empty());
}

TEST_CASE("checkpoint: bad input refuses a malformed __metadata__") {
  TempDir d;
  auto has = [](const std::string& msg, const std::string& part) {
    INFO("message: ", msg);
    CHECK(msg.find(part) != std::string::npos);
  };
  has(load_error(d, R"({"__metadata__": {"step": 5}})", 0), "__metadata__ value of key 'step' is a number, not a string");
  has(load_error(d, R"({"__metadata__": {"a": {"b": "c"}}})", 0), "__metadata__ value of key 'a' is an object");
  has(load_error(d, R"({"__metadata__": {"a": null}})", 0), "is null, not a string");
  has(load_error(d, R"({"__metadata__": ["a"]})", 0), "__metadata__ is an array, not an object");
  has(load_error(d, R"({"__metadata__": "x"})", 0), "__metadata__ is a string, not an object");
  has(load_error(d, R"({"__metadata__": {"a": "1", "a": "2"}})", 0), "duplicate __metadata__ key 'a'");
  has(load_error(d, R"({"__metadata__": {}, "__metadata__": {}})", 0), "duplicate '__metadata__'");
  const std::string path = d.file("meta.safetensors");
  write_bytes(path, raw_file(R"({"__metadata__": {"k": "v", "e": ""}})", 0));
  const auto f = load_safetensors(path);
  CHECK(f.metadata == std::map<std::string, std::string>{{"k", "v"}, {"e", ""}});
}

TEST_CASE("checkpoint: save refuses bad tensors before touching the previous file") {
  TempDir d;
  const std::string path = d.file("ckpt.safetensors");
  std::vector<float> v = {1, 2, 3, 4};
  save_safetensors(path, {{"w", DType::F32, Shape{4}, v.data()}}, {{"step", "1"}});
  const auto before = read_bytes(path);

  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"w", DType::F32, Shape{4}, nullptr}}, {}),
                       contains("tensor 'w' of shape (4) has a null data pointer"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"w", DType::F32, Shape{4}, v.data()},
                                               {"w", DType::F32, Shape{4}, v.data()}}, {}),
                       contains("duplicate tensor name 'w'"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"__metadata__", DType::F32, Shape{4}, v.data()}}, {}),
                       contains("'__metadata__' is reserved"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"", DType::F32, Shape{4}, v.data()}}, {}),
                       contains("a tensor has an empty name"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"w", DType::F32, Shape{4}, v.data()}}, {{"k", "\xff\xfe"}}),
                       contains("must be valid UTF-8"), Error);
  CHECK_THROWS_WITH_AS(
      save_safetensors(path, {{"w", DType::F64, Shape{4294967296, 4294967296}, v.data()}}, {}),
      contains("is too large"), Error);

  CHECK(read_bytes(path) == before);
  CHECK(leftover_temps(d).empty());
  CHECK(load_safetensors(path).at("w").to_tensor<float>()(3) == 4.0f);
}

TEST_CASE("checkpoint: a save that fails while writing leaves the previous file and no temp file") {
  TempDir d;
  const std::string path = d.file("ckpt.safetensors");
  std::vector<float> old_v = {1, 2, 3, 4};
  save_safetensors(path, {{"w", DType::F32, Shape{4}, old_v.data()}}, {{"step", "1"}});
  const auto before = read_bytes(path);
  std::vector<float> big(3 << 20, 0.25f);  // 12 MiB: several chunks
  const std::vector<TensorRef> refs = {{"big", DType::F32, Shape{3, 1 << 20}, big.data()}};

  SUBCASE("an I/O error midway (simulated by the test hook)") {
    detail::safetensors_save_hook = [](std::uint64_t written, std::uint64_t total) {
      if (written > (4u << 20) && written < total) throw Error("simulated disk full");
    };
    CHECK_THROWS_WITH_AS(save_safetensors(path, refs, {}), contains("simulated disk full"), Error);
    detail::safetensors_save_hook = nullptr;
  }
  SUBCASE("the temporary file cannot be created") {
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    fs::create_directory(tmp);  // open(O_WRONLY) of a directory fails, even for root
    CHECK_THROWS_WITH_AS(save_safetensors(path, refs, {}),
                         contains("cannot create the temporary file '" + tmp + "'"), Error);
    CHECK(fs::is_directory(tmp));  // not ours to remove
    fs::remove(tmp);
  }
  SUBCASE("the rename fails (the target is a non-empty directory)") {
    const std::string dir_target = d.file("target");
    fs::create_directories(dir_target + "/sub");
    CHECK_THROWS_WITH_AS(save_safetensors(dir_target, refs, {}), contains("cannot rename"), Error);
    CHECK(fs::is_directory(dir_target + "/sub"));
  }
  SUBCASE("the directory does not exist") {
    CHECK_THROWS_WITH_AS(save_safetensors(d.file("no/such/dir/x.safetensors"), refs, {}),
                         contains("cannot create the temporary file"), Error);
  }
  CHECK(read_bytes(path) == before);
  CHECK(leftover_temps(d).empty());
  CHECK(load_safetensors(path).metadata.at("step") == "1");
}

// Runs fn in a child process that SIGALRM kills after `seconds` (a reader that blocks on a FIFO
// fails the test instead of hanging it); returns fn's result, or -1 when the child did not exit
// normally (killed: it hung).
template <class Fn>
int in_child_with_deadline(Fn fn, unsigned seconds) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::alarm(seconds);
    int rc = 1;
    try {
      rc = fn();
    } catch (...) {
      rc = 3;
    }
    std::_Exit(rc);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_CASE("checkpoint and read_file: FIFOs, devices, folders and dangling links are refused without blocking") {
  TempDir d;
  const std::string fifo = d.file("fifo.safetensors");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string dangling = d.file("dangling.safetensors");
  fs::create_symlink(d.file("no-such-file"), dangling);
  struct Case { std::string path, message; };
  for (const Case& c : {Case{fifo, "is not a regular file (a FIFO)"},
                        Case{"/dev/zero", "is not a regular file (a character device)"},
                        Case{d.dir.string(), "is not a regular file (a directory)"},
                        Case{dangling, "' is a broken symbolic link (to '" +
                                           d.file("no-such-file") + "')"}}) {
    CAPTURE(c.path);
    // 0: the expected graphmoe::Error; 1: another error or none; -1: hung (killed after 10 s)
    auto expect_error = [&](auto&& load) {
      return in_child_with_deadline([&] {
        try {
          load();
        } catch (const Error& e) {
          return std::string(e.what()).find(c.message) != std::string::npos ? 0 : 1;
        }
        return 1;
      }, 10);
    };
    CHECK(expect_error([&] { (void)load_safetensors(c.path); }) == 0);
    CHECK(expect_error([&] { (void)read_file(c.path); }) == 0);
    // the streaming line reader of the tokenizers (the gzip reader calls the same check)
    CHECK(expect_error([&] { detail::for_each_file_line("t", c.path, [](std::string_view) {}); }) == 0);
  }
}

TEST_CASE("checkpoint: a save killed mid-write leaves the previous file loadable") {
  TempDir d;
  const std::string path = d.file("ckpt.safetensors");
  std::vector<float> old_v = {1, 2, 3, 4};
  save_safetensors(path, {{"w", DType::F32, Shape{4}, old_v.data()}}, {{"step", "1"}});
  const auto before = read_bytes(path);
  std::vector<float> big(4 << 20, 0.5f);  // 16 MiB

  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Child: signal the parent once the temp file is half written, then wait to be killed.
    ::close(fds[0]);
    g_pipe_fd = fds[1];
    detail::safetensors_save_hook = [](std::uint64_t written, std::uint64_t total) {
      if (written > (8u << 20) && written < total) {
        const char c = 1;
        if (::write(g_pipe_fd, &c, 1) != 1) ::_exit(4);
        for (;;) ::pause();
      }
    };
    try {
      save_safetensors(path, {{"big", DType::F32, Shape{4, 1 << 20}, big.data()}}, {{"step", "2"}});
    } catch (...) {
      ::_exit(5);
    }
    ::_exit(3);  // the save finished: the hook never fired
  }
  ::close(fds[1]);
  char c = 0;
  ssize_t r;
  do {
    r = ::read(fds[0], &c, 1);
  } while (r < 0 && errno == EINTR);
  ::close(fds[0]);
  const std::string tmp = path + ".tmp." + std::to_string(pid);
  bool tmp_partial = false;
  if (r == 1) tmp_partial = fs::exists(tmp) && fs::file_size(tmp) < 16u * (1u << 20);
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE_MESSAGE(r == 1, "the child did not reach the middle of the save (exit status ",
                  WIFEXITED(status) ? WEXITSTATUS(status) : -1, ")");
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  CHECK(tmp_partial);

  // The previous checkpoint is intact; the killed process's temp file is all that is left.
  CHECK(read_bytes(path) == before);
  const SafetensorsFile f = load_safetensors(path);
  CHECK(f.metadata.at("step") == "1");
  CHECK(f.at("w").to_tensor<float>()(2) == 3.0f);
  CHECK(leftover_temps(d) == std::vector<std::string>{fs::path(tmp).filename().string()});

  // A later save by this process succeeds over it, and removes the dead process's temp file.
  save_safetensors(path, {{"big", DType::F32, Shape{4, 1 << 20}, big.data()}}, {{"step", "2"}});
  CHECK(load_safetensors(path).at("big").to_tensor<float>()(3, 12345) == 0.5f);
  CHECK(leftover_temps(d).empty());
  CHECK(!fs::exists(tmp));
}

namespace {
// The pid of a process that has exited and been reaped (so kill(pid, 0) fails with ESRCH).
pid_t dead_pid() {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(::kill(pid, 0) != 0);
  return pid;
}

void touch(const std::string& path, std::int64_t age_seconds = 0) {
  write_bytes(path, {1, 2, 3});
  if (age_seconds > 0) {
    const auto t = fs::last_write_time(path) - std::chrono::seconds(age_seconds);
    fs::last_write_time(path, t);
  }
}
}  // namespace

TEST_CASE("checkpoint: stale temporary files of dead savers are removed, nothing else") {
  TempDir d;
  const std::string path = d.file("ckpt.safetensors");
  const std::string tmp = path + ".tmp.";
  const std::string dead = std::to_string(dead_pid());
  // A live process that is not saving: a child that waits until the test closes the pipe.
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t live = ::fork();
  REQUIRE(live >= 0);
  if (live == 0) {
    ::close(fds[1]);
    char c;
    while (::read(fds[0], &c, 1) < 0 && errno == EINTR) {
    }
    ::_exit(0);
  }
  ::close(fds[0]);
  const std::string alive = std::to_string(live);

  touch(tmp + dead);           // stale: its process is gone
  touch(tmp + alive, 3600);    // stale: written an hour before the process now holding the pid
  const std::vector<std::string> kept = {
      "ckpt.safetensors.tmp.0" + dead,       // leading zero: not a name the saver writes
      "ckpt.safetensors.tmp." + dead + "x",  // trailing characters
      "ckpt.safetensors.tmp.-" + dead,       // a sign
      "ckpt.safetensors.tmp.+" + dead,
      "ckpt.safetensors.tmp.",               // no pid
      "ckpt.safetensors.tmp.99999999999",    // beyond any pid
      "other.safetensors.tmp." + dead,       // another checkpoint's temporary file
      "xckpt.safetensors.tmp." + dead,       // a longer name ending the same way
      "ckpt.safetensors.bak",                // anything else
  };
  for (const auto& k : kept) touch(d.file(k));
  const std::string folder = tmp + std::to_string(dead_pid());  // a folder: never removed
  fs::create_directory(folder);
  const std::string target = d.file("target");
  touch(target);
  const std::string link = tmp + std::to_string(dead_pid());    // a link: never removed
  fs::create_symlink(target, link);

  std::vector<std::string> removed = remove_stale_temporaries(path);
  std::sort(removed.begin(), removed.end());
  std::vector<std::string> expect = {tmp + dead, tmp + alive};
  std::sort(expect.begin(), expect.end());
  CHECK(removed == expect);
  CHECK(!fs::exists(tmp + dead));
  CHECK(!fs::exists(tmp + alive));
  for (const auto& k : kept) CHECK_MESSAGE(fs::exists(d.file(k)), k);
  CHECK(fs::is_directory(folder));
  CHECK(fs::is_symlink(link));
  CHECK(fs::exists(target));

  // A fresh temporary file of a running process (a save in progress) is never touched.
  touch(tmp + alive);
  CHECK(remove_stale_temporaries(path).empty());
  CHECK(fs::exists(tmp + alive));

  // A save removes stale ones first (a new dead pid's), and leaves none of its own.
  const std::string dead2 = tmp + std::to_string(dead_pid());
  touch(dead2);
  std::vector<float> v = {1, 2};
  save_safetensors(path, {{"w", DType::F32, Shape{2}, v.data()}});
  CHECK(!fs::exists(dead2));
  CHECK(fs::exists(tmp + alive));
  CHECK(!fs::exists(tmp + std::to_string(::getpid())));
  for (const auto& k : kept) CHECK(fs::exists(d.file(k)));
  CHECK(load_safetensors(path).at("w").to_tensor<float>()(1) == 2.0f);

  ::close(fds[1]);  // the child exits
  int status = 0;
  ::waitpid(live, &status, 0);
  // A missing folder, or a bare file name (the current folder): nothing to do, no error.
  CHECK(remove_stale_temporaries(d.file("missing/ckpt.safetensors")).empty());
  CHECK(remove_stale_temporaries("graphmoe_no_such_checkpoint_file.safetensors").empty());
  CHECK(remove_stale_temporaries("").empty());
}

namespace {
// A small arena ("w" (2, 3), "b" (3), and a non-trainable "frozen" (2)) with values i + offset.
void small_arena(ParameterArena<float>& a, float offset) {
  a.add("w", Shape{2, 3});
  a.add("b", Shape{3});
  a.add("frozen", Shape{2}, false);
  a.allocate();
  for (index_t p = 0; p < a.size(); ++p) {
    Tensor<float> v = a.value(p);
    for (index_t i = 0; i < v.numel(); ++i) v.data()[i] = static_cast<float>(i + p) + offset;
  }
}

// Rewrites `src` to `dst` after edit(tensors, metadata) (tensors keep their bytes).
template <class Edit>
void rewrite(const std::string& src, const std::string& dst, Edit edit) {
  SafetensorsFile f = load_safetensors(src);
  std::map<std::string, LoadedTensor> tensors = f.tensors;
  std::map<std::string, std::string> meta = f.metadata;
  edit(tensors, meta);
  std::vector<TensorRef> refs;
  for (const auto& [name, t] : tensors) refs.push_back({name, t.dtype, t.shape, t.bytes.data()});
  save_safetensors(dst, refs, meta);
}

// The message load_training_state throws for `path` into a fresh arena and AdamW ("" if none);
// checks that a failed load changed nothing.
std::string training_state_error(const std::string& path) {
  ParameterArena<float> a;
  small_arena(a, 100.0f);
  AdamW<float> opt(a, AdamWConfig{});
  const std::vector<float> before(a.values().data(), a.values().data() + a.values().numel());
  std::string msg;
  try {
    load_training_state(load_safetensors(path), a, opt);
  } catch (const Error& e) {
    msg = e.what();
  }
  if (!msg.empty()) {
    CHECK(std::vector<float>(a.values().data(), a.values().data() + a.values().numel()) == before);
    CHECK(opt.steps() == 0);
    for (const auto& [name, view] : opt.state(a))
      for (index_t i = 0; i < view.numel(); ++i) CHECK(view.data()[i] == 0.0f);
  }
  return msg;
}
}  // namespace

TEST_CASE("training state: every optimizer-state tensor must have exactly its shape (crafted files)") {
  TempDir d;
  const std::string good = d.file("good.safetensors");
  {
    ParameterArena<float> a;
    small_arena(a, 0.0f);
    AdamW<float> opt(a, AdamWConfig{});
    for (index_t p = 0; p < a.size(); ++p) {
      Tensor<float> g = a.grad(p);
      for (index_t i = 0; i < g.numel(); ++i) g.data()[i] = 0.25f;
    }
    opt.step(a, 1e-3);
    opt.step(a, 1e-3);
    save_training_state(good, a, opt, {{"step", "2"}});
  }
  CHECK(training_state_error(good).empty());
  {
    ParameterArena<float> a;
    small_arena(a, 100.0f);
    AdamW<float> opt(a, AdamWConfig{});
    load_training_state(load_safetensors(good), a, opt);
    CHECK(opt.steps() == 2);
    CHECK(a.value("b")(0) != 100.0f);
  }
  const std::string bad = d.file("bad.safetensors");
  auto variant = [&](auto edit) {
    rewrite(good, bad, edit);
    return training_state_error(bad);
  };
  using Tensors = std::map<std::string, LoadedTensor>;
  using Meta = std::map<std::string, std::string>;

  // the issue: (3, 2) has the size of (2, 3) and used to load
  std::string e = variant([](Tensors& t, Meta&) { t.at("adamw.m.w").shape = Shape{3, 2}; });
  CHECK(e.find("'" + bad + "'") != std::string::npos);
  CHECK(e.find("optimizer-state tensor 'adamw.m.w' has shape (3, 2), expected (2, 3)") != std::string::npos);
  e = variant([](Tensors& t, Meta&) { t.at("adamw.v.w").shape = Shape{6}; });
  CHECK(e.find("optimizer-state tensor 'adamw.v.w' has shape (6), expected (2, 3)") != std::string::npos);
  e = variant([](Tensors& t, Meta&) { t.at("adamw.v.b").shape = Shape{1, 3}; });
  CHECK(e.find("'adamw.v.b' has shape (1, 3), expected (3)") != std::string::npos);
  // missing, wrongly typed, stray
  e = variant([](Tensors& t, Meta&) { t.erase("adamw.m.b"); });
  CHECK(e.find("has no optimizer-state tensor 'adamw.m.b'") != std::string::npos);
  e = variant([](Tensors& t, Meta&) {
    LoadedTensor& x = t.at("adamw.m.b");
    x.dtype = DType::I32;
  });
  CHECK(e.find("'adamw.m.b' has dtype I32, expected F32") != std::string::npos);
  e = variant([](Tensors& t, Meta&) { t.emplace("adamw.m.frozen", t.at("model.frozen")); });
  CHECK(e.find("has the tensor 'adamw.m.frozen'") != std::string::npos);
  e = variant([](Tensors& t, Meta&) { t.emplace("extra", t.at("model.b")); });
  CHECK(e.find("has the tensor 'extra' of shape (3), which is neither a model parameter") != std::string::npos);
  e = variant([](Tensors& t, Meta&) { t.emplace("model.extra", t.at("model.b")); });
  CHECK(e.find("has the tensor 'model.extra' that matches no parameter") != std::string::npos);
  e = variant([](Tensors& t, Meta&) { t.at("model.w").shape = Shape{3, 2}; });
  CHECK(e.find("tensor 'model.w' has shape (3, 2), parameter 'w' has shape (2, 3)") != std::string::npos);
  // values: a negative second moment, a NaN first moment
  e = variant([](Tensors& t, Meta&) {
    const float neg = -1.0f;
    std::memcpy(t.at("adamw.v.b").bytes.data() + 4, &neg, 4);
  });
  CHECK(e.find("'adamw.v.b' holds -1 at element 1 (second moments must be finite and >= 0)") != std::string::npos);
  e = variant([](Tensors& t, Meta&) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(t.at("adamw.m.w").bytes.data(), &nan, 4);
  });
  CHECK(e.find("'adamw.m.w' holds nan at element 0 (must be finite)") != std::string::npos);
  // a non-finite weight (used to load and "train": every activation NaN from the first step)
  e = variant([](Tensors& t, Meta&) {
    const float inf = std::numeric_limits<float>::infinity();
    std::memcpy(t.at("model.w").bytes.data() + 8, &inf, 4);
  });
  CHECK(e.find("'" + bad + "': model tensor 'model.w' holds inf at element 2 (a training "
               "checkpoint's weights must be finite)") != std::string::npos);
  // optimizer_steps: missing, not a number, negative, too large (no more `stoll`)
  e = variant([](Tensors&, Meta& m) { m.erase("optimizer_steps"); });
  CHECK(e.find("has no optimizer_steps in its metadata") != std::string::npos);
  e = variant([](Tensors&, Meta& m) { m["optimizer_steps"] = "two"; });
  CHECK(e.find("'" + bad + "': metadata field 'optimizer_steps' is 'two', not a decimal integer") != std::string::npos);
  e = variant([](Tensors&, Meta& m) { m["optimizer_steps"] = "2x"; });
  CHECK(e.find("metadata field 'optimizer_steps' is '2x', not a decimal integer") != std::string::npos);
  e = variant([](Tensors&, Meta& m) { m["optimizer_steps"] = "-2"; });
  CHECK(e.find("metadata field 'optimizer_steps' is -2, out of the range [0, ") != std::string::npos);
  e = variant([](Tensors&, Meta& m) { m["optimizer_steps"] = "99999999999999999999"; });
  CHECK(e.find("metadata field 'optimizer_steps' is 99999999999999999999, out of the range") != std::string::npos);
}

TEST_CASE("training state: metadata helpers name the file and the field") {
  TempDir d;
  const std::string path = d.file("m.safetensors");
  std::vector<float> v = {1};
  save_safetensors(path, {{"x", DType::F32, Shape{1}, v.data()}},
                   {{"step", "12"}, {"bad", "1.5"}, {"config", "{\"a\": 1}"}, {"broken", "{\"a\": "}});
  const SafetensorsFile f = load_safetensors(path);
  CHECK(metadata_field(f, "step") == "12");
  CHECK(metadata_int(f, "step", 0, 100) == 12);
  CHECK(metadata_json(f, "config").at("a") == 1);
  CHECK_THROWS_WITH_AS(metadata_field(f, "nope"), contains("'" + path + "' has no metadata field 'nope'"), Error);
  CHECK_THROWS_WITH_AS(metadata_int(f, "nope", 0, 1), contains("has no metadata field 'nope'"), Error);
  CHECK_THROWS_WITH_AS(metadata_int(f, "bad", 0, 100), contains("'" + path + "': metadata field 'bad' is '1.5', not a decimal integer"), Error);
  CHECK_THROWS_WITH_AS(metadata_int(f, "step", 0, 11), contains("metadata field 'step' is 12, out of the range [0, 11]"), Error);
  CHECK_THROWS_WITH_AS(metadata_json(f, "broken"), contains("'" + path + "': metadata field 'broken' is not valid JSON: "), Error);
  CHECK_THROWS_WITH_AS(metadata_json(f, "nope"), contains("has no metadata field 'nope'"), Error);
}

TEST_CASE("checkpoint: interop with the Python safetensors library") {
  const std::string python = GRAPHMOE_SAFETENSORS_PYTHON;
  REQUIRE_MESSAGE(!python.empty(),
                  "no Python 3 that can `import safetensors, numpy` was found when CMake configured "
                  "the tests; run scripts/install-deps.sh (or set GRAPHMOE_SAFETENSORS_PYTHON) and "
                  "re-run cmake");
  TempDir d;
  const auto spec = interop_spec();

  SUBCASE("graphmoe writes, safetensors.numpy reads") {
    const std::string path = d.file("from_graphmoe.safetensors");
    std::vector<TensorRef> refs;
    for (const auto& t : spec) refs.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
    save_safetensors(path, refs, kInteropMetadata);
    CHECK(run_interop("check", path));
  }
  SUBCASE("safetensors.numpy writes, graphmoe reads") {
    const std::string path = d.file("from_python.safetensors");
    REQUIRE(run_interop("write", path));
    const SafetensorsFile f = load_safetensors(path);
    CHECK(f.metadata == kInteropMetadata);
    CHECK(f.tensors.size() == spec.size());
    for (const auto& t : spec) {
      CAPTURE(t.name);
      REQUIRE(f.contains(t.name));
      const LoadedTensor& l = f.at(t.name);
      CHECK(l.dtype == t.dtype);
      CHECK(l.shape == t.shape);
      CHECK(l.bytes == t.bytes);
    }
    CHECK(f.at("model.f32").to_tensor<float>()(1, 2) == 1.5f);
    CHECK(f.at("model.i64").to_tensor<std::int64_t>()(1, 1) == 3 * (std::int64_t(1) << 33) - 5);
    CHECK(f.at("scalar").to_tensor<float>().data()[0] == -1.0f);
  }
}
