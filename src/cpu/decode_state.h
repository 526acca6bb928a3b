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
  void load(float* out) const;      // out[size()]
  void store(const float* in);      // in[size()], rounded to dtype
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
  std::vector<uint16_t> latent;      // [T][kv_lora + rope] bf16: normed c, then raw k_pe
  std::vector<uint8_t> index_keys;   // [T][index_head_dim] fp8 e4m3 (DSA only)
  std::vector<float> index_scales;   // [T][index_head_dim / 128 (at least 1)] fp32 (DSA only)
};

struct DecodeState {
  int64_t position = 0;                // tokens consumed so far
  std::vector<KdaLayerState> kda;      // [num_hidden_layers]; empty buffers on MLA layers
  std::vector<MlaLayerState> mla;      // [num_hidden_layers]; empty on KDA layers

  // Back to an empty context, keeping the allocations (a slot reused by a new request).
  void reset();
};

struct KdaStateDtypes {
  DType conv = DType::BF16;
  DType recurrent = DType::F32;
};

DecodeState make_decode_state(const ModelConfig& cfg, const KdaStateDtypes& dtypes);

// Index-key scale blocks per token: one fp32 scale per 128 values (at least one block).
inline int64_t index_scale_blocks(int64_t head_dim) { return (head_dim + 127) / 128; }

}  // namespace k3::cpu
