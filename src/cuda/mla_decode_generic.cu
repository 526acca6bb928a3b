// Generic-shape absorbed MLA decode: one CTA per (head, row), the row's tokens in tiles of 32
// with an online softmax, fp32 math. Simple on purpose: it serves small / unusual shapes (test
// models); K3's 512 / 64 keeps the split-KV kernel in mla_decode.cu.
#include "cuda/mla_decode_generic.h"

#include <cmath>

#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda::detail {
namespace {

constexpr int kTile = 32;  // tokens per tile: one lane each in the softmax update
constexpr int kThreads = 128;
constexpr int kColsPerThread = kMlaGenericMaxKvLora / kThreads;  // 8 latent columns per thread

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Queries, the cache, page tables, lengths and selections: no __restrict__ (PDL: their producer
// may still run when this kernel starts, so no ld.global.nc; see mma.cuh ld_act128).
template <bool kBf16Out>
__global__ void __launch_bounds__(kThreads)
    mla_generic_kernel(const __nv_bfloat16* q_abs, const __nv_bfloat16* q_pe,
                       const __nv_bfloat16* cache, const int32_t* block_table,
                       const int32_t* seq_len, const int32_t* selected, const int32_t* n_selected,
                       int heads, int kv_lora, int rope, int page_size, int max_pages, int max_sel,
                       float scale, void* __restrict__ out, float* __restrict__ lse) {
  K3_PDL_ENTRY();
  // q_abs [rows][heads][kv_lora] bf16; q_pe [rows][heads][rope] bf16;
  // cache [pages][page_size][kv_lora + rope] bf16; out [rows][heads][kv_lora] fp32 or bf16.
  extern __shared__ float qs[];   // [kv_lora + rope] fp32 query (q~ then q_pe)
  __shared__ float ps[kTile];     // scores, then probabilities of the tile
  __shared__ int64_t off[kTile];  // element offset of each tile token's cache row
  __shared__ float alpha_s, l_s;

  const int h = blockIdx.x, row = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int D = kv_lora + rope;
  const int64_t qh = static_cast<int64_t>(row) * heads + h;
  const int32_t* sel = selected ? selected + static_cast<int64_t>(row) * max_sel : nullptr;
  const int n = max(0, sel ? n_selected[row] : seq_len[row]);
  const int32_t* bt = block_table + static_cast<int64_t>(row) * max_pages;

  for (int d = tid; d < D; d += kThreads)
    qs[d] = d < kv_lora ? __bfloat162float(q_abs[qh * kv_lora + d])
                        : __bfloat162float(q_pe[qh * rope + d - kv_lora]);
  float m = -INFINITY;  // running max (used by warp 0 only)
  float l = 0.0f;       // running sum (every thread reads it back from l_s)
  float acc[kColsPerThread] = {};

  for (int t0 = 0; t0 < n; t0 += kTile) {
    const int nt = min(kTile, n - t0);
    if (tid < kTile) {
      int64_t o = 0;
      if (tid < nt) {
        const int pos = sel ? sel[t0 + tid] : t0 + tid;
        o = (static_cast<int64_t>(bt[pos / page_size]) * page_size + pos % page_size) * D;
      }
      off[tid] = o;
    }
    __syncthreads();  // also publishes qs on the first tile
    // Scores: one warp per token, lanes across the D columns.
    for (int t = warp; t < kTile; t += kThreads / 32) {
      float s = 0.0f;
      if (t < nt) {
        const __nv_bfloat16* c = cache + off[t];
        for (int d = lane; d < D; d += 32) s += qs[d] * __bfloat162float(c[d]);
      }
      s = warp_sum(s);
      if (lane == 0) ps[t] = t < nt ? s * scale : -INFINITY;
    }
    __syncthreads();
    // Online softmax update by warp 0 (lane = token of the tile).
    if (warp == 0) {
      const float s = ps[lane];
      const float mn = fmaxf(m, warp_max(s));  // finite: the tile holds >= 1 token
      const float p = s == -INFINITY ? 0.0f : expf(s - mn);
      const float a = m == -INFINITY ? 0.0f : expf(m - mn);
      const float sum = warp_sum(p);
      ps[lane] = p;
      if (lane == 0) {
        alpha_s = a;
        l_s = l * a + sum;
      }
      m = mn;
    }
    __syncthreads();
    const float a = alpha_s;
    l = l_s;
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k) acc[k] *= a;
    for (int t = 0; t < nt; ++t) {
      const float p = ps[t];
      const __nv_bfloat16* c = cache + off[t];
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        const int col = tid + k * kThreads;
        if (col < kv_lora) acc[k] += p * __bfloat162float(c[col]);
      }
    }
    __syncthreads();  // the next tile overwrites off and ps
  }

  const float inv = l > 0.0f ? 1.0f / l : 0.0f;                                  // no tokens: o = 0
  if (lse != nullptr && tid == 0) lse[qh] = l > 0.0f ? m + logf(l) : -INFINITY;  // m: warp 0
#pragma unroll
  for (int k = 0; k < kColsPerThread; ++k) {
    const int col = tid + k * kThreads;
    if (col >= kv_lora) break;
    const float v = acc[k] * inv;
    if constexpr (kBf16Out)
      static_cast<__nv_bfloat16*>(out)[qh * kv_lora + col] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(out)[qh * kv_lora + col] = v;
  }
}

}  // namespace

void mla_decode_generic(const MlaDecodePlan& p, const __nv_bfloat16* q_abs,
                        const __nv_bfloat16* q_pe, const __nv_bfloat16* cache,
                        const int32_t* block_table, const int32_t* seq_len, const int32_t* selected,
                        const int32_t* n_selected, float softmax_scale, void* o_latent, bool o_bf16,
                        cudaStream_t stream, float* lse) {
  K3_CHECK(mla_generic_shape_ok(p.kv_lora, p.rope), "cuda::mla_decode: kv_lora ", p.kv_lora,
           " / rope ", p.rope, " unsupported");
  if (p.rows == 0) return;
  const dim3 grid(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.rows));
  const size_t smem = sizeof(float) * static_cast<size_t>(p.kv_lora + p.rope);  // <= 4.5 KB
  if (o_bf16)
    mla_generic_kernel<true><<<grid, kThreads, smem, stream>>>(
        q_abs, q_pe, cache, block_table, seq_len, selected, n_selected, p.heads, p.kv_lora, p.rope,
        p.page_size, p.max_pages, p.max_sel, softmax_scale, o_latent, lse);
  else
    mla_generic_kernel<false><<<grid, kThreads, smem, stream>>>(
        q_abs, q_pe, cache, block_table, seq_len, selected, n_selected, p.heads, p.kv_lora, p.rope,
        p.page_size, p.max_pages, p.max_sel, softmax_scale, o_latent, lse);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda::detail
