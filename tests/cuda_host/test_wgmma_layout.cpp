// The warpgroup MXFP4 tiling's x layout (cuda/wgmma_x_layout.h) against a model of wgmma, without
// a GPU: x is scattered into shared memory as the kernel stages it, each mma step's B operand is
// read back as the PTX ISA defines a no-swizzle K-major tile (core matrices of 8 rows x 16 bytes,
// the descriptor's leading offset between the two k halves, its stride offset between 8-row
// groups), the A operand is the weights as each lane's dequantized pairs hold them
// (Mxfp4Format::load_chunk, mxfp4_dequant.cuh, dequant_half in linear_mxfp4.cu), and the sum over
// all steps must be the plain product, exactly (small integers).
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "core/rng.h"
#include "cuda/wgmma_x_layout.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::detail::kWgStrideBytes;
using cuda::detail::wg_lead_bytes;
using cuda::detail::wg_step;
using cuda::detail::wg_tile_bytes;
using cuda::detail::wg_x_word_offset;

// The weight value lane (g, c) of a warp holds as logical k kk (0..15) of row g + 8 h of mma step
// (j, w, s): pair 2 s + kk / 8 of word w of its piece of half j (k 32 c + 8 w..), element kk % 2
// of the pair (k i, then i + 4).
int a_operand_k(int j, int w, int s, int kk) {
  const int c = (kk % 8) / 2, e = kk % 2, pair = 2 * s + kk / 8;
  return j * 128 + c * 32 + w * 8 + pair + 4 * e;
}

void check_layout(int nt, int tokens, int chunks, uint64_t seed) {
  SCOPED_TRACE("nt " + std::to_string(nt) + " tokens " + std::to_string(tokens) + " chunks " +
               std::to_string(chunks));
  Rng rng(seed);
  const int K = 256 * chunks, rows = 64;
  std::vector<int> x(static_cast<size_t>(tokens * K)), W(static_cast<size_t>(rows * K));
  for (int& v : x) v = static_cast<int>(rng.next_u64() % 7) - 3;
  for (int& v : W) v = static_cast<int>(rng.next_u64() % 7) - 3;

  // Stage: one slot per bf16 element (2 bytes), -1000 where nothing was written.
  const int bytes = wg_step(chunks, 0, 0, 0) * wg_tile_bytes(nt);
  std::vector<int> smem(static_cast<size_t>(bytes / 2), -1000);
  std::set<int> written;
  for (int m = 0; m < tokens; ++m)
    for (int u = 0; u < K / 8; ++u)
      for (int p = 0; p < 4; ++p) {
        const int off = wg_x_word_offset(nt, m, u, p);
        ASSERT_EQ(off % 4, 0);
        ASSERT_GE(off, 0);
        ASSERT_LT(off, bytes);
        ASSERT_TRUE(written.insert(off).second) << "two words at byte " << off;
        smem[static_cast<size_t>(off / 2)] = x[static_cast<size_t>(m * K + 8 * u + p)];
        smem[static_cast<size_t>(off / 2 + 1)] = x[static_cast<size_t>(m * K + 8 * u + p + 4)];
      }

  // D[r][n] = sum over steps of A[r][kk] B[kk][n], B read as the descriptor describes it.
  std::vector<long> d(static_cast<size_t>(rows * tokens), 0);
  for (int chunk = 0; chunk < chunks; ++chunk)
    for (int j = 0; j < 2; ++j)
      for (int w = 0; w < 4; ++w)
        for (int s = 0; s < 2; ++s) {
          const int tile = wg_step(chunk, j, w, s) * wg_tile_bytes(nt);
          for (int n = 0; n < tokens; ++n)
            for (int kk = 0; kk < 16; ++kk) {
              const int at = tile + (kk / 8) * wg_lead_bytes(nt) + (n / 8) * kWgStrideBytes +
                             (n % 8) * 16 + (kk % 8) * 2;
              const int b = smem[static_cast<size_t>(at / 2)];
              ASSERT_NE(b, -1000) << "step reads an unwritten element (token " << n << ")";
              const int k = chunk * 256 + a_operand_k(j, w, s, kk);
              for (int r = 0; r < rows; ++r)
                d[static_cast<size_t>(r * tokens + n)] += static_cast<long>(W[r * K + k]) * b;
            }
        }
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < tokens; ++n) {
      long want = 0;
      for (int k = 0; k < K; ++k) want += static_cast<long>(W[r * K + k]) * x[n * K + k];
      ASSERT_EQ(d[static_cast<size_t>(r * tokens + n)], want) << "row " << r << " token " << n;
    }
}

TEST(WgmmaLayout, StagedXTimesDequantizedFragmentsIsTheProduct) {
  uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (int nt : {1, 2, 4, 6, 8})
    for (int chunks : {1, 3}) check_layout(nt, 8 * nt, chunks, seed++);
}

// The a operand's k over one step covers 16 distinct k (each k of the half exactly once over the
// 8 steps), so no weight is counted twice or left out whatever x holds.
TEST(WgmmaLayout, EveryWeightKOnceAHalf) {
  for (int j = 0; j < 2; ++j) {
    std::multiset<int> ks;
    for (int w = 0; w < 4; ++w)
      for (int s = 0; s < 2; ++s)
        for (int kk = 0; kk < 16; ++kk) ks.insert(a_operand_k(j, w, s, kk));
    ASSERT_EQ(ks.size(), 128u);
    for (int k = 0; k < 128; ++k) EXPECT_EQ(ks.count(j * 128 + k), 1u) << "k " << k;
  }
}

}  // namespace
}  // namespace k3
