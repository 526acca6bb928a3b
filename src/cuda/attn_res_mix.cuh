// The AttnRes mix pieces both AttnRes kernels run (attn_res.cu: the mix alone; attn_res_norm.cu:
// the mix, then RMSNorm). One source of truth keeps their bits equal: the fused kernel's h must be
// attn_res_mix's output bit for bit, which the step diff and the fused-path tests check.
//
// A thread holds one 8-element vector of each of NS sources (raw bf16 bits in registers), forms
// its per-source partial sums of squares and of <v, score_w>, and after the row's sums are known
// mixes its vector from the same registers: each source element is read from memory once.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/attn_res.h"
#include "cuda/device_util.cuh"

namespace k3::cuda::detail {

__device__ __forceinline__ float bf_lo(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf_hi(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}

// 8 bf16 as raw bits; vec: aligned and in bounds, else the first n_valid element-wise, rest 0.
__device__ __forceinline__ uint4 load_raw8(const __nv_bfloat16* p, bool vec, int n_valid) {
  if (vec) return *reinterpret_cast<const uint4*>(p);
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n_valid) w[i / 2] |= static_cast<uint32_t>(q[i]) << (16 * (i & 1));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 fp32 weights from p (live), else `fill` (a thread past the row's end).
__device__ __forceinline__ void load_weights8(const float* p, bool live, bool vec, int n_valid,
                                              float fill, float (&w)[8]) {
  if (live) {
    load_f32x8(p, vec, n_valid, w);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = fill;
}

// v[j] = this thread's 8 elements (from e0) of source j's row; zeros for a thread past the end.
template <int NS>
__device__ __forceinline__ void load_sources(uint4 (&v)[NS], const AttnResSources& s, int64_t row,
                                             int64_t row_stride, int e0, bool live, bool vec,
                                             int n_valid) {
  // s.src[j]: [rows, hidden] bf16
#pragma unroll
  for (int j = 0; j < NS; ++j)
    v[j] =
        live ? load_raw8(s.src[j] + row * row_stride + e0, vec, n_valid) : make_uint4(0, 0, 0, 0);
}

// Per-warp partials of every source: red[warp][j] = sum of squares, red[warp][NS + j] = <v, w>.
// The sources' warp reductions interleave (NS is a compile-time count).
template <int NS>
__device__ __forceinline__ void source_partials(const uint4 (&v)[NS], const float (&w)[8],
                                                float (*red)[2 * NS]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const uint32_t u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
    float ss = 0.0f, dot = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float a = bf_lo(u[k]), b = bf_hi(u[k]);
      ss += a * a + b * b;
      dot += a * w[2 * k] + b * w[2 * k + 1];
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (lane == 0) {
      red[warp][j] = ss;
      red[warp][NS + j] = dot;
    }
  }
}

// This CTA's sum of partial i over its warps, in warp order.
template <int NS>
__device__ __forceinline__ float cta_partial(const float (*red)[2 * NS], int i) {
  const int nwarps = static_cast<int>(blockDim.x >> 5);
  float t = 0.0f;
  for (int q = 0; q < nwarps; ++q) t += red[q][i];
  return t;
}

// The mixing weights from the row's sums (total[j]: sum of squares, total[NS + j]: <v_j, w>):
// softmax over j of <v_j, w> / rms(v_j). One source passes through exactly (layer 0, as the CPU
// reference).
template <int NS>
__device__ __forceinline__ void mix_weights(float (&p)[NS], const float* total, int hidden,
                                            float eps) {
  if (NS == 1) {
    p[0] = 1.0f;
    return;
  }
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    p[j] = total[NS + j] / sqrtf(total[j] / static_cast<float>(hidden) + eps);
    m = fmaxf(m, p[j]);
  }
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < NS; ++j) sum += (p[j] = expf(p[j] - m));
  const float inv = 1.0f / sum;
#pragma unroll
  for (int j = 0; j < NS; ++j) p[j] *= inv;
}

// o = sum_j p[j] * v_j over this thread's 8 elements, in source order (fp32).
template <int NS>
__device__ __forceinline__ void mix8(const uint4 (&v)[NS], const float (&p)[NS], float (&o)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = 0.0f;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const uint32_t u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] += p[j] * bf_lo(u[k]);
      o[2 * k + 1] += p[j] * bf_hi(u[k]);
    }
  }
}

}  // namespace k3::cuda::detail
