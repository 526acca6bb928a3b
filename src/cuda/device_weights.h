// The model's weights on the GPU, by role, as the stock decode step reads them: every matrix
// copied from the checkpoint in its own format (bf16, MXFP4 packed + E8M0 scales, or fp32),
// small vectors as fp32, and per MoE layer the device arrays of expert pointers the grouped
// GEMMs index with expert ids that live in device memory.
// Matrices that read the same input are stored contiguously where the format allows (one
// allocation, rows concatenated), so a fused GEMM can read them as one matrix: the per-matrix
// fields are views into that memory, nothing is stored twice.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/linear_bf16.h"
#include "cuda/moe_dispatch.h"
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
// The same with bf16 y and residual adds in the store (linear_bf16.h LinearEpilogue; bf16
// weights, or any format when epi is empty).
void linear(const DevMatrix& w, const __nv_bfloat16* x, int64_t ldx, int64_t M, __nv_bfloat16* y,
            int64_t ldy, const LinearEpilogue& epi, cudaStream_t stream);

// Several matrices [rows_i, cols] in one device allocation, rows concatenated in order.
// combined: [sum rows_i, cols], empty when the members had to be uploaded apart (see
// can_concat); parts: one view per member (an empty member gives an empty view).
struct DevConcat {
  DevMatrix combined;
  std::vector<DevMatrix> parts;
};

// Whether `ms` can share one allocation: all non-empty, one format (BF16 or MXFP4), one column
// count, and every member's start keeps the kernels' alignment (bf16 and MXFP4 packed views
// 16-byte aligned, MXFP4 scale views 8-byte aligned). Host-only; reads no matrix data.
bool can_concat(const std::vector<const WeightMatrix*>& ms);

// Row offsets of the parts of DevKda::in_proj, every projection that reads the normed x:
// in_proj = [q_proj; k_proj; v_proj; g; f_a; b_proj], g = g_proj (full-rank output gate) or
// g_a (LoRA gate, when g_proj is empty). For y = x . in_proj^T ([rows][n], row stride n) each
// part's outputs start at its offset: q at y + q (P columns), k at y + k, v at y + v (adjacent:
// the [3][P] u of kda_decode_step), the gate at y + g (P, or the LoRA rank), f_a at y + fa,
// beta logits at y + b (heads). All zero when in_proj is empty.
struct KdaInProjLayout {
  int64_t q = 0, k = 0, v = 0, g = 0, fa = 0, b = 0;  // first row of each part
  int64_t n = 0;                                      // total rows (= in_proj.rows)
  // Row stride of the projected activations: n rounded up to 8, so every row (and each part,
  // all at multiples of 8) is 16-byte aligned and the GEMMs reading a part (f_b, g_b) take the
  // tiled path.
  int64_t ld = 0;
};

struct DevKda {
  DevMatrix q_proj, k_proj, v_proj, f_a, f_b, b_proj, g_proj, g_a, g_b, o_proj;
  DevMatrix in_proj;               // [n, H] fused view over the members above (or empty)
  KdaInProjLayout in_layout;       // where each member sits in in_proj
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
  DevMatrix shared_gate_up;  // [2S, H] = [shared_gate; shared_up] (empty if not fused)
  WeightFormat expert_format = WeightFormat::MXFP4;  // MXFP4 or BF16 (all experts alike)
  int64_t inter = 0, io = 0;                         // expert [inter, io] / [io, inter]
  // The experts held here: global ids [local.begin, local.begin + local.count) of the router's
  // E (all E unless the weights are an expert-parallel rank's slice, the others left empty).
  LocalExperts local;
  // Device arrays [local.count] of expert matrix pointers (data / scales) for w1, w3, w2,
  // indexed by local id.
  const void* const* w1 = nullptr;
  const void* const* w3 = nullptr;
  const void* const* w2 = nullptr;
  const uint8_t* const* w1_scales = nullptr;
  const uint8_t* const* w3_scales = nullptr;
  const uint8_t* const* w2_scales = nullptr;
  // Device array [local.count]: expert e's [2*inter, io] matrix, rows [0, inter) = w1, [inter,
  // 2*inter) = w3 (MXFP4: packed [2*inter, io/2] and w13_scales[e] [2*inter, io/32], each
  // contiguous; BF16: [2*inter, io] bf16, w13_scales null). w13[e] == w1[e], w3[e] = w13[e] + inter
  // rows (the same tables: w13 aliases w1). Null when some expert's pair could not be fused.
  const void* const* w13 = nullptr;
  const uint8_t* const* w13_scales = nullptr;
};

struct DevDense {
  DevMatrix gate, up, down;
  DevMatrix gate_up;  // [2I, H] = [gate; up] (empty if not fused)
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
  DevMatrix upload(const WeightMatrix& m);  // empty stays empty
  DevConcat upload_concat(const std::vector<const WeightMatrix*>& ms);
  uint8_t* alloc_bytes(size_t n);                           // owned, counted in bytes_
  const float* upload_floats(const std::vector<float>& v);  // null when v is empty
  template <typename T>
  const T* keep(std::vector<T> host);

  std::vector<std::shared_ptr<void>> owned_;
  uint64_t bytes_ = 0;
};

}  // namespace k3::cuda
