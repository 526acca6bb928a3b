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

void l2_prefetch(const L2PrefetchList& list, int ctas, cudaStream_t stream) {
  K3_CHECK(list.n >= 0 && list.n <= L2PrefetchList::kMax, "l2_prefetch: ", list.n,
           " ranges (at most ", L2PrefetchList::kMax, ")");
  K3_CHECK(ctas >= 1 && ctas <= 1024, "l2_prefetch: ", ctas, " CTAs (1..1024)");
  for (int i = 0; i < list.n; ++i)
    K3_CHECK(list.r[i].bytes == 0 || list.r[i].ptr != nullptr, "l2_prefetch: range ", i,
             " is null with ", list.r[i].bytes, " bytes");
  if (list.total() == 0) return;
  l2_prefetch_kernel<<<ctas, kThreads, 0, stream>>>(list);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
