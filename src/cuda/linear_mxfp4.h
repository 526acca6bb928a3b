// The skinny decode GEMM with an MXFP4 weight (compressed-tensors: packed [N, K/2] u8, element
// 2k in the low nibble, E2M1 magnitudes {0,.5,1,1.5,2,3,4,6} with sign bit 3; scales [N, K/32]
// u8 E8M0 = 2^(s-127)). Dequantized in the kernel to exact bf16 (Hopper has no FP4 mma), fp32
// accumulation. Bytes: N*K/2 + N*K/32 of weight + M*K*2 + M*N*{2,4}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/glu.h"
#include "cuda/linear_plan.h"

namespace k3::cuda {

// x: [M, K] bf16, row stride ldx (device); w_packed: [N, K/2] u8; w_scales: [N, K/32] u8
// y: [M, N] bf16 or fp32 (y_fp32), row stride ldy (device)
// K % 32 == 0. The tiled kernel needs K % 256 == 0, ldx % 8 == 0, 16-byte aligned x and
// w_packed and 8-byte aligned w_scales; anything else takes a slow generic kernel.
void linear_mxfp4(const __nv_bfloat16* x, int64_t ldx, const uint8_t* w_packed,
                  const uint8_t* w_scales, int64_t M, int64_t N, int64_t K, void* y, int64_t ldy,
                  bool y_fp32, cudaStream_t stream);

// Grouped (MoE) form: every slot multiplies a run of gathered rows by one expert, the expert
// ids and row ranges read from device memory (nothing data-dependent on the host):
//   for s < n_slots with e = slot_expert[s] >= 0, for r in [slot_offsets[s], slot_offsets[s+1]):
//     y[r, :] = W_e . x[row_index ? row_index[r] : r, :]
// Rows of skipped slots (e < 0) are not written.
struct Mxfp4Grouped {
  const uint8_t* const* packed = nullptr;  // device [n_experts] -> [N, K/2] u8 (16-B aligned)
  const uint8_t* const* scales = nullptr;  // device [n_experts] -> [N, K/32] u8 (8-B aligned)
  const int32_t* slot_expert = nullptr;    // device [n_slots]
  const int32_t* slot_offsets = nullptr;   // device [n_slots + 1], non-decreasing
  const int32_t* row_index = nullptr;      // device [rows] or null
  int n_slots = 0;
  // Host bound on rows per slot (e.g. the batch size). <= 64 uses the tiled kernel, which
  // computes at most this many rows of a slot; larger bounds take the generic kernel.
  int max_rows_per_slot = 1;
  // Slots expected to hold rows, for the tiling (LinearPlan::active_groups); 0: all.
  int expected_active = 0;
  // The slot arrays were complete before the kernel ahead of this launch began its work (an
  // earlier grouped launch of the same grouping ran before it): under a programmatic edge the
  // kernel then reads them and streams its first weights before waiting on that kernel.
  bool slots_ready = false;
};
// x: [*, K] bf16, row stride ldx; y: [rows, N], row stride ldy (device). The expert pointers
// are not checked on the host: they must meet the alignment above.
void linear_mxfp4_grouped(const Mxfp4Grouped& g, const __nv_bfloat16* x, int64_t ldx, int64_t N,
                          int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream);

// The same GEMM on x = bf16(glu(g, u)), the activation applied while the kernel stages x (so
// the expert down-projection needs no separate GLU launch; same bits as cuda::glu then the
// GEMM): g at gu[row * ld_gu + k] and u at gu[row * ld_gu + up + k], fp32 (device). Tiled
// kernel only: grouped_glu_supported says whether these operands qualify.
bool grouped_glu_supported(const Mxfp4Grouped& g, int64_t K, const float* gu, int64_t ld_gu,
                           int64_t up);
void linear_mxfp4_grouped_glu(const Mxfp4Grouped& g, const float* gu, int64_t ld_gu, int64_t up,
                              const GluAct& act, int64_t N, int64_t K, void* y, int64_t ldy,
                              bool y_fp32, cudaStream_t stream);

// Plans (cached) and candidates, as for linear_bf16; groups = slots (1 for the dense form).
LinearPlan plan_linear_mxfp4(int m, int64_t n, int64_t k, int groups = 1);
std::vector<LinearPlan> linear_mxfp4_candidates(int m, int64_t n, int64_t k, int groups = 1);
// The clusters of tiled plan p's kernel the device holds at once with ctas_per_sm of its CTAs to
// an SM (the planner's LinearClusterFit; 0: unknown or no clusters).
int linear_mxfp4_cluster_fit(const LinearPlan& p, int ctas_per_sm);
// One dense launch (M <= 64) under an explicit plan. stamps: null, or (profiling, a tiled plan)
// [p.grid_x()][kSkinnyStamps] int64 device buffer for the kernel's phase stamps (linear_plan.h).
void linear_mxfp4(const LinearPlan& p, const __nv_bfloat16* x, int64_t ldx, const uint8_t* w_packed,
                  const uint8_t* w_scales, int64_t M, void* y, int64_t ldy, bool y_fp32,
                  cudaStream_t stream, long long* stamps = nullptr);
// One grouped launch under an explicit plan (p.groups == g.n_slots, p.m >= rows per slot).
void linear_mxfp4_grouped(const LinearPlan& p, const Mxfp4Grouped& g, const __nv_bfloat16* x,
                          int64_t ldx, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream);

}  // namespace k3::cuda
