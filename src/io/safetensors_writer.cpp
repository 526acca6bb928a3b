// Streaming safetensors writer and the sharded (HF-style) checkpoint writer. Files are written
// to "<path>.tmp" and renamed, so a crash never leaves a truncated file under the real name.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using FillFn = std::function<void(size_t index, uint8_t* out, size_t nbytes)>;
using AfterFn = std::function<void(size_t index, size_t nbytes)>;

// Byte size of a spec, refusing negative dimensions and sizes that overflow.
uint64_t checked_nbytes(const std::string& path, const TensorSpec& t) {
  unsigned __int128 n = dtype_size(t.dtype);
  for (int64_t d : t.shape) {
    if (d < 0) fail("write_safetensors ", path, ": tensor ", t.name, " has negative dim ", d);
    n *= static_cast<uint64_t>(d);
    if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail("write_safetensors ", path, ": tensor ", t.name, " ", shape_str(t.shape),
           " is too large");
  }
  return static_cast<uint64_t>(n);
}

// Owns the temporary file until commit(); on any exception it is closed and removed.
class TmpFile {
 public:
  explicit TmpFile(const std::string& path) : path_(path), tmp_(path + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("writing ", path_, ": cannot open ", tmp_, ": ", std::strerror(errno));
  }
  ~TmpFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write(const uint8_t* p, size_t n) {  // [n] bytes
    while (n > 0) {
      // Linux writes at most ~2 GiB per call; loop on partial writes.
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0)
        fail("writing ", path_, ": short write to ", tmp_, ": ",
             w < 0 ? std::strerror(errno) : "no progress");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) fail("writing ", path_, ": closing ", tmp_, ": ", std::strerror(errno));
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
      fail("writing ", path_, ": cannot rename ", tmp_, ": ", std::strerror(errno));
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

void write_file(const std::string& path, const std::vector<TensorSpec>& tensors,
                const std::map<std::string, std::string>& metadata, const FillFn& fill,
                const AfterFn& after) {
  // ordered_json keeps entries in the given order; the reference writer puts
  // __metadata__ first and pads the header with spaces to a multiple of 8.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty()) fail("write_safetensors ", path, ": empty tensor name");
    if (t.name == "__metadata__")
      fail("write_safetensors ", path, ": reserved tensor name __metadata__");
    if (!seen.insert(t.name).second)
      fail("write_safetensors ", path, ": duplicate tensor name ", t.name);
    const uint64_t n = checked_nbytes(path, t);
    nlohmann::ordered_json e;
    e["dtype"] = std::string(dtype_name(t.dtype));
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + n};
    header[t.name] = std::move(e);
    sizes.push_back(n);
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  TmpFile out(path);
  uint8_t len[8];  // little-endian u64 header length
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(len, 8);
  out.write(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  // One buffer, grown to the largest tensor seen so far and reused for the rest.
  std::vector<uint8_t> buf;  // [nbytes] raw bytes of the current tensor
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t n = static_cast<size_t>(sizes[i]);
    // At least one byte so `out` is never null, even for empty tensors (memcpy(null, ..., 0)
    // is undefined behaviour in the caller's fill).
    if (buf.size() < std::max<size_t>(n, 1)) buf.resize(std::max<size_t>(n, 1));
    fill(i, buf.data(), n);
    out.write(buf.data(), n);
    if (after) after(i, n);
  }
  out.commit();
}

std::string shard_name(size_t i, size_t count) {
  char s[64];
  std::snprintf(s, sizeof s, "model-%05zu-of-%05zu.safetensors", i + 1, count);
  return s;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorSpec>& tensors,
                       const std::map<std::string, std::string>& metadata, const FillFn& fill) {
  write_file(path, tensors, metadata, fill, {});
}

void write_sharded_checkpoint(const std::string& dir, const std::vector<TensorSpec>& tensors,
                              uint64_t max_shard_bytes, const FillFn& fill,
                              const std::function<void(uint64_t bytes)>& progress) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("write_sharded_checkpoint ", dir, ": cannot create directory: ", ec.message());
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  // A stale index would describe shards we are about to overwrite; remove it first so a
  // half-written checkpoint is never mistaken for a complete one.
  fs::remove(index_path, ec);

  // Greedy packing in the given order: start a new shard when the next tensor would push the
  // current one past the limit; an oversized tensor thus ends up alone.
  std::vector<std::vector<size_t>> shards;
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = checked_nbytes(dir, tensors[i]);
    if (shards.empty() || (in_shard > 0 && in_shard + n > max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += n;
    total += n;
  }

  nlohmann::json weight_map = nlohmann::json::object();
  std::set<std::string> seen;
  for (const TensorSpec& t : tensors)
    if (!seen.insert(t.name).second)
      fail("write_sharded_checkpoint ", dir, ": duplicate tensor name ", t.name);
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_name(s, shards.size());
    std::vector<TensorSpec> specs;
    for (size_t i : shards[s]) {
      specs.push_back(tensors[i]);
      weight_map[tensors[i].name] = name;
    }
    const std::vector<size_t>& idx = shards[s];
    write_file((fs::path(dir) / name).string(), specs, {},
               [&](size_t j, uint8_t* out, size_t n) { fill(idx[j], out, n); },
               [&](size_t, size_t n) {
                 if (progress) progress(n);
               });
  }

  nlohmann::json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = std::move(weight_map);
  const std::string text = index.dump(2) + "\n";
  TmpFile out(index_path.string());
  out.write(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  out.commit();
}

}  // namespace k3
