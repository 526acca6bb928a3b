#include "cuda/rank_ops.h"

#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::blocks_for;

constexpr int kThreads = 256;

// Sums, grouped rows, positions, page tables and partial attention: no __restrict__ (PDL: their
// producer may still run when a kernel starts, so no ld.global.nc; see mma.cuh ld_act128).
__global__ void finish_tp_sum_kernel(const float* sum, int64_t n, __nv_bfloat16* __restrict__ out,
                                     __nv_bfloat16* res, bool res_copy) {
  K3_PDL_ENTRY();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 y = __float2bfloat16_rn(sum[i]);
  out[i] = y;
  if (res != nullptr)
    res[i] = res_copy ? y : __float2bfloat16_rn(__bfloat162float(res[i]) + __bfloat162float(y));
}

__global__ void keep_own_pairs_kernel(int32_t* __restrict__ ids, int64_t rows, int top_k, int tp,
                                      int64_t total) {
  K3_PDL_ENTRY();
  // ids [ranks][rows][top_k]: entry i belongs to source s = i / (rows * top_k), pair p = i % ...
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t per_source = rows * top_k;
  const int64_t s = i / per_source, p = i % per_source;
  if (p % tp != s % tp) ids[i] = -1;
}

__global__ void pairs_kernel(const __nv_bfloat16* grouped, const int32_t* position, int64_t width,
                             __nv_bfloat16* __restrict__ pairs) {
  K3_PDL_ENTRY();
  // One CTA per pair: its row copied from the grouped position, or zeros.
  const int64_t p = blockIdx.x;
  const int32_t g = position[p];
  __nv_bfloat16* dst = pairs + p * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x)
    dst[c] = g >= 0 ? grouped[static_cast<int64_t>(g) * width + c] : __float2bfloat16_rn(0.0f);
}

__global__ void dcp_rows_kernel(const int32_t* position, const int32_t* table, int64_t rows,
                                int pages, int dcp, int rank, int32_t* __restrict__ local_pos,
                                int32_t* __restrict__ seq_rep, int32_t* __restrict__ table_rep) {
  K3_PDL_ENTRY();
  // One CTA per (row, copy c).
  const int64_t r = blockIdx.x, c = blockIdx.y;
  const int pos = position[r];
  if (c == 0 && threadIdx.x == 0) local_pos[r] = pos % dcp == rank ? pos / dcp : -1;
  if (threadIdx.x == 0) seq_rep[c * rows + r] = (pos + dcp - rank) / dcp;
  for (int j = threadIdx.x; j < pages; j += blockDim.x)
    table_rep[(c * rows + r) * pages + j] = table[r * pages + j];
}

__global__ void dcp_merge_kernel(const float* o, const float* lse, int parts, int64_t rows,
                                 int heads, int width, float* __restrict__ out) {
  K3_PDL_ENTRY();
  // One CTA per (row, head); threads over the latent columns.
  const int64_t rh = blockIdx.x;  // r * heads + h
  const int64_t stride = rows * heads;
  float M = -INFINITY;
  for (int c = 0; c < parts; ++c) M = fmaxf(M, lse[c * stride + rh]);
  float S = 0.0f;
  for (int c = 0; c < parts; ++c) {
    const float l = lse[c * stride + rh];
    S += l == -INFINITY ? 0.0f : expf(l - M);
  }
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < parts; ++c) {
      const float l = lse[c * stride + rh];
      if (l == -INFINITY) continue;  // a rank holding none of the row's tokens
      acc += expf(l - M) * o[(c * stride + rh) * width + j];
    }
    out[rh * width + j] = M == -INFINITY ? 0.0f : acc / S;
  }
}

}  // namespace

void finish_tp_sum(const float* sum, int64_t n, __nv_bfloat16* out, __nv_bfloat16* res,
                   bool res_copy, cudaStream_t stream) {
  K3_CHECK(n >= 0, "cuda::finish_tp_sum: n ", n);
  if (n == 0) return;
  finish_tp_sum_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(sum, n, out, res,
                                                                         res_copy);
  K3_CUDA_CHECK_LAUNCH();
}

void ep_keep_own_pairs(int32_t* ids, int ranks, int64_t rows, int top_k, int tp,
                       cudaStream_t stream) {
  K3_CHECK(ranks >= 1 && rows >= 0 && top_k >= 1 && tp >= 1, "cuda::ep_keep_own_pairs: ranks ",
           ranks, " rows ", rows, " top_k ", top_k, " tp ", tp);
  const int64_t total = static_cast<int64_t>(ranks) * rows * top_k;
  if (total == 0 || tp == 1) return;  // tp 1: every pair is its source's own
  keep_own_pairs_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream>>>(ids, rows, top_k, tp,
                                                                              total);
  K3_CUDA_CHECK_LAUNCH();
}

void pairs_from_grouped(const __nv_bfloat16* grouped, const int32_t* position, int64_t n_pairs,
                        int64_t width, __nv_bfloat16* pairs, cudaStream_t stream) {
  K3_CHECK(n_pairs >= 0 && width >= 1, "cuda::pairs_from_grouped: pairs ", n_pairs, " width ",
           width);
  if (n_pairs == 0) return;
  pairs_kernel<<<static_cast<unsigned>(n_pairs), 128, 0, stream>>>(grouped, position, width, pairs);
  K3_CUDA_CHECK_LAUNCH();
}

void dcp_rows(const int32_t* position, const int32_t* table, int64_t rows, int pages, int dcp,
              int rank, int32_t* local_pos, int32_t* seq_rep, int32_t* table_rep,
              cudaStream_t stream) {
  K3_CHECK(rows >= 0 && pages >= 1 && dcp >= 1 && rank >= 0 && rank < dcp, "cuda::dcp_rows: rows ",
           rows, " pages ", pages, " dcp ", dcp, " rank ", rank);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(dcp));
  dcp_rows_kernel<<<grid, 128, 0, stream>>>(position, table, rows, pages, dcp, rank, local_pos,
                                            seq_rep, table_rep);
  K3_CUDA_CHECK_LAUNCH();
}

void dcp_merge_attention(const float* o, const float* lse, int parts, int64_t rows, int heads,
                         int width, float* out, cudaStream_t stream) {
  K3_CHECK(parts >= 1 && rows >= 0 && heads >= 1 && width >= 1, "cuda::dcp_merge_attention: parts ",
           parts, " rows ", rows, " heads ", heads, " width ", width);
  if (rows == 0) return;
  dcp_merge_kernel<<<static_cast<unsigned>(rows * heads), 128, 0, stream>>>(o, lse, parts, rows,
                                                                            heads, width, out);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
