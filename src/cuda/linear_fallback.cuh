// The generic skinny GEMM for what the tiled kernel cannot take (bf16 with K % 8 != 0 or
// misaligned pointers, MXFP4 with K % 256 != 0, more than 64 rows in a group): one warp per
// output row, lanes striding k with scalar loads, 8 tokens at a time. Correct, not fast.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"
#include "cuda/skinny_gemm.cuh"

namespace k3::cuda::detail {

// Dec::at(W, Ws, n, k, K): element (n, k) of the weight as float.
template <class Dec>
__global__ void __launch_bounds__(256)
    linear_fallback_kernel(const __grid_constant__ SkinnyArgs a) {
  // Wait, then let the dependents start: a later grouped launch of the same grouping reads its
  // slot arrays before its own wait (SkinnyArgs::slots_ready), which is sound only once this
  // kernel's wait has returned (the tiled grouped kernel does the same).
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * 8 + warp;
  if (n >= a.n) return;
  const void* W = a.w;
  const uint8_t* Ws = a.ws;
  int cnt = a.m, off = 0;
  if (a.slot_expert) {
    const int s = blockIdx.y;
    const int e = a.slot_expert[s];
    off = a.slot_offsets[s];
    cnt = a.slot_offsets[s + 1] - off;
    if (e < 0 || cnt <= 0) return;
    W = a.w_table[e];
    Ws = a.ws_table ? a.ws_table[e] : nullptr;
  }
  for (int m0 = 0; m0 < cnt; m0 += 8) {
    const __nv_bfloat16* xr[8];  // x rows of tokens m0..m0+7 (null past cnt)
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int m = m0 + t;
      const int r = m < cnt ? (a.row_index ? a.row_index[off + m] : off + m) : -1;
      xr[t] = r >= 0 ? a.x + static_cast<int64_t>(r) * a.ldx : nullptr;
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = lane; k < a.k; k += 32) {
      const float w = Dec::at(W, Ws, n, k, a.k);
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (xr[t]) acc[t] += w * __bfloat162float(xr[t][k]);
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const float v = warp_sum(acc[t]);
      if (lane == 0 && xr[t]) store_output(a, static_cast<int64_t>(off + m0 + t) * a.ldy + n, v);
    }
  }
}

}  // namespace k3::cuda::detail
