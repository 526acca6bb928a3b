// Strict safetensors reader (mmap) and streaming writer. Knows nothing about models.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data section.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor_view.h"

namespace k3 {

// One mmap'd .safetensors file. Every entry is validated on open: dtype known, shape
// non-negative, data_offsets in bounds, byte length == numel * dtype size, entries
// non-overlapping (gaps and trailing bytes are tolerated), no duplicate names, __metadata__
// string -> string; any violation raises k3::Error naming the file and the tensor. Never
// crashes on malformed input.
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensor names in file order (by data offset).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws k3::Error when absent.
  const TensorView& tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Description of one tensor to write.
struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
  size_t nbytes() const { return static_cast<size_t>(k3::numel(shape)) * dtype_size(dtype); }
};

// Writes one file whose header is fixed up front; data is then streamed tensor by tensor in
// the given order, so multi-GB files never sit in memory. `fill(index, out, nbytes)` must write
// exactly the tensor's bytes. The file is written to path + ".tmp" and renamed on success.
void write_safetensors(const std::string& path, const std::vector<TensorSpec>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::function<void(size_t index, uint8_t* out, size_t nbytes)>& fill);

// A directory checkpoint: model.safetensors.index.json (weight_map name -> shard) with its
// shards, or a single model.safetensors. Validates that every shard named by the index exists
// and holds the tensors the index assigns to it.
class Checkpoint {
 public:
  static std::unique_ptr<Checkpoint> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // Throws k3::Error naming the tensor when absent.
  const TensorView& tensor(const std::string& name) const;
  const TensorView* find(const std::string& name) const;  // nullptr when absent
  uint64_t total_bytes() const;
  size_t num_shards() const { return shards_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const TensorView*> where_;
};

// Writes a sharded checkpoint into dir: shards "model-00001-of-0000N.safetensors" of at most
// max_shard_bytes each (a tensor larger than that gets a shard of its own) and
// model.safetensors.index.json with metadata.total_size. progress(n) is called with the
// bytes written as they go.
void write_sharded_checkpoint(
    const std::string& dir, const std::vector<TensorSpec>& tensors, uint64_t max_shard_bytes,
    const std::function<void(size_t index, uint8_t* out, size_t nbytes)>& fill,
    const std::function<void(uint64_t bytes)>& progress = {});

}  // namespace k3
