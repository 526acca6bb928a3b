// Absorbed MLA decode, CUDA cores, fp32 math. Kernel 1 (split): one CTA per (split, head
// group, row) streams its token range through shared memory in tiles of 32 cache rows (16-B
// cp.async copies through the page table, the next tile in flight while the current one is
// used), scores all heads of the group against each row (one warp per token), updates a
// per-head online softmax and accumulates p x c (one thread per 8 latent columns x up to 4
// heads). Kernel 2 (combine): merges the row's active splits (derived from its length, like the
// split kernel's ranges) of each (row, head) in split order, so the result does not depend on
// scheduling.
//
// Every global access of the split kernel is issued in batches (unrolled fixed-count loops), so a
// tile costs one page-table round trip and one copy round trip, overlapped with the previous
// tile's math: an earlier version with plain loop-carried loads took 35 us per layer at batch 1
// and 1k context in the decode step (bench/RESULTS.md), nearly all of it serial memory latency.
#include "cuda/mla_decode.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/mla_decode_generic.h"
#include "cuda/mma.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;

constexpr int kKvLora = 512;
constexpr int kRope = 64;
constexpr int kD = kKvLora + kRope;  // 576 values per cached token
constexpr int kChunks = kD / 8;      // 72 16-byte chunks per cache row
constexpr int kTile = 32;            // cache rows per shared-memory tile
constexpr int kMaxHeads = 16;        // heads per CTA (register budget of the score warp)
constexpr int kThreads = 256;
constexpr int kColGroups = kKvLora / 8;                  // 64 threads span the latent columns
constexpr int kHeadSets = kThreads / kColGroups;         // 4 head subsets in the PV step
constexpr int kHeadsPerThread = kMaxHeads / kHeadSets;   // 4
constexpr int kTileCopies = kTile * kChunks / kThreads;  // 16-byte copies per thread per tile
static_assert(kTile * kChunks % kThreads == 0, "a tile is whole rounds of copies");
constexpr int kQCopies = (kMaxHeads * kChunks + kThreads - 1) / kThreads;  // q: 16 B per copy

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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Tokens per split of a row with n tokens: equal ranges in whole tiles, at least kMinSplit (one
// tile: at 1k tokens, 32 CTAs of one tile each took 18.1 us against 26.7 us for 16 CTAs of two,
// H6, one row, H200). Splits from ceil(n / chunk) on are empty; the split and the combine kernels
// both derive the active count from n on the device.
constexpr int kMinSplit = kTile;
__device__ __forceinline__ int split_tokens(int n, int splits) {
  const int per = ((n + splits - 1) / splits + kTile - 1) / kTile * kTile;
  return max(kMinSplit, per);
}

// Queries, the cache, page tables, lengths, selections and the split partials: no __restrict__
// (PDL: their producer may still run when a kernel starts, so no ld.global.nc; see mma.cuh
// ld_act128).
__global__ void __launch_bounds__(kThreads)
    mla_split_kernel(const __nv_bfloat16* q_abs, const __nv_bfloat16* q_pe,
                     const __nv_bfloat16* cache, const int32_t* block_table, const int32_t* seq_len,
                     const int32_t* selected, const int32_t* n_selected, int heads, int hpg,
                     int page_size, int max_pages, int max_sel, float scale,
                     float* __restrict__ ws_acc, float* __restrict__ ws_ml) {
  K3_PDL_ENTRY();
  // q_abs [rows][heads][512] bf16; q_pe [rows][heads][64] bf16; cache [pages][page_size][576];
  // ws_acc [rows][heads][splits][512] fp32 (unnormalised sum p c); ws_ml [rows][heads][splits][2]
  extern __shared__ __align__(16) unsigned char smem[];
  // q stays bf16 here (each lane's 16-byte chunk reads are contiguous across the warp: fp32 q at
  // a 32-byte lane stride made every score-step load an 8-way bank conflict) and is widened
  // exactly where it is used.
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);    // [hpg][kD]
  __nv_bfloat16* tiles = qs + hpg * kD;                          // [2][kTile][kD]
  float* ps = reinterpret_cast<float*>(tiles + 2 * kTile * kD);  // [kMaxHeads][kTile]
  float* m_s = ps + kMaxHeads * kTile;                           // [kMaxHeads] running max
  float* l_s = m_s + kMaxHeads;                                  // [kMaxHeads] running sum
  float* a_s = l_s + kMaxHeads;                                  // [kMaxHeads] rescale this tile

  const int split = blockIdx.x, splits = gridDim.x;
  const int h0 = blockIdx.y * hpg, row = blockIdx.z;
  const int hg = min(hpg, heads - h0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t* sel = selected ? selected + static_cast<int64_t>(row) * max_sel : nullptr;
  const int n = max(0, sel ? n_selected[row] : seq_len[row]);
  const int32_t* bt = block_table + static_cast<int64_t>(row) * max_pages;
  const int chunk = split_tokens(n, splits);
  const int beg = min(n, split * chunk), end = min(n, beg + chunk);
  if (beg >= end) return;  // beyond the row's active splits: the combine never reads it

  // Tile loads: the rows' page-table entries (and sparse selections) of a tile in one batch,
  // then its 16-byte copies, one commit group per tile.
  const auto issue_tile = [&](__nv_bfloat16* dst, int t0) {
    const int nt = min(kTile, end - t0);
#pragma unroll
    for (int j = 0; j < kTileCopies; ++j) {
      const int i = tid + j * kThreads;
      const int r = i / kChunks, c = i % kChunks;
      const bool ok = r < nt;
      const int pos = ok ? (sel ? sel[t0 + r] : t0 + r) : 0;
      const int64_t page = ok ? bt[pos / page_size] : 0;
      const __nv_bfloat16* src = cache + (page * page_size + pos % page_size) * kD + c * 8;
      cp_async16(dst + r * kD + c * 8, ok ? src : cache, ok);  // zero-filled past nt
    }
    cp_async_commit();
  };
  issue_tile(tiles, beg);

  // q of the group's heads: every 16-byte load first, then the stores.
  uint4 qv[kQCopies];
#pragma unroll
  for (int j = 0; j < kQCopies; ++j) {
    const int i = tid + j * kThreads;
    const int h = i / kChunks, c = i % kChunks;
    qv[j] = make_uint4(0, 0, 0, 0);
    if (h < hg) {
      const int64_t qh = static_cast<int64_t>(row) * heads + h0 + h;
      qv[j] = c < kKvLora / 8 ? detail::ld_act128(q_abs + qh * kKvLora + c * 8)
                              : detail::ld_act128(q_pe + qh * kRope + (c - kKvLora / 8) * 8);
    }
  }
#pragma unroll
  for (int j = 0; j < kQCopies; ++j) {
    const int i = tid + j * kThreads;
    const int h = i / kChunks, c = i % kChunks;
    if (h < hg) *reinterpret_cast<uint4*>(qs + h * kD + c * 8) = qv[j];
  }
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
    // 1. The next tile's copies go out (into the buffer the previous iteration finished with),
    // then this tile's have landed.
    if (t0 + kTile < end)
      issue_tile(tiles + (buf ^ 1) * kTile * kD, t0 + kTile);
    else
      cp_async_commit();  // an empty group keeps the wait count uniform
    cp_async_wait<1>();
    __syncthreads();
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
        if (lane == 0) ps[h * kTile + t] = t < nt ? s * scale : -INFINITY;
      }
    }
    __syncthreads();
    // 3. Online softmax: one warp per head, lane = token of the tile.
    for (int h = warp; h < hg; h += kThreads / 32) {
      const float s = ps[h * kTile + lane];
      const float mo = m_s[h], mn = fmaxf(mo, warp_max(s));
      // mn is finite here: every tile holds at least one valid token.
      const float p = s == -INFINITY ? 0.0f : expf(s - mn);
      const float a = mo == -INFINITY ? 0.0f : expf(mo - mn);
      const float sum = warp_sum(p);
      ps[h * kTile + lane] = p;
      __syncwarp();
      if (lane == 0) {
        l_s[h] = l_s[h] * a + sum;
        m_s[h] = mn;
        a_s[h] = a;
      }
    }
    __syncthreads();
    // 4. acc = alpha acc + sum_t p_t c_t over 8 columns x up to 4 heads per thread.
#pragma unroll
    for (int k = 0; k < kHeadsPerThread; ++k) {
      const int h = hs + k * kHeadSets;
      const float a = h < hg ? a_s[h] : 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[k][j] *= a;
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
    const int64_t slot = (static_cast<int64_t>(row) * heads + h0 + h) * splits + split;
    float4* dst = reinterpret_cast<float4*>(ws_acc + slot * kKvLora + cg * 8);
    dst[0] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
    dst[1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
  }
  if (tid < hg) {
    const int64_t slot = (static_cast<int64_t>(row) * heads + h0 + tid) * splits + split;
    ws_ml[slot * 2] = m_s[tid];
    ws_ml[slot * 2 + 1] = l_s[tid];
  }
}

constexpr int kCombineThreads = kKvLora / 4;  // 4 latent columns per thread
constexpr int kMaxSplits = 1024;

template <bool kBf16Out>
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(const float* ws_acc, const float* ws_ml, const int32_t* seq_len,
                       const int32_t* n_selected, int heads, int splits, void* __restrict__ out,
                       float* __restrict__ lse) {
  K3_PDL_ENTRY();
  // ws_acc [rows][heads][splits][512]; ws_ml [rows][heads][splits][2];
  // out [rows][heads][512] fp32 or bf16. One CTA per (head, row). The split weights
  // exp(m_s - max) are computed once into shared memory, then every thread sums its 4 columns
  // over the active splits in split order (deterministic).
  __shared__ float w_s[kMaxSplits];
  __shared__ float red[kCombineThreads / 32];
  const int row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rh = static_cast<int64_t>(row) * heads + blockIdx.x;
  const int n = max(0, n_selected ? n_selected[row] : seq_len[row]);
  const int active = n == 0 ? 0 : (n + split_tokens(n, splits) - 1) / split_tokens(n, splits);
  const float* ml = ws_ml + rh * splits * 2;
  float mx = -INFINITY;
  for (int s = tid; s < active; s += kCombineThreads) mx = fmaxf(mx, ml[2 * s]);
  mx = warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < kCombineThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();  // red is reused for l
  float lp = 0.0f;
  for (int s = tid; s < active; s += kCombineThreads) {
    const float m = ml[2 * s];
    const float w = m == -INFINITY ? 0.0f : expf(m - mx);  // a split of masked tokens only
    w_s[s] = w;
    lp += w * ml[2 * s + 1];
  }
  lp = warp_sum(lp);
  if (lane == 0) red[warp] = lp;
  __syncthreads();
  float l = 0.0f;
  for (int w = 0; w < kCombineThreads / 32; ++w) l += red[w];
  if (lse != nullptr && tid == 0) lse[rh] = mx == -INFINITY ? -INFINITY : mx + logf(l);
  float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (mx != -INFINITY) {  // else the row has no tokens: o = 0
    const float* acc = ws_acc + rh * splits * kKvLora + tid * 4;
#pragma unroll 4
    for (int s = 0; s < active; ++s) {
      const float w = w_s[s];
      const float4 a = *reinterpret_cast<const float4*>(acc + static_cast<int64_t>(s) * kKvLora);
      o[0] += w * a.x;
      o[1] += w * a.y;
      o[2] += w * a.z;
      o[3] += w * a.w;
    }
    const float inv = 1.0f / l;
    for (float& x : o) x *= inv;
  }
  const int64_t e = rh * kKvLora + tid * 4;
  if constexpr (kBf16Out) {
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(out) + e;
    for (int j = 0; j < 4; ++j) y[j] = __float2bfloat16_rn(o[j]);
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(out) + e) = make_float4(o[0], o[1], o[2], o[3]);
  }
}

}  // namespace

MlaDecodePlan plan_mla_decode(MlaDecodePlan p, int sm_count) {
  const bool fast = p.kv_lora == kKvLora && p.rope == kRope;
  K3_CHECK(fast || detail::mla_generic_shape_ok(p.kv_lora, p.rope), "cuda::mla_decode: kv_lora ",
           p.kv_lora, " / rope ", p.rope,
           " unsupported (512 / 64, or kv_lora in [8, 1024] a multiple of 8 and rope in [0, 128])");
  K3_CHECK(p.rows >= 0 && p.heads >= 1 && p.heads <= 128, "cuda::mla_decode: rows ", p.rows,
           ", heads ", p.heads);
  K3_CHECK(p.page_size >= 1 && p.max_pages >= 1, "cuda::mla_decode: page_size ", p.page_size,
           ", max_pages ", p.max_pages);
  K3_CHECK(p.max_tokens >= 0 && p.max_tokens <= 0x7fffffff, "cuda::mla_decode: max_tokens ",
           p.max_tokens);
  K3_CHECK(sm_count >= 1, "cuda::mla_decode: sm_count ", sm_count);
  if (!fast) {  // generic kernel: one CTA per (head, row), no splits
    p.head_groups = p.heads;
    p.heads_per_group = 1;
    p.splits = 1;
    return p;
  }
  p.head_groups = (p.heads + kMaxHeads - 1) / kMaxHeads;
  p.heads_per_group = (p.heads + p.head_groups - 1) / p.head_groups;
  // Aim at two CTAs per SM (what fits at <= 94 KB of shared memory) for the longest context the
  // grid must serve; on the device each split takes at least kMinSplit tokens, so a short context
  // uses fewer splits. At batch 1 the step is latency-bound: many short splits win although each
  // writes heads_per_group x 2 KB of fp32 partials (L2-resident, read back by the combine).
  const int64_t base = std::max<int64_t>(1, static_cast<int64_t>(p.rows) * p.head_groups);
  const int64_t want = (2 * static_cast<int64_t>(sm_count) + base - 1) / base;
  const int64_t min_len = kMinSplit;
  const int64_t cap = std::max<int64_t>(1, (p.max_tokens + min_len - 1) / min_len);
  p.splits = static_cast<int>(std::clamp<int64_t>(std::min(want, cap), 1, kMaxSplits));
  return p;
}

size_t mla_decode_workspace_bytes(const MlaDecodePlan& p) {
  return sizeof(float) * static_cast<size_t>(p.rows) * p.heads * p.splits * (p.kv_lora + 2);
}

void mla_decode(const MlaDecodePlan& p, const __nv_bfloat16* q_abs, const __nv_bfloat16* q_pe,
                const __nv_bfloat16* cache, const int32_t* block_table, const int32_t* seq_len,
                const int32_t* selected, const int32_t* n_selected, float softmax_scale,
                void* workspace, void* o_latent, bool o_bf16, cudaStream_t stream, float* lse) {
  K3_CHECK(p.splits >= 1 && p.heads_per_group >= 1 && p.heads_per_group <= kMaxHeads,
           "cuda::mla_decode: plan not built by plan_mla_decode");
  K3_CHECK(selected == nullptr || (n_selected != nullptr && p.max_sel >= 1),
           "cuda::mla_decode: sparse launch needs n_selected and max_sel");
  K3_CHECK(reinterpret_cast<uintptr_t>(cache) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(workspace) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(o_latent) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(q_abs) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(q_pe) % 16 == 0,
           "cuda::mla_decode: cache, workspace, o_latent, q_abs and q_pe must be 16-byte aligned");
  if (p.kv_lora != kKvLora || p.rope != kRope) {
    detail::mla_decode_generic(p, q_abs, q_pe, cache, block_table, seq_len, selected, n_selected,
                               softmax_scale, o_latent, o_bf16, stream, lse);
    return;
  }
  if (p.rows == 0) return;
  float* ws_acc = static_cast<float*>(workspace);
  float* ws_ml = ws_acc + static_cast<size_t>(p.rows) * p.heads * p.splits * kKvLora;
  // Above the 48 KB default: an attribute, not a stream operation, so legal while capturing.
  const size_t smem = split_smem_bytes(p.heads_per_group);
  K3_CUDA_CHECK(cudaFuncSetAttribute(mla_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(split_smem_bytes(kMaxHeads))));
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.head_groups),
                  static_cast<unsigned>(p.rows));
  mla_split_kernel<<<grid, kThreads, smem, stream>>>(
      q_abs, q_pe, cache, block_table, seq_len, selected, n_selected, p.heads, p.heads_per_group,
      p.page_size, p.max_pages, p.max_sel, softmax_scale, ws_acc, ws_ml);
  K3_CUDA_CHECK_LAUNCH();
  const dim3 cgrid(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.rows));
  const int32_t* n_sel = selected ? n_selected : nullptr;
  if (o_bf16)
    mla_combine_kernel<true><<<cgrid, kCombineThreads, 0, stream>>>(
        ws_acc, ws_ml, seq_len, n_sel, p.heads, p.splits, o_latent, lse);
  else
    mla_combine_kernel<false><<<cgrid, kCombineThreads, 0, stream>>>(
        ws_acc, ws_ml, seq_len, n_sel, p.heads, p.splits, o_latent, lse);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
