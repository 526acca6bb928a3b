// L2 prefetch: a grid-stride loop over the 128-byte lines (the L2 line size) of each range. The
// prefetch is fire-and-forget, so a thread issues many of them back to back; evict_last keeps
// the warmed lines in L2 ahead of the streaming traffic until the consuming GEMM reads them.
#include "cuda/l2_prefetch.h"

#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;
constexpr uintptr_t kLine = 128;

__device__ __forceinline__ void prefetch_l2_evict_last(uintptr_t addr) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(addr) : "memory");
}

// 8 loads of 16 B at p + i * step (i < 8, within [p, end)), their values discarded: volatile asm
// keeps them, and 8 distinct destinations keep them in flight together.
#pragma nv_diag_suppress 550  // the loaded values are discarded on purpose
__device__ __forceinline__ void touch8(uintptr_t p, uint64_t step, uintptr_t end) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uintptr_t a = p + i * step;
    if (a + 16 <= end) {
      uint32_t v[4];  // discarded: only the L2 fill matters
      asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                   : "l"(a)
                   : "memory");
    }
  }
}

#pragma nv_diag_default 550

__global__ void __launch_bounds__(kThreads)
    l2_load_kernel(const __grid_constant__ L2PrefetchList list) {
  K3_PDL_ENTRY();
  // list.r[i]: device byte ranges read 16 B per lane (the 16-byte aligned part; a ragged edge
  // of under 16 B stays cold), a warp covering 512 contiguous bytes per load
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int i = 0; i < list.n; ++i) {
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(list.r[i].ptr) + 15) & ~uintptr_t{15};
    const uintptr_t end = reinterpret_cast<uintptr_t>(list.r[i].ptr) + list.r[i].bytes;
    const uint64_t step = threads * 16;
    for (uintptr_t p = begin + tid * 16; p < end; p += 8 * step) touch8(p, step, end);
  }
}

__global__ void __launch_bounds__(kThreads)
    l2_prefetch_kernel(const __grid_constant__ L2PrefetchList list) {
  K3_PDL_ENTRY();
  // list.r[i]: device byte ranges, only hinted (never dereferenced)
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int i = 0; i < list.n; ++i) {
    if (list.r[i].bytes == 0) continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(list.r[i].ptr);
    const uintptr_t end = begin + list.r[i].bytes;
    const uintptr_t first = begin & ~(kLine - 1);
    const uint64_t lines = (end - first + kLine - 1) / kLine;
    // Every address inside the range: the first line is hinted at `begin` itself.
    for (uint64_t l = tid; l < lines; l += stride) {
      const uintptr_t a = first + l * kLine;
      prefetch_l2_evict_last(a < begin ? begin : a);
    }
  }
}

}  // namespace

void l2_prefetch(const L2PrefetchList& list, int ctas, cudaStream_t stream, bool by_load) {
  K3_CHECK(list.n >= 0 && list.n <= L2PrefetchList::kMax, "l2_prefetch: ", list.n,
           " ranges (at most ", L2PrefetchList::kMax, ")");
  K3_CHECK(ctas >= 1 && ctas <= 1024, "l2_prefetch: ", ctas, " CTAs (1..1024)");
  for (int i = 0; i < list.n; ++i)
    K3_CHECK(list.r[i].bytes == 0 || list.r[i].ptr != nullptr, "l2_prefetch: range ", i,
             " is null with ", list.r[i].bytes, " bytes");
  if (list.total() == 0) return;
  if (by_load)
    l2_load_kernel<<<ctas, kThreads, 0, stream>>>(list);
  else
    l2_prefetch_kernel<<<ctas, kThreads, 0, stream>>>(list);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
