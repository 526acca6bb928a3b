// The decode step's glue ops (step_ops.h). Row kernels: one CTA per row (or per head x group of
// rows where a weight is shared), fp32 math, 16-byte bf16 vectors where shapes and pointers allow.
#include "cuda/step_ops.h"

#include <algorithm>

#include "core/error.h"
#include "cuda/block_reduce.cuh"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/moe_combine.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::aligned16;
using detail::blocks_for;
using detail::load_bf16x8;
using detail::load_f32x8;
using detail::store_bf16x8;
using detail::warp_sum;

constexpr int kRowThreads = 256;
constexpr int kGemmRows = 4;  // rows per pass over a weight column in the grouped GEMM
constexpr int kGemmWarps = 8;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// Activations, tokens, caches, page tables, positions, routing weights and grouping arrays: no
// __restrict__ (PDL: their producer may still run when a kernel starts, so no ld.global.nc; see
// mma.cuh ld_act128). Weights, norm weights and the expert pointer tables keep it.

// ---- embedding rows ----
__global__ void __launch_bounds__(kRowThreads)
    embed_kernel(const __nv_bfloat16* __restrict__ embed, int64_t vocab, int64_t hidden,
                 const int32_t* tokens, __nv_bfloat16* __restrict__ out, bool vec) {
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

__global__ void add_residual_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                                    __nv_bfloat16* sum, __nv_bfloat16* res, bool vec) {
  K3_PDL_ENTRY();
  // a, b, sum, res [n]: sum = a + b, then res += sum, each rounded to bf16 as two add_bf16.
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  const int nv = static_cast<int>(imin(8, n - i));
  float x[8], y[8], r[8];
  load_bf16x8(a + i, vec && nv == 8, nv, x);
  load_bf16x8(b + i, vec && nv == 8, nv, y);
  load_bf16x8(res + i, vec && nv == 8, nv, r);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    x[k] = __bfloat162float(__float2bfloat16_rn(x[k] + y[k]));
    r[k] += x[k];
  }
  store_bf16x8(sum + i, vec && nv == 8, nv, x);
  store_bf16x8(res + i, vec && nv == 8, nv, r);
}

// ---- latent cache append ----
__global__ void cache_append_kernel(const __nv_bfloat16* kv, int width, const int32_t* block_table,
                                    int max_pages, const int32_t* position, int page_size,
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
using detail::combine8;
using detail::kCombineMaxK;
using detail::kCombineThreads;

__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const __nv_bfloat16* y, const int32_t* y_pos, const float* weights,
                       int top_k, int64_t width, const float* __restrict__ norm_w, float eps,
                       bool vec, __nv_bfloat16* __restrict__ out) {
  // y [rows * top_k][width]; weights [rows][top_k]; norm_w [width] or null; out [rows][width].
  // One CTA per row, 8 columns per thread; with a norm, rows wider than one pass recompute the
  // same sums (the expert outputs are L2-resident) after the sum of squares.
  detail::pdl_launch_dependents();
  // One pass (K3's latent 3584 = 448 vectors): each thread's only vector stays in registers
  // between the sum of squares and the store, instead of being combined again; its norm weights
  // are requested first (weights: they do not wait on the previous kernel).
  const bool one_pass = width <= kCombineThreads * 8;
  const int64_t c0 = threadIdx.x * 8;
  const int nv0 = static_cast<int>(width - c0 < 8 ? width - c0 : 8);
  float nw0[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  if (one_pass && norm_w && c0 < width) load_f32x8(norm_w + c0, vec && nv0 == 8, nv0, nw0);
  detail::pdl_wait();
  __shared__ float scratch[33];
  __shared__ float w_s[kCombineMaxK];
  __shared__ int32_t rows_s[kCombineMaxK];
  const int64_t r = blockIdx.x;
  if (threadIdx.x < top_k) {
    const int64_t s = r * top_k + threadIdx.x;
    w_s[threadIdx.x] = weights[s];
    rows_s[threadIdx.x] = y_pos ? y_pos[s] : static_cast<int32_t>(s);
  }
  __syncthreads();
  float kept[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (one_pass && threadIdx.x * 8 < width)
    combine8(y, rows_s, w_s, top_k, width, threadIdx.x * 8, vec, kept);
  float inv = 1.0f;
  if (norm_w) {
    float ss = 0.0f;
    for (int64_t c = threadIdx.x * 8; c < width; c += kCombineThreads * 8) {
      float a[8];
      if (one_pass)
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = kept[e];
      else
        combine8(y, rows_s, w_s, top_k, width, c, vec, a);
      ss += detail::combine_sum_sq8(a);  // columns past width are 0
    }
    inv = detail::combine_inv_rms(detail::block_sum(ss, scratch), width, eps);
  }
  for (int64_t c = threadIdx.x * 8; c < width; c += kCombineThreads * 8) {
    float a[8];
    if (one_pass)
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] = kept[e];
    else
      combine8(y, rows_s, w_s, top_k, width, c, vec, a);
    const int nv = static_cast<int>(width - c < 8 ? width - c : 8);
    if (norm_w) {
      float nw[8];
      if (one_pass)
#pragma unroll
        for (int e = 0; e < 8; ++e) nw[e] = nw0[e];
      else
        load_f32x8(norm_w + c, vec && nv == 8, nv, nw);
      detail::combine_scale8(a, inv, nw);
    }
    store_bf16x8(out + r * width + c, vec && nv == 8, nv, a);
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
                          const int32_t* slot_expert, const int32_t* slot_offsets,
                          const int32_t* row_index, int64_t M, const __nv_bfloat16* x, int64_t ldx,
                          int64_t N, int64_t K, void* __restrict__ y, int64_t ldy, bool y_fp32,
                          bool vec) {
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

void add_bf16_residual(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                       __nv_bfloat16* sum, __nv_bfloat16* res, cudaStream_t stream) {
  K3_CHECK(n >= 0, "cuda::add_bf16_residual: n ", n);
  if (n == 0) return;
  const bool vec = aligned16(a) && aligned16(b) && aligned16(sum) && aligned16(res);
  add_residual_kernel<<<blocks_for(n, kRowThreads * 8), kRowThreads, 0, stream>>>(a, b, n, sum, res,
                                                                                  vec);
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
  K3_CHECK(top_k <= kCombineMaxK, "cuda::moe_combine: top_k ", top_k, " above ", kCombineMaxK);
  const bool vec =
      width % 8 == 0 && aligned16(y) && aligned16(out) && (norm_w == nullptr || aligned16(norm_w));
  moe_combine_kernel<<<static_cast<unsigned>(rows), kCombineThreads, 0, stream>>>(
      y, y_pos, weights, top_k, width, norm_w, eps, vec, out);
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
  grouped_linear_kernel<__nv_bfloat16>
      <<<grid, kGemmWarps * 32, 0, stream>>>(g.w, nullptr, g.slot_expert, g.slot_offsets,
                                             g.row_index, 0, x, ldx, N, K, y, ldy, y_fp32, vec);
  K3_CUDA_CHECK_LAUNCH();
}

void linear_f32w(const __nv_bfloat16* x, int64_t ldx, const float* w, int64_t M, int64_t N,
                 int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream) {
  K3_CHECK(M >= 0 && N >= 1 && K >= 1 && ldx >= K && ldy >= N, "cuda::linear_f32w: M ", M, " N ", N,
           " K ", K, " ldx ", ldx, " ldy ", ldy);
  if (M == 0) return;
  const bool vec = K % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w);
  const dim3 grid(blocks_for(N, kGemmWarps), 1);
  grouped_linear_kernel<float><<<grid, kGemmWarps * 32, 0, stream>>>(
      nullptr, w, nullptr, nullptr, nullptr, M, x, ldx, N, K, y, ldy, y_fp32, vec);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
