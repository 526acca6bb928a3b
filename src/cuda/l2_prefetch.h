// L2 warming for the specialized decode step: a few CTAs on a side stream hint the next
// matrices' first bytes into L2 (evict_last priority) while the main stream runs a
// latency-bound kernel that leaves HBM idle, so the next GEMM starts on L2 hits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace k3::cuda {

// One device byte range to warm (any alignment; null only when bytes == 0).
struct L2Range {
  const void* ptr;
  size_t bytes;
};

struct L2PrefetchList {
  static constexpr int kMax = 8;
  L2Range r[kMax];
  int n = 0;
  size_t total() const {
    size_t t = 0;
    for (int i = 0; i < n; ++i) t += r[i].bytes;
    return t;
  }
};

// Issues prefetch.global.L2::evict_last on every 128-byte line of every range, ranges in list
// order (the first is needed first), over `ctas` CTAs (1..1024; 8-16 beside a latency-bound
// kernel). Reads and writes nothing; an empty list (or zero bytes) launches nothing. No
// allocation, no host sync. A hint: the hardware may drop prefetches.
// by_load: the ranges are read instead (16-byte ld.global.cg per lane, 8 in flight per thread,
// results discarded), which fills L2 for sure (h200-ceilings.md: a prefetch hint barely
// populated L2 in one test, ordinary loads did) at the price of the loads' latency.
void l2_prefetch(const L2PrefetchList& list, int ctas, cudaStream_t stream, bool by_load = false);

}  // namespace k3::cuda
