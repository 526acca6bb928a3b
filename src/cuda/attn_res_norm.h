// AttnRes mix fused with the RMSNorm that follows it (the specialized decode step), per row r:
//   h = bf16(attn_res_mix(v_0..v_{n-1}))          (the same bits as cuda::attn_res_mix)
//   x = bf16(h * rsqrt(mean(h^2) + eps) * norm_w)  (cuda::rms_norm of h, on the rounded h)
// One kernel instead of two: the sources are read once and h never goes through memory.
// Matches cpu::attn_res_mix -> bf16 -> cpu::rms_norm -> bf16 up to the fp32 summation order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attn_res.h"

namespace k3::cuda {

// sources: n_sources (1..16) device pointers, each [rows, hidden] bf16, row stride row_stride
// score_w: [hidden] fp32 (device): the AttnRes norm.weight * proj.weight
// eps:     rms_norm_eps, used by both the score normalization and the output norm
// norm_w:  [hidden] fp32 (device), the following RMSNorm's weight, or null for no scale
// x_out:   [rows, hidden] bf16, row stride x_stride (device)
// h_out:   [rows, hidden] bf16, row stride h_stride (device), the intermediate mix, or null
// x_out / h_out may alias a source with the same row stride (each element is read by the
// thread that writes it, before it writes). One cluster of up to 8 CTAs per row; both sums
// reduce in a fixed order (deterministic). hidden <= 32768. No allocation, no host sync.
void attn_res_mix_norm(const AttnResSources& sources, int n_sources, int64_t row_stride,
                       const float* score_w, int64_t rows, int64_t hidden, float eps,
                       const float* norm_w, __nv_bfloat16* x_out, int64_t x_stride,
                       cudaStream_t stream, __nv_bfloat16* h_out = nullptr, int64_t h_stride = 0);

// The same over a contiguous bank: source j row r at bank + j * source_stride + r * row_stride.
// bank: [n_sources][rows][hidden] bf16 (device; source_stride >= rows * row_stride)
void attn_res_mix_norm(const __nv_bfloat16* bank, int n_sources, int64_t source_stride,
                       int64_t row_stride, const float* score_w, int64_t rows, int64_t hidden,
                       float eps, const float* norm_w, __nv_bfloat16* x_out, int64_t x_stride,
                       cudaStream_t stream, __nv_bfloat16* h_out = nullptr, int64_t h_stride = 0);

}  // namespace k3::cuda
