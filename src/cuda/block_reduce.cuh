// Deterministic CTA-wide sum: warp butterflies, then warp 0 adds the per-warp partials in warp
// order. Every thread gets the same bits on every run.
#pragma once

#include "cuda/device_util.cuh"

namespace k3::cuda::detail {

// block_sum over V * blockDim.x virtual threads, thread t holding those of t + j * blockDim.x
// in v[j]: the bits of block_sum on a CTA of V * blockDim.x threads (blockDim.x a multiple of
// 32 where V > 1, at most 32 virtual warps). scratch: >= 33 floats of shared memory. Must be
// called by every thread of the CTA.
template <int V>
__device__ __forceinline__ float block_sum_virtual(const float (&v)[V], float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = static_cast<int>((blockDim.x + 31) >> 5);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float s = warp_sum(v[j]);
    if (lane == 0) scratch[j * nwarps + warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    float t = lane < V * nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) scratch[32] = t;
  }
  __syncthreads();
  const float r = scratch[32];
  __syncthreads();  // scratch may be reused right after
  return r;
}

// scratch: >= 33 floats of shared memory. Must be called by every thread of the CTA.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const float one[1] = {v};
  return block_sum_virtual<1>(one, scratch);
}

}  // namespace k3::cuda::detail
