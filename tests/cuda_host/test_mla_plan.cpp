// The MLA split-KV planner (cuda/mla_decode.h) without a GPU: how the token axis is split for
// K3's latent shape (one 32-token tile per split at least, one wave of two CTAs per SM at most),
// the head groups, the workspace size and the generic shapes. Runs in CI (no device call).
#include <gtest/gtest.h>

#include <cstdint>

#include "core/error.h"
#include "cuda/mla_decode.h"

namespace k3 {
namespace {

constexpr int kSms = 132;  // H200
constexpr int kTile = 32;  // tokens per split tile (mla_decode.cu)

cuda::MlaDecodePlan k3_plan(int rows, int heads, int64_t max_tokens) {
  cuda::MlaDecodePlan p;
  p.rows = rows;
  p.heads = heads;
  p.kv_lora = 512;
  p.rope = 64;
  p.page_size = 64;
  p.max_pages = static_cast<int>((max_tokens + 63) / 64);
  p.max_tokens = max_tokens;
  return cuda::plan_mla_decode(p, kSms);
}

int64_t tiles(int64_t tokens) {
  return (tokens + kTile - 1) / kTile;
}

TEST(MlaPlan, ShortContextsSplitIntoSingleTiles) {
  // One row, K3 TP16 (6 heads) at 1k: the SM target (2 x 132) exceeds the tiles, so every tile
  // is its own split (18.1 us that way on the H200 against 26.7 us with two tiles per split).
  const auto p = k3_plan(1, 6, 1024);
  EXPECT_EQ(p.head_groups, 1);
  EXPECT_EQ(p.heads_per_group, 6);
  EXPECT_EQ(p.splits, tiles(1024));
  // A context shorter than a tile is one split.
  EXPECT_EQ(k3_plan(1, 6, 5).splits, 1);
}

TEST(MlaPlan, LongContextsFillOneWaveOfTwoCtasPerSm) {
  for (int rows : {1, 8, 64}) {
    const auto p = k3_plan(rows, 6, 32768);
    SCOPED_TRACE(rows);
    EXPECT_LE(p.splits, tiles(32768)) << "a split of less than one tile";
    // The most splits whose CTAs fit one wave of 2 x SMs (64 rows: 4 splits, 256 CTAs; 5 would
    // be 320, a second wave of 56).
    EXPECT_LE(static_cast<int64_t>(p.splits) * rows * p.head_groups, 2 * kSms);
    EXPECT_GT(static_cast<int64_t>(p.splits + 1) * rows * p.head_groups, 2 * kSms);
  }
  EXPECT_EQ(k3_plan(300, 6, 32768).splits, 1) << "more rows than places: one split each";
}

TEST(MlaPlan, TensorCoresOnlyWhenAskedAndForK3Shapes) {
  EXPECT_FALSE(k3_plan(1, 6, 32768).tensor_cores) << "the CUDA-core split kernel by default";
  cuda::MlaDecodePlan p;
  p.rows = 1, p.heads = 6, p.kv_lora = 512, p.rope = 64, p.page_size = 64, p.max_pages = 16;
  p.max_tokens = 1024;
  p.tensor_cores = true;
  EXPECT_TRUE(cuda::plan_mla_decode(p, kSms).tensor_cores) << "the request is kept";
  p.kv_lora = 64, p.rope = 16;
  EXPECT_FALSE(cuda::plan_mla_decode(p, kSms).tensor_cores) << "the generic kernel has no mma form";
}

TEST(MlaPlan, DeepRingsFillOneWaveOfOneCtaPerSm) {
  cuda::MlaDecodePlan p;
  p.heads = 6, p.kv_lora = 512, p.rope = 64, p.page_size = 64, p.max_pages = 512;
  p.max_tokens = 32768;
  p.tensor_cores = true;
  for (int ring : {4, 5})
    for (int rows : {1, 8, 64}) {
      SCOPED_TRACE(testing::Message() << "ring " << ring << ", rows " << rows);
      p.rows = rows, p.ring_tiles = ring;
      const auto d = cuda::plan_mla_decode(p, kSms);
      EXPECT_EQ(d.ring_tiles, ring);
      EXPECT_LE(static_cast<int64_t>(d.splits) * rows, kSms);  // one CTA per SM
      EXPECT_GT(static_cast<int64_t>(d.splits + 1) * rows, kSms);
    }
  p.rows = 1, p.ring_tiles = 4, p.tensor_cores = false;
  const auto fp32 = cuda::plan_mla_decode(p, kSms);
  EXPECT_EQ(fp32.ring_tiles, 2) << "the CUDA-core kernel has the two-tile ring only";
  EXPECT_EQ(fp32.splits, 2 * kSms);
  p.tensor_cores = true;
  for (int bad : {0, 1, 3, 6}) {
    p.ring_tiles = bad;
    EXPECT_THROW(cuda::plan_mla_decode(p, kSms), k3::Error) << "ring " << bad;
  }
}

TEST(MlaPlan, HeadGroupsAndWorkspace) {
  const auto p = k3_plan(2, 17, 4096);  // above 16 heads per CTA: two groups of 9
  EXPECT_EQ(p.head_groups, 2);
  EXPECT_EQ(p.heads_per_group, 9);
  EXPECT_EQ(cuda::mla_decode_workspace_bytes(p),
            sizeof(float) * 2 * 17 * static_cast<size_t>(p.splits) * (512 + 2));
}

TEST(MlaPlan, GenericShapesAndErrors) {
  cuda::MlaDecodePlan p;
  p.rows = 1, p.heads = 4, p.kv_lora = 64, p.rope = 16, p.page_size = 16, p.max_pages = 4;
  p.max_tokens = 64;
  const auto g = cuda::plan_mla_decode(p, kSms);  // the generic kernel: no splits
  EXPECT_EQ(g.splits, 1);
  EXPECT_EQ(g.head_groups, 4);
  p.kv_lora = 500;  // not a multiple of 8
  EXPECT_THROW(cuda::plan_mla_decode(p, kSms), Error);
  EXPECT_THROW(k3_plan(1, 0, 1024), Error) << "no heads";
  EXPECT_THROW(k3_plan(-1, 6, 1024), Error) << "negative rows";
}

}  // namespace
}  // namespace k3
