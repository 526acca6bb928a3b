// Per-request decode state of the CPU reference: KDA recurrent and conv state in the dtypes
// chosen by kda_dtypes(), the MLA latent cache and the DSA index-key cache, all per layer.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "cpu/latent_format.h"
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
  // [T][kv_lora + rope]: normed c, then raw k_pe; each row round-tripped through
  // latent_format (cpu/latent_format.h) when appended, so it holds exactly what that cache holds.
  LatentFormat latent_format = LatentFormat::BF16;
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
  // Speculative decoding: drops the MLA latent / DSA index-key entries of every token at or
  // after `new_position` and rolls `position` back to it. KDA state cannot be rolled back this
  // way (it is a recurrence); restore a KdaSnapshot taken after token new_position - 1.
  void truncate(int64_t new_position);
};

// What one token changes in the KDA layers (recurrent + conv state of every KDA layer), taken
// after a verify row so that a partial acceptance commits it instead of recomputing.
struct KdaSnapshot {
  std::vector<KdaLayerState> kda;  // [num_hidden_layers], as DecodeState::kda
  static KdaSnapshot capture(const DecodeState& s) { return {s.kda}; }
  void capture_into(const DecodeState& s) { kda = s.kda; }  // reuses this snapshot's buffers
  void restore(DecodeState& s) const { s.kda = kda; }
};

// Storage dtypes of the decode state: KDA conv and recurrent state (from kda_dtypes()) and the
// MLA latent cache format (from the deploy kv_cache_dtype; F32 only for fp32 reference runs).
struct StateDtypes {
  DType conv = DType::BF16;
  DType recurrent = DType::F32;
  LatentFormat latent_format = LatentFormat::BF16;  // latent_format_of(kv_cache_dtype)
};

DecodeState make_decode_state(const ModelConfig& cfg, const StateDtypes& dtypes);
// v rounded to a state dtype (F32, BF16 or F16).
float round_to(DType t, float v);

// Index-key scale blocks per token: one fp32 scale per 128 values (at least one block).
inline int64_t index_scale_blocks(int64_t head_dim) {
  return (head_dim + 127) / 128;
}

}  // namespace k3::cpu
