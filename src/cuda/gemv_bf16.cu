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
// does not depend on anything but its inputs and plan.
#include "cuda/gemv_bf16.h"

#include <cuda_bf16.h>

#include "core/error.h"
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

template <int M, int J>
__global__ void __launch_bounds__(32 * kGemvWarps)
    gemv_bf16_kernel(const __grid_constant__ SkinnyArgs a, int ks, int rpw) {
  pdl_launch_dependents();
  extern __shared__ float part[];  // [rows_cta][ks][M] partial dots
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = warp % ks, row_lane = warp / ks, row_lanes = kGemvWarps / ks;
  const int units = a.k / 8;
  const int u_lo = static_cast<int>(static_cast<int64_t>(units) * seg / ks);
  const int u_hi = static_cast<int>(static_cast<int64_t>(units) * (seg + 1) / ks);
  const int rows_cta = row_lanes * rpw;
  const int row0 = static_cast<int>(blockIdx.x) * rows_cta;
  const int mx = min(a.m, M);
  const __nv_bfloat16* W = static_cast<const __nv_bfloat16*>(a.w);  // [N, K] bf16

  uint4 w_cur[J], w_next[J];
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
  // The first two rows' weights stream before x is ready: behind a latency-bound kernel (a
  // norm, the KDA step, the MoE combine) twice the bytes are in flight when it completes.
  load_row(w_cur, row);
  if (rpw > 1) load_row(w_next, row + row_lanes);
  pdl_wait();
  uint4 xv[M][J];  // [m, K] bf16: this warp's k segment of each token row (zero past m)
#pragma unroll
  for (int t = 0; t < M; ++t)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int u = u_lo + lane + 32 * j;
      xv[t][j] = t < mx && u < u_hi ? ld_act128(a.x + t * a.ldx + u * 8) : make_uint4(0, 0, 0, 0);
    }
  for (int i = 0; i < rpw; ++i) {
    if (i >= 1 && i + 1 < rpw) load_row(w_next, row + row_lanes);  // row i + 1 (1: loaded above)
    float acc[M];
#pragma unroll
    for (int t = 0; t < M; ++t) {
      acc[t] = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) acc[t] = dot8(acc[t], w_cur[j], xv[t][j]);
      acc[t] = warp_sum(acc[t]);
    }
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < M; ++t) part[((i * row_lanes + row_lane) * ks + seg) * M + t] = acc[t];
    }
#pragma unroll
    for (int j = 0; j < J; ++j) w_cur[j] = w_next[j];
    row += row_lanes;
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

template <int M>
GemvKernel gemv_kernel_for_units(int j) {
  switch (j) {
    case 1:
      return gemv_bf16_kernel<M, 1>;
    case 2:
      return gemv_bf16_kernel<M, 2>;
    case 3:
      return gemv_bf16_kernel<M, 3>;
    case 4:
      return gemv_bf16_kernel<M, 4>;
    case 5:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 5>;
      break;
    case 6:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 6>;
      break;
    case 7:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 7>;
      break;
    case 8:
      if constexpr (M == 1) return gemv_bf16_kernel<M, 8>;
      break;
    default:
      break;
  }
  fail("GEMV: no kernel for ", M, " rows with ", j, " units per lane");
}

// Instances for m = 1, 2 and 4 rows (gemv_rows_instance: 3 runs the 4-row one with its last x
// row zero).
GemvKernel gemv_kernel_for(int m, int j) {
  switch (gemv_rows_instance(m)) {
    case 1:
      return gemv_kernel_for_units<1>(j);
    case 2:
      return gemv_kernel_for_units<2>(j);
    default:
      return gemv_kernel_for_units<4>(j);
  }
}

}  // namespace

cudaError_t launch_gemv_bf16(const LinearPlan& p, const SkinnyArgs& a, cudaStream_t stream) {
  K3_CHECK(p.gemv() && p.weight == LinearWeight::BF16 && p.groups == 1 && !a.slot_expert &&
               !a.x_glu && a.m >= 1 && a.m <= p.m && p.m <= kGemvMaxRows,
           "GEMV: a dense bf16 launch of 1..", kGemvMaxRows, " rows only (plan ", p.str(), ", m ",
           a.m, ")");
  const GemvKernel fn = gemv_kernel_for(p.m, gemv_units_per_lane(p.k, p.gemv_ks));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.grid_x()));
  cfg.blockDim = dim3(static_cast<unsigned>(p.threads()));
  cfg.dynamicSmemBytes = p.smem_bytes;
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, fn, a, p.gemv_ks, p.gemv_rpw);
}

}  // namespace k3::cuda::detail
