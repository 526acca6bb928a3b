// Absorbed MLA decode on tensor cores (bf16 mma.sync, fp32 accumulators). Kernel 1 (split):
// one CTA per (split, head group, row) streams its token range through shared memory in tiles of
// 32 cache rows (16-B cp.async copies through the page table, the next tile in flight while the
// current one is used). Per tile, with the group's heads as the mma's 16 rows:
//   scores S[16 x 32] = Q[16 x 576] C^T: 8 warps = 4 token columns of 8 x 2 halves of the 576;
//   online softmax per head (one warp per head, lane = token);
//   O[16 x 512] = a O + P C[:, :512]: each warp 64 latent columns. P goes to the mma as three
//   bf16 terms (each the bf16 rounding of what the ones before leave of p, which fp32 holds
//   exactly), so it is exact to 2^-27 of p, as near fp32 as the CUDA-core kernel this replaces:
//   its tests' tolerances (1e-5 of the output's RMS) hold unchanged. Two terms (2^-18 of p) put
//   single outputs ~4e-6 off, over them (H100, CudaMla.DenseMatchesFloat64).
// Kernel 2 (combine): merges the row's active splits (derived from its length, like the split
// kernel's ranges) of each (row, head) in split order, so the result does not depend on
// scheduling.
//
// Why tensor cores: at 6 heads a cached token (1152 B) costs 6 x (576 + 512) FMAs, ~5.7 per
// byte, ~24 T FMA/s at the 4.3 TB/s floor: more than the SMs' fp32 pipes sustain beside the
// bf16 unpacking and shared-memory traffic (the CUDA-core kernel reached 4-12% of the read
// curve at 32k). On the mma the arithmetic is a few percent of the tile's time.
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
using detail::ldmatrix_x4;
using detail::ldmatrix_x4_trans;
using detail::mma_bf16_16816;

constexpr int kKvLora = 512;
constexpr int kRope = 64;
constexpr int kD = kKvLora + kRope;  // 576 values per cached token
constexpr int kChunks = kD / 8;      // 72 16-byte chunks per cache row
constexpr int kTile = 32;            // cache rows per shared-memory tile
constexpr int kMaxHeads = 16;        // heads per CTA: the mma's 16 rows
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Shared rows padded by 16 B: a row is then 292 words, 4 banks on from the one before, so the 8
// rows an ldmatrix phase reads fall in distinct banks.
constexpr int kStride = kD + 8;
constexpr int kPStride = kTile + 8;                      // P rows: 20 words, likewise conflict-free
constexpr int kPTerms = 3;                               // bf16 terms of P (above)
constexpr int kScoreWarpsN = kTile / 8;                  // 4 warps along the tile's tokens
constexpr int kScoreHalves = kWarps / kScoreWarpsN;      // 2 along the 576
constexpr int kScoreKSteps = kD / 16 / kScoreHalves;     // 18 k-steps of 16 per warp
constexpr int kPvTiles = kKvLora / kWarps / 8;           // 8 n-tiles of 8 latent columns per warp
constexpr int kTileCopies = kTile * kChunks / kThreads;  // 16-byte copies per thread per tile
static_assert(kTile * kChunks % kThreads == 0, "a tile is whole rounds of copies");
static_assert(kScoreKSteps % 2 == 0 && kPvTiles % 2 == 0, "k-steps and n-tiles go in pairs");
constexpr int kQCopies = (kMaxHeads * kChunks + kThreads - 1) / kThreads;  // q: 16 B per copy

// Shared memory of a CTA: q (bf16, zero past the group's heads), two cache tiles, the two score
// halves, P as kPTerms bf16 terms, softmax state. ~99 KB: two CTAs per SM.
constexpr size_t kSplitSmemBytes =
    sizeof(__nv_bfloat16) *
        (kMaxHeads * kStride + 2 * kTile * kStride + kPTerms * kMaxHeads * kPStride) +
    sizeof(float) * (kScoreHalves * kMaxHeads * kTile + 3 * kMaxHeads);

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
__global__ void __launch_bounds__(kThreads, 2)
    mla_split_kernel(const __nv_bfloat16* q_abs, const __nv_bfloat16* q_pe,
                     const __nv_bfloat16* cache, const int32_t* block_table, const int32_t* seq_len,
                     const int32_t* selected, const int32_t* n_selected, int heads, int hpg,
                     int page_size, int max_pages, int max_sel, float scale,
                     float* __restrict__ ws_acc, float* __restrict__ ws_ml) {
  K3_PDL_ENTRY();
  // q_abs [rows][heads][512] bf16; q_pe [rows][heads][64] bf16; cache [pages][page_size][576];
  // ws_acc [rows][heads][splits][512] fp32 (unnormalised sum p c); ws_ml [rows][heads][splits][2]
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [kMaxHeads][kStride]
  __nv_bfloat16* tiles = qs + kMaxHeads * kStride;             // [2][kTile][kStride]
  __nv_bfloat16* p_terms = tiles + 2 * kTile * kStride;        // [kPTerms][kMaxHeads][kPStride]
  float* sp = reinterpret_cast<float*>(p_terms + kPTerms * kMaxHeads * kPStride);  // [2][16][kTile]
  float* m_s = sp + kScoreHalves * kMaxHeads * kTile;  // [kMaxHeads] running max
  float* l_s = m_s + kMaxHeads;                        // [kMaxHeads] running sum
  float* a_s = l_s + kMaxHeads;                        // [kMaxHeads] rescale this tile

  const int split = blockIdx.x, splits = gridDim.x;
  const int h0 = blockIdx.y * hpg, row = blockIdx.z;
  const int hg = min(hpg, heads - h0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;  // mma fragment row and column pair
  const int32_t* sel = selected ? selected + static_cast<int64_t>(row) * max_sel : nullptr;
  const int n = max(0, sel ? n_selected[row] : seq_len[row]);
  const int32_t* bt = block_table + static_cast<int64_t>(row) * max_pages;
  const int chunk = split_tokens(n, splits);
  const int beg = min(n, split * chunk), end = min(n, beg + chunk);
  if (beg >= end) return;  // beyond the row's active splits: the combine never reads it

  // Tile loads: the rows' page-table entries (and sparse selections) of a tile in one batch,
  // then its 16-byte copies, one commit group per tile. Rows past the range are zero-filled, so
  // they add nothing to P C.
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
      cp_async16(dst + r * kStride + c * 8, ok ? src : cache, ok);
    }
    cp_async_commit();
  };
  issue_tile(tiles, beg);

  // q of the group's heads, zero in the rows past them (their mma rows are never stored, but
  // must stay finite for hygiene): every 16-byte load first, then the stores.
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
    if (h < kMaxHeads) *reinterpret_cast<uint4*>(qs + h * kStride + c * 8) = qv[j];
  }
  for (int i = tid; i < kPTerms * kMaxHeads * kPStride; i += kThreads)  // rows past hg stay 0
    p_terms[i] = __float2bfloat16_rn(0.0f);
  if (tid < kMaxHeads) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
    a_s[tid] = 0.0f;
  }
  float acc[kPvTiles][4] = {};  // O rows g and g + 8, this warp's latent columns

  int buf = 0;
  for (int t0 = beg; t0 < end; t0 += kTile, buf ^= 1) {
    const int nt = min(kTile, end - t0);
    const __nv_bfloat16* tile = tiles + buf * kTile * kStride;
    // 1. The next tile's copies go out (into the buffer the previous iteration finished with),
    // then this tile's have landed.
    if (t0 + kTile < end)
      issue_tile(tiles + (buf ^ 1) * kTile * kStride, t0 + kTile);
    else
      cp_async_commit();  // an empty group keeps the wait count uniform
    cp_async_wait<1>();
    __syncthreads();
    // 2. Scores: warp -> 8 tokens (n0) x one half of the 576 (A = q rows, B = cache rows).
    {
      const int n0 = (warp % kScoreWarpsN) * 8, half = warp / kScoreWarpsN;
      const int kb = half * kScoreKSteps * 16;
      const __nv_bfloat16* a_row = qs + (lane & 15) * kStride + kb + (lane >> 4) * 8;
      const __nv_bfloat16* b_row = tile + (n0 + (lane & 7)) * kStride + kb + (lane >> 3) * 8;
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < kScoreKSteps; ks += 2) {
        uint32_t a0[4], a1[4], b[4];  // b: (b0, b1) of k-step ks, then of ks + 1
        ldmatrix_x4(a0, a_row + ks * 16);
        ldmatrix_x4(a1, a_row + ks * 16 + 16);
        ldmatrix_x4(b, b_row + ks * 16);
        mma_bf16_16816(d, a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
        mma_bf16_16816(d, a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
      }
      float* out = sp + half * kMaxHeads * kTile;
      *reinterpret_cast<float2*>(out + g * kTile + n0 + 2 * c4) = make_float2(d[0], d[1]);
      *reinterpret_cast<float2*>(out + (g + 8) * kTile + n0 + 2 * c4) = make_float2(d[2], d[3]);
    }
    __syncthreads();
    // 3. Online softmax: one warp per head, lane = token of the tile; the halves add in order.
    for (int h = warp; h < hg; h += kWarps) {
      const float raw = sp[h * kTile + lane] + sp[(kMaxHeads + h) * kTile + lane];
      const float s = lane < nt ? raw * scale : -INFINITY;
      const float mo = m_s[h], mn = fmaxf(mo, warp_max(s));
      // mn is finite here: every tile holds at least one valid token.
      const float p = s == -INFINITY ? 0.0f : expf(s - mn);
      const float a = mo == -INFINITY ? 0.0f : expf(mo - mn);
      const float sum = warp_sum(p);
      float rest = p;  // what the terms so far leave of p: exact in fp32
#pragma unroll
      for (int q = 0; q < kPTerms; ++q) {
        const __nv_bfloat16 term = __float2bfloat16_rn(rest);
        p_terms[(q * kMaxHeads + h) * kPStride + lane] = term;
        rest -= __bfloat162float(term);
      }
      if (lane == 0) {
        l_s[h] = l_s[h] * a + sum;
        m_s[h] = mn;
        a_s[h] = a;
      }
    }
    __syncthreads();
    // 4. O = a O + (P_hi + P_lo) V over this warp's 64 latent columns (B = cache rows, .trans).
    {
      const float a_g = a_s[g], a_g8 = a_s[g + 8];
#pragma unroll
      for (int j = 0; j < kPvTiles; ++j) {
        acc[j][0] *= a_g;
        acc[j][1] *= a_g;
        acc[j][2] *= a_g8;
        acc[j][3] *= a_g8;
      }
      const int col0 = warp * kPvTiles * 8, mi = lane >> 3;
#pragma unroll
      for (int kt = 0; kt < kTile; kt += 16) {
        uint32_t pf[kPTerms][4];  // A fragments of each term
#pragma unroll
        for (int q = 0; q < kPTerms; ++q)
          ldmatrix_x4(pf[q],
                      p_terms + (q * kMaxHeads + (lane & 15)) * kPStride + kt + (lane >> 4) * 8);
        // Matrix mi: tokens kt + 8 (mi & 1) .., columns + 8 (mi >> 1): (b0, b1) of n-tiles j, j
        // + 1.
        const __nv_bfloat16* v_row =
            tile + (kt + (lane & 7) + (mi & 1) * 8) * kStride + col0 + (mi >> 1) * 8;
#pragma unroll
        for (int j = 0; j < kPvTiles; j += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_row + j * 8);
#pragma unroll
          for (int q = kPTerms - 1; q >= 0; --q) {  // smallest term first
            mma_bf16_16816(acc[j], pf[q][0], pf[q][1], pf[q][2], pf[q][3], b[0], b[1]);
            mma_bf16_16816(acc[j + 1], pf[q][0], pf[q][1], pf[q][2], pf[q][3], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // the next tile overwrites tile, sp and P
  }

  const int col0 = warp * kPvTiles * 8 + 2 * c4;
  const int64_t slot0 = static_cast<int64_t>(row) * heads + h0;  // (row, first head of the group)
#pragma unroll
  for (int j = 0; j < kPvTiles; ++j) {
    if (g < hg)
      *reinterpret_cast<float2*>(ws_acc + ((slot0 + g) * splits + split) * kKvLora + col0 + j * 8) =
          make_float2(acc[j][0], acc[j][1]);
    if (g + 8 < hg)
      *reinterpret_cast<float2*>(ws_acc + ((slot0 + g + 8) * splits + split) * kKvLora + col0 +
                                 j * 8) = make_float2(acc[j][2], acc[j][3]);
  }
  if (tid < hg) {
    const int64_t slot = (slot0 + tid) * splits + split;
    ws_ml[slot * 2] = m_s[tid];
    ws_ml[slot * 2 + 1] = l_s[tid];
  }
}

// The combine: one CTA per (head, row); 8 groups of 64 threads, each thread 8 latent columns of
// every 8th split, then the groups' sums in group order. At batch 1 and 32k there are 264 splits
// for 6 CTAs: one thread walking all of them (the version before) was 264 dependent L2 round
// trips in batches of 4.
constexpr int kCombineCols = 8;
constexpr int kCombineColThreads = kKvLora / kCombineCols;            // 64
constexpr int kCombineGroups = 8;                                     // split groups
constexpr int kCombineThreads = kCombineColThreads * kCombineGroups;  // 512
constexpr int kMaxSplits = 1024;

template <bool kBf16Out>
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(const float* ws_acc, const float* ws_ml, const int32_t* seq_len,
                       const int32_t* n_selected, int heads, int splits, void* __restrict__ out,
                       float* __restrict__ lse) {
  K3_PDL_ENTRY();
  // ws_acc [rows][heads][splits][512]; ws_ml [rows][heads][splits][2];
  // out [rows][heads][512] fp32 or bf16. The split weights exp(m_s - max) are computed once into
  // shared memory; group q sums splits q, q + 8, ... in order, then the 8 group sums add in group
  // order: the result does not depend on scheduling.
  __shared__ float w_s[kMaxSplits];
  __shared__ float red[kCombineThreads / 32];
  __shared__ float4 part[kCombineGroups][kCombineColThreads][2];  // [group][thread][8 columns]
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
  const int grp = tid / kCombineColThreads, ct = tid % kCombineColThreads;
  float o[kCombineCols] = {};
  if (mx != -INFINITY) {  // else the row has no tokens: o = 0
    const float* acc = ws_acc + rh * splits * kKvLora + ct * kCombineCols;
#pragma unroll 4
    for (int s = grp; s < active; s += kCombineGroups) {
      const float w = w_s[s];
      const float4* a = reinterpret_cast<const float4*>(acc + static_cast<int64_t>(s) * kKvLora);
      const float4 a0 = a[0], a1 = a[1];
      o[0] += w * a0.x;
      o[1] += w * a0.y;
      o[2] += w * a0.z;
      o[3] += w * a0.w;
      o[4] += w * a1.x;
      o[5] += w * a1.y;
      o[6] += w * a1.z;
      o[7] += w * a1.w;
    }
  }
  part[grp][ct][0] = make_float4(o[0], o[1], o[2], o[3]);
  part[grp][ct][1] = make_float4(o[4], o[5], o[6], o[7]);
  __syncthreads();
  if (grp != 0) return;
  float r[kCombineCols] = {};
  for (int q = 0; q < kCombineGroups; ++q) {
    const float4 p0 = part[q][ct][0], p1 = part[q][ct][1];
    r[0] += p0.x;
    r[1] += p0.y;
    r[2] += p0.z;
    r[3] += p0.w;
    r[4] += p1.x;
    r[5] += p1.y;
    r[6] += p1.z;
    r[7] += p1.w;
  }
  if (mx != -INFINITY) {
    const float inv = 1.0f / l;
    for (float& x : r) x *= inv;
  }
  const int64_t e = rh * kKvLora + ct * kCombineCols;
  if constexpr (kBf16Out) {
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(out) + e;
    for (int j = 0; j < kCombineCols; ++j) y[j] = __float2bfloat16_rn(r[j]);
  } else {
    float4* y = reinterpret_cast<float4*>(static_cast<float*>(out) + e);
    y[0] = make_float4(r[0], r[1], r[2], r[3]);
    y[1] = make_float4(r[4], r[5], r[6], r[7]);
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
  // Aim at one wave of two CTAs per SM (what fits in kSplitSmemBytes each) for the longest
  // context the grid must serve: the most splits whose CTAs all fit, since the splits are equal
  // work and a second, partial wave would double the kernel's time (64 rows at 5 splits were 320
  // CTAs for 264 places). On the device each split takes at least kMinSplit tokens, so a short
  // context uses fewer splits. At batch 1 the step is latency-bound: many short splits win
  // although each writes heads_per_group x 2 KB of fp32 partials (L2-resident, read back by the
  // combine).
  const int64_t base = std::max<int64_t>(1, static_cast<int64_t>(p.rows) * p.head_groups);
  const int64_t want = 2 * static_cast<int64_t>(sm_count) / base;
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
  const size_t smem = kSplitSmemBytes;
  K3_CUDA_CHECK(cudaFuncSetAttribute(mla_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
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
