// The skinny decode GEMM body shared by the bf16 and MXFP4 weights (tiling: linear_plan.h):
//   y[m, n] = sum_k x[m, k] * W[n, k],  m < 8 * NT tokens, fp32 accumulation.
//
// W is the mma A operand (16 rows x 16 k), x the B operand (16 k x 8 tokens). A dot product
// may visit k in any order, so each thread keeps the 16-byte pieces of W it loaded in memory
// order and the kernel reads x with the same permutation: no shuffles between the coalesced
// global loads and the fragments. A format supplies (see Bf16Format / Mxfp4Format):
//   kChunk, kStageBytes(MT), kXPermute, kGluInput (x staged from SkinnyArgs::x_glu),
//   load_chunk<MT>(slot, W, Ws, N, K, row0, chunk, lane)   cp.async of one chunk for one warp
//   compute_chunk<NT, MT>(acc, slot, xs, pitch, kloc, lane, mx)
// and, for warpgroup plans (LinearPlan::wg; kWarpgroupMma formats only):
//   compute_chunk_wg<NT>(acc, slot, x_tiles, lane)   the chunk's 16 wgmma steps, x staged as
//                                                    their B tiles (sts_x8_wg)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/device_util.cuh"
#include "cuda/glu_math.cuh"
#include "cuda/linear_plan.h"
#include "cuda/mma.cuh"
#include "cuda/pdl.cuh"
#include "cuda/skinny_args.cuh"
#include "cuda/skinny_reduce.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/wgmma_x_layout.h"

namespace k3::cuda::detail {

// Index of the 16-byte unit u of a staged x row (MXFP4 reads 4 units 64 B apart per quad:
// flipping bit 1 on odd 128-byte halves spreads them over all banks).
template <bool kSwizzle>
__device__ __forceinline__ int x_unit(int u) {
  return kSwizzle ? (u ^ (((u >> 3) & 1) << 1)) : u;
}

// (MXFP4) 8 bf16 x values in the order the dequantized pairs come out: [0,4,1,5,2,6,3,7].
__device__ __forceinline__ uint4 permute_x8(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}

// (Warpgroup MMA, MXFP4) Permuted x unit u of token m into the wgmma B tiles
// (wgmma_x_layout.h: the four words go to two mma steps' tiles, both k halves).
template <int NT>
__device__ __forceinline__ void sts_x8_wg(uint8_t* xs, int m, int u, uint4 v) {
  *reinterpret_cast<uint32_t*>(xs + wg_x_word_offset(NT, m, u, 0)) = v.x;
  *reinterpret_cast<uint32_t*>(xs + wg_x_word_offset(NT, m, u, 1)) = v.y;
  *reinterpret_cast<uint32_t*>(xs + wg_x_word_offset(NT, m, u, 2)) = v.z;
  *reinterpret_cast<uint32_t*>(xs + wg_x_word_offset(NT, m, u, 3)) = v.w;
}

// 8 x values of x row xr from k = kk (zero past K): bf16 from x, or, kGlu, bf16(glu(g, u)) from
// fp32 g and u, rounded as cuda::glu rounds them. x is an earlier kernel's output: not __ldg.
template <bool kGlu>
__device__ __forceinline__ uint4 load_x8(const SkinnyArgs& a, int xr, int kk) {
  if (kk >= a.k) return make_uint4(0, 0, 0, 0);
  if constexpr (kGlu) {
    const float* gp = a.x_glu + static_cast<int64_t>(xr) * a.ld_glu + kk;
    const float4 g0 = *reinterpret_cast<const float4*>(gp);
    const float4 g1 = *reinterpret_cast<const float4*>(gp + 4);
    const float4 u0 = *reinterpret_cast<const float4*>(gp + a.glu_up);
    const float4 u1 = *reinterpret_cast<const float4*>(gp + a.glu_up + 4);
    const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    const float uv[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(
          glu_apply(a.glu, gv[2 * q], uv[2 * q]), glu_apply(a.glu, gv[2 * q + 1], uv[2 * q + 1]));
      w[q] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    return ld_act128(a.x + static_cast<int64_t>(xr) * a.ldx + kk);
  }
}

// Grouped launches: calls fn(expert, first_row, rows) for the busy slots of this CTA's turn
// (slots blockIdx.y, blockIdx.y + gridDim.y, ...; expert >= 0 and rows > 0), in slot order. 32
// candidate slots per round: warp 0 reads them at once and lists the busy ones. The decision is
// uniform over the CTA and a cluster (same slots, same device values); fn may use all of shared
// memory but must leave the CTA synced.
template <class Fn>
__device__ __forceinline__ void for_each_busy_slot(const SkinnyArgs& a, Fn&& fn) {
  __shared__ int busy_e[32], busy_off[32], busy_cnt[32];
  __shared__ int n_busy;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int stride = static_cast<int>(gridDim.y);
  for (int base = static_cast<int>(blockIdx.y); base < a.n_slots; base += 32 * stride) {
    if (warp == 0) {
      const int s = base + lane * stride;
      int e = -1, off = 0, cnt = 0;
      if (s < a.n_slots) {  // through L2: this SM's L1 may hold a previous step's values
        e = __ldcg(a.slot_expert + s);
        off = __ldcg(a.slot_offsets + s);
        cnt = __ldcg(a.slot_offsets + s + 1) - off;
      }
      const bool on = e >= 0 && cnt > 0;
      const unsigned m = __ballot_sync(0xffffffffu, on);
      if (on) {
        const int i = __popc(m & ((1u << lane) - 1u));
        busy_e[i] = e;
        busy_off[i] = off;
        busy_cnt[i] = cnt;
      }
      if (lane == 0) n_busy = __popc(m);
    }
    __syncthreads();
    const int nb = n_busy;
    for (int i = 0; i < nb; ++i) fn(busy_e[i], busy_off[i], busy_cnt[i]);
    __syncthreads();  // every thread has read n_busy before warp 0 rewrites the list
  }
}

// x rows [off, off + mx) (through a.row_index where given), units [0, units) of 8 k from
// k_base, staged with cp.async: every unit of a thread in flight at once, one commit group,
// waited for before returning (the W prologue's groups too). The mma.sync kernels copy each
// unit to its staged place (MXFP4 then permutes it there: the thread that copied it, so no
// barrier between); the warpgroup ones copy x to [mx][x_pitch] past the W rings and scatter
// the permuted units into the wgmma tiles at xs = smem. The caller syncs the CTA after.
template <class Fmt, int NT, int MT, bool kWg>
__device__ __forceinline__ void stage_x_async(const SkinnyArgs& a, uint8_t* smem, int mx, int units,
                                              int k_base, int off) {
  uint8_t* raw = kWg ? smem + a.x_bytes +
                           static_cast<size_t>(blockDim.x / 32) * a.stages * Fmt::stage_bytes(MT)
                     : smem;
  auto unit_at = [&](int m, int u) {  // where unit u of token m lands first
    return raw + m * a.x_pitch + (kWg ? u : x_unit<Fmt::kXPermute>(u)) * 16;
  };
  for (int i = threadIdx.x; i < mx * units; i += blockDim.x) {
    const int m = i / units, u = i % units;
    const int xr = a.row_index ? a.row_index[off + m] : off + m;
    const int kk = k_base + u * 8;
    const bool valid = kk < a.k;  // zero past K
    cp_async16(unit_at(m, u), valid ? a.x + static_cast<int64_t>(xr) * a.ldx + kk : a.x, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  if constexpr (Fmt::kXPermute) {
    for (int i = threadIdx.x; i < mx * units; i += blockDim.x) {
      const int m = i / units, u = i % units;
      const uint4 v = permute_x8(lds128(unit_at(m, u)));
      if constexpr (kWg)
        sts_x8_wg<NT>(smem, m, u, v);
      else
        sts128(unit_at(m, u), v);
    }
  }
}

// One row tile (blockIdx.x) of one weight: y rows [off, off + mx) = x rows . W^T (a dense
// launch: off 0; a grouped one: a slot's rows, W its expert's). Uses all of shared memory; the
// caller syncs the CTA before calling it again.
template <class Fmt, int NT, int MT, bool kWg, bool kAlt>
__device__ __forceinline__ void skinny_tile(const SkinnyArgs& a, const void* W, const uint8_t* Ws,
                                            int mx, int off, uint8_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wn_i = warp % a.wn, wk_i = warp / a.wn;
  const int rank = static_cast<int>(blockIdx.x) % a.ck;  // cluster rank (clusters along x)
  const int tile = static_cast<int>(blockIdx.x) / a.ck;
  const int bn = 16 * MT * a.wn;
  const int row0_cta = tile * bn;
  const int row0_w = row0_cta + wn_i * 16 * MT;

  // K split: chunks [c_lo, c_hi) for this CTA, [w_lo, w_hi) for this warp.
  const int c_lo = static_cast<int>(static_cast<int64_t>(a.chunks) * rank / a.ck);
  const int c_hi = static_cast<int>(static_cast<int64_t>(a.chunks) * (rank + 1) / a.ck);
  const int w_lo = c_lo + (c_hi - c_lo) * wk_i / a.wk;
  const int w_hi = c_lo + (c_hi - c_lo) * (wk_i + 1) / a.wk;
  const int nchunks = w_hi - w_lo;

  uint8_t* xs = smem;  // [mx][x_pitch] staged x slice
  uint8_t* ring = smem + a.x_bytes + static_cast<size_t>(warp) * a.stages * Fmt::stage_bytes(MT);

  // x slice: 16-byte units of k in [c_lo * kChunk, c_hi * kChunk) for rows 0..mx-1.
  const int units = (c_hi - c_lo) * Fmt::kChunk / 8;
  const int k_base = c_lo * Fmt::kChunk;
  // x through registers: a thread's loads return one after another, each behind the W prologue
  // in the memory system (~0.5 us a unit, phase stamps). Under a.x_async (the alternative-form
  // kernels only, kAlt), x without a GLU goes through cp.async instead (stage_x_async;
  // warpgroup plans only where their staging space fit: x_pitch > 0).
  const bool x_async = kAlt && a.x_async && !Fmt::kGluInput && (!kWg || a.x_pitch > 0);
  // The ring's group accounting: `stages` groups precede the loop, the prologue's stages - 1
  // and one more (x's, or an empty one when x goes through registers).
  if (!x_async) cp_async_commit();
  // The W ring prologue: stages - 1 chunks in flight before any compute.
  for (int s = 0; s < a.stages - 1; ++s) {
    if (s < nchunks)
      Fmt::template load_chunk<MT>(ring + s * Fmt::stage_bytes(MT), W, Ws, a.n, a.k, row0_w,
                                   w_lo + s, lane);
    cp_async_commit();
  }
  if (!a.slot_expert || a.slots_ready) pdl_wait();  // x is the previous kernel's output
  stamp(a, kStampWaited);
  if (x_async) {
    stage_x_async<Fmt, NT, MT, kWg>(a, smem, mx, units, k_base, off);
  } else {
    // x through registers (MXFP4 permutes it; both overlap the W prologue in flight).
    for (int i = threadIdx.x; i < mx * units; i += blockDim.x) {
      const int m = i / units, u = i % units;
      const int xr = a.row_index ? a.row_index[off + m] : off + m;
      uint4 v = load_x8<Fmt::kGluInput>(a, xr, k_base + u * 8);
      if constexpr (Fmt::kXPermute) v = permute_x8(v);
      if constexpr (kWg)
        sts_x8_wg<NT>(xs, m, u, v);
      else
        sts128(xs + m * a.x_pitch + x_unit<Fmt::kXPermute>(u) * 16, v);
    }
  }
  if constexpr (kWg) fence_proxy_async_smem();  // the tiles are read by wgmma (async proxy)
  __syncthreads();
  stamp(a, kStampXStaged);

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  int slot = 0;
  for (int i = 0; i < nchunks; ++i) {
    cp_async_wait_dyn(a.stages - 2);  // chunk i has landed (this thread's copies)
    const int nx = i + a.stages - 1;  // refill the slot chunk i-1 used
    const int nslot = slot == 0 ? a.stages - 1 : slot - 1;
    if (nx < nchunks)
      Fmt::template load_chunk<MT>(ring + nslot * Fmt::stage_bytes(MT), W, Ws, a.n, a.k, row0_w,
                                   w_lo + nx, lane);
    cp_async_commit();
    if constexpr (kWg) {  // the warpgroup's 4 warps run this loop in step (same w_lo, nchunks)
      static_assert(MT == 1 && Fmt::kWarpgroupMma, "warpgroup plans: MXFP4, 16 rows per warp");
      Fmt::template compute_chunk_wg<NT>(
          acc, ring + slot * Fmt::stage_bytes(MT),
          smem_addr(xs) + wg_step(w_lo + i - c_lo, 0, 0, 0) * wg_tile_bytes(NT), lane);
    } else {
      Fmt::template compute_chunk<NT, MT>(acc, ring + slot * Fmt::stage_bytes(MT), xs, a.x_pitch,
                                          (w_lo + i - c_lo) * Fmt::kChunk, lane, mx);
    }
    slot = slot + 1 == a.stages ? 0 : slot + 1;
  }
  cp_async_wait<0>();
  __syncthreads();  // x and the rings are dead: reuse shared memory for the reduction
  stamp(a, kStampLooped);

  reduce_tile<NT, MT, kAlt>(a, acc, smem, mx, off, row0_cta, bn, wn_i, wk_i, rank, lane);
}

// Dense: one tile of W per CTA. Grouped (MoE): the CTAs of row y cover slots y, y + gridDim.y,
// ... in turn, skipping idle ones (expert < 0 or no rows). gridDim.y is the plan's expected busy
// slot count, not the slot count: an EP rank at batch 1 has ~1 busy slot of 16, and a grid over
// every slot spent its time dispatching CTAs that only found their slot idle and exited.
// (The one-token-tile kernels of the alternative forms ask for one CTA an SM: left to itself,
// ptxas gave them 64 registers and 60-128 bytes of spills, where the default kernels use 96.)
template <class Fmt, int NT, int MT, bool kWg, bool kAlt>
__global__ void __launch_bounds__(linear_max_threads(NT, MT, kWg), kAlt&& NT == 1 ? 1 : 0)
    skinny_gemm_kernel(const __grid_constant__ SkinnyArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int mx_max = min(a.m, 8 * NT);
  if (!a.slot_expert) {  // dense: x is read after the weight prologue (it waits there)
    stamp(a, kStampGlobalEntry);
    stamp(a, kStampEntry);
    pdl_launch_dependents();
    skinny_tile<Fmt, NT, MT, kWg, kAlt>(a, a.w, a.ws, mx_max, 0, smem);
    stamp(a, kStampEnd);
    stamp(a, kStampGlobalEnd);
    return;
  }
  // A grouped launch reads the expert of its slot from an earlier kernel's output: from the
  // previous kernel's (wait first), or, slots_ready, from one that completed before that kernel
  // began (skinny_tile waits after its weight prologue). Either way its dependents are let go
  // only once this kernel's slot arrays are known complete, so a later launch of the same
  // grouping may set slots_ready.
  if (!a.slots_ready) pdl_wait();
  pdl_launch_dependents();
  for_each_busy_slot(a, [&](int e, int off, int cnt) {
    skinny_tile<Fmt, NT, MT, kWg, kAlt>(a, a.w_table[e], a.ws_table ? a.ws_table[e] : nullptr,
                                        min(cnt, mx_max), off, smem);
    __syncthreads();  // shared memory is the next slot's
  });
  // A CTA with no busy slot under slots_ready has not waited yet: its kernel must not complete
  // before the previous one, or the next kernel's wait would not cover that one's writes.
  pdl_wait();
}

}  // namespace k3::cuda::detail
