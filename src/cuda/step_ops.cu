// The decode step's glue ops (step_ops.h). Row kernels: one CTA per row (or per head x group of
// rows where a weight is shared), fp32 math, 16-byte bf16 vectors where shapes and pointers allow.
#include "cuda/step_ops.h"

#include <algorithm>

#include "core/error.h"
#include "cuda/block_reduce.cuh"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::aligned16;
using detail::load_bf16x8;
using detail::load_f32x8;
using detail::store_bf16x8;
using detail::warp_sum;

constexpr int kRowThreads = 256;
constexpr int kRowGroup = 8;  // rows sharing one pass over a head's weights (absorb / unabsorb)
constexpr int kGemmRows = 4;  // rows per pass over a weight column in the grouped GEMM
constexpr int kGemmWarps = 8;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

unsigned blocks_for(int64_t n, int per_block) {
  return static_cast<unsigned>(std::max<int64_t>(1, (n + per_block - 1) / per_block));
}

// ---- embedding rows ----
__global__ void __launch_bounds__(kRowThreads)
    embed_kernel(const __nv_bfloat16* __restrict__ embed, int64_t vocab, int64_t hidden,
                 const int32_t* __restrict__ tokens, __nv_bfloat16* __restrict__ out, bool vec) {
  K3_PDL_ENTRY();
  // embed [vocab][hidden]; out [rows][hidden]; one CTA per row.
  const int64_t r = blockIdx.x;
  const int32_t tok = tokens[r];
  const bool valid = tok >= 0 && tok < vocab;
  const __nv_bfloat16* src = embed + (valid ? static_cast<int64_t>(tok) : 0) * hidden;
  __nv_bfloat16* dst = out + r * hidden;
  for (int64_t c = threadIdx.x * 8; c < hidden; c += kRowThreads * 8) {
    const int nv = static_cast<int>(imin(8, hidden - c));
    float v[8] = {};
    if (valid) load_bf16x8(src + c, vec && nv == 8, nv, v);
    store_bf16x8(dst + c, vec && nv == 8, nv, v);  // bf16 -> float -> bf16 is exact
  }
}

// ---- elementwise bf16 add ----
__global__ void add_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                           __nv_bfloat16* out, bool vec) {
  K3_PDL_ENTRY();
  // a, b, out [n]; out may alias a or b (each thread reads its 8 before writing them).
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  const int nv = static_cast<int>(imin(8, n - i));
  float x[8], y[8];
  load_bf16x8(a + i, vec && nv == 8, nv, x);
  load_bf16x8(b + i, vec && nv == 8, nv, y);
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] += y[k];
  store_bf16x8(out + i, vec && nv == 8, nv, x);
}

// ---- MLA query absorption: q_abs = W_uk^T q_nope per head ----
__global__ void __launch_bounds__(128)
    absorb_q_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv_b,
                    int64_t rows, int heads, int nope, int rope, int v, int kv_lora,
                    __nv_bfloat16* __restrict__ q_abs, __nv_bfloat16* __restrict__ q_pe) {
  K3_PDL_ENTRY();
  // q [rows][heads][nope + rope]; kv_b [heads * (nope + v)][kv_lora];
  // q_abs [rows][heads][kv_lora]; q_pe [rows][heads][rope]. CTA = (head, group of 8 rows).
  extern __shared__ float qn[];  // [kRowGroup][nope] fp32
  const int h = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowGroup;
  const int nr = static_cast<int>(imin(kRowGroup, rows - r0));
  const int qhd = nope + rope;
  for (int i = threadIdx.x; i < nr * qhd; i += blockDim.x) {
    const int rr = i / qhd, d = i % qhd;
    const __nv_bfloat16 x = q[((r0 + rr) * heads + h) * qhd + d];
    if (d < nope)
      qn[rr * nope + d] = __bfloat162float(x);
    else
      q_pe[((r0 + rr) * heads + h) * rope + d - nope] = x;
  }
  __syncthreads();
  const __nv_bfloat16* w_uk = kv_b + static_cast<int64_t>(h) * (nope + v) * kv_lora;  // [nope][L]
  for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) {
    float acc[kRowGroup] = {};
    for (int i = 0; i < nope; ++i) {  // ascending i, as the CPU accumulates
      const float w = __bfloat162float(w_uk[static_cast<int64_t>(i) * kv_lora + c]);
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr)
        if (rr < nr) acc[rr] += qn[rr * nope + i] * w;
    }
    for (int rr = 0; rr < nr; ++rr)
      q_abs[((r0 + rr) * heads + h) * kv_lora + c] = __float2bfloat16_rn(acc[rr]);
  }
}

// The CPU's sigmoid (ops_basic.cpp): only a non-positive number is exponentiated.
__device__ __forceinline__ float sigmoid_ref(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

// ---- MLA value up-projection (+ sigmoid gate) ----
__global__ void __launch_bounds__(256)
    unabsorb_v_kernel(const float* __restrict__ o_latent, const __nv_bfloat16* __restrict__ kv_b,
                      const __nv_bfloat16* __restrict__ gate, int64_t rows, int heads, int nope,
                      int v, int kv_lora, __nv_bfloat16* __restrict__ o) {
  K3_PDL_ENTRY();
  // o_latent [rows][heads][kv_lora] fp32; kv_b [heads * (nope + v)][kv_lora];
  // gate, o [rows][heads * v]. CTA = (head, group of 8 rows); one warp per output column j.
  extern __shared__ float ol[];  // [kRowGroup][kv_lora] fp32
  const int h = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowGroup;
  const int nr = static_cast<int>(imin(kRowGroup, rows - r0));
  for (int i = threadIdx.x; i < nr * kv_lora; i += blockDim.x) {
    const int rr = i / kv_lora, c = i % kv_lora;
    ol[i] = o_latent[((r0 + rr) * heads + h) * kv_lora + c];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const __nv_bfloat16* w_uv = kv_b + (static_cast<int64_t>(h) * (nope + v) + nope) * kv_lora;
  for (int j = warp; j < v; j += nwarps) {
    const __nv_bfloat16* wr = w_uv + static_cast<int64_t>(j) * kv_lora;  // [kv_lora]
    float acc[kRowGroup] = {};
    for (int c = lane; c < kv_lora; c += 32) {
      const float w = __bfloat162float(wr[c]);
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr)
        if (rr < nr) acc[rr] += w * ol[rr * kv_lora + c];
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

// ---- latent cache append ----
__global__ void cache_append_kernel(const __nv_bfloat16* __restrict__ kv, int width,
                                    const int32_t* __restrict__ block_table, int max_pages,
                                    const int32_t* __restrict__ position, int page_size,
                                    __nv_bfloat16* __restrict__ cache) {
  K3_PDL_ENTRY();
  // kv [rows][width]; block_table [rows][max_pages]; cache [pages][page_size][width].
  const int64_t r = blockIdx.x;
  const int pos = position[r];
  if (pos < 0 || pos / page_size >= max_pages) return;  // no page for it: nothing to write
  const int64_t page = block_table[r * max_pages + pos / page_size];
  __nv_bfloat16* dst = cache + (page * page_size + pos % page_size) * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = kv[r * width + c];
}

// ---- MoE combine (+ rms_norm) ----
__device__ __forceinline__ float combine_at(const __nv_bfloat16* y, const int32_t* y_pos,
                                            int64_t r, const float* w, int top_k, int64_t width,
                                            int64_t c) {
  // y rows of this row's choices (at y_pos[r*k + j], or r*k + j), w [top_k]: ascending j as the
  // CPU adds, multiply and add rounded separately as on the CPU (no fused multiply-add).
  float acc = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t s = r * top_k + j;
    const int64_t row = y_pos ? y_pos[s] : s;
    acc = __fadd_rn(acc, __fmul_rn(w[j], __bfloat162float(y[row * width + c])));
  }
  return acc;
}

__global__ void __launch_bounds__(kRowThreads)
    moe_combine_kernel(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ y_pos,
                       const float* __restrict__ weights, int top_k, int64_t width,
                       const float* __restrict__ norm_w, float eps,
                       __nv_bfloat16* __restrict__ out) {
  K3_PDL_ENTRY();
  // y [rows * top_k][width]; weights [rows][top_k]; norm_w [width] or null; out [rows][width].
  __shared__ float scratch[33];
  const int64_t r = blockIdx.x;
  const float* wr = weights + r * top_k;
  float inv = 1.0f;
  if (norm_w) {  // first pass: the sum of squares; the second recomputes the same acc values
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < width; c += kRowThreads) {
      const float a = combine_at(y, y_pos, r, wr, top_k, width, c);
      ss += a * a;
    }
    ss = detail::block_sum(ss, scratch);
    inv = 1.0f / sqrtf(ss / static_cast<float>(width) + eps);
  }
  for (int64_t c = threadIdx.x; c < width; c += kRowThreads) {
    const float a = combine_at(y, y_pos, r, wr, top_k, width, c);
    out[r * width + c] = __float2bfloat16_rn(norm_w ? a * inv * norm_w[c] : a);
  }
}

// ---- grouped / single linear with bf16 or fp32 weights ----
template <typename WT>
__device__ __forceinline__ void load_w8(const WT* p, bool vec, int nv, float (&v)[8]) {
  if constexpr (sizeof(WT) == 2)
    load_bf16x8(reinterpret_cast<const __nv_bfloat16*>(p), vec, nv, v);
  else
    load_f32x8(reinterpret_cast<const float*>(p), vec, nv, v);
}

// CTA = (8 output columns, slot); one warp per column, rows of the slot in passes of 4.
// Single form: w_table and slot_offsets null, w_single is the weight and rows are [0, M).
template <typename WT>
__global__ void __launch_bounds__(kGemmWarps * 32)
    grouped_linear_kernel(const WT* const* __restrict__ w_table, const WT* __restrict__ w_single,
                          const int32_t* __restrict__ slot_expert,
                          const int32_t* __restrict__ slot_offsets,
                          const int32_t* __restrict__ row_index, int64_t M,
                          const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t N, int64_t K,
                          void* __restrict__ y, int64_t ldy, bool y_fp32, bool vec) {
  K3_PDL_ENTRY();
  // x [*][ldx] bf16; W [N][K]; y [rows][ldy] bf16 or fp32.
  const int s = blockIdx.y;
  const WT* W = w_single;
  int64_t r_beg = 0, r_end = M;
  if (slot_offsets) {
    const int e = slot_expert[s];
    if (e < 0) return;  // skipped slot: its rows are not written
    W = w_table[e];
    r_beg = slot_offsets[s];
    r_end = slot_offsets[s + 1];
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemmWarps + warp;
  if (n >= N) return;
  const WT* wn = W + n * K;  // [K]
  for (int64_t r0 = r_beg; r0 < r_end; r0 += kGemmRows) {
    const int nr = static_cast<int>(imin(kGemmRows, r_end - r0));
    const __nv_bfloat16* xr[kGemmRows];
#pragma unroll
    for (int k = 0; k < kGemmRows; ++k) {
      const int64_t r = r0 + (k < nr ? k : 0);
      xr[k] = x + (row_index ? static_cast<int64_t>(row_index[r]) : r) * ldx;
    }
    float acc[kGemmRows] = {};
    for (int64_t k0 = static_cast<int64_t>(lane) * 8; k0 < K; k0 += 32 * 8) {
      const int nv = static_cast<int>(imin(8, K - k0));
      const bool vv = vec && nv == 8;
      float w[8];
      load_w8(wn + k0, vv, nv, w);
#pragma unroll
      for (int k = 0; k < kGemmRows; ++k) {
        float xv[8];
        load_bf16x8(xr[k] + k0, vv, nv, xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[k] += w[i] * xv[i];
      }
    }
#pragma unroll
    for (int k = 0; k < kGemmRows; ++k) acc[k] = warp_sum(acc[k]);
    if (lane == 0) {
      for (int k = 0; k < nr; ++k) {
        const int64_t e = (r0 + k) * ldy + n;
        if (y_fp32)
          static_cast<float*>(y)[e] = acc[k];
        else
          static_cast<__nv_bfloat16*>(y)[e] = __float2bfloat16_rn(acc[k]);
      }
    }
  }
}

}  // namespace

void embed_rows(const __nv_bfloat16* embed, int64_t vocab, int64_t hidden, const int32_t* tokens,
                int64_t rows, __nv_bfloat16* out, cudaStream_t stream) {
  K3_CHECK(vocab >= 1 && hidden >= 1 && rows >= 0, "cuda::embed_rows: vocab ", vocab, ", hidden ",
           hidden, ", rows ", rows);
  if (rows == 0) return;
  const bool vec = hidden % 8 == 0 && aligned16(embed) && aligned16(out);
  embed_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(embed, vocab, hidden,
                                                                         tokens, out, vec);
  K3_CUDA_CHECK_LAUNCH();
}

void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, __nv_bfloat16* out,
              cudaStream_t stream) {
  K3_CHECK(n >= 0, "cuda::add_bf16: n ", n);
  if (n == 0) return;
  const bool vec = aligned16(a) && aligned16(b) && aligned16(out);
  add_kernel<<<blocks_for(n, kRowThreads * 8), kRowThreads, 0, stream>>>(a, b, n, out, vec);
  K3_CUDA_CHECK_LAUNCH();
}

void mla_absorb_q(const __nv_bfloat16* q, const __nv_bfloat16* kv_b, int64_t rows, int heads,
                  int nope, int rope, int v, int kv_lora, __nv_bfloat16* q_abs,
                  __nv_bfloat16* q_pe, cudaStream_t stream) {
  K3_CHECK(rows >= 0 && heads >= 1 && nope >= 1 && nope <= 1024 && rope >= 0 && v >= 1 &&
               kv_lora >= 1,
           "cuda::mla_absorb_q: rows ", rows, " heads ", heads, " nope ", nope, " rope ", rope,
           " v ", v, " kv_lora ", kv_lora);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(heads), blocks_for(rows, kRowGroup));
  const size_t smem = sizeof(float) * kRowGroup * static_cast<size_t>(nope);  // <= 32 KB
  absorb_q_kernel<<<grid, 128, smem, stream>>>(q, kv_b, rows, heads, nope, rope, v, kv_lora, q_abs,
                                               q_pe);
  K3_CUDA_CHECK_LAUNCH();
}

void mla_unabsorb_v(const float* o_latent, const __nv_bfloat16* kv_b, const __nv_bfloat16* gate,
                    int64_t rows, int heads, int nope, int v, int kv_lora, __nv_bfloat16* o,
                    cudaStream_t stream) {
  K3_CHECK(rows >= 0 && heads >= 1 && nope >= 0 && v >= 1 && kv_lora >= 1 && kv_lora <= 1024,
           "cuda::mla_unabsorb_v: rows ", rows, " heads ", heads, " nope ", nope, " v ", v,
           " kv_lora ", kv_lora);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(heads), blocks_for(rows, kRowGroup));
  const size_t smem = sizeof(float) * kRowGroup * static_cast<size_t>(kv_lora);  // <= 32 KB
  unabsorb_v_kernel<<<grid, 256, smem, stream>>>(o_latent, kv_b, gate, rows, heads, nope, v,
                                                 kv_lora, o);
  K3_CUDA_CHECK_LAUNCH();
}

void mla_cache_append(const __nv_bfloat16* kv, int64_t rows, int width, const int32_t* block_table,
                      int max_pages, const int32_t* position, int page_size, __nv_bfloat16* cache,
                      cudaStream_t stream) {
  K3_CHECK(rows >= 0 && width >= 1 && max_pages >= 1 && page_size >= 1,
           "cuda::mla_cache_append: rows ", rows, " width ", width, " max_pages ", max_pages,
           " page_size ", page_size);
  if (rows == 0) return;
  cache_append_kernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      kv, width, block_table, max_pages, position, page_size, cache);
  K3_CUDA_CHECK_LAUNCH();
}

void moe_combine(const __nv_bfloat16* y, const float* weights, int64_t rows, int top_k,
                 int64_t width, const float* norm_w, float eps, __nv_bfloat16* out,
                 cudaStream_t stream, const int32_t* y_pos) {
  K3_CHECK(rows >= 0 && top_k >= 1 && width >= 1, "cuda::moe_combine: rows ", rows, " top_k ",
           top_k, " width ", width);
  if (rows == 0) return;
  moe_combine_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
      y, y_pos, weights, top_k, width, norm_w, eps, out);
  K3_CUDA_CHECK_LAUNCH();
}

void linear_bf16_grouped(const Bf16Grouped& g, const __nv_bfloat16* x, int64_t ldx, int64_t N,
                         int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream) {
  K3_CHECK(N >= 1 && K >= 1 && ldx >= K && ldy >= N && g.n_slots >= 0 && g.n_slots <= 65535,
           "cuda::linear_bf16_grouped: N ", N, " K ", K, " ldx ", ldx, " ldy ", ldy, " slots ",
           g.n_slots);
  K3_CHECK(g.n_slots == 0 || (g.w && g.slot_expert && g.slot_offsets),
           "cuda::linear_bf16_grouped: null expert table or slot arrays");
  if (g.n_slots == 0) return;
  // Expert pointers are not visible on the host: the vector path needs K % 8 == 0, which with
  // cudaMalloc'd / 16-B aligned expert tensors (a documented requirement) keeps rows aligned.
  const bool vec = K % 8 == 0 && ldx % 8 == 0 && aligned16(x);
  const dim3 grid(blocks_for(N, kGemmWarps), static_cast<unsigned>(g.n_slots));
  grouped_linear_kernel<__nv_bfloat16><<<grid, kGemmWarps * 32, 0, stream>>>(
      g.w, nullptr, g.slot_expert, g.slot_offsets, g.row_index, 0, x, ldx, N, K, y, ldy, y_fp32,
      vec);
  K3_CUDA_CHECK_LAUNCH();
}

void linear_f32w(const __nv_bfloat16* x, int64_t ldx, const float* w, int64_t M, int64_t N,
                 int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream) {
  K3_CHECK(M >= 0 && N >= 1 && K >= 1 && ldx >= K && ldy >= N, "cuda::linear_f32w: M ", M, " N ",
           N, " K ", K, " ldx ", ldx, " ldy ", ldy);
  if (M == 0) return;
  const bool vec = K % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w);
  const dim3 grid(blocks_for(N, kGemmWarps), 1);
  grouped_linear_kernel<float><<<grid, kGemmWarps * 32, 0, stream>>>(
      nullptr, w, nullptr, nullptr, nullptr, M, x, ldx, N, K, y, ldy, y_fp32, vec);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
