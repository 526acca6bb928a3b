// The few-row bf16 GEMV: y[m, N] = x[m, K] . W[N, K]^T, m <= 4, with the skinny GEMM's epilogue
// (skinny_gemm.cuh: store_output). Decode at batch 1 runs every dense projection with one token
// row, where the tiled mma kernel stages W through shared memory for an mma that is 1/8 used;
// this kernel streams W straight into registers instead (measured: 3.43 against 2.9 TB/s on a
// 51 MB matrix, 2.3 against 1.5 TB/s on 11 MB; bench/RESULTS.md).
//
// Layout. A CTA is 8 warps: ks k segments x (8 / ks) row lanes. A warp holds its segment of the
// m x rows in registers (J 16-byte units per lane: lane l takes units l, l + 32, ...) and streams
// rpw rows of W, the next row's loads in flight while the current one is summed (the first two
// rows are requested before waiting on the previous kernel). Partial dots meet
// in fixed order: lanes by an xor tree, then the ks segments in shared memory, so a shape's result
// does not depend on anything but its inputs and plan (ks; not rpw).
//
// Combined input (kCombine, linear_bf16_combined): every CTA computes the whole x rows as the
// MoE combine (+ latent RMSNorm) of the expert outputs into shared memory, with moe_combine's
// bits (moe_combine.cuh: its 512 threads are 2 virtual threads of each of these 256), then
// reads its segments from there: the combine kernel's launch leaves the critical path, and the
// first weight rows still stream before the wait.
#include "cuda/gemv_bf16.h"

#include <cuda_bf16.h>

#include "core/error.h"
#include "cuda/block_reduce.cuh"
#include "cuda/linear_launch.cuh"
#include "cuda/moe_combine.cuh"
#include "cuda/pdl.cuh"
#include "cuda/skinny_gemm.cuh"

namespace k3::cuda::detail {
namespace {

constexpr int kGemvWarps = 8;

__device__ __forceinline__ float dot8(float acc, uint4 w, uint4 x) {
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(wp[i]);
    const float2 b = __bfloat1622float2(xp[i]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

constexpr int kCombineVirtual = kCombineThreads / (32 * kGemvWarps);  // per real thread
static_assert(kCombineVirtual * 32 * kGemvWarps == kCombineThreads);
static_assert(gemv_takes_combined(8 * kCombineThreads, kCombineMaxK) &&
              !gemv_takes_combined(8 * kCombineThreads + 8, 1) &&
              !gemv_takes_combined(8, kCombineMaxK + 1));

// This thread's latent norm weights (its virtual threads' 8 columns each; 1 without a norm).
__device__ __forceinline__ void load_combine_norm(const SkinnyArgs& a,
                                                  float (&nw)[kCombineVirtual][8]) {
#pragma unroll
  for (int j = 0; j < kCombineVirtual; ++j) {
    const int c = (threadIdx.x + j * blockDim.x) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) nw[j][e] = 1.0f;
    if (a.combine_norm && c < a.k) load_f32x8(a.combine_norm + c, true, 8, nw[j]);
  }
}

// xs [mx][k] bf16 = the combined (and normed) x rows, as moe_combine_kernel computes them (one
// pass: k <= 8 * kCombineThreads, k % 8 == 0, 16-byte aligned operands: the launcher checks).
__device__ __forceinline__ void stage_combined_x(const SkinnyArgs& a, int mx,
                                                 const float (&nw)[kCombineVirtual][8],
                                                 __nv_bfloat16* xs) {
  __shared__ float scratch[33];
  __shared__ float w_s[kCombineMaxK];
  __shared__ int32_t rows_s[kCombineMaxK];
  const int top_k = a.combine_k;
  for (int t = 0; t < mx; ++t) {
    if (static_cast<int>(threadIdx.x) < top_k) {
      const int s = t * top_k + static_cast<int>(threadIdx.x);
      w_s[threadIdx.x] = a.combine_w[s];
      rows_s[threadIdx.x] = a.combine_pos ? a.combine_pos[s] : s;
    }
    __syncthreads();
    float v[kCombineVirtual][8], ss[kCombineVirtual];
#pragma unroll
    for (int j = 0; j < kCombineVirtual; ++j) {
      const int c = (threadIdx.x + j * blockDim.x) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[j][e] = 0.0f;
      if (c < a.k) combine8(a.combine_y, rows_s, w_s, top_k, a.k, c, true, v[j]);
      ss[j] = combine_sum_sq8(v[j]);
    }
    if (a.combine_norm) {
      const float inv =
          combine_inv_rms(block_sum_virtual<kCombineVirtual>(ss, scratch), a.k, a.combine_eps);
#pragma unroll
      for (int j = 0; j < kCombineVirtual; ++j) combine_scale8(v[j], inv, nw[j]);
    }
#pragma unroll
    for (int j = 0; j < kCombineVirtual; ++j) {
      const int c = (threadIdx.x + j * blockDim.x) * 8;
      if (c < a.k) store_bf16x8(xs + static_cast<int64_t>(t) * a.k + c, true, 8, v[j]);
    }
    __syncthreads();  // w_s / rows_s are the next row's; xs complete
  }
}

template <int M, int J, bool kCombine>
__global__ void __launch_bounds__(32 * kGemvWarps)
    gemv_bf16_kernel(const __grid_constant__ SkinnyArgs a, int ks, int rpw) {
  // P: rows of W in flight per warp (a ring of P rows in registers), all P requested before the
  // wait; each row's dot is the same whatever P, so P changes the timing only. Rings of 4-8 rows
  // for up to 4 units per lane measured 10.6% slower over the batch-1 step (bench/RESULTS.md,
  // eighteenth stop).
  constexpr int P = 2;
  pdl_launch_dependents();
  extern __shared__ __align__(16) uint8_t gemv_smem[];
  // [mx][k] bf16 combined x (kCombine; x_bytes), then [rows_cta][ks][M] fp32 partial dots.
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(gemv_smem);
  float* part = reinterpret_cast<float*>(gemv_smem + a.x_bytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = warp % ks, row_lane = warp / ks, row_lanes = kGemvWarps / ks;
  const int units = a.k / 8;
  const int u_lo = static_cast<int>(static_cast<int64_t>(units) * seg / ks);
  const int u_hi = static_cast<int>(static_cast<int64_t>(units) * (seg + 1) / ks);
  const int rows_cta = row_lanes * rpw;
  const int row0 = static_cast<int>(blockIdx.x) * rows_cta;
  const int mx = min(a.m, M);
  const __nv_bfloat16* W = static_cast<const __nv_bfloat16*>(a.w);  // [N, K] bf16

  uint4 w_ring[P][J];
  const auto load_row = [&](uint4(&w)[J], int row) {
    const bool ok = row < a.n;
    const uint4* src = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(ok ? row : 0) * a.k);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int u = u_lo + lane + 32 * j;
      w[j] = ok && u < u_hi ? ldg_stream(src + u) : make_uint4(0, 0, 0, 0);
    }
  };
  int row = row0 + row_lane;  // rows row0 + row_lane + i * row_lanes, i < rpw
  // The first P rows' weights stream before x is ready: behind a latency-bound kernel (a norm,
  // the KDA step, the MoE combine) P rows' bytes are in flight (or arrived) when it completes.
#pragma unroll
  for (int q = 0; q < P; ++q)
    if (q < rpw) load_row(w_ring[q], row + q * row_lanes);
  float nw[kCombineVirtual][8];
  if constexpr (kCombine) load_combine_norm(a, nw);  // weights: before the wait
  pdl_wait();
  if constexpr (kCombine) stage_combined_x(a, mx, nw, xs);
  uint4 xv[M][J];  // [m, K] bf16: this warp's k segment of each token row (zero past m)
#pragma unroll
  for (int t = 0; t < M; ++t)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int u = u_lo + lane + 32 * j;
      if (!(t < mx && u < u_hi))
        xv[t][j] = make_uint4(0, 0, 0, 0);
      else if constexpr (kCombine)
        xv[t][j] = *reinterpret_cast<const uint4*>(xs + t * a.k + u * 8);
      else
        xv[t][j] = ld_act128(a.x + t * a.ldx + u * 8);
    }
  // Row i sits in ring slot i % P (unrolled by P so the slot is static); once summed, the slot
  // takes row i + P.
  for (int i0 = 0; i0 < rpw; i0 += P) {
#pragma unroll
    for (int q = 0; q < P; ++q) {
      const int i = i0 + q;
      if (i >= rpw) break;
      float acc[M];
#pragma unroll
      for (int t = 0; t < M; ++t) {
        acc[t] = 0.0f;
#pragma unroll
        for (int j = 0; j < J; ++j) acc[t] = dot8(acc[t], w_ring[q][j], xv[t][j]);
        acc[t] = warp_sum(acc[t]);
      }
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < M; ++t) part[((i * row_lanes + row_lane) * ks + seg) * M + t] = acc[t];
      }
      if (i + P < rpw) load_row(w_ring[q], row + (i + P) * row_lanes);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < rows_cta * mx; e += blockDim.x) {
    const int r = e / mx, t = e % mx;
    const int out_row = row0 + r;  // part's rows are the CTA's rows in order
    if (out_row >= a.n) continue;
    float s = 0.0f;
    for (int q = 0; q < ks; ++q) s += part[(r * ks + q) * M + t];
    store_output(a, static_cast<int64_t>(t) * a.ldy + out_row, s);
  }
}

using GemvKernel = void (*)(SkinnyArgs, int, int);

template <int M, bool kCombine>
GemvKernel gemv_kernel_for_units(int j) {
  switch (j) {
    case 1:
      return gemv_bf16_kernel<M, 1, kCombine>;
    case 2:
      return gemv_bf16_kernel<M, 2, kCombine>;
    case 3:
      return gemv_bf16_kernel<M, 3, kCombine>;
    case 4:
      return gemv_bf16_kernel<M, 4, kCombine>;
    case 5:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 5, kCombine>;
      break;
    case 6:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 6, kCombine>;
      break;
    case 7:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 7, kCombine>;
      break;
    case 8:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 8, kCombine>;
      break;
    default:
      break;
  }
  fail("GEMV: no kernel for ", M, " rows with ", j, " units per lane");
}

// Instances for m = 1, 2 and 4 rows (gemv_rows_instance: 3 runs the 4-row one with its last x
// row zero).
template <bool kCombine>
GemvKernel gemv_kernel_for(int m, int j) {
  switch (gemv_rows_instance(m)) {
    case 1:
      return gemv_kernel_for_units<1, kCombine>(j);
    case 2:
      return gemv_kernel_for_units<2, kCombine>(j);
    default:
      return gemv_kernel_for_units<4, kCombine>(j);
  }
}

}  // namespace

cudaError_t launch_gemv_bf16(const LinearPlan& p, const SkinnyArgs& args, cudaStream_t stream) {
  K3_CHECK(p.gemv() && p.weight == LinearWeight::BF16 && p.groups == 1 && !args.slot_expert &&
               !args.x_glu && args.m >= 1 && args.m <= p.m && p.m <= kGemvMaxRows,
           "GEMV: a dense bf16 launch of 1..", kGemvMaxRows, " rows only (plan ", p.str(), ", m ",
           args.m, ")");
  SkinnyArgs a = args;
  const bool combine = a.combine_y != nullptr;
  a.x_bytes = 0;
  if (combine) {
    K3_CHECK(gemv_takes_combined(a.k, a.combine_k) && a.combine_w, "GEMV: a combined input of ",
             a.combine_k, " choices over width ", a.k, " does not fit the kernel");
    a.x_bytes = gemv_rows_instance(p.m) * a.k * static_cast<int>(sizeof(__nv_bfloat16));
  }
  const int j = gemv_units_per_lane(p.k, p.gemv_ks);
  const GemvKernel fn = combine ? gemv_kernel_for<true>(p.m, j) : gemv_kernel_for<false>(p.m, j);
  if (combine) allow_max_smem(reinterpret_cast<const void*>(fn));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.grid_x()));
  cfg.blockDim = dim3(static_cast<unsigned>(p.threads()));
  cfg.dynamicSmemBytes = p.smem_bytes + static_cast<size_t>(a.x_bytes);
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, fn, a, p.gemv_ks, p.gemv_rpw);
}

}  // namespace k3::cuda::detail
