#include "cuda/moe_dispatch.h"

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/moe_group.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxExperts = 1024;
constexpr int kMaxPairs = kMaxGroupedPairs;

// ids: no __restrict__ (PDL: the router may still run when this kernel starts; see mma.cuh
// ld_act128).
__global__ void __launch_bounds__(kThreads)
    group_kernel(const int32_t* ids, int n, int top_k, int first, int E,
                 int32_t* __restrict__ slot_expert, int32_t* __restrict__ slot_offsets,
                 int32_t* __restrict__ row_index, int32_t* __restrict__ position, bool compact) {
  K3_PDL_ENTRY();
  __shared__ detail::GroupScratch<kMaxExperts, kMaxPairs> sm;
  detail::group_pairs(sm, ids, n, top_k, first, E, slot_expert, slot_offsets, row_index, position,
                      compact);
}

void launch_group(const int32_t* ids, int64_t rows, int top_k, LocalExperts local,
                  int32_t* slot_expert, int32_t* slot_offsets, int32_t* row_index,
                  int32_t* position, bool compact, cudaStream_t stream) {
  const int64_t n = rows * top_k;
  K3_CHECK(local.count >= 1 && local.count <= kMaxExperts && local.begin >= 0,
           "moe_group_by_expert: local experts [", local.begin, ", ", local.begin + local.count,
           ") (1 to ", kMaxExperts, " of them)");
  K3_CHECK(n >= 0 && n <= kMaxPairs, "moe_group_by_expert: ", n, " (row, choice) pairs (at most ",
           kMaxPairs, ")");
  if (n == 0) return;
  group_kernel<<<1, kThreads, 0, stream>>>(ids, static_cast<int>(n), top_k, local.begin,
                                           local.count, slot_expert, slot_offsets, row_index,
                                           position, compact);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_group_by_expert(const int32_t* ids, int64_t rows, int top_k, LocalExperts local,
                         int32_t* slot_expert, int32_t* slot_offsets, int32_t* row_index,
                         int32_t* position, cudaStream_t stream) {
  launch_group(ids, rows, top_k, local, slot_expert, slot_offsets, row_index, position, false,
               stream);
}

void moe_group_by_expert_compact(const int32_t* ids, int64_t rows, int top_k, LocalExperts local,
                                 int32_t* slot_expert, int32_t* slot_offsets, int32_t* row_index,
                                 int32_t* position, cudaStream_t stream) {
  launch_group(ids, rows, top_k, local, slot_expert, slot_offsets, row_index, position, true,
               stream);
}

}  // namespace k3::cuda
