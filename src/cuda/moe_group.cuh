// The expert grouping of a step's (row, choice) pairs (moe_dispatch.h) as a routine of one CTA,
// shared by the grouping kernel and the router kernel that groups in its last CTA
// (router_topk_grouped). Every thread of the CTA calls it; any block size works.
#pragma once

#include <cstdint>

namespace k3::cuda::detail {

template <int kMaxExperts, int kMaxPairs>
struct GroupScratch {
  int count[kMaxExperts + 1];
  int id_of[kMaxPairs];
  int n_active;
};

// ids: [n] int32 global expert ids (row-major [rows][top_k]), read through L2 (__ldcg): in the
// router's last CTA other CTAs wrote them, and under PDL the router may still run when the
// grouping kernel starts (so no __restrict__). Outputs as moe_group_by_expert(_compact).
template <int kMaxExperts, int kMaxPairs>
__device__ void group_pairs(GroupScratch<kMaxExperts, kMaxPairs>& sm, const int32_t* ids, int n,
                            int top_k, int first, int E, int32_t* __restrict__ slot_expert,
                            int32_t* __restrict__ slot_offsets, int32_t* __restrict__ row_index,
                            int32_t* __restrict__ position, bool compact) {
  const int T = static_cast<int>(blockDim.x);
  for (int e = threadIdx.x; e <= E; e += T) sm.count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += T) {
    const int e = __ldcg(ids + p) - first;  // local id; outside [0, E): another rank's expert
    const bool local = e >= 0 && e < E;
    sm.id_of[p] = local ? e : -1;
    if (local) atomicAdd(&sm.count[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive prefix over <= 1024 experts by warp 0: a lane per range
    const int lane = static_cast<int>(threadIdx.x);
    const int per = (E + 31) / 32;
    const int e_lo = min(E, lane * per), e_hi = min(E, e_lo + per);
    int c_sum = 0, a_sum = 0;  // the range's pairs and active experts
    for (int e = e_lo; e < e_hi; ++e) {
      const int c = sm.count[e];
      c_sum += c;
      a_sum += c > 0;
    }
    int c_in = c_sum, a_in = a_sum;  // inclusive scans over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int cu = __shfl_up_sync(0xffffffffu, c_in, o);
      const int au = __shfl_up_sync(0xffffffffu, a_in, o);
      if (lane >= o) {
        c_in += cu;
        a_in += au;
      }
    }
    int run = c_in - c_sum, active = a_in - a_sum;
    for (int e = e_lo; e < e_hi; ++e) {
      const int c = sm.count[e];
      if (!compact) {
        slot_offsets[e] = run;
        slot_expert[e] = c > 0 ? e : -1;
      } else if (c > 0) {  // slot = rank of e among the active experts
        slot_offsets[active] = run;
        slot_expert[active] = e;
        ++active;
      }
      sm.count[e] = run;
      run += c;
    }
    if (lane == 31) {  // its inclusive sums are the totals
      slot_offsets[E] = c_in;
      sm.n_active = a_in;
      sm.count[E] = c_in;
    }
  }
  __syncthreads();
  if (compact)  // the unused tail: empty slots at the end of the pairs
    for (int sl = sm.n_active + threadIdx.x; sl < E; sl += T) {
      slot_expert[sl] = -1;
      slot_offsets[sl] = sm.count[E];
    }
  // Rank of pair p among the earlier pairs of its expert: stable, so the order is deterministic.
  for (int p = threadIdx.x; p < n; p += T) {
    const int e = sm.id_of[p];
    if (e < 0) {
      position[p] = -1;
      continue;
    }
    int rank = 0;
    for (int q = 0; q < p; ++q) rank += sm.id_of[q] == e;
    const int pos = sm.count[e] + rank;
    position[p] = pos;
    row_index[pos] = p / top_k;
  }
}

}  // namespace k3::cuda::detail
