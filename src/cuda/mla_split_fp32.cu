// MLA split kernel on CUDA cores, fp32 math (the default; mla_split.cuh, mla_decode.h): one CTA
// per (split, head group, row) streams its token range through shared memory in tiles of 32
// cache rows (the next tile in flight while the current one is used), scores all heads of the
// group against each row (one warp per token), updates a per-head online softmax and accumulates
// p x c (one thread per 8 latent columns x up to 4 heads).
//
// Every global access is issued in batches (unrolled fixed-count loops), so a tile costs one
// page-table round trip and one copy round trip, overlapped with the previous tile's math: an
// earlier version with plain loop-carried loads took 35 us per layer at batch 1 and 1k context
// in the decode step (bench/RESULTS.md), nearly all of it serial memory latency.
#include <cmath>

#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/mla_split.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda::detail::mla {
namespace {

constexpr int kColGroups = kKvLora / 8;                 // 64 threads span the latent columns
constexpr int kHeadSets = kThreads / kColGroups;        // 4 head subsets in the PV step
constexpr int kHeadsPerThread = kMaxHeads / kHeadSets;  // 4

// Shared memory of a CTA with hpg heads: q (bf16), two cache tiles, scores, softmax state.
constexpr size_t split_smem_bytes(int hpg) {
  return sizeof(__nv_bfloat16) * hpg * kD + 2 * sizeof(__nv_bfloat16) * kTile * kD +
         sizeof(float) * kMaxHeads * kTile + sizeof(float) * kMaxHeads * 3;
}

__device__ __forceinline__ void bf16x8_to_f32(const uint4 u, float (&v)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__global__ void __launch_bounds__(kThreads)
    mla_split_fp32_kernel(const __grid_constant__ SplitArgs a) {
  K3_PDL_ENTRY();
  extern __shared__ __align__(16) unsigned char smem[];
  // q stays bf16 here (each lane's 16-byte chunk reads are contiguous across the warp: fp32 q at
  // a 32-byte lane stride made every score-step load an 8-way bank conflict) and is widened
  // exactly where it is used.
  const int hpg = a.hpg;
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);    // [hpg][kD]
  __nv_bfloat16* tiles = qs + hpg * kD;                          // [2][kTile][kD]
  float* ps = reinterpret_cast<float*>(tiles + 2 * kTile * kD);  // [kMaxHeads][kTile]
  float* m_s = ps + kMaxHeads * kTile;                           // [kMaxHeads] running max
  float* l_s = m_s + kMaxHeads;                                  // [kMaxHeads] running sum
  float* a_s = l_s + kMaxHeads;                                  // [kMaxHeads] rescale this tile

  const int split = blockIdx.x, splits = gridDim.x;
  const int h0 = blockIdx.y * hpg, row = blockIdx.z;
  const int hg = min(hpg, a.heads - h0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const SplitRange range = split_range(a, row, split, splits);
  const int beg = range.beg, end = range.end;
  if (beg >= end) return;  // beyond the row's active splits: the combine never reads it

  ring_start<kD, 2>(a, range, tiles, tid);
  load_q<kD>(a, row, h0, hg, hg, qs, tid);
  if (tid < kMaxHeads) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int cg = tid % kColGroups, hs = tid / kColGroups;
  float acc[kHeadsPerThread][8] = {};

  int buf = 0;
  for (int t0 = beg; t0 < end; t0 += kTile, buf ^= 1) {
    const int nt = min(kTile, end - t0);
    const __nv_bfloat16* tile = tiles + buf * kTile * kD;
    tile_ready<kD, 2>(a, range, tiles, buf, t0, tid);  // 1. this tile landed, the next in flight
    // 2. Scores: one warp per token; the lane's 8-column chunks are reused for all heads.
    for (int t = warp; t < kTile; t += kThreads / 32) {
      float part[kMaxHeads] = {};
      for (int c = lane; c < kChunks; c += 32) {
        float v[8];
        bf16x8_to_f32(*reinterpret_cast<const uint4*>(tile + t * kD + c * 8), v);
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
          if (h >= hg) break;
          float qf[8];
          bf16x8_to_f32(*reinterpret_cast<const uint4*>(qs + h * kD + c * 8), qf);
          part[h] += qf[0] * v[0] + qf[1] * v[1] + qf[2] * v[2] + qf[3] * v[3] + qf[4] * v[4] +
                     qf[5] * v[5] + qf[6] * v[6] + qf[7] * v[7];
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h) {
        if (h >= hg) break;
        const float s = warp_sum(part[h]);
        if (lane == 0) ps[h * kTile + t] = t < nt ? s * a.scale : -INFINITY;
      }
    }
    __syncthreads();
    // 3. Online softmax: one warp per head, lane = token of the tile.
    for (int h = warp; h < hg; h += kThreads / 32) {
      float* pt = ps + h * kTile + lane;
      *pt = softmax_step(*pt, m_s, l_s, a_s, h, lane);
    }
    __syncthreads();
    // 4. acc = alpha acc + sum_t p_t c_t over 8 columns x up to 4 heads per thread.
#pragma unroll
    for (int k = 0; k < kHeadsPerThread; ++k) {
      const int h = hs + k * kHeadSets;
      const float al = h < hg ? a_s[h] : 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[k][j] *= al;
    }
    for (int t = 0; t < nt; ++t) {
      float v[8];
      bf16x8_to_f32(*reinterpret_cast<const uint4*>(tile + t * kD + cg * 8), v);
#pragma unroll
      for (int k = 0; k < kHeadsPerThread; ++k) {
        const int h = hs + k * kHeadSets;
        if (h >= hg) break;
        const float p = ps[h * kTile + t];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[k][j] += p * v[j];
      }
    }
    __syncthreads();  // the next tile overwrites tile and ps
  }

#pragma unroll
  for (int k = 0; k < kHeadsPerThread; ++k) {
    const int h = hs + k * kHeadSets;
    if (h >= hg) break;
    const int64_t slot = (static_cast<int64_t>(row) * a.heads + h0 + h) * splits + split;
    float4* dst = reinterpret_cast<float4*>(a.ws_acc + slot * kKvLora + cg * 8);
    dst[0] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
    dst[1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
  }
  store_ml(a, row, h0, hg, split, splits, m_s, l_s, tid);
}

}  // namespace

void launch_split_fp32(const SplitArgs& a, dim3 grid, cudaStream_t stream) {
  // Above the 48 KB default: an attribute, not a stream operation, so legal while capturing.
  K3_CUDA_CHECK(cudaFuncSetAttribute(mla_split_fp32_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(split_smem_bytes(kMaxHeads))));
  mla_split_fp32_kernel<<<grid, kThreads, split_smem_bytes(a.hpg), stream>>>(a);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda::detail::mla
