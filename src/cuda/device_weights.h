// The model's weights on the GPU, by role, as the stock decode step reads them: every matrix
// copied from the checkpoint in its own format (bf16, MXFP4 packed + E8M0 scales, or fp32),
// small vectors as fp32, and per MoE layer the device arrays of expert pointers the grouped
// GEMMs index with expert ids that live in device memory.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device_buffer.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3::cuda {

// One weight matrix [rows, cols] on the device (PyTorch Linear layout: rows = out features).
struct DevMatrix {
  WeightFormat format = WeightFormat::BF16;  // BF16, MXFP4 or F32 (F16 is converted to bf16)
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;       // BF16: [rows, cols] bf16; F32: [rows, cols] fp32;
                                    // MXFP4: [rows, cols/2] u8 packed
  const uint8_t* scales = nullptr;  // MXFP4: [rows, cols/32] u8 E8M0
  bool empty() const { return data == nullptr; }
  const __nv_bfloat16* bf16() const { return static_cast<const __nv_bfloat16*>(data); }
};

// y[M, rows] = x[M, cols] . W^T for any format; bf16 or fp32 (y_fp32) output.
// x: [M, cols] bf16, row stride ldx; y: row stride ldy (device).
void linear(const DevMatrix& w, const __nv_bfloat16* x, int64_t ldx, int64_t M, void* y,
            int64_t ldy, bool y_fp32, cudaStream_t stream);

struct DevKda {
  DevMatrix q_proj, k_proj, v_proj, f_a, f_b, b_proj, g_proj, g_a, g_b, o_proj;
  const float* conv = nullptr;     // [3][P][kernel] fp32
  const float* dt_bias = nullptr;  // [P] fp32
  const float* a_log = nullptr;    // [heads] fp32
  const float* o_norm = nullptr;   // [head_dim] fp32
};

struct DevDsa {
  DevMatrix wq_b, wk, weights_proj;
  const float* k_norm_w = nullptr;  // [index_head_dim] fp32
  const float* k_norm_b = nullptr;  // [index_head_dim] fp32, null for RMSNorm keys
};

struct DevMla {
  DevMatrix q_a, q_b, q_proj, kv_a, kv_b, g_proj, o_proj;
  const float* q_a_norm = nullptr;   // [q_lora] fp32 (null without q LoRA)
  const float* kv_a_norm = nullptr;  // [kv_lora] fp32
  bool has_indexer = false;
  DevDsa indexer;
};

struct DevMoe {
  DevMatrix gate;                      // router [E, H]
  const float* score_bias = nullptr;   // [E] fp32 or null
  DevMatrix latent_down, latent_up;    // [L, H], [H, L] (empty without latent MoE)
  const float* latent_norm = nullptr;  // [L] fp32 or null
  DevMatrix shared_gate, shared_up, shared_down;
  WeightFormat expert_format = WeightFormat::MXFP4;  // MXFP4 or BF16 (all experts alike)
  int64_t inter = 0, io = 0;                         // expert [inter, io] / [io, inter]
  // Device arrays [E] of expert matrix pointers (data / scales) for w1, w3, w2.
  const void* const* w1 = nullptr;
  const void* const* w3 = nullptr;
  const void* const* w2 = nullptr;
  const uint8_t* const* w1_scales = nullptr;
  const uint8_t* const* w3_scales = nullptr;
  const uint8_t* const* w2_scales = nullptr;
};

struct DevDense {
  DevMatrix gate, up, down;
};

struct DevLayer {
  LayerKind kind = LayerKind::KDA;
  bool moe = false;
  const float* input_norm = nullptr;      // [H] fp32
  const float* post_attn_norm = nullptr;  // [H] fp32
  const float* attn_res_attn = nullptr;   // [H] fp32 or null
  const float* attn_res_mlp = nullptr;    // [H] fp32 or null
  DevKda kda;
  DevMla mla;
  DevMoe moe_w;
  DevDense dense;
};

class DeviceWeights {
 public:
  // Uploads every tensor (synchronous). Raises k3::Error for formats the GPU path cannot read.
  DeviceWeights(const ModelConfig& cfg, const ModelWeights& w);
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  DevMatrix embed, lm_head;                // [V, H] bf16
  const float* final_norm = nullptr;       // [H] fp32
  const float* output_attn_res = nullptr;  // [H] fp32 or null
  std::vector<DevLayer> layers;
  uint64_t bytes() const { return bytes_; }  // device bytes held

 private:
  DevMatrix upload(const WeightMatrix& m);                  // empty stays empty
  const float* upload_floats(const std::vector<float>& v);  // null when v is empty
  template <typename T>
  const T* keep(std::vector<T> host);

  std::vector<std::shared_ptr<void>> owned_;
  uint64_t bytes_ = 0;
};

}  // namespace k3::cuda
