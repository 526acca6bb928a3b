// RMSNorm, one CTA per row. The cached kernel keeps each thread's VPT 8-element vectors in
// registers between the sum of squares and the scaling (one global read per element); the
// generic kernel reads twice, element by element, for odd sizes or alignment.
#include "cuda/rms_norm.h"

#include <algorithm>

#include "core/error.h"
#include "cuda/block_reduce.cuh"
#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::aligned16;

template <int VPT>
__global__ void __launch_bounds__(1024)
    rms_norm_cached(const __nv_bfloat16* x, int64_t x_stride, const float* w, int hidden, float eps,
                    __nv_bfloat16* y, int64_t y_stride) {
  // x: [rows, hidden] bf16; w: [hidden] fp32 or null; y: [rows, hidden] bf16
  detail::pdl_launch_dependents();
  // The weights first, as they do not wait on the previous kernel; up to 4 vectors per thread
  // (8 would spill under the 64 registers of 1024 threads: those load them at the end).
  constexpr bool kEarly = VPT <= 4;
  float wv[kEarly ? VPT : 1][8];
#pragma unroll
  for (int i = 0; i < (kEarly ? VPT : 0); ++i) {
    const int e0 = (threadIdx.x + i * blockDim.x) * 8;
    if (w && e0 < hidden)
      detail::load_f32x8(w + e0, true, 8, wv[i]);
    else
#pragma unroll
      for (int k = 0; k < 8; ++k) wv[i][k] = 1.0f;
  }
  detail::pdl_wait();
  __shared__ float scratch[33];
  const __nv_bfloat16* xr = x + blockIdx.x * x_stride;  // [hidden]
  __nv_bfloat16* yr = y + blockIdx.x * y_stride;        // [hidden]
  uint4 v[VPT];                                         // raw bf16 bits: 4 registers per 8 elements
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e0 = (threadIdx.x + i * blockDim.x) * 8;
    v[i] = e0 < hidden ? *reinterpret_cast<const uint4*>(xr + e0) : make_uint4(0, 0, 0, 0);
    const uint32_t u[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float a = __uint_as_float(u[k] << 16), b = __uint_as_float(u[k] & 0xffff0000u);
      ss += a * a;
      ss += b * b;
    }
  }
  ss = detail::block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e0 = (threadIdx.x + i * blockDim.x) * 8;
    if (e0 >= hidden) continue;
    const uint32_t u[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
    float o[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] = __uint_as_float(u[k] << 16) * inv;
      o[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u) * inv;
    }
    if (w) {
      float wk[8];
      if constexpr (kEarly) {
#pragma unroll
        for (int k = 0; k < 8; ++k) wk[k] = wv[i][k];
      } else {
        detail::load_f32x8(w + e0, true, 8, wk);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] *= wk[k];
    }
    detail::store_bf16x8(yr + e0, true, 8, o);
  }
}

__global__ void __launch_bounds__(1024)
    rms_norm_generic(const __nv_bfloat16* x, int64_t x_stride, const float* w, int64_t hidden,
                     float eps, __nv_bfloat16* y, int64_t y_stride) {
  K3_PDL_ENTRY();
  // x: [rows, hidden] bf16; w: [hidden] fp32 or null; y: [rows, hidden] bf16
  __shared__ float scratch[33];
  const __nv_bfloat16* xr = x + blockIdx.x * x_stride;  // [hidden]
  __nv_bfloat16* yr = y + blockIdx.x * y_stride;        // [hidden]
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = __bfloat162float(xr[i]);
    ss += v * v;
  }
  ss = detail::block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = __bfloat162float(xr[i]) * inv;
    yr[i] = __float2bfloat16_rn(w ? v * w[i] : v);
  }
}

}  // namespace

void rms_norm(const __nv_bfloat16* x, int64_t x_stride, const float* w, int64_t rows,
              int64_t hidden, float eps, __nv_bfloat16* y, int64_t y_stride, cudaStream_t stream) {
  K3_CHECK(rows >= 0 && hidden > 0, "cuda::rms_norm: rows ", rows, ", hidden ", hidden);
  K3_CHECK(x_stride >= hidden && y_stride >= hidden, "cuda::rms_norm: strides ", x_stride, "/",
           y_stride, " below hidden ", hidden);
  K3_CHECK(rows <= 0x7fffffff, "cuda::rms_norm: too many rows ", rows);
  if (rows == 0) return;
  const bool vec = hidden % 8 == 0 && x_stride % 8 == 0 && y_stride % 8 == 0 && aligned16(x) &&
                   aligned16(y) && (w == nullptr || aligned16(w));
  const int64_t nv = hidden / 8;
  const dim3 grid(static_cast<unsigned>(rows));
  // Each thread caches VPT 8-element vectors: VPT 1 for short rows, 4 from 512 vectors up
  // (hidden 7168: 896 vectors, 224 threads), 8 past 4096 vectors; longer rows read twice.
  auto threads_for = [&](int vpt) {
    return static_cast<int>(std::max<int64_t>(32, ((nv + vpt - 1) / vpt + 31) / 32 * 32));
  };
  const int h = static_cast<int>(hidden);
  if (vec && nv <= 256) {
    rms_norm_cached<1><<<grid, threads_for(1), 0, stream>>>(x, x_stride, w, h, eps, y, y_stride);
  } else if (vec && nv <= 512) {
    rms_norm_cached<2><<<grid, threads_for(2), 0, stream>>>(x, x_stride, w, h, eps, y, y_stride);
  } else if (vec && nv <= 4096) {
    rms_norm_cached<4><<<grid, threads_for(4), 0, stream>>>(x, x_stride, w, h, eps, y, y_stride);
  } else if (vec && nv <= 8192) {
    rms_norm_cached<8><<<grid, threads_for(8), 0, stream>>>(x, x_stride, w, h, eps, y, y_stride);
  } else {
    const int threads = static_cast<int>(std::clamp<int64_t>((hidden + 31) / 32 * 32, 32, 512));
    rms_norm_generic<<<grid, threads, 0, stream>>>(x, x_stride, w, hidden, eps, y, y_stride);
  }
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
