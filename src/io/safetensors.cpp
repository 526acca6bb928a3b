// Strict safetensors reader. The file is untrusted input: every number in the header is
// range-checked (with 128-bit arithmetic where a product could overflow) before any pointer
// into the mapping is formed, and every failure is a k3::Error naming the file.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace k3 {
namespace {

using json = nlohmann::json;
using u128 = unsigned __int128;

// A header this large is certainly corrupt; the reference implementation uses the same cap.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

// Closes the descriptor on every exit path of open().
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// One header entry after validation, before views are created.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// Parses JSON and rejects duplicate keys at any depth: nlohmann silently keeps the last of
// two equal keys, which would let a file carry two definitions of one tensor.
json parse_header_json(const std::string& path, const char* first, const char* last) {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  bool top_level_duplicate = false;
  const json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (ev == json::parse_event_t::key && !open_objects.empty() && duplicate.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second) {
        duplicate = key;
        top_level_duplicate = open_objects.size() == 1;
      }
    }
    return true;
  };
  json j;
  try {
    j = json::parse(first, last, cb);
  } catch (const json::exception& e) {
    fail("safetensors ", path, ": header is not valid JSON: ", e.what());
  }
  if (!duplicate.empty()) {
    if (top_level_duplicate)
      fail("safetensors ", path, ": duplicate tensor name \"", duplicate, "\"");
    fail("safetensors ", path, ": duplicate key \"", duplicate, "\" in header");
  }
  return j;
}

// A JSON number that is a non-negative integer, as uint64; fails naming `what` otherwise.
uint64_t non_negative_int(const std::string& ctx, const json& v, const char* what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) fail(ctx, ": negative ", what, " ", v.get<int64_t>());
  fail(ctx, ": ", what, " must be a non-negative integer, got ", v.dump());
}

Entry parse_entry(const std::string& path, const std::string& name, const json& v) {
  const std::string ctx = "safetensors " + path + ": tensor \"" + name + "\"";
  if (!v.is_object()) fail(ctx, ": entry must be an object, got ", v.type_name());
  for (const auto& [key, _] : v.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail(ctx, ": unknown key \"", key, "\" in entry");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) fail(ctx, ": missing key \"", key, "\"");

  Entry e;
  e.name = name;
  const json& dt = v["dtype"];
  if (!dt.is_string()) fail(ctx, ": dtype must be a string, got ", dt.dump());
  try {
    e.dtype = parse_dtype(dt.get_ref<const std::string&>());
  } catch (const Error& err) {
    fail(ctx, ": ", err.what());
  }

  const json& sh = v["shape"];
  if (!sh.is_array()) fail(ctx, ": shape must be an array, got ", sh.dump());
  // Every prefix product must fit in int64 so that k3::numel() can never overflow.
  u128 numel = 1;
  for (const json& d : sh) {
    const uint64_t dim = non_negative_int(ctx, d, "shape entry");
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(ctx, ": shape entry ", dim, " is too large");
    numel *= dim;
    if (numel > static_cast<u128>(std::numeric_limits<int64_t>::max()))
      fail(ctx, ": shape ", sh.dump(), " has too many elements");
    e.shape.push_back(static_cast<int64_t>(dim));
  }

  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2)
    fail(ctx, ": data_offsets must be an array of 2 integers, got ", off.dump());
  e.begin = non_negative_int(ctx, off[0], "data offset");
  e.end = non_negative_int(ctx, off[1], "data offset");
  if (e.begin > e.end) fail(ctx, ": data_offsets begin ", e.begin, " > end ", e.end);
  const u128 expect = numel * dtype_size(e.dtype);
  if (expect != e.end - e.begin)
    fail(ctx, ": byte length mismatch: data_offsets [", e.begin, ", ", e.end, "] hold ",
         e.end - e.begin, " bytes but ", dtype_name(e.dtype), " ", shape_str(e.shape), " needs ",
         static_cast<uint64_t>(expect));
  return e;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& v) {
  const std::string ctx = "safetensors " + path + ": __metadata__";
  if (!v.is_object()) fail(ctx, " must be an object of strings, got ", v.type_name());
  std::map<std::string, std::string> out;
  for (const auto& [key, val] : v.items()) {
    if (!val.is_string())
      fail(ctx, " value for \"", key, "\" must be a string, got ", val.type_name());
    out[key] = val.get<std::string>();
  }
  return out;
}

}  // namespace

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd.fd < 0) fail("safetensors ", path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail("safetensors ", path, ": cannot stat: ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("safetensors ", path, ": not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8)
    fail("safetensors ", path, ": truncated: file is ", file_size,
         " bytes, shorter than the 8-byte header length");

  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (f->map_ == MAP_FAILED) {
    f->map_ = nullptr;
    fail("safetensors ", path, ": mmap failed: ", std::strerror(errno));
  }
  f->map_size_ = file_size;
  const uint8_t* base = static_cast<const uint8_t*>(f->map_);  // [file_size] bytes

  uint64_t n = 0;  // little-endian u64 header length
  for (int i = 7; i >= 0; --i) n = (n << 8) | base[i];
  if (n > kMaxHeaderBytes)
    fail("safetensors ", path, ": header length ", n, " is unreasonably large (> ", kMaxHeaderBytes,
         " bytes)");
  if (8 + n > file_size)
    fail("safetensors ", path, ": truncated: header length ", n, " exceeds the file size ",
         file_size);
  const char* hdr = reinterpret_cast<const char*>(base + 8);  // [n] bytes of JSON
  const json j = parse_header_json(path, hdr, hdr + n);
  if (!j.is_object())
    fail("safetensors ", path, ": header must be a JSON object, got ", j.type_name());

  const uint64_t data_size = file_size - 8 - n;
  const uint8_t* data = base + 8 + n;  // [data_size] bytes: the data section
  std::vector<Entry> entries;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      f->metadata_ = parse_metadata(path, v);
      continue;
    }
    Entry e = parse_entry(path, name, v);
    if (e.end > data_size)
      fail("safetensors ", path, ": tensor \"", name, "\": truncated: data section too short (",
           "data_offsets end ", e.end, " > data section size ", data_size, ")");
    entries.push_back(std::move(e));
  }

  // File order; ties (zero-byte tensors) broken by name so names() is deterministic.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  // Gaps and trailing bytes are tolerated (harmless to a reader); overlaps are not.
  // Zero-byte tensors occupy nothing and cannot overlap.
  const Entry* last = nullptr;
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (last && e.begin < last->end)
      fail("safetensors ", path, ": tensors \"", last->name, "\" [", last->begin, ", ", last->end,
           ") and \"", e.name, "\" [", e.begin, ", ", e.end, ") overlap");
    last = &e;
  }

  for (Entry& e : entries) {
    TensorView t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = std::move(e.shape);
    t.data = data + e.begin;  // [shape] dtype, row-major
    t.nbytes = static_cast<size_t>(e.end - e.begin);
    f->names_.push_back(e.name);
    f->tensors_.emplace(e.name, std::move(t));
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorView& SafetensorsFile::tensor(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail("tensor ", name, " not found in ", path_);
  return it->second;
}

}  // namespace k3
