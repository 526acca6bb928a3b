// AttnRes mix + RMSNorm. The mix half is attn_res.cu's kernel step for step (same cluster shape,
// same per-thread vectors, same reduction and accumulation order), so h has attn_res_mix's
// bits. The mixed vector then stays in registers: it is rounded to bf16, its sum of squares
// reduces warp -> CTA -> cluster (rank order) like the scores did, and every CTA scales its
// slice. Compared with attn_res_mix + rms_norm this saves a launch, h's round trip through
// memory and the norm's single-CTA-per-row reduction. Each cluster reduction pushes a rank's
// sums into every CTA and then syncs once (two cluster barriers in all, where reading the
// ranks' sums remotely took three), and the weights are read before waiting on the previous
// kernel. Instantiated per source count, as attn_res.cu's kernel (its per-source reductions
// interleave).
#include "cuda/attn_res_norm.h"

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
constexpr int kMaxCluster = 8;  // CTAs per row (attn_res_mix_norm's cluster shape)

template <int NS>
__global__ void __launch_bounds__(kMaxThreads)
    attn_res_norm_kernel(const __grid_constant__ AttnResSources s, int64_t row_stride,
                         const float* score_w, int hidden, float eps, const float* norm_w,
                         __nv_bfloat16* x_out, int64_t x_stride, __nv_bfloat16* h_out,
                         int64_t h_stride, bool vec) {
  // sources s.src[j]: [rows, hidden] bf16; score_w, norm_w: [hidden] fp32 (norm_w may be null);
  // x_out: [rows, hidden] bf16; h_out: [rows, hidden] bf16 or null
  detail::pdl_launch_dependents();
  cg::cluster_group cluster = cg::this_cluster();
  // Arrive now, wait before the first push into another CTA's shared memory (which must have
  // started): by then every CTA has long arrived, so the wait costs nothing.
  cluster.barrier_arrive();
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;

  __shared__ float red[kMaxThreads / 32][2 * NS];  // per-warp partials: ss then dot
  // Each rank's sums, pushed by that rank into every CTA of the cluster (one barrier, then
  // local reads, instead of a barrier, remote reads and a barrier to keep the CTAs alive).
  __shared__ float part[kMaxCluster][2 * NS];
  __shared__ float total[2 * NS];            // the row's sums
  __shared__ float red_h[kMaxThreads / 32];  // per-warp sum of h^2
  __shared__ float part_h[kMaxCluster];      // each rank's sum of h^2 (pushed)

  const int e0 = (rank * blockDim.x + threadIdx.x) * 8;  // first element of this thread's vector
  const bool live = e0 < hidden;
  const int nvalid = live ? min(8, hidden - e0) : 0;

  // The score and norm weights first: they do not depend on the previous kernel.
  float w[8], nw[8];
  detail::load_weights8(score_w + e0, live, vec, nvalid, 0.0f, w);
  detail::load_weights8(norm_w ? norm_w + e0 : nullptr, live && norm_w, vec, nvalid, 1.0f, nw);
  detail::pdl_wait();

  // ---- Mix (attn_res_mix's bits) ----
  uint4 v[NS];
  detail::load_sources(v, s, row, row_stride, e0, live, vec, nvalid);
  detail::source_partials<NS>(v, w, red);
  __syncthreads();
  cluster.barrier_wait();  // every CTA has started: pushes may go out
  if (threadIdx.x < 2 * NS) {
    const float t = detail::cta_partial<NS>(red, threadIdx.x);
    for (int q = 0; q < C; ++q) *cluster.map_shared_rank(&part[rank][threadIdx.x], q) = t;
  }
  cluster.sync();  // every rank's sums have landed here
  if (threadIdx.x < 2 * NS) {
    float t = 0.0f;  // in rank order (cluster_sum_in_order's bits)
    for (int q = 0; q < C; ++q) t += part[q][threadIdx.x];
    total[threadIdx.x] = t;
  }
  __syncthreads();

  float p[NS];
  detail::mix_weights(p, total, hidden, eps);
  float o[8];
  detail::mix8(v, p, o);

  // ---- RMSNorm of the bf16-rounded h ----
  float h[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 r = __floats2bfloat162_rn(o[2 * k], o[2 * k + 1]);
    h[2 * k] = __low2float(r);
    h[2 * k + 1] = __high2float(r);
  }
  if (live && h_out) detail::store_bf16x8(h_out + row * h_stride + e0, vec, nvalid, h);
  // Elements past hidden are 0 (zero-loaded sources), so they add nothing.
  float hs = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) hs += h[k] * h[k];
  hs = detail::warp_sum(hs);
  if (lane == 0) red_h[warp] = hs;
  __syncthreads();
  if (threadIdx.x < C) {  // thread q pushes this rank's sum to rank q
    float t = 0.0f;
    for (int q = 0; q < nwarps; ++q) t += red_h[q];
    *cluster.map_shared_rank(&part_h[rank], static_cast<int>(threadIdx.x)) = t;
  }
  cluster.sync();  // every rank's sum has landed; no remote access follows, so CTAs may leave

  if (!live) return;
  float total_h = 0.0f;  // in rank order
  for (int q = 0; q < C; ++q) total_h += part_h[q];
  const float inv = 1.0f / sqrtf(total_h / static_cast<float>(hidden) + eps);
  float x[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = h[k] * inv * nw[k];  // (h * inv) * w, as the references
  detail::store_bf16x8(x_out + row * x_stride + e0, vec, nvalid, x);
}

template <int... I>
constexpr auto kernel_table(std::integer_sequence<int, I...>) {
  return std::array{&attn_res_norm_kernel<I + 1>...};
}

}  // namespace

void attn_res_mix_norm(const AttnResSources& sources, int n_sources, int64_t row_stride,
                       const float* score_w, int64_t rows, int64_t hidden, float eps,
                       const float* norm_w, __nv_bfloat16* x_out, int64_t x_stride,
                       cudaStream_t stream, __nv_bfloat16* h_out, int64_t h_stride) {
  const bool aligned =
      detail::attn_res_sources_aligned(sources, n_sources, "cuda::attn_res_mix_norm");
  K3_CHECK(rows >= 0 && hidden > 0, "cuda::attn_res_mix_norm: rows ", rows, ", hidden ", hidden);
  K3_CHECK(row_stride >= hidden && x_stride >= hidden && (h_out == nullptr || h_stride >= hidden),
           "cuda::attn_res_mix_norm: strides ", row_stride, "/", x_stride, "/", h_stride,
           " below hidden ", hidden);
  K3_CHECK(score_w && x_out, "cuda::attn_res_mix_norm: null score vector or output");
  const bool vec = aligned && hidden % 8 == 0 && row_stride % 8 == 0 && x_stride % 8 == 0 &&
                   aligned16(x_out) && aligned16(score_w) &&
                   (norm_w == nullptr || aligned16(norm_w)) &&
                   (h_out == nullptr || (h_stride % 8 == 0 && aligned16(h_out)));
  if (rows == 0) return;
  // The cluster shape of attn_res_mix (the mix's bits depend on it).
  const detail::AttnResShape shape = detail::attn_res_shape(hidden);
  const int C = shape.cluster;
  K3_CHECK(C <= kMaxCluster && shape.threads <= kMaxThreads,
           "cuda::attn_res_mix_norm: cluster shape ", C, " x ", shape.threads);
  K3_CHECK(rows * C <= 0x7fffffff, "cuda::attn_res_mix_norm: too many rows ", rows);

  const detail::ClusterLaunch launch(dim3(static_cast<unsigned>(rows * C)),
                                     dim3(static_cast<unsigned>(shape.threads)), 0, stream,
                                     static_cast<unsigned>(C));
  static constexpr auto kKernels = kernel_table(std::make_integer_sequence<int, kMaxS>{});
  K3_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kKernels[n_sources - 1], sources, row_stride,
                                   score_w, static_cast<int>(hidden), eps, norm_w, x_out, x_stride,
                                   h_out, h_stride, vec));
}

void attn_res_mix_norm(const __nv_bfloat16* bank, int n_sources, int64_t source_stride,
                       int64_t row_stride, const float* score_w, int64_t rows, int64_t hidden,
                       float eps, const float* norm_w, __nv_bfloat16* x_out, int64_t x_stride,
                       cudaStream_t stream, __nv_bfloat16* h_out, int64_t h_stride) {
  attn_res_mix_norm(detail::attn_res_bank(bank, n_sources, source_stride, rows, row_stride,
                                          "cuda::attn_res_mix_norm"),
                    n_sources, row_stride, score_w, rows, hidden, eps, norm_w, x_out, x_stride,
                    stream, h_out, h_stride);
}

}  // namespace k3::cuda
