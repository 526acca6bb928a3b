// DSA index scores on fp8 tensor cores (mma.sync m16n8k32 E4M3; dsa_index_scores with
// tensor_cores, dsa_indexer.h) for index_head_dim 128 (one fp8 scale block per key) and
// index_n_heads a multiple of 16 up to 64 (K3.1: 32 x 128).
//
// The keys sit in the cache as E4M3 bytes with one fp32 scale each, and the queries take the same
// fp8 block round trip (dsa_select), so with both scales positive
//   I[s] = sk_s * sum_h (w_h sq_h) relu(sum_j e4m3(q_h)_j e4m3(k_s)_j):
// one fp8 GEMM [nh x 128] x [128 x tokens] per row, whose products are exact; the tensor cores
// sum them in fp32. Why: the CUDA-core kernel sums every (token, head) dot product across a warp
// (5 shuffles per head): ~210 us per row at 131072 tokens, ~90 GB/s of keys (bench/RESULTS.md).
//
// Layout: each warp takes 64 tokens of a 512-token chunk (32 heads), as 8 n-tiles of 8. Lane (g, t)
// loads bytes 32 t .. 32 t + 31 of token g's key (two 16-byte loads; a group's 4 lanes read the
// whole 128-byte row), and k is permuted alike in the query fragments: k-step s, fragment half e
// (b0 / b1, a0 / a2) holds bytes 32 t + 8 s + 4 e .. + 3. A dot product does not depend on k's
// order.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/dsa_query.cuh"
#include "cuda/mma.cuh"
#include "cuda/pdl.cuh"
#include "cuda/quant_util.cuh"

namespace k3::cuda::detail::dsa {
namespace {

constexpr int kHd = 128;  // index_head_dim of this kernel
// Query rows in shared memory, in the k order of the fragments (below), padded by 16 bytes so that
// the 8 rows an ldmatrix phase reads fall in distinct banks.
constexpr int kQStride = kHd + 16;
constexpr int kThreads = 256;  // 8 warps
// n-tiles of 8 tokens a warp loads at once: 8 (64 registers of keys) for up to 32 heads, 4 for
// 48 or 64, so that two CTAs fit an SM's registers (ptxas: 128, 8-16 bytes of spill).
constexpr int tiles_per_warp(int m_tiles) {
  return m_tiles <= 2 ? 8 : 4;
}
// Tokens of a CTA round: 512 for up to 32 heads, else 256.
constexpr int chunk_tokens(int m_tiles) {
  return kThreads / 32 * tiles_per_warp(m_tiles) * 8;
}

template <int kMTiles>
__global__ void __launch_bounds__(kThreads, 2)
    scores_mma_kernel(const __nv_bfloat16* q, const __nv_bfloat16* head_w, float head_scale,
                      const uint8_t* key_cache, const float* scale_cache,
                      const int32_t* block_table, int max_pages, const int32_t* seq_len,
                      int page_size, float* __restrict__ scores, int64_t max_tokens) {
  constexpr int kNh = kMTiles * 16;
  constexpr int kTilesPerWarp = tiles_per_warp(kMTiles), kChunk = chunk_tokens(kMTiles);
  K3_PDL_ENTRY();
  __shared__ float sq[kNh * kHd];                       // rotated queries, fp32
  __shared__ float sw[kNh];                             // w_h head_scale
  __shared__ __align__(16) uint8_t qb[kNh * kQStride];  // E4M3 queries, fragment k order
  __shared__ float cw[kNh];                             // w_h head_scale sq_h
  const int64_t r = blockIdx.x;
  // Token positions fit 32 bits (the launcher checks max_tokens), so the page arithmetic is
  // 32-bit division, not a 64-bit one per key.
  const int T = static_cast<int>(min(static_cast<int64_t>(seq_len[r]), max_tokens));
  if (static_cast<int>(blockIdx.y) * kChunk >= T) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int32_t* bt = block_table + r * max_pages;  // [max_pages]

  // The warp's keys of one chunk: token base + 8 i + g for n-tile i (zero past T).
  uint4 kv[kTilesPerWarp][2];
  float ks[kTilesPerWarp];
  const auto load_keys = [&](int base) {
#pragma unroll
    for (int i = 0; i < kTilesPerWarp; ++i) {
      const int s = base + 8 * i + g;
      kv[i][0] = kv[i][1] = make_uint4(0, 0, 0, 0);
      ks[i] = 0.0f;
      if (s < T) {
        const int64_t slot = static_cast<int64_t>(bt[s / page_size]) * page_size + s % page_size;
        const uint4* k = reinterpret_cast<const uint4*>(key_cache + slot * kHd + 32 * t);
        kv[i][0] = k[0];
        kv[i][1] = k[1];
        ks[i] = scale_cache[slot];
      }
    }
  };

  int chunk = static_cast<int>(blockIdx.y);
  load_keys(chunk * kChunk + warp * kTilesPerWarp * 8);  // in flight during the query preparation
  // (The A fragments are read by ldmatrix per tile: kept in registers across the chunk loop,
  // they spilled ~500 bytes.)

  // Queries as dsa_select prepares them (Hadamard, one fp8 block per head), kept as E4M3 bytes
  // and the block scale folded into the head weight.
  rotated_queries(q, head_w, head_scale, r, kNh, kHd, sq, sw);
  for (int h = warp; h < kNh; h += kThreads / 32) {
    const float* x = sq + h * kHd;
    const float scale = fp8_block_scale(warp_amax(x, kHd));
    // Key byte p = 32 t + 8 s + 4 e + i is k-step s's fragment column 16 e + 4 t + i.
    for (int p = lane; p < kHd; p += 32) {
      const int tt = p / 32, s = p % 32 / 8, e = p % 8 / 4, i = p % 4;
      qb[h * kQStride + 32 * s + 16 * e + 4 * tt + i] = f32_to_e4m3(__fdiv_rn(x[p], scale));
    }
    if (lane == 0) cw[h] = sw[h] * scale;
  }
  __syncthreads();

  for (;;) {
    const int base = chunk * kChunk + warp * kTilesPerWarp * 8;
#pragma unroll
    for (int i = 0; i < kTilesPerWarp; ++i) {
      const uint32_t w[8] = {kv[i][0].x, kv[i][0].y, kv[i][0].z, kv[i][0].w,
                             kv[i][1].x, kv[i][1].y, kv[i][1].z, kv[i][1].w};
      float p0 = 0.0f, p1 = 0.0f;  // this lane's heads, tokens 2 t and 2 t + 1 of the n-tile
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        const uint8_t* a_row = qb + (16 * m + (lane & 15)) * kQStride + (lane >> 4) * 16;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a[4];
          ldmatrix_x4(a, a_row + 32 * s);
          mma_e4m3_16832(d, a[0], a[1], a[2], a[3], w[2 * s], w[2 * s + 1]);
        }
        const float w0 = cw[16 * m + g], w1 = cw[16 * m + g + 8];
        p0 += w0 * fmaxf(d[0], 0.0f) + w1 * fmaxf(d[2], 0.0f);
        p1 += w0 * fmaxf(d[1], 0.0f) + w1 * fmaxf(d[3], 0.0f);
      }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {  // over the 8 groups' heads
        p0 += __shfl_xor_sync(0xffffffffu, p0, o);
        p1 += __shfl_xor_sync(0xffffffffu, p1, o);
      }
      // Token c's scale is in the lanes of group c.
      const float sk0 = __shfl_sync(0xffffffffu, ks[i], 8 * t);
      const float sk1 = __shfl_sync(0xffffffffu, ks[i], 8 * t + 4);
      const int s0 = base + 8 * i + 2 * t;
      if (g == 0 && s0 < T) scores[r * max_tokens + s0] = sk0 * p0;
      if (g == 0 && s0 + 1 < T) scores[r * max_tokens + s0 + 1] = sk1 * p1;
    }
    chunk += static_cast<int>(gridDim.y);
    if (chunk * kChunk >= T) break;
    load_keys(chunk * kChunk + warp * kTilesPerWarp * 8);
  }
}

}  // namespace

bool scores_mma_shape(int nh, int hd) {
  return hd == kHd && nh % 16 == 0 && nh >= 16 && nh <= 64;
}

void scores_mma(const __nv_bfloat16* q, const __nv_bfloat16* head_w, float head_scale, int64_t rows,
                int nh, const uint8_t* key_cache, const float* scale_cache,
                const int32_t* block_table, int max_pages, const int32_t* seq_len, int page_size,
                float* scores, int64_t max_tokens, cudaStream_t stream) {
  K3_CHECK(scores_mma_shape(nh, kHd), "dsa scores (tensor cores): index_n_heads ", nh);
  K3_CHECK(max_tokens <= 0x7fff0000, "dsa scores (tensor cores): max_tokens ", max_tokens);
  if (rows == 0 || max_tokens == 0) return;
  // Chunks of the longest row, at most what fills two CTAs per SM over the rows; a CTA walks
  // every gridDim.y-th chunk of its row.
  int dev = 0, sms = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int m_tiles = nh / 16;
  const int64_t chunks = (max_tokens + chunk_tokens(m_tiles) - 1) / chunk_tokens(m_tiles);
  const int64_t per_row = std::max<int64_t>(1, 2 * static_cast<int64_t>(sms) / rows);
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>(std::min<int64_t>({chunks, per_row, 65535})));
  const auto launch = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(q, head_w, head_scale, key_cache, scale_cache,
                                          block_table, max_pages, seq_len, page_size, scores,
                                          max_tokens);
  };
  switch (m_tiles) {
    case 1:
      launch(scores_mma_kernel<1>);
      break;
    case 2:
      launch(scores_mma_kernel<2>);
      break;
    case 3:
      launch(scores_mma_kernel<3>);
      break;
    default:
      launch(scores_mma_kernel<4>);
      break;
  }
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda::detail::dsa
