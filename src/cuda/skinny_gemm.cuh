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

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/device_util.cuh"
#include "cuda/glu_math.cuh"
#include "cuda/linear_plan.h"
#include "cuda/mma.cuh"
#include "cuda/pdl.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/wgmma_x_layout.h"

namespace k3::cuda::detail {

struct SkinnyArgs {
  // Dense weight: w [N, K] in the format, ws its scales (MXFP4) or null.
  const void* w = nullptr;
  const uint8_t* ws = nullptr;
  // Grouped (MoE): slot s multiplies rows [slot_offsets[s], slot_offsets[s+1]) by expert
  // slot_expert[s] (< 0: skip), whose matrices are w_table[e] / ws_table[e]; all device arrays.
  const void* const* w_table = nullptr;
  const uint8_t* const* ws_table = nullptr;
  const int32_t* slot_expert = nullptr;   // [groups]
  const int32_t* slot_offsets = nullptr;  // [groups + 1]
  const int32_t* row_index = nullptr;     // [rows]: x row of each gathered row, or null (same)
  int n_slots = 0;                        // groups (the CTAs' y rows take turns over them)
  // Grouped: the slot arrays were complete before the previous kernel began its work (an earlier
  // grouped launch of this grouping, which lets its dependents start only after its own wait),
  // so they are read, and the first weights requested, before waiting on that kernel.
  int slots_ready = 0;
  const __nv_bfloat16* x = nullptr;  // [*, ldx] bf16
  int64_t ldx = 0;
  // Instead of x (tiled kernel only): x = bf16(glu(g, u)) computed while staging, g at
  // x_glu[row * ld_glu + k] and u glu_up elements further (fp32, 16-byte aligned rows).
  const float* x_glu = nullptr;
  int64_t ld_glu = 0, glu_up = 0;
  GluAct glu;
  // Instead of x (bf16 GEMV only, linear_bf16_combined): x row t = the MoE combine (+ latent
  // RMSNorm) of expert outputs, computed as moe_combine computes it (moe_combine.cuh):
  // combine_y [*, k] bf16, combine_pos [m * combine_k] int32 or null, combine_w
  // [m * combine_k] fp32, combine_norm [k] fp32 or null.
  const __nv_bfloat16* combine_y = nullptr;
  const int32_t* combine_pos = nullptr;
  const float* combine_w = nullptr;
  const float* combine_norm = nullptr;
  float combine_eps = 0.0f;
  int combine_k = 0;
  void* y = nullptr;  // [*, ldy] bf16 or fp32
  int64_t ldy = 0;
  int y_fp32 = 0;
  // bf16 y only, both optional (LinearEpilogue): y = bf16(bf16(acc) + add[.]); then
  // res[.] = res_copy ? y : bf16(res[.] + y), in place. add / res: [*, ldy] bf16 like y.
  const __nv_bfloat16* add = nullptr;
  __nv_bfloat16* res = nullptr;
  int res_copy = 0;
  int m = 0, n = 0, k = 0;  // m: token rows (dense) / bound per slot (grouped)
  int wn = 1, wk = 1, ck = 1, stages = 4, chunks = 0, x_pitch = 0, x_bytes = 0;
  int x_async = 0;  // x through cp.async where the format allows (skinny_x_async())
  // Profiling (dense launches only): [grid_x][kSkinnyStamps] int64 phase stamps, or null.
  long long* stamps = nullptr;
};

// Stamp `which` of this CTA (SkinnyStamp, linear_plan.h): clock64, or %globaltimer for the two
// global ones. Thread 0 only; the branch is uniform and taken only by profiling launches.
__device__ __forceinline__ void stamp(const SkinnyArgs& a, int which) {
  if (!a.stamps || threadIdx.x != 0) return;
  long long t;
  if (which == kStampGlobalEntry || which == kStampGlobalEnd)
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  else
    t = clock64();
  a.stamps[static_cast<int64_t>(blockIdx.x) * kSkinnyStamps + which] = t;
}

// Output element o of y (and the epilogue's res): the accumulator rounded as the unfused ops
// round it (the GEMM's bf16 output, then each add in fp32 rounded to bf16).
__device__ __forceinline__ void store_output(const SkinnyArgs& a, int64_t o, float v) {
  if (a.y_fp32) {
    static_cast<float*>(a.y)[o] = v;
    return;
  }
  __nv_bfloat16 y = __float2bfloat16_rn(v);
  if (a.add) y = __float2bfloat16_rn(__bfloat162float(y) + __bfloat162float(a.add[o]));
  static_cast<__nv_bfloat16*>(a.y)[o] = y;
  if (a.res)
    a.res[o] =
        a.res_copy ? y : __float2bfloat16_rn(__bfloat162float(a.res[o]) + __bfloat162float(y));
}

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

// One row tile (blockIdx.x) of one weight: y rows [off, off + mx) = x rows . W^T (a dense
// launch: off 0; a grouped one: a slot's rows, W its expert's). Uses all of shared memory; the
// caller syncs the CTA before calling it again.
template <class Fmt, int NT, int MT, bool kWg>
__device__ __forceinline__ void skinny_tile(const SkinnyArgs& a, const void* W, const uint8_t* Ws,
                                            int mx, int off, uint8_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2;
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
  // Under a.x_async, x without a GLU goes through cp.async: every unit of a thread in flight at
  // once. Through registers a thread's loads return one after another, each behind the W
  // prologue in the memory system (~0.5 us a unit, phase stamps). Warpgroup plans load it past
  // the rings (x_pitch: its row pitch; 0 where that did not fit) and scatter it into the tiles.
  const bool x_async = a.x_async && !Fmt::kGluInput && (!kWg || a.x_pitch > 0);
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
  const int x_units = mx * units;
  // [mx][x_pitch] x as loaded: in place (mma.sync; MXFP4 swizzles the units) or past the rings.
  uint8_t* x_raw = kWg ? smem + a.x_bytes +
                             static_cast<size_t>(blockDim.x / 32) * a.stages * Fmt::stage_bytes(MT)
                       : xs;
  auto raw_unit = [&](int m, int u) {  // where unit u of token m lands first
    return x_raw + m * a.x_pitch + (kWg ? u : x_unit<Fmt::kXPermute>(u)) * 16;
  };
  if (x_async) {
    for (int i = threadIdx.x; i < x_units; i += blockDim.x) {
      const int m = i / units, u = i % units;
      const int xr = a.row_index ? a.row_index[off + m] : off + m;
      const int kk = k_base + u * 8;
      const bool valid = kk < a.k;  // zero past K
      cp_async16(raw_unit(m, u), valid ? a.x + static_cast<int64_t>(xr) * a.ldx + kk : a.x, valid);
    }
    cp_async_commit();
    cp_async_wait<0>();              // this thread's units (and the prologue) have landed
    if constexpr (Fmt::kXPermute) {  // MXFP4: permute the units this thread copied
      for (int i = threadIdx.x; i < x_units; i += blockDim.x) {
        const int m = i / units, u = i % units;
        const uint4 v = permute_x8(lds128(raw_unit(m, u)));
        if constexpr (kWg)
          sts_x8_wg<NT>(xs, m, u, v);
        else
          sts128(raw_unit(m, u), v);
      }
    }
  } else {
    // x through registers (MXFP4 permutes it; both overlap the W prologue in flight).
    for (int i = threadIdx.x; i < x_units; i += blockDim.x) {
      const int m = i / units, u = i % units;
      const int xr = a.row_index ? a.row_index[off + m] : off + m;
      uint4 v = load_x8<Fmt::kGluInput>(a, xr, k_base + u * 8);
      if constexpr (Fmt::kXPermute) v = permute_x8(v);
      if constexpr (kWg)
        sts_x8_wg<NT>(xs, m, u, v);
      else
        sts128(raw_unit(m, u), v);
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

  // red[wk][mx][bn]: each warp's 16*MT x 8*NT tile, then summed over wk in order into red[0].
  float* red = reinterpret_cast<float*>(smem);
  const int c = lane & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wn_i * 16 * MT + i * 16 + g + (e >= 2 ? 8 : 0);
        const int m = j * 8 + 2 * c + (e & 1);
        if (m < mx) red[(wk_i * mx + m) * bn + r] = acc[i][j][e];
      }
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
  // Cluster: rank q's partial tile is red[0..elems) in its shared memory; this rank sums its
  // share of the elements over ranks 0..ck-1 in order.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  stamp(a, kStampClusterSynced);
  const int lo = static_cast<int>(static_cast<int64_t>(elems) * rank / a.ck);
  const int hi = static_cast<int>(static_cast<int64_t>(elems) * (rank + 1) / a.ck);
  for (int idx = lo + threadIdx.x; idx < hi; idx += blockDim.x) {
    store(idx, cluster_sum_in_order(cluster, red + idx, a.ck));
  }
  stamp(a, kStampSummed);
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

// Dense: one tile of W per CTA. Grouped (MoE): the CTAs of row y cover slots y, y + gridDim.y,
// ... in turn, skipping idle ones (expert < 0 or no rows). gridDim.y is the plan's expected busy
// slot count, not the slot count: an EP rank at batch 1 has ~1 busy slot of 16, and a grid over
// every slot spent its time dispatching CTAs that only found their slot idle and exited.
template <class Fmt, int NT, int MT, bool kWg>
__global__ void __launch_bounds__(linear_max_threads(NT, MT, kWg))
    skinny_gemm_kernel(const __grid_constant__ SkinnyArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int mx_max = min(a.m, 8 * NT);
  if (!a.slot_expert) {  // dense: x is read after the weight prologue (it waits there)
    stamp(a, kStampGlobalEntry);
    stamp(a, kStampEntry);
    pdl_launch_dependents();
    skinny_tile<Fmt, NT, MT, kWg>(a, a.w, a.ws, mx_max, 0, smem);
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
    skinny_tile<Fmt, NT, MT, kWg>(a, a.w_table[e], a.ws_table ? a.ws_table[e] : nullptr,
                                  min(cnt, mx_max), off, smem);
    __syncthreads();  // shared memory is the next slot's
  });
  // A CTA with no busy slot under slots_ready has not waited yet: its kernel must not complete
  // before the previous one, or the next kernel's wait would not cover that one's writes.
  pdl_wait();
}

}  // namespace k3::cuda::detail
