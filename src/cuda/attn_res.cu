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
#include "cuda/attn_res_mix.cuh"
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

template <int NS>
__global__ void __launch_bounds__(kMaxThreads)
    attn_res_kernel(const __grid_constant__ AttnResSources s, int64_t row_stride,
                    const float* score_w, int hidden, float eps, __nv_bfloat16* out,
                    int64_t out_stride, float* probs, bool vec) {
  K3_PDL_ENTRY();
  // sources s.src[j]: [rows, hidden] bf16; score_w: [hidden] fp32; out: [rows, hidden] bf16;
  // probs: [rows, NS] fp32 or null
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / C;

  __shared__ float red[kMaxThreads / 32][2 * NS];  // per-warp partials: ss then dot
  __shared__ float part[2 * NS];                   // this CTA's sums (read by the cluster)
  __shared__ float total[2 * NS];                  // the row's sums

  const int e0 = (rank * blockDim.x + threadIdx.x) * 8;  // first element of this thread's vector
  const bool live = e0 < hidden;
  const int nvalid = live ? min(8, hidden - e0) : 0;

  uint4 v[NS];
  detail::load_sources(v, s, row, row_stride, e0, live, vec, nvalid);
  float w[8];
  detail::load_weights8(score_w + e0, live, vec, nvalid, 0.0f, w);
  detail::source_partials<NS>(v, w, red);
  __syncthreads();
  if (threadIdx.x < 2 * NS) part[threadIdx.x] = detail::cta_partial<NS>(red, threadIdx.x);
  cluster.sync();  // every CTA's part[] is written
  if (threadIdx.x < 2 * NS)
    total[threadIdx.x] = detail::cluster_sum_in_order(cluster, part + threadIdx.x, C);
  cluster.sync();  // remote reads done (no CTA leaves while others read it); total[] visible

  // Mixing weights, computed identically by every thread of every CTA of the row.
  float p[NS];
  detail::mix_weights(p, total, hidden, eps);
  if (probs && rank == 0 && threadIdx.x < NS) {
    float pj = 0.0f;
#pragma unroll
    for (int j = 0; j < NS; ++j)
      if (j == static_cast<int>(threadIdx.x)) pj = p[j];
    probs[row * NS + threadIdx.x] = pj;
  }

  if (!live) return;
  float o[8];
  detail::mix8(v, p, o);
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

bool attn_res_sources_aligned(const AttnResSources& s, int n_sources, const char* op) {
  K3_CHECK(n_sources >= 1 && n_sources <= AttnResSources::kMax, op, ": ", n_sources,
           " sources (1..", AttnResSources::kMax, ")");
  bool aligned = true;
  for (int j = 0; j < n_sources; ++j) {
    K3_CHECK(s.src[j] != nullptr, op, ": source ", j, " is null");
    aligned = aligned && aligned16(s.src[j]);
  }
  return aligned;
}

AttnResSources attn_res_bank(const __nv_bfloat16* bank, int n_sources, int64_t source_stride,
                             int64_t rows, int64_t row_stride, const char* op) {
  K3_CHECK(n_sources >= 1 && n_sources <= AttnResSources::kMax, op, ": ", n_sources,
           " sources (1..", AttnResSources::kMax, ")");
  K3_CHECK(bank != nullptr, op, ": null bank");
  K3_CHECK(source_stride >= rows * row_stride, op, ": source stride ", source_stride,
           " below rows * row_stride ", rows * row_stride);
  AttnResSources s;
  for (int j = 0; j < n_sources; ++j) s.src[j] = bank + j * source_stride;
  return s;
}

}  // namespace detail

void attn_res_mix(const AttnResSources& sources, int n_sources, int64_t row_stride,
                  const float* score_w, int64_t rows, int64_t hidden, float eps, __nv_bfloat16* out,
                  int64_t out_stride, float* probs, cudaStream_t stream) {
  const bool aligned = detail::attn_res_sources_aligned(sources, n_sources, "cuda::attn_res_mix");
  K3_CHECK(rows >= 0 && hidden > 0, "cuda::attn_res_mix: rows ", rows, ", hidden ", hidden);
  K3_CHECK(row_stride >= hidden && out_stride >= hidden, "cuda::attn_res_mix: strides ", row_stride,
           "/", out_stride, " below hidden ", hidden);
  K3_CHECK(score_w && out, "cuda::attn_res_mix: null score vector or output");
  const bool vec = aligned && hidden % 8 == 0 && row_stride % 8 == 0 && out_stride % 8 == 0 &&
                   aligned16(out) && aligned16(score_w);
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
  attn_res_mix(
      detail::attn_res_bank(bank, n_sources, source_stride, rows, row_stride, "cuda::attn_res_mix"),
      n_sources, row_stride, score_w, rows, hidden, eps, out, out_stride, probs, stream);
}

}  // namespace k3::cuda
