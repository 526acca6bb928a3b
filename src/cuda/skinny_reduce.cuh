// The skinny GEMM's last phase (skinny_gemm.cuh): each warp's partial tile through shared
// memory, summed over the warps along K in order, then over the cluster's CTAs in rank order
// through distributed shared memory, and stored with the epilogue (store_output).
//
// Two forms with the same sums in the same order, so the same bits (the fast one under
// LinearPlan::fast_reduce, K3_SKINNY_FAST_REDUCE=1, in the alternative-form kernels only; off
// until it has run on a GPU):
//  - plain: tile rows bn floats apart; the wk sum always written back (a copy onto itself at
//    wk 1), then stored from shared memory; one element's ck remote loads in flight a thread.
//  - fast: rows skinny_red_pitch(bn, true) = bn + 4 apart (bn is a multiple of 16, so the 4
//    lanes of a quad, tokens 2 apart, store to distinct banks instead of one: a 4-way conflict
//    on every accumulator store); without a cluster the wk sum is stored at once; with one it is
//    written back only at wk > 1; 4 elements' remote loads in flight a thread.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/device_util.cuh"
#include "cuda/linear_plan.h"
#include "cuda/skinny_args.cuh"

namespace k3::cuda::detail {

// The cluster phase: rank q's partial tile is red[0..elems) in its shared memory; this rank sums
// its share of the elements over ranks 0..ck-1 in order and stores each (store(idx, sum)), with
// kInFlight elements' remote loads issued before any is summed (1: one element's ck loads at a
// time). Syncs the cluster before and after (no CTA leaves while another reads its memory).
template <int kInFlight, class Store>
__device__ __forceinline__ void cluster_reduce_store(const SkinnyArgs& a, float* red, int elems,
                                                     int rank, Store&& store) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  stamp(a, kStampClusterSynced);
  const int lo = static_cast<int>(static_cast<int64_t>(elems) * rank / a.ck);
  const int hi = static_cast<int>(static_cast<int64_t>(elems) * (rank + 1) / a.ck);
  if constexpr (kInFlight == 1) {
    for (int idx = lo + threadIdx.x; idx < hi; idx += blockDim.x)
      store(idx, cluster_sum_in_order(cluster, red + idx, a.ck));
  } else {
    const int stride = static_cast<int>(blockDim.x);
    for (int base = lo + static_cast<int>(threadIdx.x); base < hi; base += kInFlight * stride) {
      float v[kInFlight][8];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int idx = base + u * stride;
#pragma unroll
        for (int q = 0; q < 8; ++q)
          v[u][q] = q < a.ck && idx < hi ? *cluster.map_shared_rank(red + idx, q) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        float t = 0.0f;
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (q < a.ck) t += v[u][q];
        const int idx = base + u * stride;
        if (idx < hi) store(idx, t);
      }
    }
  }
  stamp(a, kStampSummed);
  cluster.sync();
}

// Each warp's accumulators into its tile of red[wk][mx][pitch] (element idx of a tile: token
// idx / pitch, output row idx % pitch).
template <int NT, int MT>
__device__ __forceinline__ void write_partials(const float (&acc)[MT][NT][4], float* red, int mx,
                                               int pitch, int wn_i, int wk_i, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wn_i * 16 * MT + i * 16 + g + (e >= 2 ? 8 : 0);
        const int m = j * 8 + 2 * c + (e & 1);
        if (m < mx) red[(wk_i * mx + m) * pitch + r] = acc[i][j][e];
      }
}

// The fast form (a.fast_reduce).
template <int NT, int MT>
__device__ __forceinline__ void reduce_tile_fast(const SkinnyArgs& a, const float (&acc)[MT][NT][4],
                                                 uint8_t* smem, int mx, int off, int row0_cta,
                                                 int bn, int wn_i, int wk_i, int rank, int lane) {
  const int pitch = skinny_red_pitch(bn, true);
  float* red = reinterpret_cast<float*>(smem);
  write_partials<NT, MT>(acc, red, mx, pitch, wn_i, wk_i, lane);
  __syncthreads();
  const int elems = mx * pitch;
  auto wk_sum = [&](int idx) {  // the warps along K in order
    float t = red[idx];
    for (int q = 1; q < a.wk; ++q) t += red[q * elems + idx];
    return t;
  };
  auto store = [&](int idx, float v) {
    const int m = idx / pitch, r = idx % pitch;
    const int row = row0_cta + r;
    if (r >= bn || row >= a.n) return;  // the pad, or past N
    store_output(a, static_cast<int64_t>(off + m) * a.ldy + row, v);
  };
  if (a.ck == 1) {
    for (int idx = threadIdx.x; idx < elems; idx += blockDim.x) store(idx, wk_sum(idx));
    stamp(a, kStampReduced);
    stamp(a, kStampClusterSynced);
    stamp(a, kStampSummed);
    return;
  }
  if (a.wk > 1)
    for (int idx = threadIdx.x; idx < elems; idx += blockDim.x) red[idx] = wk_sum(idx);
  stamp(a, kStampReduced);
  cluster_reduce_store<4>(a, red, elems, rank, store);
}

// acc: this warp's 16*MT rows x 8*NT tokens (mma accumulator layout) of the CTA's bn-row tile;
// rows [row0_cta, row0_cta + bn) of y rows [off, off + mx). Uses all of shared memory (the
// caller has synced after the main loop); leaves the cluster synced. kAlt: a kernel of the
// alternative forms, which takes the fast form under a.fast_reduce.
template <int NT, int MT, bool kAlt>
__device__ __forceinline__ void reduce_tile(const SkinnyArgs& a, const float (&acc)[MT][NT][4],
                                            uint8_t* smem, int mx, int off, int row0_cta, int bn,
                                            int wn_i, int wk_i, int rank, int lane) {
  if (kAlt && a.fast_reduce) {
    reduce_tile_fast<NT, MT>(a, acc, smem, mx, off, row0_cta, bn, wn_i, wk_i, rank, lane);
    return;
  }
  // red[wk][mx][bn]: each warp's tile, then summed over wk in order into red[0].
  float* red = reinterpret_cast<float*>(smem);
  write_partials<NT, MT>(acc, red, mx, bn, wn_i, wk_i, lane);
  __syncthreads();
  const int elems = mx * bn;
  for (int idx = threadIdx.x; idx < elems; idx += blockDim.x) {
    float t = red[idx];
    for (int q = 1; q < a.wk; ++q) t += red[q * elems + idx];
    red[idx] = t;
  }
  auto store = [&](int idx, float v) {
    const int m = idx / bn, r = idx % bn;
    const int row = row0_cta + r;
    if (row >= a.n) return;
    store_output(a, static_cast<int64_t>(off + m) * a.ldy + row, v);
  };
  stamp(a, kStampReduced);
  if (a.ck == 1) {  // same thread, same idx as the sum above: no barrier needed
    for (int idx = threadIdx.x; idx < elems; idx += blockDim.x) store(idx, red[idx]);
    stamp(a, kStampClusterSynced);
    stamp(a, kStampSummed);
    return;
  }
  cluster_reduce_store<1>(a, red, elems, rank, store);
}

}  // namespace k3::cuda::detail
