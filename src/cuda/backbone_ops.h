// Small pieces shared by the stock (backbone_layers.cu) and specialized (backbone_fused.cu)
// layer blocks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_weights.h"
#include "cuda/glu.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3::cuda {

// The FFN activation of the config (SiLU or SiTU with its betas) as the GLU kernel's form.
GluAct glu_act(const ModelConfig& cfg);

// A step's (row, choice) pairs grouped by local expert (moe_dispatch.h), as the grouped GEMMs
// read them: slot s multiplies the rows [offsets[s], offsets[s+1]) by expert slot_expert[s]
// (< 0: skipped), at most max_rows rows per slot; row_index[r]: the x row of grouped row r.
struct ExpertGroups {
  const int32_t* slot_expert = nullptr;  // [n_slots] device
  const int32_t* offsets = nullptr;      // [n_slots + 1] device
  const int32_t* row_index = nullptr;    // [pairs] device
  int n_slots = 0, max_rows = 0;
  int expected_active = 0;   // slots expected busy (the GEMM tiling's parallelism), 0: all
  bool slots_ready = false;  // Mxfp4Grouped::slots_ready (a launch after the first of a grouping)
};

// Expected distinct local experts `rows` rows touch (each picks top_k of E uniformly), as the
// grouped GEMMs' expected_active: local * (1 - (1 - top_k / E)^rows), rounded up, in [1, slots].
int expected_active_experts(int local, int E, int top_k, int64_t rows, int slots);

// A bf16 or MXFP4 expert GEMM over the groups. w / scales: device arrays [local experts] of
// expert matrix pointers ([N, K] in the format). x: [*, ldx] bf16, gathered through row_index
// when `gather` (else grouped row r reads x row r); y: [pairs, N] bf16 or fp32 (y_fp32), row
// stride N.
void expert_linear(WeightFormat fmt, const void* const* w, const uint8_t* const* scales,
                   const ExpertGroups& g, bool gather, const __nv_bfloat16* x, int64_t ldx,
                   int64_t N, int64_t K, void* y, bool y_fp32, cudaStream_t stream);

// The expert down-projection w2 on h = glu(g, u) computed inside the GEMM (linear_mxfp4.h):
// g at gu[row * ld_gu + i], u at up elements further (fp32, device); y [pairs, io] bf16, or fp32
// (y_fp32). Returns false, doing nothing, when the experts are not MXFP4 or the operands do not
// qualify.
bool expert_down_glu(const DevMoe& m, const ExpertGroups& g, const GluAct& act, const float* gu,
                     int64_t ld_gu, int64_t up, void* y, bool y_fp32, cudaStream_t stream);

}  // namespace k3::cuda
