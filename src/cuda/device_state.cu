#include "cuda/device_state.h"

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace k3::cuda {

SlotPool::SlotPool(const ModelConfig& cfg, const SlotPoolShape& shape) : shape_(shape) {
  K3_CHECK(shape.slots >= 1, "slot pool needs at least one slot, got ", shape.slots);
  K3_CHECK(shape.max_context >= 1, "slot pool needs a context of at least one token");
  K3_CHECK(shape.page_size >= 1, "page size must be >= 1, got ", shape.page_size);
  K3_CHECK(shape.latent != cpu::LatentFormat::F32,
           "the CUDA latent cache holds bf16 or a packed kv_cache_dtype, not float32");
  K3_CHECK(shape.recurrent == DType::F32 || shape.recurrent == DType::BF16,
           "the CUDA KDA kernel keeps its recurrent state in float32 or bfloat16, not ",
           dtype_name(shape.recurrent));
  K3_CHECK(shape.cache_shards >= 1, "cache_shards must be >= 1, got ", shape.cache_shards);
  pages_per_slot_ =
      static_cast<int>((shape.cached_tokens() + shape.page_size - 1) / shape.page_size);
  const size_t S = static_cast<size_t>(shape.slots);
  const size_t pages = S * static_cast<size_t>(pages_per_slot_);
  const size_t page = static_cast<size_t>(shape.page_size);

  positions_ = DeviceBuffer<int32_t>(S);
  positions_.fill_bytes(0);
  std::vector<int32_t> table(pages);
  for (size_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(i);
  block_table_ = to_device<int32_t>(table);

  const auto& la = cfg.linear_attn_config;
  const size_t P = static_cast<size_t>(cfg.kda_proj_dim());
  const size_t D = static_cast<size_t>(la.head_dim);
  conv_per_slot_ = 3 * P * static_cast<size_t>(la.short_conv_kernel_size - 1);
  recurrent_bytes_per_slot_ =
      static_cast<size_t>(la.num_heads) * D * D * dtype_size(shape.recurrent);
  const size_t latent_w = static_cast<size_t>(cfg.kv_lora_rank + cfg.qk_rope_head_dim);
  const size_t hd = static_cast<size_t>(cfg.dsa_config.index_head_dim);
  const size_t blocks = (hd + 127) / 128;  // one fp32 scale per 128 values

  const int n = cfg.num_hidden_layers;
  conv_.resize(static_cast<size_t>(n));
  recurrent_.resize(static_cast<size_t>(n));
  latent_.resize(static_cast<size_t>(n));
  packed_.resize(static_cast<size_t>(n));
  const bool packed = shape.latent != cpu::LatentFormat::BF16;
  const size_t entry =
      packed ? cpu::latent_entry_bytes(shape.latent, cfg.kv_lora_rank, cfg.qk_rope_head_dim) : 0;
  bool any_mla = false;
  index_keys_.resize(static_cast<size_t>(n));
  index_scales_.resize(static_cast<size_t>(n));
  for (int l = 0; l < n; ++l) {
    const size_t i = static_cast<size_t>(l);
    if (cfg.layer_kind(l) == LayerKind::KDA) {
      conv_[i] = DeviceBuffer<__nv_bfloat16>(S * conv_per_slot_);
      recurrent_[i] = DeviceBuffer<uint8_t>(S * recurrent_bytes_per_slot_);
      conv_[i].fill_bytes(0);
      recurrent_[i].fill_bytes(0);
      bytes_ += conv_[i].bytes() + recurrent_[i].bytes();
    } else {
      any_mla = true;
      if (packed) {
        packed_[i] = DeviceBuffer<uint8_t>(pages * page * entry);
        bytes_ += packed_[i].bytes();
      } else {
        latent_[i] = DeviceBuffer<__nv_bfloat16>(pages * page * latent_w);
        bytes_ += latent_[i].bytes();
      }
      if (cfg.dsa_config.enabled) {
        index_keys_[i] = DeviceBuffer<uint8_t>(pages * page * hd);
        index_scales_[i] = DeviceBuffer<float>(pages * page * blocks);
        bytes_ += index_keys_[i].bytes() + index_scales_[i].bytes();
      }
    }
  }
  if (packed && any_mla) {
    scratch_ = DeviceBuffer<__nv_bfloat16>(pages * page * latent_w);
    bytes_ += scratch_.bytes();
  }
  K3_CUDA_CHECK(cudaDeviceSynchronize());
}

void SlotPool::reset(int slot, cudaStream_t stream) {
  K3_CHECK(slot >= 0 && slot < shape_.slots, "slot ", slot, " outside the pool of ", shape_.slots);
  const size_t s = static_cast<size_t>(slot);
  for (size_t l = 0; l < conv_.size(); ++l) {
    if (conv_[l].empty()) continue;
    K3_CUDA_CHECK(cudaMemsetAsync(conv_[l].data() + s * conv_per_slot_, 0,
                                  conv_per_slot_ * sizeof(__nv_bfloat16), stream));
    K3_CUDA_CHECK(cudaMemsetAsync(recurrent_[l].data() + s * recurrent_bytes_per_slot_, 0,
                                  recurrent_bytes_per_slot_, stream));
  }
  K3_CUDA_CHECK(cudaMemsetAsync(positions_.data() + s, 0, sizeof(int32_t), stream));
}

void SlotPool::reserve_snapshots(int n) {
  if (n <= snapshots_) return;
  const size_t S = static_cast<size_t>(shape_.slots), N = static_cast<size_t>(n);
  conv_snap_.resize(conv_.size());
  recurrent_snap_.resize(recurrent_.size());
  for (size_t l = 0; l < conv_.size(); ++l) {
    if (conv_[l].empty()) continue;
    conv_snap_[l] = DeviceBuffer<__nv_bfloat16>(N * S * conv_per_slot_);
    recurrent_snap_[l] = DeviceBuffer<uint8_t>(N * S * recurrent_bytes_per_slot_);
  }
  snapshots_ = n;
}

void SlotPool::save_kda(int slot, int index, cudaStream_t stream) {
  K3_CHECK(slot >= 0 && slot < shape_.slots && index >= 0 && index < snapshots_, "save_kda: slot ",
           slot, " snapshot ", index, " (", snapshots_, " reserved)");
  const size_t s = static_cast<size_t>(slot), i = static_cast<size_t>(index) * shape_.slots + s;
  for (size_t l = 0; l < conv_.size(); ++l) {
    if (conv_[l].empty()) continue;
    K3_CUDA_CHECK(cudaMemcpyAsync(
        conv_snap_[l].data() + i * conv_per_slot_, conv_[l].data() + s * conv_per_slot_,
        conv_per_slot_ * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, stream));
    K3_CUDA_CHECK(cudaMemcpyAsync(recurrent_snap_[l].data() + i * recurrent_bytes_per_slot_,
                                  recurrent_[l].data() + s * recurrent_bytes_per_slot_,
                                  recurrent_bytes_per_slot_, cudaMemcpyDeviceToDevice, stream));
  }
}

void SlotPool::restore_kda(int slot, int index, cudaStream_t stream) {
  K3_CHECK(slot >= 0 && slot < shape_.slots && index >= 0 && index < snapshots_,
           "restore_kda: slot ", slot, " snapshot ", index, " (", snapshots_, " reserved)");
  const size_t s = static_cast<size_t>(slot), i = static_cast<size_t>(index) * shape_.slots + s;
  for (size_t l = 0; l < conv_.size(); ++l) {
    if (conv_[l].empty()) continue;
    K3_CUDA_CHECK(cudaMemcpyAsync(
        conv_[l].data() + s * conv_per_slot_, conv_snap_[l].data() + i * conv_per_slot_,
        conv_per_slot_ * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, stream));
    K3_CUDA_CHECK(cudaMemcpyAsync(recurrent_[l].data() + s * recurrent_bytes_per_slot_,
                                  recurrent_snap_[l].data() + i * recurrent_bytes_per_slot_,
                                  recurrent_bytes_per_slot_, cudaMemcpyDeviceToDevice, stream));
  }
}

void SlotPool::set_position(int slot, int64_t position, cudaStream_t stream) {
  K3_CHECK(slot >= 0 && slot < shape_.slots, "slot ", slot, " outside the pool");
  K3_CHECK(position >= 0 && position <= shape_.max_context, "position ", position,
           " outside the context of ", shape_.max_context);
  const int32_t pos = static_cast<int32_t>(position);
  K3_CUDA_CHECK(
      cudaMemcpyAsync(positions_.data() + slot, &pos, sizeof(pos), cudaMemcpyHostToDevice, stream));
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));  // `pos` is a host local
}

namespace {

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// n values from index `first` on: bf16 in [-1, 1) (or e4m3 bytes in [-1, 1) when e4m3).
__global__ void fill_pattern_kernel(void* dst, int64_t first, int64_t n, bool e4m3) {
  K3_PDL_ENTRY();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(static_cast<uint64_t>(first + i));
    const float v = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    if (e4m3) {
      // e4m3 with exponent bias 7: sign | 0110 | mmm is in [0.5, 1): magnitudes below 1.
      static_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(((h & 1u) << 7) | 0x30u | (h >> 29));
    } else {
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16(v);
    }
  }
}

__global__ void fill_value_kernel(float* dst, int64_t n, float v) {
  K3_PDL_ENTRY();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = v;
}

}  // namespace

void SlotPool::fill_synthetic(int slot, int64_t tokens, cudaStream_t stream) {
  K3_CHECK(slot >= 0 && slot < shape_.slots, "slot ", slot, " outside the pool");
  K3_CHECK(tokens >= 0 && tokens < shape_.max_context, "fill_synthetic: ", tokens,
           " tokens do not fit a context of ", shape_.max_context);
  K3_CHECK(shape_.latent == cpu::LatentFormat::BF16 && shape_.cache_shards == 1,
           "fill_synthetic: benchmarks fill whole (not context-parallel) bf16 latent caches only");
  // Slot s's pages are contiguous (static block table), so its first `tokens` entries are too.
  const int64_t first_token = static_cast<int64_t>(slot) * pages_per_slot_ * shape_.page_size;
  for (size_t l = 0; l < latent_.size(); ++l) {
    if (!latent_[l].empty()) {
      const int64_t w = static_cast<int64_t>(latent_[l].size()) /
                        (static_cast<int64_t>(shape_.slots) * pages_per_slot_ * shape_.page_size);
      fill_pattern_kernel<<<1024, 256, 0, stream>>>(latent_[l].data() + first_token * w,
                                                    first_token * w, tokens * w, false);
      K3_CUDA_CHECK_LAUNCH();
    }
    if (!index_keys_[l].empty()) {
      const int64_t per_tok =
          static_cast<int64_t>(index_keys_[l].size()) /
          (static_cast<int64_t>(shape_.slots) * pages_per_slot_ * shape_.page_size);
      const int64_t blocks =
          static_cast<int64_t>(index_scales_[l].size()) /
          (static_cast<int64_t>(shape_.slots) * pages_per_slot_ * shape_.page_size);
      fill_pattern_kernel<<<1024, 256, 0, stream>>>(index_keys_[l].data() + first_token * per_tok,
                                                    first_token * per_tok, tokens * per_tok, true);
      K3_CUDA_CHECK_LAUNCH();
      fill_value_kernel<<<256, 256, 0, stream>>>(index_scales_[l].data() + first_token * blocks,
                                                 tokens * blocks, 1.0f);
      K3_CUDA_CHECK_LAUNCH();
    }
  }
  const int32_t pos = static_cast<int32_t>(tokens);
  K3_CUDA_CHECK(
      cudaMemcpyAsync(positions_.data() + slot, &pos, sizeof(pos), cudaMemcpyHostToDevice, stream));
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));  // `pos` is a host local
}

namespace {

// Rows of one slot are consecutive (a run): row r is token r - first of its run.
__device__ __forceinline__ int32_t offset_in_run(const int32_t* slot_of_row, int64_t r) {
  int32_t off = 0;
  while (r - off > 0 && slot_of_row[r - off - 1] == slot_of_row[r]) ++off;
  return off;
}

__global__ void prepare_rows_kernel(const int32_t* slot_of_row, int64_t rows,
                                    const int32_t* positions, const int32_t* table,
                                    int pages_per_slot, int32_t* position, int32_t* seq_len,
                                    int32_t* row_table) {
  K3_PDL_ENTRY();
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  const int32_t slot = slot_of_row[r];
  if (threadIdx.x == 0) {
    const int32_t p = positions[slot] + offset_in_run(slot_of_row, r);
    position[r] = p;
    seq_len[r] = p + 1;
  }
  for (int j = threadIdx.x; j < pages_per_slot; j += blockDim.x)
    row_table[r * pages_per_slot + j] = table[static_cast<int64_t>(slot) * pages_per_slot + j];
}

// The last row of each run moves its slot past the run (one writer per slot).
__global__ void advance_rows_kernel(const int32_t* slot_of_row, int64_t rows, int32_t* positions) {
  K3_PDL_ENTRY();
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows || (r + 1 < rows && slot_of_row[r + 1] == slot_of_row[r])) return;
  positions[slot_of_row[r]] += offset_in_run(slot_of_row, r) + 1;
}

}  // namespace

void prepare_rows(const int32_t* slot_of_row, int64_t rows, const int32_t* positions,
                  const int32_t* table, int pages_per_slot, int32_t* position, int32_t* seq_len,
                  int32_t* row_table, cudaStream_t stream) {
  if (rows <= 0) return;
  prepare_rows_kernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      slot_of_row, rows, positions, table, pages_per_slot, position, seq_len, row_table);
  K3_CUDA_CHECK_LAUNCH();
}

void advance_rows(const int32_t* slot_of_row, int64_t rows, int32_t* positions,
                  cudaStream_t stream) {
  if (rows <= 0) return;
  advance_rows_kernel<<<static_cast<unsigned>((rows + 127) / 128), 128, 0, stream>>>(
      slot_of_row, rows, positions);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
