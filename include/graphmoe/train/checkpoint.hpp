// graphmoe/train/checkpoint.hpp: checkpoints in the safetensors format (huggingface/safetensors).
//
// File layout:
//   [8 bytes]  N, the header size, unsigned 64-bit little-endian
//   [N bytes]  UTF-8 JSON object, padded with spaces so that N is a multiple of 8:
//                {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//                 "__metadata__": {"key": "value", ...}}
//   [rest]     the data buffer; data_offsets are byte offsets into it. Each tensor is contiguous,
//              row-major, little-endian; the tensors cover the buffer exactly, without gaps or
//              overlaps (what the reference implementation requires).
//
// save_safetensors writes atomically: a temporary file `path + ".tmp.<pid>"` in the same
// directory, fsync, rename over `path`, fsync of the directory. A failed save removes the
// temporary file and leaves any previous `path` untouched; a killed process can leave only a
// stale temporary file behind, never a partial `path`; the next save (or remove_stale_temporaries)
// removes it once its process is gone.
//
// load_safetensors validates the whole header before it allocates anything the header asks
// for, and throws graphmoe::Error naming the file and the problem for malformed input. The full
// list is in docs/checkpoints.md.
//
// POSIX only (open, fsync, rename) and little-endian hosts only.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <ostream>
#include <sstream>
#include <set>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/train/files.hpp"

static_assert(std::endian::native == std::endian::little,
              "graphmoe/train/checkpoint.hpp: safetensors data is little-endian; big-endian hosts "
              "are not supported");

namespace graphmoe {

// The element types graphmoe reads and writes, with their safetensors names.
enum class DType { F32, F64, BF16, F16, I32, I64, U8 };

// "F32", "F64", "BF16", "F16", "I32", "I64", "U8".
inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
  }
  return "?";
}

// Bytes per element.
inline std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}

inline std::ostream& operator<<(std::ostream& os, DType d) { return os << dtype_name(d); }

// The DType of a C++ element type: float F32, double F64, int32 I32, int64 I64, uint8 U8.
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) {
    return DType::F32;
  } else if constexpr (std::is_same_v<T, double>) {
    return DType::F64;
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    return DType::I32;
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return DType::I64;
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return DType::U8;
  } else {
    static_assert(!std::is_same_v<T, T>,
                  "graphmoe::dtype_of: T has no safetensors dtype (use float, double, int32_t, "
                  "int64_t or uint8_t)");
    return DType::U8;
  }
}

// A tensor to write: a view, the caller keeps `data` alive during save_safetensors. `data` holds
// shape.numel() * dtype_size(dtype) bytes, row-major, in host (little-endian) byte order.
struct TensorRef {
  std::string name;
  DType dtype;
  Shape shape;
  const void* data;
};

// A tensor read from a file: its raw bytes (row-major, little-endian), owned.
struct LoadedTensor {
  DType dtype = DType::U8;
  Shape shape;
  std::vector<std::uint8_t> bytes;
  std::string name;  // the tensor's name and file, for error messages
  std::string path;

  // A new CPU tensor holding a copy of the values. Throws unless dtype == dtype_of<T>(): no
  // implicit conversion (read an F32 tensor as float, then convert explicitly if needed).
  template <class T>
  Tensor<T, cpu> to_tensor() const {
    GRAPHMOE_CHECK(dtype == dtype_of<T>(), "LoadedTensor::to_tensor", "tensor '", name,
                   "' in '", path, "' has dtype ", dtype, ", cannot read it as ", dtype_of<T>());
    GRAPHMOE_CHECK(bytes.size() == static_cast<std::size_t>(shape.numel()) * sizeof(T),
                   "LoadedTensor::to_tensor", "tensor '", name, "' in '", path, "' holds ",
                   bytes.size(), " bytes, shape ", shape, " needs ",
                   static_cast<std::size_t>(shape.numel()) * sizeof(T));
    Tensor<T, cpu> t(shape);
    if (!bytes.empty()) std::memcpy(t.data(), bytes.data(), bytes.size());
    return t;
  }
};

// A whole safetensors file in memory.
struct SafetensorsFile {
  std::string path;                                // the file it was read from
  std::map<std::string, std::string> metadata;     // "__metadata__" (string -> string)
  std::map<std::string, LoadedTensor> tensors;

  bool contains(const std::string& name) const { return tensors.count(name) != 0; }
  const LoadedTensor& at(const std::string& name) const {
    auto it = tensors.find(name);
    GRAPHMOE_CHECK(it != tensors.end(), "SafetensorsFile::at", "no tensor named '", name,
                   "' in '", path, "' (", tensors.size(), " tensors)");
    return it->second;
  }
};

namespace detail {

// Test hook: when set, save_safetensors calls it after writing the header and after each chunk of
// data to the temporary file (before fsync and rename), with the bytes written so far and the
// total. Tests use it to fail or kill a save midway; nothing else should set it.
using SafetensorsSaveHook = void (*)(std::uint64_t written, std::uint64_t total);
inline SafetensorsSaveHook safetensors_save_hook = nullptr;

inline constexpr std::uint64_t kSafetensorsMaxHeader = 100'000'000;  // as the reference library
inline constexpr std::size_t kSafetensorsChunk = std::size_t(1) << 20;

inline bool parse_dtype(const std::string& s, DType& out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::F32}, {"F64", DType::F64}, {"BF16", DType::BF16}, {"F16", DType::F16},
      {"I32", DType::I32}, {"I64", DType::I64}, {"U8", DType::U8}};
  for (const auto& [n, d] : kNames)
    if (s == n) {
      out = d;
      return true;
    }
  return false;
}

// numel * element size of a shape, false on overflow of 64 bits.
inline bool checked_nbytes(const std::vector<std::uint64_t>& dims, std::uint64_t elem,
                           std::uint64_t& out) {
  std::uint64_t n = elem;
  for (std::uint64_t d : dims)
    if (__builtin_mul_overflow(n, d, &n)) return false;
  out = n;
  return true;
}

inline std::string errno_text(int e) { return std::string(std::strerror(e)); }

// One header entry as parsed, before the offsets are checked against each other.
struct RawEntry {
  std::string name;
  std::string dtype;
  std::vector<std::uint64_t> shape;
  std::vector<std::uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// Streaming (SAX) reader of the header: accepts exactly the safetensors structure and stops at
// the first deviation, so a hostile header never builds a large or deep JSON tree. Nesting is at
// most root object -> entry object -> shape array.
class SafetensorsHeaderSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::vector<RawEntry> entries;
  std::map<std::string, std::string> metadata;
  std::string error;  // set when parsing stopped for a reason other than a JSON syntax error
  std::string syntax_error;
  bool finished = false;

  bool null() override { return scalar("null"); }
  bool boolean(bool) override { return scalar("a boolean"); }
  bool number_integer(number_integer_t v) override {
    if (v < 0) {
      if (state_ == State::Array) return fail("'" + field_ + "' of tensor '" + cur_.name +
                                              "' holds the negative number " + std::to_string(v));
      return scalar("a number");
    }
    return number(static_cast<std::uint64_t>(v));
  }
  bool number_unsigned(number_unsigned_t v) override { return number(v); }
  bool number_float(number_float_t, const string_t& s) override {
    if (state_ == State::Array)
      return fail("'" + field_ + "' of tensor '" + cur_.name + "' holds the non-integer " + s);
    return scalar("a number");
  }
  bool string(string_t& v) override {
    if (state_ == State::Metadata) {
      metadata[meta_key_] = v;
      return true;
    }
    if (state_ == State::Entry && field_ == "dtype") {
      cur_.dtype = v;
      cur_.has_dtype = true;
      return true;
    }
    return scalar("a string");
  }
  bool binary(binary_t&) override { return scalar("binary data"); }
  bool start_object(std::size_t) override {
    switch (state_) {
      case State::Start: state_ = State::Root; return true;
      case State::RootValue:
        if (is_metadata_) {
          state_ = State::Metadata;
        } else {
          cur_ = RawEntry{};
          cur_.name = key_;
          entry_keys_.clear();
          state_ = State::Entry;
        }
        return true;
      default: return scalar("an object");
    }
  }
  bool key(string_t& k) override {
    switch (state_) {
      case State::Root:
        // save_safetensors refuses an empty name; so does the reader (an empty key would be a
        // tensor that no parameter or message can name).
        if (k.empty()) return fail("a tensor has an empty name");
        if (!root_keys_.insert(k).second)
          return fail(k == "__metadata__" ? std::string("duplicate '__metadata__'")
                                          : "duplicate tensor name '" + k + "'");
        key_ = k;
        is_metadata_ = (k == "__metadata__");
        state_ = State::RootValue;
        return true;
      case State::Metadata:
        if (!meta_keys_.insert(k).second) return fail("duplicate __metadata__ key '" + k + "'");
        meta_key_ = k;
        return true;
      case State::Entry:
        if (k != "dtype" && k != "shape" && k != "data_offsets")
          return fail("tensor '" + cur_.name + "' has the unknown field '" + k + "'");
        if (!entry_keys_.insert(k).second)
          return fail("tensor '" + cur_.name + "' has a duplicate field '" + k + "'");
        field_ = k;
        return true;
      default: return fail("unexpected key '" + k + "'");
    }
  }
  bool end_object() override {
    switch (state_) {
      case State::Root: state_ = State::Done; finished = true; return true;
      case State::Metadata: state_ = State::Root; return true;
      case State::Entry:
        if (!cur_.has_dtype) return fail("tensor '" + cur_.name + "' has no 'dtype'");
        if (!cur_.has_shape) return fail("tensor '" + cur_.name + "' has no 'shape'");
        if (!cur_.has_offsets) return fail("tensor '" + cur_.name + "' has no 'data_offsets'");
        entries.push_back(std::move(cur_));
        state_ = State::Root;
        return true;
      default: return fail("unexpected end of object");
    }
  }
  bool start_array(std::size_t) override {
    if (state_ == State::Entry && (field_ == "shape" || field_ == "data_offsets")) {
      state_ = State::Array;
      array_.clear();
      return true;
    }
    return scalar("an array");
  }
  bool end_array() override {
    if (state_ != State::Array) return fail("unexpected end of array");
    if (field_ == "shape") {
      cur_.shape = array_;
      cur_.has_shape = true;
    } else {
      if (array_.size() != 2)
        return fail("'data_offsets' of tensor '" + cur_.name + "' has " +
                    std::to_string(array_.size()) + " entries, expected 2");
      cur_.offsets = array_;
      cur_.has_offsets = true;
    }
    state_ = State::Entry;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::json::exception& ex) override {
    syntax_error = "header is not valid JSON (byte " + std::to_string(position) + "): " + ex.what();
    return false;
  }

 private:
  enum class State { Start, Root, RootValue, Metadata, Entry, Array, Done };

  bool number(std::uint64_t v) {
    if (state_ != State::Array) return scalar("a number");
    const std::size_t cap = field_ == "shape" ? static_cast<std::size_t>(Shape::kMaxRank) : 2;
    if (array_.size() >= cap) {
      if (field_ == "shape")
        return fail("tensor '" + cur_.name + "' has rank above the maximum rank " +
                    std::to_string(Shape::kMaxRank));
      return fail("'data_offsets' of tensor '" + cur_.name + "' has more than 2 entries");
    }
    if (field_ == "shape" && v > static_cast<std::uint64_t>(INT64_MAX))
      return fail("tensor '" + cur_.name + "' has the dimension " + std::to_string(v) +
                  ", too large");
    array_.push_back(v);
    return true;
  }
  // A value of the wrong JSON type for where it appears.
  bool scalar(const char* what) {
    switch (state_) {
      case State::Start: return fail(std::string("header is ") + what + ", not a JSON object");
      case State::RootValue:
        if (is_metadata_) return fail(std::string("__metadata__ is ") + what + ", not an object");
        return fail("entry '" + key_ + "' is " + what + ", not an object");
      case State::Metadata:
        return fail("__metadata__ value of key '" + meta_key_ + "' is " + what +
                    ", not a string");
      case State::Entry:
        return fail("'" + field_ + "' of tensor '" + cur_.name + "' is " + what + ", expected " +
                    (field_ == "dtype" ? "a string" : "an array of integers"));
      case State::Array:
        return fail("'" + field_ + "' of tensor '" + cur_.name + "' holds " + what +
                    ", expected non-negative integers");
      default: return fail(std::string("unexpected ") + what);
    }
  }
  bool fail(std::string msg) {
    if (error.empty()) error = std::move(msg);
    return false;
  }

  State state_ = State::Start;
  std::set<std::string> root_keys_, meta_keys_, entry_keys_;
  std::string key_, meta_key_, field_;
  bool is_metadata_ = false;
  RawEntry cur_;
  std::vector<std::uint64_t> array_;
};

// An open file descriptor, closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Gives the descriptor up without closing it.
  void release() { fd_ = -1; }
  // Closes now and reports close()'s error (write errors can surface there).
  int close() {
    const int r = ::close(fd_);
    fd_ = -1;
    return r;
  }

 private:
  int fd_;
};

inline void write_all(int fd, const void* data, std::size_t n, const std::string& tmp) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    const ::ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      detail::throw_error("save_safetensors", "writing '", tmp, "' failed: ",
                          errno_text(errno));
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Reads exactly n bytes at the current position, false on a short read.
inline bool read_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<std::uint8_t*>(data);
  while (n > 0) {
    const ::ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// The start of process `pid` in seconds since the epoch, from /proc/<pid>/stat (its field 22,
// clock ticks since boot) and /proc/stat's btime (Linux); false where either cannot be read.
inline bool process_start_time(long pid, double& seconds) {
  std::ifstream st("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!st || !std::getline(st, line)) return false;
  const std::size_t close = line.rfind(')');  // the command name may hold spaces and ')'
  if (close == std::string::npos) return false;
  std::istringstream fields(line.substr(close + 1));
  std::string field;
  unsigned long long ticks = 0;
  for (int i = 3; i <= 22; ++i) {  // field 3 (state) follows the name
    if (!(fields >> field)) return false;
    if (i == 22) {
      const auto r = std::from_chars(field.data(), field.data() + field.size(), ticks);
      if (r.ec != std::errc() || r.ptr != field.data() + field.size()) return false;
    }
  }
  std::ifstream stat("/proc/stat");
  unsigned long long btime = 0;
  bool found = false;
  while (std::getline(stat, line))
    if (line.rfind("btime ", 0) == 0) {
      btime = std::strtoull(line.c_str() + 6, nullptr, 10);
      found = btime > 0;
      break;
    }
  const long hz = ::sysconf(_SC_CLK_TCK);
  if (!found || hz <= 0) return false;
  seconds = static_cast<double>(btime) + static_cast<double>(ticks) / static_cast<double>(hz);
  return true;
}

// The pid of `name` if it is exactly `prefix` + a pid as save_safetensors writes it (decimal, no
// sign, no leading zero, in [1, INT_MAX]); 0 otherwise.
inline long temporary_pid(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return 0;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 10 || digits[0] == '0') return 0;
  long pid = 0;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
  if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) return 0;
  return pid >= 1 && pid <= 2147483647L ? pid : 0;
}
}  // namespace detail

// Removes the stale temporary files that killed saves to `path` left behind: the regular files
// (not links, not folders) in path's folder named exactly `<file name of path>.tmp.<pid>`, as
// save_safetensors writes them, whose process is gone (kill(pid, 0) fails with ESRCH) or was
// started after the file was last written (the pid was reused: Linux, /proc). A temporary file of
// a running saver is never touched, nor any other file. Failures to list or remove are ignored
// (this is housekeeping). Returns the paths removed. save_safetensors calls it before each save;
// a program may call it at start (the examples do).
inline std::vector<std::string> remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  if (path.empty()) return removed;
  const fs::path p(path);
  const std::string prefix = p.filename().string() + ".tmp.";
  if (prefix == ".tmp.") return removed;
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return removed;
  for (const fs::directory_entry& e : it) {
    const long pid = detail::temporary_pid(e.path().filename().string(), prefix);
    if (pid == 0) continue;
    const std::string file = e.path().string();
    struct stat st {};
    if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    bool stale = ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    if (!stale) {
      // The pid runs: stale only if that process started after the file was last written (2 s
      // of margin for the boot time's and the start time's rounding).
      double started = 0;
      stale = detail::process_start_time(pid, started) &&
              static_cast<double>(st.st_mtim.tv_sec) < started - 2.0;
    }
    if (stale && ::unlink(file.c_str()) == 0) removed.push_back(file);
  }
  return removed;
}

// Writes `tensors` (in the given order, contiguously) and `metadata` to `path`, atomically.
// Throws graphmoe::Error before touching the file system for: an empty, duplicate or
// "__metadata__" tensor name, a null data pointer for a non-empty tensor, names or metadata that
// are not valid UTF-8; and after it for any I/O failure, having removed its temporary file.
inline void save_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  const char* op = "save_safetensors";
  GRAPHMOE_CHECK(!path.empty(), op, "empty path");

  // 1. The header, with every check that needs no file.
  nlohmann::json header = nlohmann::json::object();
  std::vector<std::uint64_t> sizes;
  sizes.reserve(tensors.size());
  std::uint64_t total = 0;
  for (const TensorRef& t : tensors) {
    GRAPHMOE_CHECK(!t.name.empty(), op, "'", path, "': a tensor has an empty name");
    GRAPHMOE_CHECK(t.name != "__metadata__", op, "'", path,
                   "': '__metadata__' is reserved and cannot name a tensor");
    GRAPHMOE_CHECK(!header.contains(t.name), op, "'", path, "': duplicate tensor name '", t.name,
                   "'");
    std::vector<std::uint64_t> dims(t.shape.begin(), t.shape.end());
    std::uint64_t nbytes = 0;
    GRAPHMOE_CHECK(detail::checked_nbytes(dims, dtype_size(t.dtype), nbytes), op, "'", path,
                   "': tensor '", t.name, "' of shape ", t.shape, " is too large");
    GRAPHMOE_CHECK(t.data != nullptr || nbytes == 0, op, "'", path, "': tensor '", t.name,
                   "' of shape ", t.shape, " has a null data pointer");
    GRAPHMOE_CHECK(!__builtin_add_overflow(total, nbytes, &total), op, "'", path,
                   "': tensors too large");
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", dims},
                      {"data_offsets", {total - nbytes, total}}};
    sizes.push_back(nbytes);
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    detail::throw_error(op, "'", path, "': tensor names and metadata must be valid UTF-8 (",
                        e.what(), ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::uint8_t size_bytes[8];
  for (int i = 0; i < 8; ++i)
    size_bytes[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  const std::uint64_t file_total = 8 + text.size() + total;

  // 2. The temporary file; removed on every exit but success. Stale ones of killed saves first.
  remove_stale_temporaries(path);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  GRAPHMOE_CHECK(raw >= 0, op, "cannot create the temporary file '", tmp, "' for '", path,
                 "': ", detail::errno_text(errno));
  struct RemoveTemp {
    const std::string& name;
    bool armed = true;
    ~RemoveTemp() {
      if (armed) ::unlink(name.c_str());
    }
  } remove_temp{tmp};
  detail::Fd fd(raw);

  std::uint64_t written = 0;
  auto progress = [&](std::uint64_t n) {
    written += n;
    if (detail::safetensors_save_hook) detail::safetensors_save_hook(written, file_total);
  };
  detail::write_all(fd.get(), size_bytes, 8, tmp);
  detail::write_all(fd.get(), text.data(), text.size(), tmp);
  progress(8 + text.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto* p = static_cast<const std::uint8_t*>(tensors[i].data);
    for (std::uint64_t done = 0; done < sizes[i];) {
      const std::size_t n =
          static_cast<std::size_t>(std::min<std::uint64_t>(detail::kSafetensorsChunk, sizes[i] - done));
      detail::write_all(fd.get(), p + done, n, tmp);
      done += n;
      progress(n);
    }
  }
  GRAPHMOE_CHECK(::fsync(fd.get()) == 0, op, "fsync of '", tmp, "' failed: ",
                 detail::errno_text(errno));
  GRAPHMOE_CHECK(fd.close() == 0, op, "closing '", tmp, "' failed: ", detail::errno_text(errno));

  // 3. Publish: rename over path, then make the rename durable.
  GRAPHMOE_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, op, "cannot rename '", tmp, "' to '",
                 path, "': ", detail::errno_text(errno));
  remove_temp.armed = false;
  // (not `dir = "."` after the fact: GCC 12 -O3 reports a false -Wrestrict on that assignment)
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  detail::Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  GRAPHMOE_CHECK(dfd.get() >= 0, op, "'", path, "' was written but its directory '", dir,
                 "' cannot be opened to fsync it: ", detail::errno_text(errno));
  // EINVAL: the file system does not support fsync on directories; nothing more can be done.
  GRAPHMOE_CHECK(::fsync(dfd.get()) == 0 || errno == EINVAL, op, "'", path,
                 "' was written but fsync of its directory '", dir,
                 "' failed: ", detail::errno_text(errno));
}

// One tensor of a validated safetensors header: where its bytes are in the data buffer.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::U8;
  Shape shape;
  std::uint64_t begin = 0, end = 0;  // byte offsets into the data buffer, end - begin = its bytes
};

// The header of a safetensors file, validated as load_safetensors validates it (every check of
// docs/checkpoints.md), without reading the data.
struct SafetensorsHeader {
  std::string path;
  std::uint64_t file_size = 0;
  std::uint64_t data_start = 0;  // 8 + the header size: the data buffer's offset in the file
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsEntry> entries;  // in the order of their data (ascending offsets)
};

namespace detail {

// Opens `path` for reading, refusing anything but a regular file (checked before opening:
// opening a FIFO for reading blocks until a writer comes, and a device such as /dev/zero never
// ends; O_NONBLOCK keeps a file swapped for a FIFO after the check from blocking the open, and
// fstat then checks what was actually opened). Returns the descriptor; st holds its status.
inline int open_regular_for_reading(const char* op, const std::string& path, struct stat& st) {
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    require_no_broken_link(op, path);
    throw_error(op, "cannot open '", path, "': ", errno_text(err));
  }
  GRAPHMOE_CHECK(S_ISREG(st.st_mode), op, "'", path, "' is not a regular file (",
                 file_kind(st.st_mode), ")");
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  GRAPHMOE_CHECK(raw >= 0, op, "cannot open '", path, "': ", errno_text(errno));
  Fd fd(raw);
  GRAPHMOE_CHECK(::fstat(fd.get(), &st) == 0, op, "cannot stat '", path, "': ",
                 errno_text(errno));
  GRAPHMOE_CHECK(S_ISREG(st.st_mode), op, "'", path, "' is not a regular file (",
                 file_kind(st.st_mode), ")");
  const int out = fd.get();
  fd.release();
  return out;
}

// Reads and validates the header of the open file fd (positioned at its start, file_size bytes)
// and leaves fd at the start of the data buffer. Errors "graphmoe::<op>: '<path>': <problem>".
inline SafetensorsHeader read_safetensors_header(const char* op, const std::string& path, int fd,
                                                 std::uint64_t file_size) {
  GRAPHMOE_CHECK(file_size >= 8, op, "'", path, "': file is ", file_size,
                 " bytes, shorter than the 8-byte header size field (truncated?)");
  std::uint8_t size_bytes[8];
  GRAPHMOE_CHECK(read_all(fd, size_bytes, 8), op, "'", path, "': cannot read the header size");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(size_bytes[i]) << (8 * i);
  GRAPHMOE_CHECK(n <= kSafetensorsMaxHeader, op, "'", path, "': header size ", n,
                 " exceeds the limit of ", kSafetensorsMaxHeader, " bytes");
  GRAPHMOE_CHECK(n <= file_size - 8, op, "'", path, "': header size ", n,
                 " runs past the end of the file (", file_size, " bytes; truncated?)");
  std::string text(static_cast<std::size_t>(n), '\0');
  GRAPHMOE_CHECK(read_all(fd, text.data(), text.size()), op, "'", path, "': cannot read the ", n,
                 "-byte header (file shrank while reading?)");

  SafetensorsHeaderSax sax;
  const bool ok = nlohmann::json::sax_parse(text, &sax);
  GRAPHMOE_CHECK(sax.error.empty(), op, "'", path, "': ", sax.error);
  GRAPHMOE_CHECK(sax.syntax_error.empty(), op, "'", path, "': ", sax.syntax_error);
  GRAPHMOE_CHECK(ok && sax.finished, op, "'", path, "': header is not a complete JSON object");

  // Entries: dtype, sizes, and offsets that tile the data buffer.
  const std::uint64_t buffer = file_size - 8 - n;
  SafetensorsHeader out;
  out.path = path;
  out.file_size = file_size;
  out.data_start = 8 + n;
  out.metadata = std::move(sax.metadata);
  out.entries.reserve(sax.entries.size());
  for (const RawEntry& e : sax.entries) {
    DType d{};
    GRAPHMOE_CHECK(parse_dtype(e.dtype, d), op, "'", path, "': tensor '", e.name,
                   "' has the unknown or unsupported dtype '", e.dtype,
                   "' (supported: F32, F64, BF16, F16, I32, I64, U8)");
    const std::uint64_t begin = e.offsets[0], end = e.offsets[1];
    GRAPHMOE_CHECK(begin <= end, op, "'", path, "': tensor '", e.name, "' has data_offsets [",
                   begin, ", ", end, "] in reverse order");
    GRAPHMOE_CHECK(end <= buffer, op, "'", path, "': tensor '", e.name, "' has data_offsets [",
                   begin, ", ", end, "] beyond the data buffer of ", buffer,
                   " bytes (truncated?)");
    std::uint64_t nbytes = 0;
    GRAPHMOE_CHECK(checked_nbytes(e.shape, dtype_size(d), nbytes), op, "'", path, "': tensor '",
                   e.name, "' has a shape whose byte size overflows 64 bits");
    GRAPHMOE_CHECK(end - begin == nbytes, op, "'", path, "': tensor '", e.name, "' spans ",
                   end - begin, " bytes, but its dtype ", e.dtype, " and shape need ", nbytes);
    SafetensorsEntry entry;
    entry.name = e.name;
    entry.dtype = d;
    const std::vector<index_t> dims(e.shape.begin(), e.shape.end());  // each <= INT64_MAX
    entry.shape = Shape::from_range(dims.begin(), dims.end());
    entry.begin = begin;
    entry.end = end;
    out.entries.push_back(std::move(entry));
  }
  std::sort(out.entries.begin(), out.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  std::uint64_t expected = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& s : out.entries) {
    GRAPHMOE_CHECK(s.begin >= expected, op, "'", path, "': tensors '", prev ? prev->name : "",
                   "' and '", s.name, "' overlap in the data buffer");
    GRAPHMOE_CHECK(s.begin == expected, op, "'", path, "': gap of ", s.begin - expected,
                   " bytes in the data buffer before tensor '", s.name, "'");
    expected = s.end;
    prev = &s;
  }
  GRAPHMOE_CHECK(expected == buffer, op, "'", path, "': ", buffer - expected,
                 " bytes after the last tensor are not covered by any tensor");
  return out;
}

}  // namespace detail

// Reads and validates the header of a safetensors file (the checks of load_safetensors), without
// its data: the tensors' names, dtypes, shapes and places. graphmoe/hf/reader.hpp maps the data.
inline SafetensorsHeader read_safetensors_header(const std::string& path) {
  const char* op = "read_safetensors_header";
  struct stat st {};
  detail::Fd fd(detail::open_regular_for_reading(op, path, st));
  return detail::read_safetensors_header(op, path, fd.get(), static_cast<std::uint64_t>(st.st_size));
}

// Reads and validates a whole safetensors file. Throws graphmoe::Error naming the file and the
// problem for anything malformed (see docs/checkpoints.md for the list).
inline SafetensorsFile load_safetensors(const std::string& path) {
  const char* op = "load_safetensors";
  struct stat st {};
  detail::Fd fd(detail::open_regular_for_reading(op, path, st));
  SafetensorsHeader header =
      detail::read_safetensors_header(op, path, fd.get(), static_cast<std::uint64_t>(st.st_size));
  SafetensorsFile out;
  out.path = path;
  out.metadata = std::move(header.metadata);
  // Data: sequential reads (the entries tile the buffer in this order), each allocation bounded
  // by what the file holds.
  for (SafetensorsEntry& e : header.entries) {
    LoadedTensor t;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.name = e.name;
    t.path = path;
    t.bytes.resize(static_cast<std::size_t>(e.end - e.begin));
    GRAPHMOE_CHECK(detail::read_all(fd.get(), t.bytes.data(), t.bytes.size()), op, "'", path,
                   "': cannot read the data of tensor '", e.name, "' (file shrank while reading?)");
    out.tensors.emplace(std::move(e.name), std::move(t));
  }
  return out;
}

// Appends every parameter of `arena` (values only, not gradients) as prefix + name. The arena
// must be allocated and must outlive the save.
template <class T>
void append_arena(std::vector<TensorRef>& out, const ParameterArena<T, cpu>& arena,
                  const std::string& prefix = "") {
  GRAPHMOE_CHECK(arena.allocated(), "append_arena", "the arena is not allocated");
  for (index_t i = 0; i < arena.size(); ++i) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    GRAPHMOE_CHECK(!p.sharded(), "append_arena", "parameter '", p.name, "' is an expert shard (rows ",
                   p.shard_begin, "..", p.shard_begin + p.shape[0], " of ", p.shard_rows,
                   "): this rank alone cannot write it; use dist::save_training_state or "
                   "dist::gather_parameter (graphmoe/train/distributed_checkpoint.hpp)");
    out.push_back({prefix + p.name, dtype_of<T>(), p.shape, arena.value(i).data()});
  }
}

// Copies the tensors named prefix + name into the arena's values. The dtype must be exactly
// dtype_of<T>() and the shape exactly the parameter's; there is no conversion (an F32 file into
// a double arena throws). An expert shard (ParameterInfo::sharded) reads its rows of the file's
// whole tensor, whose shape must be full_shape(): a checkpoint of any world size loads into any
// other (docs/checkpoints.md). strict: every parameter must be present, and every tensor of the file
// whose name starts with `prefix` must be a parameter. !strict: missing parameters keep their
// values, extra tensors are ignored. Everything is checked before anything is copied, so a
// failed load leaves the arena unchanged.
template <class T>
void load_arena(const SafetensorsFile& f, ParameterArena<T, cpu>& arena,
                const std::string& prefix = "", bool strict = true) {
  const char* op = "load_arena";
  GRAPHMOE_CHECK(arena.allocated(), op, "the arena is not allocated");
  std::vector<std::pair<index_t, const LoadedTensor*>> copies;
  for (index_t i = 0; i < arena.size(); ++i) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    const std::string name = prefix + p.name;
    auto it = f.tensors.find(name);
    if (it == f.tensors.end()) {
      GRAPHMOE_CHECK(!strict, op, "'", f.path, "' has no tensor '", name, "' for parameter '",
                     p.name, "' of shape ", p.shape);
      continue;
    }
    const LoadedTensor& t = it->second;
    GRAPHMOE_CHECK(t.dtype == dtype_of<T>(), op, "'", f.path, "': tensor '", name,
                   "' has dtype ", t.dtype, ", the arena holds ", dtype_of<T>(),
                   " (no conversion is done)");
    GRAPHMOE_CHECK(t.shape == p.full_shape(), op, "'", f.path, "': tensor '", name,
                   "' has shape ", t.shape, ", parameter '", p.name, "' has shape ",
                   p.full_shape(), p.sharded() ? " (this rank holds a shard of it)" : "");
    copies.emplace_back(i, &t);
  }
  if (strict) {
    for (const auto& [name, t] : f.tensors) {
      if (name.compare(0, prefix.size(), prefix) != 0) continue;
      GRAPHMOE_CHECK(arena.contains(name.substr(prefix.size())), op, "'", f.path,
                     "' has the tensor '", name, "' that matches no parameter (strict load)");
    }
  }
  for (const auto& [i, t] : copies) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    const std::size_t bytes = static_cast<std::size_t>(p.shape.numel()) * sizeof(T);
    if (bytes == 0) continue;
    // a shard: its rows of the whole tensor (row-major, so one contiguous block)
    const std::size_t skip =
        p.sharded() ? bytes / static_cast<std::size_t>(p.shape[0]) * static_cast<std::size_t>(p.shard_begin) : 0;
    std::memcpy(arena.value(i).data(), t->bytes.data() + skip, bytes);
  }
  arena.mark_values_written();
}

// Checks the values of the file's tensors of dtype T whose names start with `prefix`, before any
// is loaded: each must be finite and, when max_abs is finite, at most max_abs in magnitude. The
// first that is not throws "'<path>': model tensor '<name>' holds <x> at element <i> (<whose>
// weights must be finite[ and at most <max_abs> in magnitude])". Tensors of another dtype are
// skipped (load_arena refuses them by name). The rule of load_training_state (train_lm --resume)
// and, with a limit, of finetune_classifier's pretrained backbone (docs/reliability.md).
template <class T>
void check_weight_values(const SafetensorsFile& f, const std::string& prefix, const char* op,
                         const std::string& whose,
                         double max_abs = std::numeric_limits<double>::infinity()) {
  const bool limited = std::isfinite(max_abs);
  for (const auto& [name, t] : f.tensors) {
    if (name.compare(0, prefix.size(), prefix) != 0 || t.dtype != dtype_of<T>()) continue;
    for (std::size_t i = 0; i + sizeof(T) <= t.bytes.size(); i += sizeof(T)) {
      T x;
      std::memcpy(&x, t.bytes.data() + i, sizeof(T));
      if (std::isfinite(x) && (!limited || std::abs(static_cast<double>(x)) <= max_abs)) continue;
      std::ostringstream limit;
      if (limited) limit << " and at most " << max_abs << " in magnitude";
      detail::throw_error(op, "'", f.path, "': model tensor '", name, "' holds ", x,
                          " at element ", i / sizeof(T), " (", whose, " weights must be finite",
                          limit.str(), ")");
    }
  }
}

}  // namespace graphmoe
