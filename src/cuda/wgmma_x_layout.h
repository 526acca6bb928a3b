// Where the warpgroup MXFP4 tiling (LinearPlan::wg) stages x and where wgmma reads it back:
// host and device code, so that a host test can check the layout against a model of the
// instruction (tests/cuda_host/test_wgmma_layout.cpp).
//
// A warp's weight piece of half j (128 k) of a 256-k chunk holds, in lane c = lane % 4, k 32 c +
// 8 w + i of word w; dequantized, word w gives pairs (k i, k i + 4), i = 0..3 (mxfp4_dequant.cuh),
// and pairs 2 s and 2 s + 1 are the A fragment's logical k 2 c, 2 c + 1 and 2 c + 8, 2 c + 9 of
// mma step (j, w, s). So each step's B tile must hold, at logical k 2 c + 8 h + e, the x of k
// 32 c + 8 w + 2 s + h + 4 e: x unit u (k 8 u.., permuted into those pairs by permute_x8) is
// scattered over two steps' tiles as 4-byte words.
#pragma once

#ifdef __CUDACC__
#define K3_WG_HD __host__ __device__
#else
#define K3_WG_HD
#endif

namespace k3::cuda::detail {

// One 16-k B tile of 8 nt tokens: two k halves (k 0-7, 8-15) of nt core matrices (8 tokens x 8 k,
// 16 bytes a token, 128 contiguous bytes).
constexpr K3_WG_HD int wg_tile_bytes(int nt) {
  return nt * 256;
}
// The descriptor's offsets: between the two k halves (leading) and the 8-token groups (stride).
constexpr K3_WG_HD int wg_lead_bytes(int nt) {
  return nt * 128;
}
constexpr int kWgStrideBytes = 128;

// The tile of mma step s (of 2) of word w (of 4) of half j (of 2) of local chunk `chunk`.
constexpr K3_WG_HD int wg_step(int chunk, int j, int w, int s) {
  return chunk * 16 + j * 8 + w * 2 + s;
}

// Byte offset of word p (pair p: k 8 u + p, 8 u + p + 4) of token m's permuted x unit u (k 8 u..
// 8 u + 7 of the CTA's K slice).
constexpr K3_WG_HD int wg_x_word_offset(int nt, int m, int u, int p) {
  const int chunk = u >> 5, j = (u >> 4) & 1, c = (u >> 2) & 3, w = u & 3;
  return wg_step(chunk, j, w, p >> 1) * wg_tile_bytes(nt) + (p & 1) * wg_lead_bytes(nt) +
         (m >> 3) * kWgStrideBytes + (m & 7) * 16 + c * 4;
}

}  // namespace k3::cuda::detail
