// Small pieces shared by the stock (backbone_layers.cu) and specialized (backbone_fused.cu)
// layer blocks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/glu.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3::cuda {

// The FFN activation of the config (SiLU or SiTU with its betas) as the GLU kernel's form.
GluAct glu_act(const ModelConfig& cfg);

// A bf16 or MXFP4 expert GEMM over expert-grouped rows: slot s multiplies the rows
// [offsets[s], offsets[s+1]) by expert slot_expert[s] (< 0: skipped), at most max_rows rows
// per slot. w / scales: device arrays [E] of expert matrix pointers ([N, K] in the format).
// x: [*, ldx] bf16 (row_index[r] picks the x row of grouped row r, or r when null);
// y: [rows, N] bf16 or fp32 (y_fp32), row stride N.
void expert_linear(WeightFormat fmt, const void* const* w, const uint8_t* const* scales,
                   const int32_t* slot_expert, const int32_t* offsets, const int32_t* row_index,
                   int n_slots, int max_rows, const __nv_bfloat16* x, int64_t ldx, int64_t N,
                   int64_t K, void* y, bool y_fp32, cudaStream_t stream);

}  // namespace k3::cuda
