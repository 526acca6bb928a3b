// Device-side helpers shared by the elementwise / row kernels: 8-wide bf16 loads and stores
// (one 16-byte access when aligned, element-wise with a bound otherwise) and warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda::detail {

// True when p is 16-byte aligned (a bf16x8 / float4 vector access is legal).
__host__ __device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// 8 bf16 at p as floats. vec: p is 16-byte aligned and all 8 are in bounds; otherwise the first
// n_valid are read one by one and the rest are 0.
__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, bool vec, int n_valid,
                                            float (&v)[8]) {
  if (vec) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = i < n_valid ? __bfloat162float(p[i]) : 0.0f;
  }
}

// Round 8 floats to bf16 (nearest even, as core/numeric.h) and store the first n_valid.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* p, bool vec, int n_valid,
                                             const float (&v)[8]) {
  if (vec) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < n_valid) p[i] = __float2bfloat16_rn(v[i]);
  }
}

// 8 floats at p (fp32 weights): one or two 16-byte loads when vec, else bounded scalar loads.
__device__ __forceinline__ void load_f32x8(const float* p, bool vec, int n_valid, float (&v)[8]) {
  if (vec) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = i < n_valid ? p[i] : 0.0f;
  }
}

// cpu::sigmoid exactly (ops_basic.cpp): only a non-positive number is exponentiated.
__device__ __forceinline__ float sigmoid_ref(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

// CTAs for n items at per_block each (at least 1: a launch with 0 blocks is an error).
inline unsigned blocks_for(int64_t n, int per_block) {
  return static_cast<unsigned>(n <= 0 ? 1 : (n + per_block - 1) / per_block);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over cluster ranks 0..C-1 (C <= 8) of the float at `p` in each rank's shared memory, in
// rank order (the bits of the plain loop), with the remote loads all issued before the adds
// instead of one distributed-shared-memory round trip per rank.
template <class Cluster>
__device__ __forceinline__ float cluster_sum_in_order(Cluster& cluster, float* p, int C) {
  float v[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) v[q] = q < C ? *cluster.map_shared_rank(p, q) : 0.0f;
  float t = 0.0f;
#pragma unroll
  for (int q = 0; q < 8; ++q)
    if (q < C) t += v[q];
  return t;
}

}  // namespace k3::cuda::detail
