// MLA split kernel on tensor cores (bf16 mma.sync m16n8k16; MlaDecodePlan::tensor_cores, off by
// default until its GPU tests pass: mla_decode.h). Same CTA grid, tiles and token ranges as the
// CUDA-core kernel (mla_split.cuh), in a ring of 2 tiles (two CTAs per SM) or 4 / 5 (one CTA per
// SM, MlaDecodePlan::ring_tiles); per tile, with the group's heads as the mma's 16 rows:
//   scores S[16 x 32] = Q[16 x 576] C^T: 8 warps = 4 token columns of 8 x 2 halves of the 576;
//   online softmax per head (one warp per head, lane = token);
//   O[16 x 512] = a O + P C[:, :512]: each warp 64 latent columns.
// Why: at 6 heads a cached token (1152 B) costs 6 x (576 + 512) FMAs, ~5.7 per byte, ~24 T FMA/s
// at the 4.3 TB/s floor, more than the fp32 pipes sustain beside the bf16 unpacking and the
// shared-memory traffic (the CUDA-core kernel: 4-17% of the read curve; this one 3-9x faster,
// bench/RESULTS.md, nineteenth stop).
//
// Accuracy, to stay within the fp32 kernel's tolerances: P goes to the mma as three bf16 terms
// (each the bf16 rounding of what the ones before leave of p, which fp32 holds exactly), so it is
// exact to 2^-27 of p; and every mma starts from zero, its result added in fp32 (one k-step of
// the scores, one tile of O), since the tensor cores' own accumulation truncates: accumulating
// O over a split's tiles in the mma put outputs up to ~1e-5 off with 129 tiles in one split, and
// two P terms (2^-18) ~4e-6 (H100, CudaMla; tolerance 1e-5 of the outputs' RMS).
#include <cmath>

#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/mla_split.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda::detail::mla {
namespace {

constexpr int kWarps = kThreads / 32;
// Shared rows padded by 16 B: a row is then 292 words, 4 banks on from the one before, so the 8
// rows an ldmatrix phase reads fall in distinct banks.
constexpr int kStride = kD + 8;
constexpr int kPStride = kTile + 8;                   // P rows: 20 words, likewise conflict-free
constexpr int kPTerms = 3;                            // bf16 terms of P (above)
constexpr int kScoreWarpsN = kTile / 8;               // 4 warps along the tile's tokens
constexpr int kScoreHalves = kWarps / kScoreWarpsN;   // 2 along the 576
constexpr int kScoreKSteps = kD / 16 / kScoreHalves;  // 18 k-steps of 16 per warp
constexpr int kPvTiles = kKvLora / kWarps / 8;        // 8 n-tiles of 8 latent columns per warp
static_assert(kScoreKSteps % 2 == 0 && kPvTiles % 2 == 0, "k-steps and n-tiles go in pairs");

// Shared memory of a CTA: q (bf16, zero past the group's heads), a ring of kStages cache tiles,
// P as kPTerms bf16 terms, the two score halves, softmax state. Two tiles: ~99 KB, two CTAs per
// SM; four: ~172 KB and five: ~209 KB, one CTA per SM with three or four tiles in flight.
constexpr size_t smem_bytes(int stages) {
  return sizeof(__nv_bfloat16) *
             (kMaxHeads * kStride + stages * kTile * kStride + kPTerms * kMaxHeads * kPStride) +
         sizeof(float) * (kScoreHalves * kMaxHeads * kTile + 3 * kMaxHeads);
}
static_assert(smem_bytes(kRingDeepest) <= 227 * 1024, "the deepest ring fits one CTA per SM");

__device__ __forceinline__ void mma_from_zero(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1) {
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  mma_bf16_16816(d, a[0], a[1], a[2], a[3], b0, b1);
}

template <int kStages>
__global__ void __launch_bounds__(kThreads, kStages == 2 ? 2 : 1)
    mla_split_mma_kernel(const __grid_constant__ SplitArgs a) {
  K3_PDL_ENTRY();
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);  // [kMaxHeads][kStride]
  __nv_bfloat16* tiles = qs + kMaxHeads * kStride;             // [kStages][kTile][kStride]
  __nv_bfloat16* p_terms = tiles + kStages * kTile * kStride;  // [kPTerms][kMaxHeads][kPStride]
  float* sp = reinterpret_cast<float*>(p_terms + kPTerms * kMaxHeads * kPStride);  // [2][16][32]
  float* m_s = sp + kScoreHalves * kMaxHeads * kTile;  // [kMaxHeads] running max
  float* l_s = m_s + kMaxHeads;                        // [kMaxHeads] running sum
  float* a_s = l_s + kMaxHeads;                        // [kMaxHeads] rescale this tile

  const int split = blockIdx.x, splits = gridDim.x;
  const int h0 = blockIdx.y * a.hpg, row = blockIdx.z;
  const int hg = min(a.hpg, a.heads - h0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;  // mma fragment row and column pair
  const SplitRange range = split_range(a, row, split, splits);
  const int beg = range.beg, end = range.end;
  if (beg >= end) return;  // beyond the row's active splits: the combine never reads it

  ring_start<kStride, kStages>(a, range, tiles, tid);
  // q rows past hg are zero: their mma rows are never stored, but stay finite.
  load_q<kStride>(a, row, h0, hg, kMaxHeads, qs, tid);
  for (int i = tid; i < kPTerms * kMaxHeads * kPStride; i += kThreads)  // rows past hg stay 0
    p_terms[i] = __float2bfloat16_rn(0.0f);
  if (tid < kMaxHeads) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
    a_s[tid] = 0.0f;
  }
  float acc[kPvTiles][4] = {};  // O rows g and g + 8, this warp's latent columns

  int buf = 0;
  for (int t0 = beg; t0 < end; t0 += kTile, buf = buf + 1 == kStages ? 0 : buf + 1) {
    const int nt = min(kTile, end - t0);
    const __nv_bfloat16* tile = tiles + buf * kTile * kStride;
    tile_ready<kStride, kStages>(a, range, tiles, buf, t0, tid);  // 1. landed, the next in flight
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
        float t[4], u[4];
        mma_from_zero(t, a0, b[0], b[1]);
        mma_from_zero(u, a1, b[2], b[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] += t[e] + u[e];
      }
      float* out = sp + half * kMaxHeads * kTile;
      *reinterpret_cast<float2*>(out + g * kTile + n0 + 2 * c4) = make_float2(d[0], d[1]);
      *reinterpret_cast<float2*>(out + (g + 8) * kTile + n0 + 2 * c4) = make_float2(d[2], d[3]);
    }
    __syncthreads();
    // 3. Online softmax: one warp per head, lane = token of the tile; the halves add in order.
    for (int h = warp; h < hg; h += kWarps) {
      const float raw = sp[h * kTile + lane] + sp[(kMaxHeads + h) * kTile + lane];
      const float s = lane < nt ? raw * a.scale : -INFINITY;
      float rest = softmax_step(s, m_s, l_s, a_s, h, lane);  // what the terms leave of p
#pragma unroll
      for (int q = 0; q < kPTerms; ++q) {
        const __nv_bfloat16 term = __float2bfloat16_rn(rest);
        p_terms[(q * kMaxHeads + h) * kPStride + lane] = term;
        rest -= __bfloat162float(term);  // exact in fp32
      }
    }
    __syncthreads();
    // 4. O = a O + (sum of the P terms) V over this warp's 64 latent columns (B = cache rows,
    // .trans); each n-tile's tile product starts from zero in the mma and is added in fp32.
    {
      const float a_g = a_s[g], a_g8 = a_s[g + 8];
      uint32_t pf[2][kPTerms][4];  // A fragments: [k-step of 16 tokens][term]
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int q = 0; q < kPTerms; ++q)
          ldmatrix_x4(pf[k][q], p_terms + (q * kMaxHeads + (lane & 15)) * kPStride + k * 16 +
                                    (lane >> 4) * 8);
      const int col0 = warp * kPvTiles * 8, mi = lane >> 3;
      // Matrix mi: tokens 8 (mi & 1) .., columns + 8 (mi >> 1): (b0, b1) of n-tiles j, j + 1.
      const __nv_bfloat16* v_row =
          tile + ((lane & 7) + (mi & 1) * 8) * kStride + col0 + (mi >> 1) * 8;
#pragma unroll
      for (int j = 0; j < kPvTiles; j += 2) {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f}, u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_row + k * 16 * kStride + j * 8);
#pragma unroll
          for (int q = kPTerms - 1; q >= 0; --q) {  // smallest term first
            mma_bf16_16816(t, pf[k][q][0], pf[k][q][1], pf[k][q][2], pf[k][q][3], b[0], b[1]);
            mma_bf16_16816(u, pf[k][q][0], pf[k][q][1], pf[k][q][2], pf[k][q][3], b[2], b[3]);
          }
        }
        acc[j][0] = acc[j][0] * a_g + t[0];
        acc[j][1] = acc[j][1] * a_g + t[1];
        acc[j][2] = acc[j][2] * a_g8 + t[2];
        acc[j][3] = acc[j][3] * a_g8 + t[3];
        acc[j + 1][0] = acc[j + 1][0] * a_g + u[0];
        acc[j + 1][1] = acc[j + 1][1] * a_g + u[1];
        acc[j + 1][2] = acc[j + 1][2] * a_g8 + u[2];
        acc[j + 1][3] = acc[j + 1][3] * a_g8 + u[3];
      }
    }
    __syncthreads();  // the next tile overwrites tile, sp and P
  }

  const int col = warp * kPvTiles * 8 + 2 * c4;
  const int64_t rh0 = static_cast<int64_t>(row) * a.heads + h0;  // (row, first head of the group)
#pragma unroll
  for (int j = 0; j < kPvTiles; ++j) {
    if (g < hg)
      *reinterpret_cast<float2*>(a.ws_acc + ((rh0 + g) * splits + split) * kKvLora + col + j * 8) =
          make_float2(acc[j][0], acc[j][1]);
    if (g + 8 < hg)
      *reinterpret_cast<float2*>(a.ws_acc + ((rh0 + g + 8) * splits + split) * kKvLora + col +
                                 j * 8) = make_float2(acc[j][2], acc[j][3]);
  }
  store_ml(a, row, h0, hg, split, splits, m_s, l_s, tid);
}

template <int kStages>
void launch_ring(const SplitArgs& a, dim3 grid, cudaStream_t stream) {
  // Above the 48 KB default: an attribute, not a stream operation, so legal while capturing.
  K3_CUDA_CHECK(cudaFuncSetAttribute(mla_split_mma_kernel<kStages>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem_bytes(kStages))));
  mla_split_mma_kernel<kStages><<<grid, kThreads, smem_bytes(kStages), stream>>>(a);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_split_mma(const SplitArgs& a, dim3 grid, int ring_tiles, cudaStream_t stream) {
  switch (ring_tiles) {
    case 2:
      return launch_ring<2>(a, grid, stream);
    case 4:
      return launch_ring<4>(a, grid, stream);
    case kRingDeepest:
      return launch_ring<kRingDeepest>(a, grid, stream);
    default:
      K3_CHECK(false, "cuda::mla_decode: tile ring of ", ring_tiles, " (2, 4 or 5)");
  }
}

}  // namespace k3::cuda::detail::mla
