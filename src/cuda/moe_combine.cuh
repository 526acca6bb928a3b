// The MoE combine (+ latent RMSNorm) of one row, as device pieces shared by the combine kernel
// (step_ops.cu: moe_combine) and the bf16 GEMV that computes it while staging its input
// (gemv_bf16.cu: linear_bf16_combined). Both evaluate the same expressions in the same order
// over the same decomposition (kCombineThreads virtual threads of 8 columns each, their sums of
// squares reduced as block_sum reduces a CTA of kCombineThreads), so they give the same bits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/device_util.cuh"

namespace k3::cuda::detail {

constexpr int kCombineThreads = 512;  // 8 columns per (virtual) thread: one pass covers 4096
constexpr int kCombineMaxK = 64;

// acc[e] = sum_j w[j] * y[row_j][c + e] for 8 columns (ascending j, multiply and add rounded
// separately as on the CPU: no fused multiply-add); rows_s[j] < 0 (experts held by other
// ranks) left out. y: [*, width] bf16, written by an earlier kernel (plain loads: PDL-safe).
__device__ __forceinline__ void combine8(const __nv_bfloat16* y, const int32_t* rows_s,
                                         const float* w_s, int top_k, int64_t width, int64_t c,
                                         bool vec, float (&acc)[8]) {
  const int nv = static_cast<int>(width - c < 8 ? width - c : 8);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
#pragma unroll 4
  for (int j = 0; j < top_k; ++j) {
    if (rows_s[j] < 0) continue;  // another rank's expert (uniform over the CTA: no divergence)
    float v[8];
    load_bf16x8(y + static_cast<int64_t>(rows_s[j]) * width + c, vec && nv == 8, nv, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w_s[j], v[e]));
  }
}

// One thread's share of the sum of squares (columns past the width hold 0).
__device__ __forceinline__ float combine_sum_sq8(const float (&a)[8]) {
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) ss = __fmaf_rn(a[e], a[e], ss);
  return ss;
}

// 1 / rms of the row from its complete sum of squares.
__device__ __forceinline__ float combine_inv_rms(float ss, int64_t width, float eps) {
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(width)), eps)));
}

// a[e] = a[e] * inv * nw[e] (each product rounded).
__device__ __forceinline__ void combine_scale8(float (&a)[8], float inv, const float (&nw)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) a[e] = __fmul_rn(__fmul_rn(a[e], inv), nw[e]);
}

}  // namespace k3::cuda::detail
