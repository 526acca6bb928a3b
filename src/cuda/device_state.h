// The decode state of every request slot on the GPU: per KDA layer the conv window and the
// recurrent state, per MLA layer a paged latent cache (and, for K3.1, the DSA index-key cache),
// and each slot's position. Pages are assigned statically (slot s owns pages
// [s * pages_per_slot, (s+1) * pages_per_slot)), so the block table never changes and a captured
// step stays valid; the kernels still read it through a block table, as a paged allocator would
// hand it to them. A slot is reset (zeroed KDA state, position 0) before a new request uses it,
// so no state leaks from one request into the next.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "cpu/latent_format.h"
#include "cuda/device_buffer.h"
#include "model/config.h"

namespace k3::cuda {

struct SlotPoolShape {
  int slots = 1;
  int64_t max_context = 0;                             // tokens per slot
  int page_size = 64;                                  // tokens per cache page
  DType recurrent = DType::F32;                        // KDA recurrent state: F32 or BF16
  cpu::LatentFormat latent = cpu::LatentFormat::BF16;  // kv_cache_dtype (BF16, FP8, *_DS_MLA)
  // Decode context parallelism: this rank caches every cache_shards-th token of a context
  // (token t at local index t / cache_shards on rank t % cache_shards), so its latent pages
  // cover ceil(max_context / cache_shards) tokens per slot.
  int cache_shards = 1;
  int64_t cached_tokens() const { return (max_context + cache_shards - 1) / cache_shards; }
};

class SlotPool {
 public:
  SlotPool(const ModelConfig& cfg, const SlotPoolShape& shape);

  int slots() const { return shape_.slots; }
  int page_size() const { return shape_.page_size; }
  int pages_per_slot() const { return pages_per_slot_; }  // pages of one slot's cached tokens
  int64_t max_context() const { return shape_.max_context; }
  DType recurrent_dtype() const { return shape_.recurrent; }

  // Zeroes slot s's KDA state and position (ordered on `stream`). Cache pages need no clearing:
  // attention reads only positions below the slot's length.
  void reset(int slot, cudaStream_t stream);

  // Benchmarks: makes slot s look `tokens` long without decoding them: its cache pages hold
  // deterministic pseudo-random bf16 latents (and fp8 index keys, unit scales) in [-1, 1) and
  // its position is `tokens`. KDA state is left as it is.
  void fill_synthetic(int slot, int64_t tokens, cudaStream_t stream);

  // Speculative verify: copies of a slot's KDA state (conv + recurrent, every KDA layer) after
  // a verify row's tokens, so an accepted prefix is committed by restoring one (no recompute).
  // reserve_snapshots(n) allocates n copies per slot (once; grows only); index < n.
  void reserve_snapshots(int n);
  void save_kda(int slot, int index, cudaStream_t stream);
  int snapshots() const { return snapshots_; }
  // Layer l's copies (null before reserve_snapshots): conv [snapshots][slots][3][P][K-1] bf16,
  // recurrent [snapshots][slots][h][D][D] in the recurrent dtype.
  __nv_bfloat16* conv_snapshots(int layer) {
    return snapshots_ ? conv_snap_[idx(layer)].data() : nullptr;
  }
  void* recurrent_snapshots(int layer) {
    return snapshots_ ? recurrent_snap_[idx(layer)].data() : nullptr;
  }
  void restore_kda(int slot, int index, cudaStream_t stream);
  // Sets slot s's position (ordered on `stream`; waits for the copy). Cache entries at or past
  // it are dead: attention reads positions below the length only, later tokens overwrite them.
  void set_position(int slot, int64_t position, cudaStream_t stream);

  int32_t* positions() { return positions_.data(); }  // [slots] int32: tokens consumed
  const int32_t* block_table() const { return block_table_.data(); }  // [slots][pages_per_slot]

  __nv_bfloat16* conv(int layer) { return conv_[idx(layer)].data(); }   // [slots][3][P][K-1] bf16
  void* recurrent(int layer) { return recurrent_[idx(layer)].data(); }  // [slots][h][D][D]
  cpu::LatentFormat latent_format() const { return shape_.latent; }
  // The bf16 latent cache attention reads, [pages][page][kv_lora + rope]: the layer's own cache
  // for BF16; for a packed format one scratch shared by every layer, which the step refills
  // from latent_packed(layer) before each layer's attention.
  __nv_bfloat16* latent(int layer) {
    return shape_.latent == cpu::LatentFormat::BF16 ? latent_[idx(layer)].data() : scratch_.data();
  }
  // Packed formats: the layer's cache, [pages][page][latent_entry_bytes] (null for BF16).
  uint8_t* latent_packed(int layer) { return packed_[idx(layer)].data(); }
  uint8_t* index_keys(int layer) { return index_keys_[idx(layer)].data(); }    // [pages][page][hd]
  float* index_scales(int layer) { return index_scales_[idx(layer)].data(); }  // [pages][page][b]
  uint64_t bytes() const { return bytes_; }

 private:
  size_t idx(int layer) const { return static_cast<size_t>(layer); }

  SlotPoolShape shape_;
  int pages_per_slot_ = 0;
  size_t conv_per_slot_ = 0, recurrent_bytes_per_slot_ = 0;
  DeviceBuffer<int32_t> positions_, block_table_;
  std::vector<DeviceBuffer<__nv_bfloat16>> conv_;
  std::vector<DeviceBuffer<uint8_t>> recurrent_;
  std::vector<DeviceBuffer<__nv_bfloat16>> latent_;
  std::vector<DeviceBuffer<uint8_t>> packed_;
  int snapshots_ = 0;
  std::vector<DeviceBuffer<__nv_bfloat16>> conv_snap_;  // per layer [snapshots][slots][conv]
  std::vector<DeviceBuffer<uint8_t>> recurrent_snap_;   // per layer [snapshots][slots][state]
  DeviceBuffer<__nv_bfloat16> scratch_;
  std::vector<DeviceBuffer<uint8_t>> index_keys_;
  std::vector<DeviceBuffer<float>> index_scales_;
  uint64_t bytes_ = 0;
};

// Per-row step values derived on the device from the rows' slots (nothing comes from the host
// but the slot ids, so a captured step replays with new rows). Rows of one slot are consecutive
// (a run: the request's next tokens in order); o[r] = r - (first row of r's run):
//   position[r] = positions[slot[r]] + o[r]   (the token index this row writes)
//   seq_len[r]  = position[r] + 1              (tokens attended, this one included)
//   row_table[r][j] = table[slot[r]][j]        ([rows][pages_per_slot])
void prepare_rows(const int32_t* slot_of_row, int64_t rows, const int32_t* positions,
                  const int32_t* table, int pages_per_slot, int32_t* position, int32_t* seq_len,
                  int32_t* row_table, cudaStream_t stream);
// positions[slot] += (rows of its run) for every run.
void advance_rows(const int32_t* slot_of_row, int64_t rows, int32_t* positions,
                  cudaStream_t stream);

}  // namespace k3::cuda
