// Argmax. Grid: rows x C CTAs, one cluster of C per row, each CTA a contiguous slice of the row
// read with 16-byte loads (several in flight per thread). (value, index) pairs merge with "larger
// value, then lower index", an order-independent rule, so the result is exact and deterministic.
#include "cuda/argmax.h"

#include <cooperative_groups.h>

#include <algorithm>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/cluster_launch.cuh"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

namespace cg = cooperative_groups;
constexpr int kThreads = 512;
constexpr int64_t kNone = INT64_MAX;  // no candidate yet (every element so far was NaN)

struct Best {
  float v;
  int64_t i;
};

// b replaces a when larger, or equal with a lower index. NaN never compares larger or equal.
__device__ __forceinline__ void merge(Best& a, float v, int64_t i) {
  if (v > a.v || (v == a.v && i < a.i)) a = {v, i};
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int64_t i = __shfl_xor_sync(0xffffffffu, b.i, o);
    merge(b, v, i);
  }
  return b;
}

template <typename Id>
__global__ void __launch_bounds__(kThreads)
    argmax_kernel(const float* logits, int64_t stride, int64_t n, Id* ids, bool vec) {
  K3_PDL_ENTRY();
  // logits: [rows, n] fp32; ids: [rows]
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / C;
  const float* x = logits + row * stride;  // [n]
  // This CTA's slice [lo, hi), in whole float4s when vec.
  const int64_t n4 = (n + 3) / 4;
  const int64_t lo4 = n4 * rank / C, hi4 = n4 * (rank + 1) / C;
  Best b{-INFINITY, kNone};
  if (vec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    constexpr int kUnroll = 4;              // independent 16-byte loads in flight per thread
    const int64_t full4 = min(hi4, n / 4);  // float4s wholly inside the row
    int64_t q = lo4 + threadIdx.x;
    for (; q + (kUnroll - 1) * kThreads < full4; q += kUnroll * kThreads) {
      float4 f[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) f[u] = x4[q + u * kThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = 4 * (q + u * kThreads);
        merge(b, f[u].x, i);
        merge(b, f[u].y, i + 1);
        merge(b, f[u].z, i + 2);
        merge(b, f[u].w, i + 3);
      }
    }
    for (; q < hi4; q += kThreads) {
      const int64_t i = 4 * q;
      if (i + 3 < n) {
        const float4 f = x4[q];
        merge(b, f.x, i);
        merge(b, f.y, i + 1);
        merge(b, f.z, i + 2);
        merge(b, f.w, i + 3);
      } else {
        for (int64_t k = i; k < n; ++k) merge(b, x[k], k);
      }
    }
  } else {
    const int64_t hi = min(4 * hi4, n);
    for (int64_t i = 4 * lo4 + threadIdx.x; i < hi; i += kThreads) merge(b, x[i], i);
  }

  __shared__ Best warps[kThreads / 32];
  __shared__ Best cta;
  b = warp_best(b);
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = b;
  __syncthreads();
  if (threadIdx.x < 32) {
    Best t = threadIdx.x < blockDim.x / 32 ? warps[threadIdx.x] : Best{-INFINITY, kNone};
    t = warp_best(t);
    if (threadIdx.x == 0) cta = t;
  }
  cluster.sync();
  if (rank == 0 && threadIdx.x == 0) {
    Best t{-INFINITY, kNone};
    for (int q = 0; q < C; ++q) {
      const Best r = *cluster.map_shared_rank(&cta, q);
      merge(t, r.v, r.i);
    }
    ids[row] = static_cast<Id>(t.i == kNone ? 0 : t.i);
  }
  cluster.sync();  // keep every CTA's shared memory alive until rank 0 has read it
}

template <typename Id>
void launch(const float* logits, int64_t stride, int64_t rows, int64_t n, Id* ids,
            cudaStream_t stream) {
  K3_CHECK(rows >= 0 && n > 0, "cuda::argmax: rows ", rows, ", n ", n);
  K3_CHECK(stride >= n, "cuda::argmax: stride ", stride, " below n ", n);
  K3_CHECK(logits && ids, "cuda::argmax: null logits or ids");
  if (rows == 0) return;
  const bool vec = stride % 4 == 0 && detail::aligned16(logits);
  // About 8K logits per CTA before the row is split further (up to 8 CTAs).
  const int C = static_cast<int>(std::clamp<int64_t>((n + 8191) / 8192, 1, 8));
  K3_CHECK(rows * C <= 0x7fffffff, "cuda::argmax: too many rows ", rows);
  const detail::ClusterLaunch launch(dim3(static_cast<unsigned>(rows * C)), dim3(kThreads), 0,
                                     stream, static_cast<unsigned>(C));
  K3_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, argmax_kernel<Id>, logits, stride, n, ids, vec));
}

}  // namespace

void argmax(const float* logits, int64_t stride, int64_t rows, int64_t n, int32_t* ids,
            cudaStream_t stream) {
  K3_CHECK(n <= INT32_MAX, "cuda::argmax: n ", n, " does not fit int32 ids");
  launch(logits, stride, rows, n, ids, stream);
}
void argmax(const float* logits, int64_t stride, int64_t rows, int64_t n, int64_t* ids,
            cudaStream_t stream) {
  launch(logits, stride, rows, n, ids, stream);
}

}  // namespace k3::cuda
