#include "cuda/moe_dispatch.h"

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxExperts = 1024;
constexpr int kMaxPairs = kMaxGroupedPairs;

__global__ void __launch_bounds__(kThreads)
    group_kernel(const int32_t* __restrict__ ids, int n, int top_k, int first, int E,
                 int32_t* __restrict__ slot_expert, int32_t* __restrict__ slot_offsets,
                 int32_t* __restrict__ row_index, int32_t* __restrict__ position, bool compact) {
  K3_PDL_ENTRY();
  __shared__ int count[kMaxExperts + 1];
  __shared__ int id_of[kMaxPairs];
  __shared__ int n_active;
  for (int e = threadIdx.x; e <= E; e += kThreads) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += kThreads) {
    const int e = ids[p] - first;  // local id; outside [0, E): another rank's expert
    const bool local = e >= 0 && e < E;
    id_of[p] = local ? e : -1;
    if (local) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix over <= 1024 experts: cheap next to the GEMMs
    int run = 0, active = 0;
    for (int e = 0; e < E; ++e) {
      const int c = count[e];
      if (!compact) {
        slot_offsets[e] = run;
        slot_expert[e] = c > 0 ? e : -1;
      } else if (c > 0) {  // slot = rank of e among the active experts
        slot_offsets[active] = run;
        slot_expert[active] = e;
        ++active;
      }
      count[e] = run;
      run += c;
    }
    slot_offsets[E] = run;
    n_active = active;
    count[E] = run;
  }
  __syncthreads();
  if (compact)  // the unused tail: empty slots at the end of the pairs
    for (int sl = n_active + threadIdx.x; sl < E; sl += kThreads) {
      slot_expert[sl] = -1;
      slot_offsets[sl] = count[E];
    }
  // Rank of pair p among the earlier pairs of its expert: stable, so the order is deterministic.
  for (int p = threadIdx.x; p < n; p += kThreads) {
    const int e = id_of[p];
    if (e < 0) {
      position[p] = -1;
      continue;
    }
    int rank = 0;
    for (int q = 0; q < p; ++q) rank += id_of[q] == e;
    const int pos = count[e] + rank;
    position[p] = pos;
    row_index[pos] = p / top_k;
  }
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
