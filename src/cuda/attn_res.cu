// AttnRes mix. Grid: rows x C CTAs, one cluster of C (<= 8) CTAs per row, each CTA a contiguous
// slice of the row's 8-element vectors, one vector per thread per source held in registers
// (NS sources x 16 B). Per-source sum of squares and <v, w> reduce warp -> CTA -> cluster
// (rank order), every CTA forms the same softmax, then mixes its slice from registers: each
// source element is read from memory once. The kernel is instantiated per source count: with a
// run-time count the per-source warp reductions ran one after another (a loop with an exit),
// and a launch took 0.1 us more per source (5.4 against 4.5 us at 9 sources on the H200).
#include "cuda/attn_res.h"

#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <utility>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/cluster_launch.cuh"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

namespace cg = cooperative_groups;
using detail::aligned16;
constexpr int kMaxS = AttnResSources::kMax;
constexpr int kMaxThreads = 512;
constexpr int kMaxCluster = 8;

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

template <int NS>
__global__ void __launch_bounds__(kMaxThreads)
    attn_res_kernel(const __grid_constant__ AttnResSources s, int64_t row_stride,
                    const float* score_w, int hidden, float eps, __nv_bfloat16* out,
                    int64_t out_stride, float* probs, bool vec) {
  K3_PDL_ENTRY();
  constexpr int n = NS;
  // sources s.src[j]: [rows, hidden] bf16; score_w: [hidden] fp32; out: [rows, hidden] bf16;
  // probs: [rows, n] fp32 or null
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;

  __shared__ float red[kMaxThreads / 32][2 * NS];  // per-warp partials: ss then dot
  __shared__ float part[2 * NS];                   // this CTA's sums (read by the cluster)
  __shared__ float total[2 * NS];                  // the row's sums

  const int e0 = (rank * blockDim.x + threadIdx.x) * 8;  // first element of this thread's vector
  const bool live = e0 < hidden;
  const int nvalid = live ? min(8, hidden - e0) : 0;

  uint4 v[NS];
#pragma unroll
  for (int j = 0; j < NS; ++j)
    v[j] = (j < n && live) ? load_raw8(s.src[j] + row * row_stride + e0, vec, nvalid)
                           : make_uint4(0, 0, 0, 0);
  float w[8];
  if (live)
    detail::load_f32x8(score_w + e0, vec, nvalid, w);
  else
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = 0.0f;

#pragma unroll
  for (int j = 0; j < NS; ++j) {
    if (j >= n) break;
    const uint32_t u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
    float ss = 0.0f, dot = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float a = bf_lo(u[k]), b = bf_hi(u[k]);
      ss += a * a + b * b;
      dot += a * w[2 * k] + b * w[2 * k + 1];
    }
    ss = detail::warp_sum(ss);
    dot = detail::warp_sum(dot);
    if (lane == 0) {
      red[warp][j] = ss;
      red[warp][NS + j] = dot;
    }
  }
  __syncthreads();
  if (threadIdx.x < 2 * NS && (threadIdx.x % NS) < n) {
    float t = 0.0f;
    for (int q = 0; q < nwarps; ++q) t += red[q][threadIdx.x];
    part[threadIdx.x] = t;
  }
  cluster.sync();  // every CTA's part[] is written
  if (threadIdx.x < 2 * NS && (threadIdx.x % NS) < n) {
    total[threadIdx.x] = detail::cluster_sum_in_order(cluster, part + threadIdx.x, C);
  }
  cluster.sync();  // remote reads done (no CTA leaves while others read it); total[] visible

  // Scores and softmax, computed identically by every thread of every CTA of the row.
  float p[NS];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    p[j] = j < n ? total[NS + j] / sqrtf(total[j] / static_cast<float>(hidden) + eps) : 0.0f;
    if (j < n) m = fmaxf(m, p[j]);
  }
  if (n == 1) {
    p[0] = 1.0f;  // layer 0: no mixing, out = v_0 exactly (as the CPU reference)
  } else {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NS; ++j)
      if (j < n) sum += (p[j] = expf(p[j] - m));
    const float inv = 1.0f / sum;
#pragma unroll
    for (int j = 0; j < NS; ++j) p[j] *= inv;
  }
  if (probs && rank == 0 && threadIdx.x < n) {
    float pj = 0.0f;
#pragma unroll
    for (int j = 0; j < NS; ++j)
      if (j == static_cast<int>(threadIdx.x)) pj = p[j];
    probs[row * n + threadIdx.x] = pj;
  }

  if (!live) return;
  float o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    if (j >= n) break;
    const uint32_t u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] += p[j] * bf_lo(u[k]);
      o[2 * k + 1] += p[j] * bf_hi(u[k]);
    }
  }
  detail::store_bf16x8(out + row * out_stride + e0, vec, nvalid, o);
}

template <int... I>
constexpr auto kernel_table(std::integer_sequence<int, I...>) {
  return std::array{&attn_res_kernel<I + 1>...};
}

}  // namespace

namespace detail {

AttnResShape attn_res_shape(int64_t hidden) {
  // Vectors per row, split over C CTAs of T threads (one vector each): C grows first so that a
  // row spreads over several SMs (a single row is latency-bound on one SM). C is a power of two:
  // a cluster of 8 launched 0.2 us faster than one of 7 on the H200 (hidden 7168: 896 vectors,
  // so the eighth CTA holds none and the sums keep the 7-CTA bits).
  const int64_t nv = (hidden + 7) / 8;
  int C = 1;
  while (C < kMaxCluster && C * 128 < nv) C *= 2;
  const int64_t T = ((nv + C - 1) / C + 31) / 32 * 32;
  K3_CHECK(T <= kMaxThreads, "cuda::attn_res: hidden ", hidden, " above the ",
           8 * kMaxThreads * kMaxCluster, " the AttnRes kernels hold in registers");
  return {C, static_cast<int>(T)};
}

}  // namespace detail

void attn_res_mix(const AttnResSources& sources, int n_sources, int64_t row_stride,
                  const float* score_w, int64_t rows, int64_t hidden, float eps, __nv_bfloat16* out,
                  int64_t out_stride, float* probs, cudaStream_t stream) {
  K3_CHECK(n_sources >= 1 && n_sources <= AttnResSources::kMax, "cuda::attn_res_mix: ", n_sources,
           " sources (1..", AttnResSources::kMax, ")");
  K3_CHECK(rows >= 0 && hidden > 0, "cuda::attn_res_mix: rows ", rows, ", hidden ", hidden);
  K3_CHECK(row_stride >= hidden && out_stride >= hidden, "cuda::attn_res_mix: strides ", row_stride,
           "/", out_stride, " below hidden ", hidden);
  K3_CHECK(score_w && out, "cuda::attn_res_mix: null score vector or output");
  bool vec = hidden % 8 == 0 && row_stride % 8 == 0 && out_stride % 8 == 0 && aligned16(out) &&
             aligned16(score_w);
  for (int j = 0; j < n_sources; ++j) {
    K3_CHECK(sources.src[j] != nullptr, "cuda::attn_res_mix: source ", j, " is null");
    vec = vec && aligned16(sources.src[j]);
  }
  if (rows == 0) return;
  const detail::AttnResShape shape = detail::attn_res_shape(hidden);
  const int C = shape.cluster;
  K3_CHECK(rows * C <= 0x7fffffff, "cuda::attn_res_mix: too many rows ", rows);

  const detail::ClusterLaunch launch(dim3(static_cast<unsigned>(rows * C)),
                                     dim3(static_cast<unsigned>(shape.threads)), 0, stream,
                                     static_cast<unsigned>(C));
  static constexpr auto kKernels = kernel_table(std::make_integer_sequence<int, kMaxS>{});
  K3_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kKernels[n_sources - 1], sources, row_stride,
                                   score_w, static_cast<int>(hidden), eps, out, out_stride, probs,
                                   vec));
}

void attn_res_mix(const __nv_bfloat16* bank, int n_sources, int64_t source_stride,
                  int64_t row_stride, const float* score_w, int64_t rows, int64_t hidden, float eps,
                  __nv_bfloat16* out, int64_t out_stride, float* probs, cudaStream_t stream) {
  K3_CHECK(n_sources >= 1 && n_sources <= AttnResSources::kMax, "cuda::attn_res_mix: ", n_sources,
           " sources (1..", AttnResSources::kMax, ")");
  K3_CHECK(bank != nullptr, "cuda::attn_res_mix: null bank");
  K3_CHECK(source_stride >= rows * row_stride, "cuda::attn_res_mix: source stride ", source_stride,
           " below rows * row_stride ", rows * row_stride);
  AttnResSources s;
  for (int j = 0; j < n_sources; ++j) s.src[j] = bank + j * source_stride;
  attn_res_mix(s, n_sources, row_stride, score_w, rows, hidden, eps, out, out_stride, probs,
               stream);
}

}  // namespace k3::cuda
