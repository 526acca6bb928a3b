// The skinny-GEMM planner's host logic (cuda/linear_plan.h) without a GPU: which problems get
// GEMV plans, their limits and shared memory, how they rank against the tilings, batch
// invariance, the tuner's shortlist, where it offers cuBLAS, how resident clusters price
// waves, and the warpgroup (wgmma) tilings. Runs in CI (no device call: explicit H200 limits, no
// register or cluster query).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/linear_plan.h"
#include "cuda_host/plan_test_util.h"

namespace k3 {
namespace {

using cuda::LinearPlan;
using cuda::LinearWeight;
using plan_test::candidates;
using plan_test::InvariantScope;
using plan_test::WgmmaScope;

int count_gemv(const std::vector<LinearPlan>& c) {
  return static_cast<int>(
      std::count_if(c.begin(), c.end(), [](const auto& p) { return p.gemv(); }));
}

TEST(LinearPlan, GemvPlansForDenseBf16OfOneToFourRows) {
  const InvariantScope off(false);
  for (int m = 1; m <= 4; ++m)
    EXPECT_GE(count_gemv(candidates(LinearWeight::BF16, m, 768, 7168)), 4);
  EXPECT_EQ(count_gemv(candidates(LinearWeight::BF16, 5, 768, 7168)), 0);
  EXPECT_EQ(count_gemv(candidates(LinearWeight::BF16, 1, 768, 7168, 16)), 0) << "grouped";
  EXPECT_EQ(count_gemv(candidates(LinearWeight::MXFP4, 1, 3072, 3584)), 0);
  EXPECT_EQ(count_gemv(candidates(LinearWeight::BF16, 1, 768, 1001)), 0) << "K % 8 != 0";
}

TEST(LinearPlan, GemvRanksFirstForOneRowOnly) {
  const InvariantScope off(false);
  for (const auto& [n, k] : {std::pair<int64_t, int64_t>{768, 7168}, {3584, 7168}, {7168, 768}}) {
    EXPECT_TRUE(candidates(LinearWeight::BF16, 1, n, k).front().gemv()) << n << "x" << k;
    const auto two = candidates(LinearWeight::BF16, 2, n, k);
    EXPECT_FALSE(two.front().gemv()) << n << "x" << k;
    EXPECT_TRUE(two.back().gemv()) << "the GEMV plans follow the tilings";
  }
}

// Units per lane within the kernel's registers for its rows, the CTA's rows covering N, and the
// partial sums' shared memory (the 3-row launch runs the 4-row instance).
TEST(LinearPlan, GemvPlanLimitsAndSharedMemory) {
  const InvariantScope off(false);
  for (int m = 1; m <= 4; ++m)
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{768, 7168}, {130, 4104}, {37, 72}})
      for (const LinearPlan& p : candidates(LinearWeight::BF16, m, n, k)) {
        if (!p.gemv()) continue;
        const int j = cuda::gemv_units_per_lane(k, p.gemv_ks);
        EXPECT_GE(j, 1);
        EXPECT_LE(j, cuda::gemv_max_units_per_lane(m)) << p.str();
        EXPECT_GE(static_cast<int64_t>(j) * 32 * p.gemv_ks, k / 8) << "every unit has a lane";
        EXPECT_EQ(p.threads(), 256);
        EXPECT_EQ(p.rows_per_cta(), 8 / p.gemv_ks * p.gemv_rpw);
        EXPECT_GE(p.grid_x() * p.rows_per_cta(), n);
        EXPECT_LT((p.grid_x() - 1) * p.rows_per_cta(), n) << "no CTA without rows";
        const size_t rows_instance = m == 3 ? 4 : static_cast<size_t>(m);
        EXPECT_EQ(p.smem_bytes, static_cast<size_t>(p.rows_per_cta()) * p.gemv_ks * rows_instance *
                                    sizeof(float));
      }
  // K = 4104: 513 units need 4 or 8 k segments to fit 8 units per lane at one row, 8 at two.
  std::set<int> ks1, ks2;
  for (const auto& p : candidates(LinearWeight::BF16, 1, 130, 4104))
    if (p.gemv()) ks1.insert(p.gemv_ks);
  for (const auto& p : candidates(LinearWeight::BF16, 2, 130, 4104))
    if (p.gemv()) ks2.insert(p.gemv_ks);
  EXPECT_EQ(ks1, (std::set<int>{4, 8}));
  EXPECT_EQ(ks2, (std::set<int>{8}));
}

TEST(LinearPlan, NoGemvUnderBatchInvariance) {
  const InvariantScope on(true);
  for (int m = 1; m <= 4; ++m)
    EXPECT_EQ(count_gemv(candidates(LinearWeight::BF16, m, 768, 7168)), 0);
  // same_k_order keeps tilings only, even given a GEMV plan's knobs.
  LinearPlan anchor;
  anchor.wk = 1, anchor.ck = 1;
  const InvariantScope off(false);
  for (const auto& p : cuda::same_k_order(candidates(LinearWeight::BF16, 1, 768, 7168), anchor))
    EXPECT_FALSE(p.gemv()) << p.str();
}

// The tuner times at most six GEMV plans (the model's best) and up to 12 tilings, none twice,
// whatever the GEMV plans' rank.
TEST(LinearPlan, TuningShortlistTakesBothKinds) {
  const InvariantScope off(false);
  for (int m : {1, 2}) {
    const auto ranked = candidates(LinearWeight::BF16, m, 768, 7168);
    const auto list = cuda::detail::tuning_shortlist(ranked);
    const int g = count_gemv(list);
    EXPECT_EQ(g, std::min(6, count_gemv(ranked))) << "m " << m;  // 2 rows: 5 (8 k segments only)
    EXPECT_GE(g, 5) << "m " << m;
    EXPECT_GE(static_cast<int>(list.size()) - g, 6) << "m " << m;
    EXPECT_LE(static_cast<int>(list.size()) - g, 12) << "m " << m;
    std::set<std::string> seen;
    for (const auto& p : list) EXPECT_TRUE(seen.insert(p.str()).second) << p.str();
    // The GEMV plans listed are the model's best ones, in its order.
    std::vector<std::string> best;
    for (const auto& p : ranked)
      if (p.gemv() && best.size() < 6) best.push_back(p.str());
    for (int i = 0; i < g; ++i)
      EXPECT_EQ(list[static_cast<size_t>(i)].str(), best[static_cast<size_t>(i)]);
  }
}

std::vector<LinearPlan> fp4_gemv(const std::vector<LinearPlan>& c) {
  std::vector<LinearPlan> out;
  for (const auto& p : c)
    if (p.gemv_fp4()) out.push_back(p);
  return out;
}

// MXFP4 GEMV plans: 1..8 rows per slot with K % 256 == 0, dense and grouped, outside batch
// invariance; 1, 2 or 4 pieces per warp within the instance's threads; first for one row only;
// ranked alike whatever the slot counts (the stock and specialized launches of one expert shape
// make the same pick); the tuner times them.
TEST(LinearPlan, Mxfp4GemvPlans) {
  const InvariantScope off(false);
  const bool was = cuda::mxfp4_gemv_plans();
  cuda::set_mxfp4_gemv_plans(true);
  const cuda::DeviceLimits d;
  for (const auto& [n, k] : {std::pair<int64_t, int64_t>{3072, 3584}, {3584, 3072}, {40, 256}}) {
    for (int m = 1; m <= cuda::kGemvMxfp4MaxRows; ++m) {
      const auto c = candidates(LinearWeight::MXFP4, m, n, k);
      const auto g = fp4_gemv(c);
      ASSERT_EQ(g.size(), 3u) << m << " rows, " << n << "x" << k;
      std::set<int> pieces;
      for (const auto& p : g) {
        pieces.insert(p.gemv_fp4_pieces);
        EXPECT_FALSE(p.gemv()) << p.str();
        EXPECT_TRUE(p.streams_rows());
        EXPECT_EQ(p.rows_per_cta(), 16);
        EXPECT_EQ(p.grid_x(), (n + 15) / 16);
        const int warps = static_cast<int>((k / 128 + p.gemv_fp4_pieces - 1) / p.gemv_fp4_pieces);
        EXPECT_EQ(p.threads(), 32 * warps) << p.str();
        EXPECT_EQ(p.chunks, k / 128);
        EXPECT_EQ(p.x_pitch, p.gemv_fp4_pieces * 256 + 16);
        EXPECT_EQ(p.smem_bytes, static_cast<size_t>(warps) * m * p.x_pitch +
                                    static_cast<size_t>(k / 128) * m * 16 * 4);
        EXPECT_NE(p.str().find("gemv-fp4"), std::string::npos) << p.str();
      }
      EXPECT_EQ(pieces, (std::set<int>{1, 2, 4}));
      EXPECT_EQ(c.front().gemv_fp4(), m == 1) << m << " rows: GEMV first for one row only";
      if (m > 1) {
        EXPECT_TRUE(c.back().gemv_fp4()) << "after the tilings";
      }
      // Grouped, other slot counts: the same GEMV plans in the same order.
      for (const auto& [slots, busy] : {std::pair<int, int>{56, 1}, {16, 1}, {16, 0}}) {
        const auto gg = fp4_gemv(
            cuda::linear_candidates(LinearWeight::MXFP4, m, n, k, slots, d, nullptr, busy));
        ASSERT_EQ(gg.size(), g.size());
        for (size_t i = 0; i < g.size(); ++i) {
          EXPECT_EQ(gg[i].gemv_fp4_pieces, g[i].gemv_fp4_pieces);
          EXPECT_EQ(gg[i].model_us, g[i].model_us);
        }
      }
      // The tuner's shortlist leads with them.
      const auto list = cuda::detail::tuning_shortlist(c);
      for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(list[i].str(), g[i].str());
    }
    EXPECT_TRUE(fp4_gemv(candidates(LinearWeight::MXFP4, 9, n, k)).empty()) << "9 rows";
  }
  EXPECT_TRUE(fp4_gemv(candidates(LinearWeight::MXFP4, 1, 64, 384)).empty()) << "K % 256 != 0";
  EXPECT_TRUE(fp4_gemv(candidates(LinearWeight::BF16, 1, 3072, 3584)).empty()) << "bf16";
  // 64 pieces: one per warp would take 2048 threads.
  const auto big = fp4_gemv(candidates(LinearWeight::MXFP4, 1, 512, 8192));
  ASSERT_EQ(big.size(), 2u);
  for (const auto& p : big) EXPECT_NE(p.gemv_fp4_pieces, 1);
  // Not under batch invariance, and never in the tilings that keep the one-row K order.
  {
    const InvariantScope on(true);
    EXPECT_TRUE(fp4_gemv(candidates(LinearWeight::MXFP4, 1, 3072, 3584)).empty());
  }
  LinearPlan anchor;
  anchor.wk = 1, anchor.ck = 1;
  EXPECT_TRUE(
      fp4_gemv(cuda::same_k_order(candidates(LinearWeight::MXFP4, 1, 3072, 3584), anchor)).empty());
  cuda::set_mxfp4_gemv_plans(was);
}

TEST(LinearPlan, CublasOnlyForDenseBf16WithPlainInput) {
  const int floor_before = cuda::cublas_min_rows();
  EXPECT_EQ(floor_before, 2) << "the default: one-row launches keep their GEMVs";
  cuda::set_cublas_min_rows(1);
  EXPECT_TRUE(cuda::cublas_plan_applies(LinearWeight::BF16, 1, 1, false, false));
  EXPECT_FALSE(cuda::cublas_plan_applies(LinearWeight::MXFP4, 1, 1, false, false));
  EXPECT_FALSE(cuda::cublas_plan_applies(LinearWeight::BF16, 1, 4, false, false)) << "grouped";
  EXPECT_FALSE(cuda::cublas_plan_applies(LinearWeight::BF16, 1, 1, true, false)) << "GLU input";
  EXPECT_FALSE(cuda::cublas_plan_applies(LinearWeight::BF16, 1, 1, false, true)) << "invariant";
  // A row floor leaves the fewer-row launches to the kernels (PDL edges kept).
  cuda::set_cublas_min_rows(2);
  EXPECT_FALSE(cuda::cublas_plan_applies(LinearWeight::BF16, 1, 1, false, false));
  EXPECT_TRUE(cuda::cublas_plan_applies(LinearWeight::BF16, 2, 1, false, false));
  EXPECT_TRUE(cuda::cublas_plan_applies(LinearWeight::BF16, 64, 1, false, false));
  EXPECT_THROW(cuda::set_cublas_min_rows(0), Error);
  cuda::set_cublas_min_rows(floor_before);

  LinearPlan p = cuda::cublas_plan(8, 3584, 7168);
  EXPECT_TRUE(p.cublas);
  EXPECT_FALSE(p.gemv());
  EXPECT_EQ(p.str(), "cublas");
  EXPECT_TRUE(cuda::finalize_plan(p, cuda::DeviceLimits{}));
  EXPECT_EQ(p.smem_bytes, 0u);
  LinearPlan grouped = p;
  grouped.groups = 2;
  EXPECT_FALSE(cuda::finalize_plan(grouped, cuda::DeviceLimits{}));
  LinearPlan fp4 = p;
  fp4.weight = LinearWeight::MXFP4;
  EXPECT_FALSE(cuda::finalize_plan(fp4, cuda::DeviceLimits{}));
  EXPECT_THROW(cuda::cublas_plan(65, 3584, 7168), Error) << "one launch holds 64 rows";
}

TEST(LinearPlan, TuningShortlistEndsWithCublasWhenAsked) {
  const InvariantScope off(false);
  for (int m : {1, 8, 64}) {
    const auto ranked = candidates(LinearWeight::BF16, m, 3584, 7168);
    const auto plain = cuda::detail::tuning_shortlist(ranked);
    const auto with = cuda::detail::tuning_shortlist(ranked, true);
    EXPECT_EQ(std::count_if(plain.begin(), plain.end(), [](const auto& p) { return p.cublas; }), 0);
    ASSERT_EQ(with.size(), plain.size() + 1) << "m " << m;
    EXPECT_TRUE(with.back().cublas);
    EXPECT_EQ(with.back().m, m);
    EXPECT_EQ(with.back().n, 3584);
    EXPECT_EQ(with.back().k, 7168);
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(with[i].str(), plain[i].str());
  }
  // The batch-invariant subset never holds it (cuBLAS's K order is its own).
  std::vector<LinearPlan> with_blas = candidates(LinearWeight::BF16, 8, 3584, 7168);
  const LinearPlan anchor = with_blas.front();
  with_blas.insert(with_blas.begin(), cuda::cublas_plan(8, 3584, 7168));
  const auto same = cuda::same_k_order(with_blas, anchor);
  EXPECT_FALSE(same.empty());
  for (const auto& p : same) EXPECT_FALSE(p.cublas);
}

// Clusters the device holds at once bound the waves (LinearClusterFit): with a fit below the
// grid's cluster count a plan costs another wave, and the best plan is one whose clusters fit
// (an H100 held 15 clusters of 8 one-CTA-per-SM CTAs; a 16-cluster plan ran 1.9x slower).
TEST(LinearPlan, ClusterFitPricesTheWaves) {
  const InvariantScope off(false);
  const cuda::DeviceLimits d;  // 132 SMs
  const int m = 64;
  const int64_t n = 3072, k = 3584;
  // 15 clusters of 8 (and 30 of 4, 60 of 2) per CTA-per-SM, as GPCs hold them.
  const auto gpc_fit = [](const LinearPlan& p, int ctas_per_sm) {
    return 120 / p.ck * ctas_per_sm;
  };
  const auto plain = cuda::linear_candidates(LinearWeight::MXFP4, m, n, k, 1, d, nullptr);
  const auto fitted =
      cuda::linear_candidates(LinearWeight::MXFP4, m, n, k, 1, d, nullptr, 0, gpc_fit);
  ASSERT_EQ(plain.size(), fitted.size());
  int slower = 0;
  for (const LinearPlan& p : plain) {
    const auto same = std::find_if(fitted.begin(), fitted.end(),
                                   [&](const LinearPlan& q) { return q.str() == p.str(); });
    ASSERT_NE(same, fitted.end()) << p.str();
    if (p.ck == 1) {
      EXPECT_EQ(same->model_us, p.model_us) << p.str() << ": no cluster, no change";
    } else {
      EXPECT_GE(same->model_us, p.model_us) << p.str();
      slower += same->model_us > p.model_us;
    }
  }
  EXPECT_GT(slower, 0) << "some cluster plans need a second wave under the fit";
  // With the fit, the pick's clusters fit in one wave (before the model priced the x staging
  // per load, its pick without the fit was a 16-cluster plan of 8: two waves on an H100).
  const LinearPlan& pick = fitted.front();
  if (pick.ck > 1) {
    EXPECT_LE(pick.grid_x() / pick.ck, gpc_fit(pick, 1)) << pick.str();
  }
  // An unknown fit (0) keeps the SM-count pricing.
  const auto unknown = cuda::linear_candidates(LinearWeight::MXFP4, m, n, k, 1, d, nullptr, 0,
                                               [](const LinearPlan&, int) { return 0; });
  ASSERT_EQ(unknown.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(unknown[i].model_us, plain[i].model_us);
}

// x staging is priced per 16-byte unit a thread loads, one round trip each (the kernel stages
// them one at a time behind the W prologue): the H100's phase stamps put an 8-row plan with 19
// units a thread at 11.3 us of staging against 3.1 us for one with 3, and the model's old
// bandwidth pricing picked the former (13.0 us a launch against 8.3 for the best tiling). Its
// pick for that expert shape now loads at most 8 units a thread.
TEST(LinearPlan, XStagingPricedPerUnitOfAThread) {
  const InvariantScope off(false);
  const int64_t n = 3072, k = 3584;
  const auto c = candidates(LinearWeight::MXFP4, 8, n, k);
  const auto tiled =
      std::find_if(c.begin(), c.end(), [](const LinearPlan& p) { return !p.streams_rows(); });
  ASSERT_NE(tiled, c.end());
  const int units =
      (tiled->chunks + tiled->ck - 1) / tiled->ck * cuda::linear_chunk_k(LinearWeight::MXFP4) / 8;
  const int per_thread = (8 * units + tiled->threads() - 1) / tiled->threads();
  EXPECT_LE(per_thread, 8) << tiled->str();
}

// Warpgroup tilings (offered when switched on): MXFP4 only, mt 1 and whole warpgroups along N
// (64-row sets), x staged as 16 wgmma tiles of nt * 256 bytes per chunk of the CTA's K slice, in
// every token-tile count; the tuner times some of one and of two warpgroups a CTA; batch invariance
// keeps the anchor's kind (wgmma and mma.sync may round their in-instruction sums differently).
TEST(LinearPlan, WarpgroupPlansForMxfp4) {
  const InvariantScope off(false);
  {
    const WgmmaScope off_by_default(false);
    for (const auto& p : candidates(LinearWeight::MXFP4, 64, 3072, 3584))
      EXPECT_FALSE(p.wg) << "offered while switched off: " << p.str();
  }
  const WgmmaScope on(true);
  for (int m : {1, 2, 8, 17, 40, 64}) {
    const auto c = candidates(LinearWeight::MXFP4, m, 3072, 3584);
    int n_wg = 0;
    for (const auto& p : c) {
      if (!p.wg) continue;
      ++n_wg;
      EXPECT_EQ(p.mt, 1) << p.str();
      EXPECT_EQ(p.wn % 4, 0) << p.str();
      EXPECT_EQ(p.rows_per_cta() % 64, 0) << p.str();
      EXPECT_LE(p.threads(), cuda::linear_max_threads(p.nt, p.mt, true)) << p.str();
      const int per_cta = (p.chunks + p.ck - 1) / p.ck;
      EXPECT_EQ(p.x_bytes, static_cast<size_t>(per_cta) * 16 * p.nt * 256) << p.str();
      EXPECT_GE(p.smem_bytes, p.x_bytes) << p.str();
      if (p.x_pitch != 0) {
        EXPECT_EQ(p.x_pitch, per_cta * 256 * 2) << p.str();
      }
      EXPECT_EQ(p.str().rfind("wg ", 0), 0u) << p.str();
    }
    EXPECT_GT(n_wg, 0) << m << " rows";
    const auto list = cuda::detail::tuning_shortlist(c);
    for (int wn : {4, 8})
      EXPECT_TRUE(
          std::any_of(list.begin(), list.end(), [&](const auto& p) { return p.wg && p.wn == wn; }))
          << m << " rows: the tuner times a warpgroup plan of " << wn / 4 << " warpgroups a CTA";
    std::set<std::string> seen;
    for (const auto& p : list) EXPECT_TRUE(seen.insert(p.str()).second) << p.str();
  }
  for (const auto& p : candidates(LinearWeight::BF16, 64, 3584, 7168)) EXPECT_FALSE(p.wg);
  LinearPlan bad = candidates(LinearWeight::MXFP4, 64, 3072, 3584).front();
  bad.gemv_fp4_pieces = 0, bad.wg = true, bad.mt = 1, bad.wn = 6, bad.wk = 1;
  EXPECT_FALSE(cuda::finalize_plan(bad, cuda::DeviceLimits{})) << "wn % 4 != 0";
  const auto c = candidates(LinearWeight::MXFP4, 64, 3072, 3584);
  const auto anchor =
      std::find_if(c.begin(), c.end(), [](const auto& p) { return !p.wg && !p.streams_rows(); });
  ASSERT_NE(anchor, c.end());
  for (const auto& p : cuda::same_k_order(c, *anchor)) EXPECT_FALSE(p.wg) << p.str();
}

// The read curve the benches judge kernels by (the H200 table's and a card's measured one).
TEST(ReadCurve, InterpolatesLogLinearlyScalesBelowAndHoldsAbove) {
  constexpr double kMiB = 1024.0 * 1024.0;
  const double mib[] = {1, 4, 16};
  const double tbps[] = {1.0, 2.0, 3.0};
  EXPECT_DOUBLE_EQ(cuda::read_curve_tbps(mib, tbps, 3, 4 * kMiB), 2.0);  // a point
  EXPECT_DOUBLE_EQ(cuda::read_curve_tbps(mib, tbps, 3, 2 * kMiB), 1.5);  // halfway in log size
  EXPECT_DOUBLE_EQ(cuda::read_curve_tbps(mib, tbps, 3, 8 * kMiB), 2.5);
  EXPECT_DOUBLE_EQ(cuda::read_curve_tbps(mib, tbps, 3, 0.25 * kMiB), 0.25);  // the 1 MB time
  EXPECT_DOUBLE_EQ(cuda::read_curve_tbps(mib, tbps, 3, 1024 * kMiB), 3.0);
  const double one[] = {2.5};
  EXPECT_DOUBLE_EQ(cuda::read_curve_tbps(mib, one, 1, 64 * kMiB), 2.5);
  EXPECT_THROW(cuda::read_curve_tbps(mib, tbps, 0, kMiB), Error);
  // The H200 table through it: its points, and rising with the size.
  EXPECT_DOUBLE_EQ(cuda::h200_read_curve_tbps(8 * kMiB), 2.7);
  EXPECT_DOUBLE_EQ(cuda::h200_read_curve_tbps(512 * kMiB), 4.2);
  double last = 0;
  for (double mb = 0.5; mb <= 128; mb *= 1.5) {
    const double r = cuda::h200_read_curve_tbps(mb * kMiB);
    EXPECT_GT(r, last) << mb << " MB";
    last = r;
  }
}

}  // namespace
}  // namespace k3
