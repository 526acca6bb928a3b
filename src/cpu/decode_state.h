// Per-request decode state of the CPU reference: KDA recurrent and conv state in the dtypes
// chosen by kda_dtypes(), the MLA latent cache and the DSA index-key cache, all per layer.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"

namespace k3::cpu {

// A float array kept in a storage dtype (F32 / BF16 / F16); values round on store, as the GPU
// state does.
class StateBuffer {
 public:
  StateBuffer() = default;
  StateBuffer(DType dtype, size_t n);
  DType dtype() const { return dtype_; }
  size_t size() const { return n_; }
  void load(float* out) const;  // out[size()]
  void store(const float* in);  // in[size()], rounded to dtype
  void zero();

 private:
  DType dtype_ = DType::F32;
  size_t n_ = 0;
  std::vector<uint8_t> bytes_;
};

struct KdaLayerState {
  StateBuffer recurrent;  // [heads][head_dim][head_dim], rows = key channel
  StateBuffer conv;       // [3 (q,k,v)][heads * head_dim][kernel - 1], oldest first
};

struct MlaLayerState {
  // [T][kv_lora + rope]: normed c, then raw k_pe; each value rounded to latent_dtype when
  // appended, so it holds exactly what a cache of that dtype holds.
  DType latent_dtype = DType::BF16;
  std::vector<float> latent;
  std::vector<uint8_t> index_keys;  // [T][index_head_dim] fp8 e4m3 (DSA only)
  std::vector<float> index_scales;  // [T][index_head_dim / 128 (at least 1)] fp32 (DSA only)
};

struct DecodeState {
  int64_t position = 0;            // tokens consumed so far
  std::vector<KdaLayerState> kda;  // [num_hidden_layers]; empty buffers on MLA layers
  std::vector<MlaLayerState> mla;  // [num_hidden_layers]; empty on KDA layers

  // Back to an empty context, keeping the allocations (a slot reused by a new request).
  void reset();
};

// Storage dtypes of the decode state: KDA conv and recurrent state (from kda_dtypes()) and the
// MLA latent cache (bf16 for kv_cache_dtype auto / bfloat16; F32 only for fp32 reference runs).
struct StateDtypes {
  DType conv = DType::BF16;
  DType recurrent = DType::F32;
  DType latent = DType::BF16;
};

DecodeState make_decode_state(const ModelConfig& cfg, const StateDtypes& dtypes);
// v rounded to a state dtype (F32, BF16 or F16).
float round_to(DType t, float v);

// Index-key scale blocks per token: one fp32 scale per 128 values (at least one block).
inline int64_t index_scale_blocks(int64_t head_dim) {
  return (head_dim + 127) / 128;
}

}  // namespace k3::cpu
