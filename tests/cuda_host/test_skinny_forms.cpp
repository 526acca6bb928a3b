// The tiled skinny GEMM's alternative forms on the host (skinny_gemm.cuh stage_x_async,
// skinny_reduce.cuh): what the plans reserve for them, and the bank pattern of the reduction
// tile's stores. Runs in CI (no device call).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "cuda/linear_plan.h"
#include "cuda_host/plan_test_util.h"

namespace k3 {
namespace {

using cuda::LinearWeight;
using plan_test::candidates;
using plan_test::InvariantScope;
using plan_test::WgmmaScope;

// Under skinny_x_async() a warpgroup plan stages x as loaded past its rings (x_pitch: the raw
// row pitch) where that fits, and counts the space; switched off (the default) it reserves none.
TEST(LinearPlan, WarpgroupXStagingSpaceOnlyUnderXAsync) {
  const InvariantScope off(false);
  const WgmmaScope on(true);
  const bool was = cuda::skinny_x_async();
  for (const bool x_async : {false, true}) {
    cuda::set_skinny_x_async(x_async);
    for (int m : {8, 64}) {
      int staged = 0;
      for (const auto& p : candidates(LinearWeight::MXFP4, m, 3072, 3584)) {
        if (!p.wg) continue;
        if (!x_async) {
          EXPECT_EQ(p.x_pitch, 0) << p.str();
          continue;
        }
        if (p.x_pitch == 0) continue;
        ++staged;
        const size_t rings = static_cast<size_t>(p.wn * p.wk) * p.stages * 2560;
        EXPECT_GE(p.smem_bytes, p.x_bytes + rings + static_cast<size_t>(m) * p.x_pitch) << p.str();
      }
      if (x_async) {
        EXPECT_GT(staged, 0) << m << " rows";
      }
    }
  }
  cuda::set_skinny_x_async(was);
}

// Plans finalized under skinny_fast_reduce() carry the fast reduction and size shared memory for
// its padded tile rows (bn + 4 floats); others the plain bn.
TEST(LinearPlan, FastReductionSizesItsPaddedTile) {
  const InvariantScope off(false);
  const bool was = cuda::skinny_fast_reduce();
  for (const bool fast : {false, true}) {
    cuda::set_skinny_fast_reduce(fast);
    for (const auto w : {LinearWeight::MXFP4, LinearWeight::BF16}) {
      int tiled = 0;
      for (const auto& p : candidates(w, 64, 3072, 3584)) {
        if (p.streams_rows() || p.fallback || p.cublas) continue;
        ++tiled;
        EXPECT_EQ(p.fast_reduce, fast) << p.str();
        const int bn = p.rows_per_cta();
        EXPECT_EQ(cuda::skinny_red_pitch(bn, fast), fast ? bn + 4 : bn);
        EXPECT_GE(p.smem_bytes, static_cast<size_t>(p.wk) * std::min(64, 8 * p.nt) *
                                    cuda::skinny_red_pitch(bn, fast) * sizeof(float))
            << p.str();
      }
      EXPECT_GT(tiled, 0);
    }
  }
  cuda::set_skinny_fast_reduce(was);
}

// The reduction tile's accumulator stores (skinny_reduce.cuh write_partials): lane (g, c) of a
// warp stores row r = base + g (+ 8), token m = 2 c (+ 1) at m * pitch + r. With rows bn apart
// (bn a multiple of 16) the 4 lanes of a quad hit one bank: 4-way conflicts; the fast form's
// pitch of bn + 4 puts each of the 32 lanes on its own bank.
TEST(LinearPlan, FastReductionStoresWithoutBankConflicts) {
  const auto worst_conflict = [](int bn, int pitch, int mt, int nt, int wn_i) {
    int worst = 0;
    for (int i = 0; i < mt; ++i)
      for (int j = 0; j < nt; ++j)
        for (int e = 0; e < 4; ++e) {  // one store instruction of the warp
          std::map<int, std::set<int>> words_of_bank;
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, c = lane & 3;
            const int r = wn_i * 16 * mt + i * 16 + g + (e >= 2 ? 8 : 0);
            const int m = j * 8 + 2 * c + (e & 1);
            EXPECT_LT(r, bn);
            const int word = m * pitch + r;
            words_of_bank[word % 32].insert(word);
          }
          for (const auto& [bank, words] : words_of_bank)
            worst = std::max(worst, static_cast<int>(words.size()));
        }
    return worst;
  };
  for (int mt : {1, 2})
    for (int wn : {1, 4, 7, 8})
      for (int nt : {1, 8}) {
        const int bn = 16 * mt * wn;
        for (int wn_i = 0; wn_i < wn; ++wn_i) {
          EXPECT_EQ(worst_conflict(bn, cuda::skinny_red_pitch(bn, false), mt, nt, wn_i), 4)
              << "mt " << mt << " wn " << wn;
          EXPECT_EQ(worst_conflict(bn, cuda::skinny_red_pitch(bn, true), mt, nt, wn_i), 1)
              << "mt " << mt << " wn " << wn;
        }
      }
}

}  // namespace
}  // namespace k3
