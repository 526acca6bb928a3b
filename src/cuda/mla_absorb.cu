// MLA query absorption and value up-projection (declared in step_ops.h), the two small GEMMs
// around the absorbed attention. Per head they read kv_b's W_uk [nope][kv_lora] and W_uv
// [v][kv_lora] (K3: 128 KB each per head, 0.75 MB per TP16 rank): latency, not bandwidth, is the
// cost, so the work is spread over many CTAs: (head, 64 latent columns, 8 rows) for the
// absorption and (head, 16 value columns, 8 rows) for the up-projection, each staging its
// weight slice with 16-byte loads that are all in flight at once.
#include <algorithm>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"
#include "cuda/step_ops.h"

namespace k3::cuda {
namespace {

using detail::aligned16;
using detail::blocks_for;
using detail::load_bf16x8;
using detail::sigmoid_ref;
using detail::warp_sum;

constexpr int kRowGroup = 8;  // rows sharing one pass over a head's weights
constexpr int kAbsCols = 64;  // latent columns per absorption CTA
constexpr int kAbsRows = 64;  // W_uk rows (nope index) staged per pass
constexpr int kAbsThreads = 256;
constexpr int kUvCols = 16;  // value columns per up-projection CTA (2 per warp)
constexpr int kUvThreads = 256;

// q, o_latent and gate: no __restrict__ (PDL: their producer may still run when a kernel starts,
// so no ld.global.nc; see mma.cuh ld_act128). kv_b is a weight and keeps it.

// ---- q_abs = W_uk^T q_nope per head ----
__global__ void __launch_bounds__(kAbsThreads)
    absorb_q_kernel(const __nv_bfloat16* q, const __nv_bfloat16* __restrict__ kv_b, int64_t rows,
                    int heads, int nope, int rope, int v, int kv_lora, bool vec,
                    __nv_bfloat16* __restrict__ q_abs, __nv_bfloat16* __restrict__ q_pe) {
  K3_PDL_ENTRY();
  // q [rows][heads][nope + rope]; kv_b [heads * (nope + v)][kv_lora];
  // q_abs [rows][heads][kv_lora]; q_pe [rows][heads][rope].
  // CTA = (head, 64 latent columns, 8 rows); thread = (column, rows rs and rs + 4).
  extern __shared__ float smem[];
  float* qn = smem;                     // [kRowGroup][nope] fp32
  float* wt = smem + kRowGroup * nope;  // [kAbsRows][kAbsCols] fp32
  const int h = blockIdx.x, c0 = blockIdx.y * kAbsCols;
  const int64_t r0 = static_cast<int64_t>(blockIdx.z) * kRowGroup;
  const int nr = static_cast<int>(rows - r0 < kRowGroup ? rows - r0 : kRowGroup);
  const int nc = min(kAbsCols, kv_lora - c0);
  const int qhd = nope + rope;
  for (int i = threadIdx.x; i < nr * qhd; i += kAbsThreads) {
    const int rr = i / qhd, d = i % qhd;
    const __nv_bfloat16 x = q[((r0 + rr) * heads + h) * qhd + d];
    if (d < nope)
      qn[rr * nope + d] = __bfloat162float(x);
    else if (blockIdx.y == 0)
      q_pe[((r0 + rr) * heads + h) * rope + d - nope] = x;
  }
  const __nv_bfloat16* w_uk = kv_b + static_cast<int64_t>(h) * (nope + v) * kv_lora + c0;
  const int c = threadIdx.x % kAbsCols, rs = threadIdx.x / kAbsCols;  // rs in 0..3
  float acc[2] = {0.0f, 0.0f};
  for (int i0 = 0; i0 < nope; i0 += kAbsRows) {
    const int ni = min(kAbsRows, nope - i0);
    __syncthreads();  // qn is written / the previous pass's wt is consumed
    for (int e = threadIdx.x; e < ni * (kAbsCols / 8); e += kAbsThreads) {
      const int i = e / (kAbsCols / 8), cc = (e % (kAbsCols / 8)) * 8;
      float w8[8];
      load_bf16x8(w_uk + static_cast<int64_t>(i0 + i) * kv_lora + cc, vec && cc + 8 <= nc,
                  max(0, min(8, nc - cc)), w8);
#pragma unroll
      for (int j = 0; j < 8; ++j) wt[i * kAbsCols + cc + j] = w8[j];
    }
    __syncthreads();
    // Ascending i, as the CPU accumulates.
    for (int i = 0; i < ni; ++i) {
      const float w = wt[i * kAbsCols + c];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int rr = rs + 4 * k;
        if (rr < nr) acc[k] += qn[rr * nope + i0 + i] * w;
      }
    }
  }
  if (c < nc)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int rr = rs + 4 * k;
      if (rr < nr) q_abs[((r0 + rr) * heads + h) * kv_lora + c0 + c] = __float2bfloat16_rn(acc[k]);
    }
}

// ---- o = W_uv o_latent per head (+ sigmoid gate) ----
__global__ void __launch_bounds__(kUvThreads)
    unabsorb_v_kernel(const float* o_latent, const __nv_bfloat16* __restrict__ kv_b,
                      const __nv_bfloat16* gate, int64_t rows, int heads, int nope, int v,
                      int kv_lora, bool vec, __nv_bfloat16* __restrict__ o) {
  K3_PDL_ENTRY();
  // o_latent [rows][heads][kv_lora] fp32; kv_b [heads * (nope + v)][kv_lora];
  // gate, o [rows][heads * v]. CTA = (head, 16 value columns, 8 rows); one warp per column.
  extern __shared__ float ol[];  // [kRowGroup][kv_lora] fp32
  const int h = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.z) * kRowGroup;
  const int nr = static_cast<int>(rows - r0 < kRowGroup ? rows - r0 : kRowGroup);
  for (int i = threadIdx.x; i < nr * kv_lora; i += kUvThreads) {
    const int rr = i / kv_lora, c = i % kv_lora;
    ol[i] = o_latent[((r0 + rr) * heads + h) * kv_lora + c];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const __nv_bfloat16* w_uv = kv_b + (static_cast<int64_t>(h) * (nope + v) + nope) * kv_lora;
  for (int j = blockIdx.y * kUvCols + warp; j < min(v, (blockIdx.y + 1) * kUvCols);
       j += kUvThreads / 32) {
    const __nv_bfloat16* wr = w_uv + static_cast<int64_t>(j) * kv_lora;  // [kv_lora]
    float acc[kRowGroup] = {};
    for (int c = lane * 8; c < kv_lora; c += 32 * 8) {
      float w8[8];
      load_bf16x8(wr + c, vec && c + 8 <= kv_lora, min(8, kv_lora - c), w8);
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr) {
        if (rr >= nr) break;
        const float* x = ol + rr * kv_lora + c;
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (c + e < kv_lora) acc[rr] += w8[e] * x[e];
      }
    }
#pragma unroll
    for (int rr = 0; rr < kRowGroup; ++rr) acc[rr] = warp_sum(acc[rr]);
    if (lane == 0) {
      for (int rr = 0; rr < nr; ++rr) {
        const int64_t e = (r0 + rr) * heads * v + static_cast<int64_t>(h) * v + j;
        float y = __bfloat162float(__float2bfloat16_rn(acc[rr]));  // the CPU rounds o first
        if (gate) y *= sigmoid_ref(__bfloat162float(gate[e]));
        o[e] = __float2bfloat16_rn(y);
      }
    }
  }
}

}  // namespace

void mla_absorb_q(const __nv_bfloat16* q, const __nv_bfloat16* kv_b, int64_t rows, int heads,
                  int nope, int rope, int v, int kv_lora, __nv_bfloat16* q_abs, __nv_bfloat16* q_pe,
                  cudaStream_t stream) {
  K3_CHECK(
      rows >= 0 && heads >= 1 && nope >= 1 && nope <= 1024 && rope >= 0 && v >= 1 && kv_lora >= 1,
      "cuda::mla_absorb_q: rows ", rows, " heads ", heads, " nope ", nope, " rope ", rope, " v ", v,
      " kv_lora ", kv_lora);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(heads), blocks_for(kv_lora, kAbsCols),
                  blocks_for(rows, kRowGroup));
  // qn <= 32 KB + the 16 KB weight slice: above 48 KB only for nope > 1024 (refused).
  const size_t smem = sizeof(float) * (kRowGroup * static_cast<size_t>(nope) + kAbsRows * kAbsCols);
  K3_CUDA_CHECK(cudaFuncSetAttribute(absorb_q_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  const bool vec = kv_lora % 8 == 0 && aligned16(kv_b);
  absorb_q_kernel<<<grid, kAbsThreads, smem, stream>>>(q, kv_b, rows, heads, nope, rope, v, kv_lora,
                                                       vec, q_abs, q_pe);
  K3_CUDA_CHECK_LAUNCH();
}

void mla_unabsorb_v(const float* o_latent, const __nv_bfloat16* kv_b, const __nv_bfloat16* gate,
                    int64_t rows, int heads, int nope, int v, int kv_lora, __nv_bfloat16* o,
                    cudaStream_t stream) {
  K3_CHECK(rows >= 0 && heads >= 1 && nope >= 0 && v >= 1 && kv_lora >= 1 && kv_lora <= 1024,
           "cuda::mla_unabsorb_v: rows ", rows, " heads ", heads, " nope ", nope, " v ", v,
           " kv_lora ", kv_lora);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(heads), blocks_for(v, kUvCols),
                  blocks_for(rows, kRowGroup));
  const size_t smem = sizeof(float) * kRowGroup * static_cast<size_t>(kv_lora);  // <= 32 KB
  const bool vec = kv_lora % 8 == 0 && aligned16(kv_b);
  unabsorb_v_kernel<<<grid, kUvThreads, smem, stream>>>(o_latent, kv_b, gate, rows, heads, nope, v,
                                                        kv_lora, vec, o);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
